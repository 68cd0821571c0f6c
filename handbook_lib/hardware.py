"""Hardware presets: the links between GPUs and the GPUs themselves. Pure: no ``torch``.

Chapter 3 introduces the links (bandwidth and latency feed the alpha-beta time model of
``handbook_lib.comm``); chapter 4 uses the accelerators (memory to fit the model state, peak
FLOP/s to estimate compute time).

Conventions, so that every figure reads the same way:

- A link's bandwidth is **per GPU, per direction**, in bytes/s. Datasheets often quote the
  bidirectional total (NVLink 4: "900 GB/s" = 450 GB/s each way) or bits/s (InfiniBand NDR:
  "400 Gb/s" = 50e9 bytes/s); we convert. A ring collective sends and receives at the same
  time, so its time is set by the one-way figure.
- A link's latency is the per-message (per ring step) cost ``alpha``, in seconds. Latencies are
  typical published figures for a collective library's hop over that link, not datasheet values.
- An accelerator's memory is the datasheet's figure in decimal bytes (80 GB → 80e9). The hardware
  capacity is usually that number in GiB, and what a program can allocate is a little less;
  the book compares against the datasheet figure and says so.
- Peak FLOP/s are dense (no 2:4 sparsity), from the vendor's datasheet.
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.names import lookup

__all__ = [
    "Link",
    "Accelerator",
    "Node",
    "LINKS",
    "ACCELERATORS",
    "get_link",
    "get_accelerator",
]


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

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s!r}")
        if not self.latency_s >= 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s!r}")


@dataclass(frozen=True)
class Accelerator:
    """One accelerator (GPU), as its datasheet describes it."""

    name: str
    """Human-readable name, e.g. ``"NVIDIA H100 SXM 80GB"``."""
    memory_bytes: int
    """Device memory, bytes, as the datasheet states it (80 GB → 80e9)."""
    peak_flops_bf16: float
    """Dense bf16 tensor-core peak, FLOP/s."""
    peak_flops_fp32: float
    """Plain fp32 (non-tensor-core) peak, FLOP/s."""
    source: str
    """Where the figures come from, in words."""

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "peak_flops_bf16", "peak_flops_fp32"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Node:
    """A machine: ``gpus_per_node`` accelerators joined by ``intra_link``, reaching other
    machines through ``inter_link``."""

    accelerator: Accelerator
    """The GPU model every slot holds."""
    gpus_per_node: int
    """Accelerators in one machine (a count)."""
    intra_link: Link
    """Link between two GPUs of the same machine (NVLink, PCIe)."""
    inter_link: Link
    """Link a GPU uses to reach a GPU of another machine (InfiniBand, Ethernet)."""

    def __post_init__(self) -> None:
        g = self.gpus_per_node
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"gpus_per_node must be an int >= 1, got {g!r}")

    def link_for(self, group_size: int) -> Link:
        """The slowest link a ring over ``group_size`` GPUs crosses, packed onto as few nodes as
        possible: ``intra_link`` if the group fits in one node, else ``inter_link``."""
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        return self.intra_link if group_size <= self.gpus_per_node else self.inter_link


_TYPICAL = "latency is a typical published figure for one hop, not a datasheet value"

LINKS: dict[str, Link] = {
    "nvlink4": Link("NVLink 4 (H100 SXM)", 450e9, 2e-6,
                    "NVIDIA H100 Tensor Core GPU datasheet (2022): 900 GB/s NVLink per GPU, "
                    f"bidirectional, so 450 GB/s each way; {_TYPICAL}"),
    "nvlink3": Link("NVLink 3 (A100 SXM)", 300e9, 2e-6,
                    "NVIDIA A100 Tensor Core GPU datasheet (2020): 600 GB/s NVLink per GPU, "
                    f"bidirectional, so 300 GB/s each way; {_TYPICAL}"),
    "pcie4": Link("PCIe 4.0 x16", 32e9, 3e-6,
                  "PCI-SIG PCIe 4.0 specification (2017): 16 GT/s x 16 lanes, about 32 GB/s raw "
                  f"each way; about 25 GB/s is achievable in practice; {_TYPICAL}"),
    "pcie5": Link("PCIe 5.0 x16", 64e9, 3e-6,
                  "PCI-SIG PCIe 5.0 specification (2019): 32 GT/s x 16 lanes, about 64 GB/s raw "
                  f"each way; {_TYPICAL}"),
    "ib-ndr400": Link("InfiniBand NDR 400 Gb/s", 50e9, 5e-6,
                      "NVIDIA ConnectX-7 / InfiniBand NDR (2021): 400 Gb/s per port = 50e9 bytes/s "
                      f"each way, one port per GPU as in a DGX H100; {_TYPICAL}"),
    "ib-hdr200": Link("InfiniBand HDR 200 Gb/s", 25e9, 5e-6,
                      "NVIDIA ConnectX-6 / InfiniBand HDR (2018): 200 Gb/s per port = 25e9 bytes/s "
                      f"each way, one port per GPU as in a DGX A100; {_TYPICAL}"),
    "100gbe": Link("100 Gigabit Ethernet (TCP)", 12.5e9, 20e-6,
                   "IEEE 802.3 100GbE line rate: 100 Gb/s = 12.5e9 bytes/s each way for one port; "
                   "divide by the GPUs that share the port; latency is a typical TCP figure, "
                   "not a datasheet value"),
    "25gbe": Link("25 Gigabit Ethernet (TCP)", 3.125e9, 30e-6,
                  "IEEE 802.3 25GbE line rate: 25 Gb/s = 3.125e9 bytes/s each way for one port; "
                  "divide by the GPUs that share the port; latency is a typical TCP figure, "
                  "not a datasheet value"),
}
"""Link presets by short name. Bandwidth per GPU per direction (bytes/s), latency in seconds."""

_A100 = "NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOP/s bf16 dense, 19.5 TFLOP/s fp32"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (2023), SXM: 989 TFLOP/s bf16 dense, 67 TFLOP/s fp32"

ACCELERATORS: dict[str, Accelerator] = {
    "a100-40gb": Accelerator("NVIDIA A100 40GB", 40 * 10**9, 312e12, 19.5e12, f"{_A100}, 40 GB HBM2"),
    "a100-80gb": Accelerator("NVIDIA A100 80GB", 80 * 10**9, 312e12, 19.5e12, f"{_A100}, 80 GB HBM2e"),
    "h100-80gb": Accelerator("NVIDIA H100 SXM 80GB", 80 * 10**9, 989e12, 67e12, f"{_H100}, 80 GB HBM3"),
    "h200-141gb": Accelerator("NVIDIA H200 SXM 141GB", 141 * 10**9, 989e12, 67e12,
                              "NVIDIA H200 Tensor Core GPU datasheet (2024): 141 GB HBM3e, "
                              "compute as the H100 SXM (989 TFLOP/s bf16 dense, 67 TFLOP/s fp32)"),
    "l4-24gb": Accelerator("NVIDIA L4 24GB", 24 * 10**9, 121e12, 30.3e12,
                           "NVIDIA L4 Tensor Core GPU datasheet (2023): 24 GB GDDR6, 121 TFLOP/s "
                           "bf16 dense (242 with sparsity), 30.3 TFLOP/s fp32"),
    "cpu": Accelerator("CPU (nominal)", 16 * 10**9, 100e9, 100e9,
                       "nominal figures for the book's CPU runs (16 GB, 100 GFLOP/s), not a "
                       "datasheet or a measurement: use them for arithmetic, not for predictions"),
}
"""Accelerator presets by short name. Memory in bytes, peaks in FLOP/s (dense)."""


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
