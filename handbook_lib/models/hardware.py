"""Hardware presets: the links between GPUs and the GPUs themselves. Pure: no ``torch``.

Chapter 3 introduces the links (bandwidth and latency feed :mod:`handbook_lib.models.traffic`'s
alpha-beta model); chapter 4 the accelerators (memory for the state, peak FLOP/s for compute time).

A node preset is a GPU plus its intra-node link: every accelerator preset names the link between
two of its GPUs in one machine (``intra_link``, a key of :data:`LINKS`) and the usual GPUs per
machine, so :func:`node_preset` never guesses from the GPU's name (no link: refused, not PCIe).

Conventions, so that every figure reads the same way:

- A link's bandwidth is **per GPU, per direction**, in bytes/s. Datasheets often quote the
  bidirectional total (NVLink 4: "900 GB/s" = 450 GB/s each way) or bits/s (InfiniBand NDR:
  "400 Gb/s" = 50e9 bytes/s); we convert. A ring collective sends and receives at the same
  time, so its time is set by the one-way figure.
- A link's latency is the per-message (per ring step) cost ``alpha``, in seconds. Latencies are
  typical published figures for a collective library's hop over that link, not datasheet values.
- A link's ``efficiency``: the fraction of line rate a collective library reaches on it, from its
  maintainers' published figures where there are some, else 1.0 (the line rate, an upper bound);
  the models price the product, :attr:`Link.achievable_bytes_per_s`.
- A node reaches the others through ``nics_per_node`` network ports of ``inter_link`` each
  (rails): 8 in a DGX, one per GPU. How a collective spread over them is priced is
  :mod:`handbook_lib.models.topology`'s.
- An accelerator's memory is the total its driver reports (``nvidia-smi``: 81,559 MiB on an
  H100 80GB, 81,920 MiB on an A100 80GB) where published, else the datasheet's "GB" read as GiB,
  as the HBM stacks hold it (an MI300X has 8 stacks of 24 GiB): about 7 % over the datasheet's
  decimal GB (:func:`datasheet_bytes`). A program can allocate less: CUDA reports the total less
  the driver's share (``runtime_memory_bytes``, where measured or published);
  :func:`usable_memory_bytes` also takes off what a training process holds outside its tensors
  (:data:`TRAINING_CONTEXT_BYTES`); the allocator's reserve is :mod:`handbook_lib.models.allocator`'s.
- A machine's host (:class:`Host`): cores, RAM, DRAM bandwidth, the PCIe link a GPU reaches it
  over and the GPUs behind one uplink: what CPU offload leans on. Peak FLOP/s: dense, datasheets'.
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.core.checks import check_int, is_int, lookup

__all__ = ["Link", "Host", "Accelerator", "Node", "LINKS", "ACCELERATORS", "get_link", "get_accelerator",
           "default_intra_link", "node_preset", "usable_memory_bytes", "datasheet_bytes", "CUDA_CONTEXT_BYTES",
           "TRAINING_CONTEXT_BYTES", "GIB", "NVLINK_RING_STEP_S"]

GIB = 2**30
"""Bytes in a GiB."""


@dataclass(frozen=True)
class Link:
    """A connection a GPU uses to talk to its peers."""

    name: str
    """Human-readable name, e.g. ``"NVLink 4 (H100 SXM)"``."""
    bandwidth_bytes_per_s: float
    """Unidirectional bandwidth available to one GPU, bytes/s (the beta of alpha-beta is 1/this)."""
    latency_s: float
    """Cost of one message or ring step, seconds (the alpha of the alpha-beta model)."""
    source: str
    """Where the figures come from, in words."""
    efficiency: float = 1.0
    """Fraction of ``bandwidth_bytes_per_s`` a collective achieves on the link, in (0, 1]
    (``source`` says whose figure; 1.0 where none is published)."""
    one_per_gpu: bool = False
    """A network link that machines carry one port of per GPU (InfiniBand rails in a DGX);
    ``False``: one port per machine, shared by its GPUs (or a link inside a machine)."""
    upper_bound: bool = False
    """Priced at its line rate for want of a published measurement: a bound no collective
    reaches (``source`` says so)."""

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s!r}")
        if not self.latency_s >= 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s!r}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {self.efficiency!r}")

    @property
    def achievable_bytes_per_s(self) -> float:
        """Bytes/s one GPU's collective moves each way on the link: line rate x efficiency."""
        return self.bandwidth_bytes_per_s * self.efficiency


CUDA_CONTEXT_BYTES = 287_047_680
"""Device bytes a bare CUDA process holds before its first tensor: the CUDA context (the driver's
state and the kernels loaded so far). PyTorch measured 287,047,680 bytes with CUDA's lazy module
loading (the default since CUDA 12.2 on Linux) against 666,632,192 without
(pytorch/pytorch#86509, which made ``CUDA_MODULE_LOADING=LAZY`` torch's default); NVIDIA's
PyTorch engineer puts it at "~300MB" (pytorch/pytorch#107667). A training process holds more:
:data:`TRAINING_CONTEXT_BYTES`."""

TRAINING_CONTEXT_BYTES = 1_457_521_152
"""Device bytes a training process holds that no tensor of the memory model can use, once it
has trained a step: the CUDA context with the kernels a step loads, cuBLAS's and cuDNN's
handles and workspaces, and NCCL's communicator. Measured by ``make gpu-check`` on one H200
(torch 2.11.0+cu130, NCCL 2.28.9, ``results/gpu/nvidia-h200.json``): CUDA's total less what
the rank found free plus what its caching allocator held, less the workspaces already
allocated. That run had one rank: NCCL's buffers for peers (per channel and protocol) come on
top with more ranks and are not priced. Five times :data:`CUDA_CONTEXT_BYTES`."""


@dataclass(frozen=True)
class Host:
    """The CPU side of a GPU machine, as its datasheet describes it."""

    name: str
    """The CPUs, e.g. ``"2 x Intel Xeon Platinum 8480C"``."""
    cores: int
    """CPU cores of the machine, all sockets (a count)."""
    memory_bytes: int
    """System memory (RAM) of the machine, bytes."""
    link: str
    """Key in :data:`LINKS` of the link between one GPU and host memory (``"pcie5"``)."""
    source: str
    """Where the figures come from, in words."""
    memory_bandwidth_bytes_per_s: float | None = None
    """The machine's DRAM bandwidth, all sockets, bytes/s, at its channels' peak (an upper
    bound); ``None``: not given, and the CPU optimizer is priced on its cores alone."""
    gpus_per_uplink: int = 1
    """GPUs whose host traffic shares one ``link`` to the CPU (behind one PCIe switch; ``source``
    says whose figure); 1 where each GPU has its own or none is published (a bound)."""

    def __post_init__(self) -> None:
        check_int("cores", self.cores, 1)
        check_int("gpus_per_uplink", self.gpus_per_uplink, 1)
        check_int("memory_bytes", self.memory_bytes, 1)
        if self.link not in LINKS:
            raise ValueError(f"host link of {self.name!r} must be one of {', '.join(LINKS)}, got {self.link!r}")


@dataclass(frozen=True)
class Accelerator:
    """One accelerator (GPU), as its datasheet describes it, and the node it usually sits in."""

    name: str
    """Human-readable name, e.g. ``"NVIDIA H100 SXM 80GB"``."""
    memory_bytes: int
    """Device memory, bytes: the datasheet's GB read as GiB, as the HBM stacks hold it
    (80 GB → 80 x 2**30)."""
    peak_flops_bf16: float
    """Dense bf16 tensor-core peak, FLOP/s."""
    peak_flops_fp32: float
    """Plain fp32 (non-tensor-core) peak, FLOP/s."""
    source: str
    """Where the figures come from, in words."""
    intra_link: str = ""
    """Key in :data:`LINKS` of the link between two of these GPUs in one machine (``"nvlink4"``);
    ``""`` means unknown, which :func:`default_intra_link` and :func:`node_preset` refuse."""
    gpus_per_node: int | None = None
    """The usual number of these GPUs in one machine (8 on an SXM board); ``None`` = unknown."""
    node_source: str = ""
    """Where ``intra_link`` and ``gpus_per_node`` come from, in words."""
    memory_bandwidth_bytes_per_s: float | None = None
    """Device-memory (HBM) bandwidth, bytes/s, as the datasheet states it; ``None`` = not given.
    ``source`` names the datasheet."""
    host: Host | None = None
    """The machine's CPU side these GPUs usually sit in (``None`` = unknown: CPU offload cannot be
    priced)."""
    datasheet_gb: float | None = None
    """The memory as the datasheet prints it, in its "GB" (80 for "80 GB"); ``None``: the
    capacity in decimal GB. Read as 10**9 bytes it is the convention this book used before, and
    what chapter 4's sensitivity compares against."""
    runtime_memory_bytes: int | None = None
    """Device memory as CUDA reports it (``cudaMemGetInfo``'s total, torch's
    ``total_memory``): the total less what the driver keeps back, bytes; ``None`` where no
    measurement or source gives it (then :func:`usable_memory_bytes` starts from
    ``memory_bytes``, optimistic by the driver's share: 616 MiB on the H200)."""
    context_bytes: int = TRAINING_CONTEXT_BYTES
    """Device bytes no tensor can use in a training process (:data:`TRAINING_CONTEXT_BYTES`;
    0 for the ``cpu`` preset, whose "device" is host memory)."""
    backend: str = "nccl"
    """The process group's backend of its ranks: ``nccl`` for a GPU, ``gloo`` for the ``cpu``
    preset. :func:`~handbook_lib.models.memory.estimate_memory` takes it as ``backend``, which
    also says where the ranks compute (foreach Adam's temporary is a GPU's)."""

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s for a run config's ``precision`` or a compute dtype's name: fp32's for
        ``fp32``, else bf16's (``bf16-mixed``, ``bf16``, ``fp16``: the matrix products run in 16
        bits)."""
        return self.peak_flops_fp32 if precision == "fp32" else self.peak_flops_bf16

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "peak_flops_bf16", "peak_flops_fp32"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        check_int("context_bytes", self.context_bytes, 0)
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend of {self.name!r} must be 'nccl' or 'gloo', got {self.backend!r}")
        runtime = self.runtime_memory_bytes
        if runtime is not None and not (is_int(runtime) and 0 < runtime <= self.memory_bytes):
            raise ValueError(f"runtime_memory_bytes of {self.name!r} must be an int in (0, memory_bytes] "
                             f"or None, got {runtime!r}")
        if self.context_bytes >= (runtime or self.memory_bytes):
            raise ValueError(f"context_bytes of {self.name!r} must be less than the memory CUDA reports")
        if self.datasheet_gb is not None and not self.datasheet_gb > 0:
            raise ValueError(f"datasheet_gb of {self.name!r} must be > 0 or None, got {self.datasheet_gb!r}")
        bw = self.memory_bandwidth_bytes_per_s
        if bw is not None and not bw > 0:
            raise ValueError(f"memory_bandwidth_bytes_per_s must be > 0 or None, got {bw!r}")
        # LINKS is defined below this class; it exists by the time any Accelerator is built.
        if not isinstance(self.intra_link, str) or (self.intra_link and self.intra_link not in LINKS):
            raise ValueError(f"intra_link of {self.name!r} must be one of {', '.join(LINKS)} "
                             f"(or \"\" for unknown), got {self.intra_link!r}")
        g = self.gpus_per_node
        if g is not None and not (is_int(g) and g >= 1):
            raise ValueError(f"gpus_per_node of {self.name!r} must be an int >= 1 or None, got {g!r}")


@dataclass(frozen=True)
class Node:
    """A machine: ``gpus_per_node`` accelerators joined by ``intra_link``, reaching other
    machines through ``nics_per_node`` ports of ``inter_link``."""

    accelerator: Accelerator
    """The GPU model every slot holds."""
    gpus_per_node: int
    """Accelerators in one machine (a count)."""
    intra_link: Link
    """Link between two GPUs of the same machine (NVLink, PCIe)."""
    inter_link: Link
    """One network port of the machine (InfiniBand, Ethernet): its figures are per port."""
    nics_per_node: int = 1
    """Network ports (rails) of ``inter_link`` the machine has, a count."""

    def __post_init__(self) -> None:
        check_int("gpus_per_node", self.gpus_per_node, 1)
        check_int("nics_per_node", self.nics_per_node, 1)

    def link_for(self, group_size: int) -> Link:
        """The slowest link a ring over ``group_size`` GPUs crosses, packed onto as few nodes as
        possible: ``intra_link`` if the group fits in one node, else ``inter_link``."""
        check_int("group_size", group_size, 1)
        return self.intra_link if group_size <= self.gpus_per_node else self.inter_link


_TYPICAL = "latency is a typical published figure for one hop, not a datasheet value"
NVLINK_RING_STEP_S = 7.7e-6
"""NVLink's alpha per ring step, seconds: :func:`~handbook_lib.models.collectives.fit_alpha_beta`
on NCCL's ring reduce-scatters of 128 MiB and 8 GiB on 8 H100 (NVIDIA/nccl#1047: 311 and 362
GB/s of bus bandwidth; the published page checks the sizes between). Every NVLink takes it."""
_NVLINK_STEP = ("latency per ring step fitted to NCCL's reduce-scatter on 8 H100 from 128 MiB to 8 GiB "
                "(NVIDIA/nccl#1047), taken for every NVLink generation")
_LINE_RATE = "line rate: no measured fraction published, so an upper bound"
_NVLINK_EFF = ("efficiency 0.82: NCCL's maintainer, 2024 (NVIDIA/nccl-tests#212): of H100 "
               "NVLink's 450 GB/s line rate, 'NCCL can get an effective NVLink bandwidth of 370GB/s' "
               "(about 20 % protocol overhead), taken for every NVLink generation")
_IB_EFF = ("efficiency 0.94: NCCL's maintainers, 2025 (NVIDIA/nccl-tests#290): 'For NDR @ 400Gbps "
           "you should see 46-48GB/s per NIC', 47 of 50 GB/s, taken for HDR too")

LINKS: dict[str, Link] = {
    "nvlink4": Link("NVLink 4 (H100 SXM)", 450e9, NVLINK_RING_STEP_S,
                    "NVIDIA H100 Tensor Core GPU datasheet (2022): 900 GB/s NVLink per GPU, "
                    f"bidirectional, so 450 GB/s each way; {_NVLINK_STEP}; {_NVLINK_EFF}", 0.82),
    "nvlink3": Link("NVLink 3 (A100 SXM)", 300e9, NVLINK_RING_STEP_S,
                    "NVIDIA A100 Tensor Core GPU datasheet (2020): 600 GB/s NVLink per GPU, "
                    f"bidirectional, so 300 GB/s each way; {_NVLINK_STEP}; {_NVLINK_EFF}", 0.82),
    "pcie4": Link("PCIe 4.0 x16", 32e9, 3e-6,
                  "PCI-SIG PCIe 4.0 specification (2017): 16 GT/s x 16 lanes, about 32 GB/s raw "
                  f"each way; about 25 GB/s is achievable in practice (efficiency 0.78); {_TYPICAL}",
                  25 / 32),
    "pcie5": Link("PCIe 5.0 x16", 64e9, 3e-6,
                  "PCI-SIG PCIe 5.0 specification (2019): 32 GT/s x 16 lanes, about 64 GB/s raw "
                  "each way; efficiency 0.81: Microsoft Azure's ND H200 v5 results (Azure/AI-benchmarking-"
                  "guide, 2024), nvbandwidth host to device and device to host 52 GB/s each; "
                  f"{_TYPICAL}", 52 / 64),
    "ib-ndr400": Link("InfiniBand NDR 400 Gb/s", 50e9, 5e-6,
                      "NVIDIA ConnectX-7 / InfiniBand NDR (2021): 400 Gb/s per port = 50e9 bytes/s "
                      f"each way, one port per GPU as in a DGX H100; {_TYPICAL}; {_IB_EFF}", 0.94,
                      one_per_gpu=True),
    "ib-hdr200": Link("InfiniBand HDR 200 Gb/s", 25e9, 5e-6,
                      "NVIDIA ConnectX-6 / InfiniBand HDR (2018): 200 Gb/s per port = 25e9 bytes/s "
                      f"each way, one port per GPU as in a DGX A100; {_TYPICAL}; {_IB_EFF}", 0.94,
                      one_per_gpu=True),
    "100gbe": Link("100 Gigabit Ethernet (TCP)", 12.5e9, 20e-6,
                   "IEEE 802.3 100GbE line rate: 100 Gb/s = 12.5e9 bytes/s each way for one port; "
                   "divide by the GPUs that share the port; latency is a typical TCP figure, "
                   f"not a datasheet value; {_LINE_RATE}", upper_bound=True),
    "25gbe": Link("25 Gigabit Ethernet (TCP)", 3.125e9, 30e-6,
                  "IEEE 802.3 25GbE line rate: 25 Gb/s = 3.125e9 bytes/s each way for one port; "
                  "divide by the GPUs that share the port; latency is a typical TCP figure, "
                  f"not a datasheet value; {_LINE_RATE}", upper_bound=True),
    "nvlink5": Link("NVLink 5 (B200 SXM)", 900e9, NVLINK_RING_STEP_S,
                    "NVIDIA DGX B200 datasheet (2024): fifth-generation NVLink, 1.8 TB/s per GPU, "
                    f"bidirectional (14.4 TB/s for 8 GPUs), so 900 GB/s each way; {_NVLINK_STEP}; "
                    f"{_NVLINK_EFF}", 0.82),
    "infinity-fabric": Link("AMD Infinity Fabric (MI300X platform)", 448e9, 2e-6,
                            "AMD Instinct MI300X datasheet (2023): 7 Infinity Fabric links per GPU, one "
                            "to each peer of an 8-GPU board, 128 GB/s bidirectional each, 896 GB/s in "
                            "all, so 448 GB/s each way per GPU; one link alone carries 64 GB/s each "
                            "way, so the 448 assume the collective library (RCCL) runs rings over "
                            f"all 7 peer links at once; {_LINE_RATE}; {_TYPICAL}", upper_bound=True),
    "loopback": Link("TCP loopback (gloo, one host)", 1e9, 20e-6,
                     "nominal figures for the book's CPU runs, whose ranks are processes of one host "
                     "talking through gloo's TCP transport: 1 GB/s each way, as chapter 3 measures a "
                     "few hundred MB/s to a few GB/s; not a datasheet value or a specification; "
                     "latency is a typical TCP loopback figure per message, and a whole gloo "
                     "collective measures more"),
}
"""Link presets by short name. Bandwidth per GPU per direction (bytes/s), latency in seconds."""

_A100 = "NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOP/s bf16 dense, 19.5 TFLOP/s fp32"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (2023), SXM: 989 TFLOP/s bf16 dense, 67 TFLOP/s fp32"
_DGX_A100 = "NVIDIA DGX A100 datasheet (2020): 8 A100 SXM per system, joined by NVLink 3 through NVSwitch"
_DGX_H = ("NVIDIA DGX H100 / DGX H200 datasheets (2023, 2024): 8 SXM GPUs per system, joined by "
          "NVLink 4 through NVSwitch")
_GIB = " (GB read as GiB, as the memory stacks hold it: no driver-reported total is published)"
_MIB = 2**20


def _smi(mib: int) -> str:
    return (f" ({mib:,} MiB as nvidia-smi reports the card's total, modal-labs/modal-client#2797 "
            "and public nvidia-smi logs)")


def _cuda_gib(gib: float) -> int:
    """Bytes of a total that PyTorch's out-of-memory message prints in GiB to two decimals
    ("GPU 0 has a total capacity of 79.11 GiB"): exact to about 5 MiB."""
    return round(gib * 2**30)


RUNTIME_MEMORY_SOURCES = {
    "a100-40gb": "39.50 GiB in a PyTorch out-of-memory message, TianheWu/CoSeR#10 (2025); older "
                 "drivers report 39.39 to 39.59 (raoyongming/DenseCLIP#52, bigscience-workshop/t-zero#12)",
    "a100-80gb": "79.25 GiB in PyTorch out-of-memory messages, levihsu/OOTDiffusion#235 (2025) and "
                 "wbfwonderful/Vad-R1#11 (2026); older drivers report 79.35",
    "h100-80gb": "79.11 GiB in a PyTorch out-of-memory message on an H100 80GB HBM3, "
                 "vllm-project/vllm#27508 (2025)",
    "l4-24gb": "22.03 GiB in a PyTorch out-of-memory message on an L4, ArcInstitute/evo2#190 (2025)",
    "h200-141gb": "150,109,880,320 B, torch's total_memory measured by make gpu-check (results/gpu/"
                  "nvidia-h200.json): nvidia-smi's 143,771 MiB less the 616 MiB it lists as reserved",
}
"""Where each preset's ``runtime_memory_bytes`` comes from (the others have none published)."""


def _dgx_a100_host(memory_tb: int) -> Host:
    return Host("2 x AMD EPYC 7742", 128, memory_tb * 2**40, "pcie4",
                f"NVIDIA DGX A100 datasheet (2020): dual AMD Rome 7742, 128 cores in all, {memory_tb} TB "
                "of system memory (the 320 GB system 1 TB, the 640 GB system 2 TB); PCIe 4.0; AMD's EPYC "
                "7742 specifications: 8 channels of DDR4-3200 a socket, 204.8 GB/s; NVIDIA's DGX A100 "
                "system architecture white paper (WP-10083-001, its block diagram): four PCIe Gen4 "
                "switches, each with two A100s and two ConnectX-6 HCAs behind one x16 uplink to a CPU",
                2 * 204.8e9, gpus_per_uplink=2)


_DGX_H_HOST = Host("2 x Intel Xeon Platinum 8480C", 112, 2 * 2**40, "pcie5",
                   "NVIDIA DGX BasePOD reference architecture, core components (DGX H100 / H200): "
                   "'Dual Intel Xeon Platinum 8480C processors, 112 cores total ... with PCIe 5.0 "
                   "support', '2 TB of DDR5 system memory'; Intel's Xeon Platinum 8480+ specifications: "
                   "8 channels of DDR5-4800 a socket, 307.2 GB/s", 2 * 307.2e9)

ACCELERATORS: dict[str, Accelerator] = {
    "a100-40gb": Accelerator("NVIDIA A100 40GB", 40_960 * _MIB, 312e12, 19.5e12,
                             f"{_A100}, 40 GB HBM2{_smi(40_960)} at 1,555 GB/s", "nvlink3", 8, _DGX_A100, 1.555e12,
                             _dgx_a100_host(1), datasheet_gb=40, runtime_memory_bytes=_cuda_gib(39.50)),
    "a100-80gb": Accelerator("NVIDIA A100 80GB", 81_920 * _MIB, 312e12, 19.5e12,
                             f"{_A100}, 80 GB HBM2e{_smi(81_920)} at 2,039 GB/s", "nvlink3", 8, _DGX_A100, 2.039e12,
                             _dgx_a100_host(2), datasheet_gb=80, runtime_memory_bytes=_cuda_gib(79.25)),
    "h100-80gb": Accelerator("NVIDIA H100 SXM 80GB", 81_559 * _MIB, 989e12, 67e12,
                             f"{_H100}, 80 GB HBM3{_smi(81_559)} at 3.35 TB/s", "nvlink4", 8, _DGX_H, 3.35e12,
                             _DGX_H_HOST, datasheet_gb=80, runtime_memory_bytes=_cuda_gib(79.11)),
    "h200-141gb": Accelerator("NVIDIA H200 SXM 141GB", 143_771 * _MIB, 989e12, 67e12,
                              f"NVIDIA H200 Tensor Core GPU datasheet (2024): 141 GB HBM3e{_smi(143_771)} at 4.8 TB/s, "
                              "compute as the H100 SXM (989 TFLOP/s bf16 dense, 67 TFLOP/s fp32)",
                              "nvlink4", 8, _DGX_H, 4.8e12, _DGX_H_HOST, datasheet_gb=141,
                              runtime_memory_bytes=150_109_880_320),
    "l4-24gb": Accelerator("NVIDIA L4 24GB", 24 * GIB, 121e12, 30.3e12,
                           f"NVIDIA L4 Tensor Core GPU datasheet (2023): 24 GB GDDR6{_GIB}, 121 TFLOP/s "
                           "bf16 dense (242 with sparsity), 30.3 TFLOP/s fp32",
                           "pcie4", 8,
                           "NVIDIA L4 datasheet (2023): a PCIe Gen4 x16 card (64 GB/s bidirectional) "
                           "with no NVLink, so GPUs of one machine talk over PCIe 4; the largest "
                           "cloud L4 machines hold 8 (Google Cloud g2-standard-96, AWS EC2 "
                           "g6.48xlarge)", None,
                           Host("96 vCPUs (Google Cloud g2-standard-96)", 48, 384 * 10**9, "pcie4",
                                "Google Cloud machine types, G2: g2-standard-96 has 8 L4, 96 vCPUs "
                                "(2 per core, so 48 cores) and 384 GB of memory"), datasheet_gb=24,
                           runtime_memory_bytes=_cuda_gib(22.03)),
    "b200-180gb": Accelerator("NVIDIA B200 SXM 180GB", 180 * GIB, 2.25e15, 75e12,
                              "NVIDIA DGX B200 datasheet (2024): 1,440 GB HBM3e for 8 GPUs, so 180 GB "
                              f"each{_GIB} (the 2024 launch figure was 192 GB); NVIDIA HGX B200 "
                              "datasheet: 36 PFLOP/s bf16 with sparsity and 600 TFLOP/s fp32 for 8 "
                              "GPUs, so 2.25 PFLOP/s bf16 dense and 75 TFLOP/s fp32 per GPU",
                              "nvlink5", 8,
                              "NVIDIA DGX B200 datasheet (2024): 8 B200 SXM per system, joined by "
                              "NVLink 5 through NVSwitch", None,
                              Host("2 x Intel Xeon Platinum 8570", 112, 2 * 2**40, "pcie5",
                                   "NVIDIA DGX B200 user guide, hardware overview: '2 x Intel Xeon "
                                   "8570 PCIe Gen5 CPUs with 56 cores each', '2 TB using 32 x DIMMs "
                                   "(upgradable to 4 TB)'; the B200's own PCIe 6 runs at the "
                                   "host's Gen5; Intel's Xeon Platinum 8570 specifications: 8 "
                                   "channels of DDR5-5600 a socket, 358.4 GB/s", 2 * 358.4e9), datasheet_gb=180),
    "mi300x-192gb": Accelerator("AMD Instinct MI300X 192GB", 192 * GIB, 1307.4e12, 163.4e12,
                                f"AMD Instinct MI300X datasheet (2023): 192 GB HBM3{_GIB}, 1307.4 TFLOP/s "
                                "bf16 dense (2614.9 with sparsity), 163.4 TFLOP/s fp32 vector",
                                "infinity-fabric", 8,
                                "AMD Instinct MI300X Platform datasheet (2023): 8 MI300X on one "
                                "board, each joined to the 7 others by Infinity Fabric links; the "
                                "platform names no host server, so CPU offload is not priced", datasheet_gb=192),
    "cpu": Accelerator("CPU (nominal)", 16 * GIB, 100e9, 100e9,
                       "nominal figures for the book's CPU runs (16 GiB, 100 GFLOP/s), not a "
                       "datasheet or a measurement: use them for arithmetic, not for predictions",
                       "loopback", 2,
                       "nominal: the book's CPU runs start their ranks as processes of one host "
                       "(2 by default, as 'run --nproc 2'), talking over TCP loopback; pass "
                       "gpus_per_node for more ranks", None,
                       Host("the same CPU (nominal)", 2, 16 * GIB, "loopback",
                            "nominal: on a CPU run the 'device' is host memory already; 2 cores "
                            "and 16 GiB as the book's build machine, not a datasheet"), context_bytes=0,
                       backend="gloo"),
}
"""Accelerator presets by short name. Memory in bytes, peaks in FLOP/s (dense)."""


def datasheet_bytes(accelerator: Accelerator | str) -> int:
    """``accelerator``'s memory as its datasheet's "GB" read as decimal: 80 GB → 80e9 bytes."""
    acc = _accelerator(accelerator)
    return int(acc.memory_bytes if acc.datasheet_gb is None else acc.datasheet_gb * 10**9)


def usable_memory_bytes(accelerator: Accelerator | str) -> int:
    """Bytes of ``accelerator``'s memory a training process's tensors can fill: the memory CUDA
    reports (``runtime_memory_bytes``, else the driver's total ``memory_bytes``) less
    ``context_bytes`` (:data:`TRAINING_CONTEXT_BYTES` on a GPU). The caching allocator's own
    reserve is not taken off here: the memory model prices it (``MemoryEstimate.peak_reserved``).
    On the H200 this is the usable memory ``make gpu-check`` measured inside a rank."""
    acc = _accelerator(accelerator)
    return (acc.runtime_memory_bytes or acc.memory_bytes) - acc.context_bytes


def get_link(name: str) -> Link:
    """The :data:`LINKS` preset called ``name``.

    Raises:
        ValueError: for an unknown name, listing the accepted ones.
    """
    return lookup(LINKS, name, "link name")


def get_accelerator(name: str) -> Accelerator:
    """The :data:`ACCELERATORS` preset called ``name``.

    Raises:
        ValueError: for an unknown name, listing the accepted ones.
    """
    return lookup(ACCELERATORS, name, "accelerator name")


def _accelerator(accelerator: Accelerator | str) -> Accelerator:
    return accelerator if isinstance(accelerator, Accelerator) else get_accelerator(accelerator)


def _link(link: Link | str) -> Link:
    return link if isinstance(link, Link) else get_link(link)


def default_intra_link(accelerator: Accelerator | str) -> Link:
    """The link between two GPUs of one machine that ``accelerator`` states (its ``intra_link``).

    Args:
        accelerator: An :class:`Accelerator` or the name of an :data:`ACCELERATORS` preset.

    Raises:
        ValueError: for an unknown preset name, or an accelerator that states no intra-node link
            (pass ``intra_link`` explicitly then: no link is guessed from the GPU's name).
    """
    acc = _accelerator(accelerator)
    if not acc.intra_link:
        raise ValueError(f"accelerator {acc.name!r} states no intra-node link: pass intra_link "
                         f"explicitly (one of {', '.join(LINKS)})")
    return LINKS[acc.intra_link]


def node_preset(accelerator: Accelerator | str, *, inter_link: str | Link = "ib-ndr400",
                intra_link: str | Link | None = None, gpus_per_node: int | None = None,
                nics_per_node: int | None = None) -> Node:
    """A :class:`Node` of ``accelerator``: its own intra-node link and usual node size.

    Args:
        accelerator: An :class:`Accelerator` or the name of an :data:`ACCELERATORS` preset.
        inter_link: One network port between machines, a :data:`LINKS` name or a :class:`Link`.
        intra_link: Overrides the accelerator's own intra-node link (a name or a :class:`Link`).
        gpus_per_node: Overrides the accelerator's usual node size.
        nics_per_node: Ports of ``inter_link`` per machine; default one per GPU for a link
            machines carry one of per GPU (:attr:`Link.one_per_gpu`: InfiniBand), else one.

    Raises:
        ValueError: for an unknown name, an accelerator that states no intra-node link (pass
            ``intra_link`` explicitly) or no node size (pass ``gpus_per_node``), or a bad count.
    """
    acc = _accelerator(accelerator)
    intra = default_intra_link(acc) if intra_link is None else _link(intra_link)
    per_node = acc.gpus_per_node if gpus_per_node is None else gpus_per_node
    if per_node is None:
        raise ValueError(f"accelerator {acc.name!r} states no usual node size: pass gpus_per_node "
                         "explicitly")
    inter = _link(inter_link)
    if nics_per_node is None:
        nics_per_node = per_node if inter.one_per_gpu else 1
    return Node(acc, per_node, intra, inter, nics_per_node)
