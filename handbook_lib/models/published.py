"""Other people's GPU measurements, and the models' predictions beside them. Pure: no ``torch``.

What this book cannot measure (many GPUs, many machines) is checked against figures that others
published, each with its configuration and its source. One model for every row, nothing tuned
per row; a row the model's own parameters were taken from is marked ``calibration`` and is not
evidence for the model.

Three kinds of rows, each priced by one model:

- **bus bandwidth**, nccl-tests' ``busbw`` (NVIDIA/nccl-tests, ``doc/PERFORMANCE.md``): the bytes
  one rank sends in the ring algorithm over the time, ``2(N-1)/N · B / t`` for an all-reduce and
  ``(N-1)/N · B / t`` for an all-gather, comparable to a link's bandwidth whatever N is; the
  model is :func:`~handbook_lib.models.topology.route_collective`;
- **training throughput**, tokens per second per GPU, against the compute model
  (:func:`~handbook_lib.models.timing.estimate_compute_time`: 6PT, attention's FLOPs and the
  recomputed forward, at :func:`~handbook_lib.models.timing.expected_utilization`): what the
  utilization fitted on a few runs is worth on everyone's jobs;
- **peak memory**: :mod:`handbook_lib.models.published_memory`.
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.models.collectives import estimate_collective
from handbook_lib.models.hardware import get_accelerator, node_preset
from handbook_lib.models.hf_config import decoder_shape_from_hf
from handbook_lib.models.presets import DecoderShape, get_shape
from handbook_lib.models.foundry_runs import FOUNDRY_RUNS, FOUNDRY_SOURCE, MPT_SHAPES, FoundryRun
from handbook_lib.models.timing import estimate_compute_time, estimate_step_flops, expected_utilization
from handbook_lib.models.topology import route_collective

__all__ = [
    "PUBLISHED_BUS_BANDWIDTH",
    "PUBLISHED_SOURCES",
    "PUBLISHED_THROUGHPUT",
    "BandwidthRow",
    "PublishedBandwidth",
    "PublishedThroughput",
    "ThroughputRow",
    "bus_bandwidth_rows",
    "throughput_rows",
    "published_model",
]

_VOLTAGE_PARK = ("AI @ Georgia Tech and Voltage Park, github.com/aigatech/vpbenchmarking (2025): "
                 "4 nodes x 8 H100 SXM, 3.2 Tb/s InfiniBand (8 x 400 Gb/s) per node, NCCL 2.24.3, "
                 "nccl-tests peak bus bandwidth across nodes")


@dataclass(frozen=True)
class PublishedBandwidth:
    """One published collective benchmark."""

    label: str
    kind: str
    """``all_reduce``, ``all_gather`` or ``reduce_scatter``."""
    strategy: str
    """The strategy whose group the benchmark's collective is (one group of every GPU: DDP's
    all-reduce, FULL_SHARD's all-gather), for :func:`~handbook_lib.models.topology.route_collective`."""
    gpu: str
    """Accelerator preset of the machines."""
    gpus: int
    """GPUs in the benchmark, filling whole machines."""
    inter_link: str
    """Network port preset (one per GPU on these machines)."""
    buffer_bytes: int
    """Message size the model is priced at, bytes (large: where the figure peaks)."""
    busbw_bytes_per_s: float
    """The published bus bandwidth, bytes/s."""
    source: str
    calibration: bool = False
    """The model's own parameters were taken from this figure."""
    nics_per_node: int | None = None
    """Network ports per machine, where the benchmark's machines have fewer than one per GPU
    (``None``: the preset's, one per GPU for InfiniBand)."""
    why: str = ""
    """Where the model misses, why (a known gap of the model, not a correction)."""


_AZURE = ("Microsoft Azure, github.com/Azure/AI-benchmarking-guide, Azure_Results (2024): "
          "nccl-tests all_reduce, in place, 8 GB message, NCCL 2.18.5")
_NVLS = ("NCCL ran NVLink SHARP (NVLS): the NVSwitch adds the buffers, so each GPU sends its data "
         "once instead of a ring's twice; the model knows only ring and tree")

_NCCL_1047 = ("NVIDIA/nccl#1047 (2023): reduce_scatter_perf on one server of 8 H100 80GB HBM3, NCCL's ring, "
              "out of place")
_RAMP = ((128, 311.34), (256, 330.94), (512, 340.94), (1024, 349.36), (2048, 354.81), (4096, 357.76),
         (8192, 362.16))
"""NVIDIA/nccl#1047's reduce-scatter: (MiB, bus bandwidth GB/s), from 128 MiB to 8 GiB. The
smallest and the largest set NVLink's latency per ring step
(:data:`~handbook_lib.models.hardware.NVLINK_RING_STEP_S`)."""

PUBLISHED_BUS_BANDWIDTH: tuple[PublishedBandwidth, ...] = (
    PublishedBandwidth("1 x 8 H100, ring", "all_gather", "FULL_SHARD", "h100-80gb", 8, "ib-ndr400", 8 * 2**30, 370e9,
                       "NCCL's maintainer, NVIDIA/nccl-tests#212 (2024): 'an effective NVLink bandwidth "
                       "of 370GB/s' for non-all-reduce collectives or NCCL_ALGO=RING on 8 H100",
                       calibration=True),
    PublishedBandwidth("4 x 8 H100, 8 x NDR", "all_reduce", "DDP", "h100-80gb", 32, "ib-ndr400", 8 * 2**30,
                       330.93e9, _VOLTAGE_PARK),
    PublishedBandwidth("4 x 8 H100, 8 x NDR", "all_gather", "FULL_SHARD", "h100-80gb", 32, "ib-ndr400", 8 * 2**30,
                       323.53e9, _VOLTAGE_PARK),
    PublishedBandwidth("1 x 8 A100 (ND A100 v4)", "all_reduce", "DDP", "a100-80gb", 8, "ib-hdr200", 8 * 10**9,
                       231.58e9, _AZURE),
    PublishedBandwidth("1 x 8 H100 (ND H100 v5)", "all_reduce", "DDP", "h100-80gb", 8, "ib-ndr400", 8 * 10**9,
                       478.87e9, _AZURE, why=_NVLS),
    PublishedBandwidth("DGX A100, 8 x HDR", "all_reduce", "DDP", "a100-80gb", 16, "ib-hdr200", 8 * 2**30, 192e9,
                       "NCCL's maintainers, NVIDIA/nccl#812 (2023): 'we have 8x200Gbit/s IB cards and we "
                       "measure 192GB/s AllReduce BusBW' (DGX A100; the node count is not stated, "
                       "priced on 2)"),
    PublishedBandwidth("2 x 8 A100, 4 x HDR", "all_reduce", "DDP", "a100-80gb", 16, "ib-hdr200", 8 * 2**30, 91e9,
                       "NVIDIA/nccl-tests#100 (2022): 2 HGX A100 80GB with 4 ConnectX-6 200 Gb/s each, "
                       "'the testing result can reach 91GB/s in busbw' at 1 to 8 GB",
                       nics_per_node=4),
    PublishedBandwidth("3 x 8 A100 40GB, 4 x HDR", "all_reduce", "DDP", "a100-40gb", 24, "ib-hdr200", 131_072_008,
                       96.45e9,
                       "NVIDIA/nccl-tests#119 (2023): 3 nodes of 8 A100 SXM4 40GB, 4 x HDR 200 Gb/s "
                       "each, all_reduce peak 96.45 GB/s at 131,072,008 bytes", nics_per_node=4),
    PublishedBandwidth("248 x 8 H200, 8 x NDR", "all_reduce", "DDP", "h200-141gb", 1984, "ib-ndr400", 512 * 2**20,
                       350e9,
                       "NVIDIA/nccl-tests#283 (2025): 1,984 ranks on 248 nodes of 8 H200 with 8 HCAs "
                       "each, all_reduce of 512 MB 'typically measuring around 350G' (the HCAs' speed "
                       "is not stated; priced as NDR 400 Gb/s)"),
    *(PublishedBandwidth(f"{nodes} x 8 H100", "reduce_scatter", "FULL_SHARD", "h100-80gb",
                         8 * nodes, "ib-ndr400", 8 * 2**30, gbs * 1e9,
                         "NVIDIA/nccl#1229 (2024): reduce-scatter on H100 clusters of 4 to 128 nodes, bus bandwidth "
                         "'just like 360,345,320,300,280,260' (GB/s, rounded by its author; message size not "
                         "stated, priced at 8 GiB, where a ring's bus bandwidth peaks)")
      for nodes, gbs in ((4, 360), (8, 345), (16, 320), (32, 300), (64, 280), (128, 260))),
    *(PublishedBandwidth(f"1 x 8 H100, {mib:,} MiB", "reduce_scatter", "FULL_SHARD", "h100-80gb", 8,
                         "ib-ndr400", mib * 2**20, gbs * 1e9, _NCCL_1047, calibration=mib in (128, 8192))
      for mib, gbs in _RAMP),
)
"""Published bus bandwidths, with their configurations and sources."""


@dataclass(frozen=True)
class BandwidthRow:
    """A published bus bandwidth beside the model's."""

    published: PublishedBandwidth
    model_bytes_per_s: float
    """The model's bus bandwidth at the row's buffer, bytes/s."""
    algorithm: str
    """The algorithm the model chose."""

    @property
    def error(self) -> float:
        """Model over published, minus one (+0.10: the model is 10 % faster)."""
        return self.model_bytes_per_s / self.published.busbw_bytes_per_s - 1


def bus_bandwidth_rows(rows: tuple[PublishedBandwidth, ...] = PUBLISHED_BUS_BANDWIDTH) -> list[BandwidthRow]:
    """Each published bus bandwidth with the model's: the collective priced on its route
    (:func:`~handbook_lib.models.topology.route_collective`) over machines of the row's
    preset, its ring bytes over the predicted time."""
    out = []
    for row in rows:
        node = node_preset(row.gpu, inter_link=row.inter_link, nics_per_node=row.nics_per_node)
        cost = estimate_collective(row.kind, row.buffer_bytes, row.gpus)
        route = route_collective(cost, node, row.gpus, row.strategy)
        out.append(BandwidthRow(row, cost.sent_bytes / route.seconds, route.algorithm))
    return out


_CONFIG_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings")
_PUBLISHED_CONFIGS = {  # name: (its config.json's sizes, in _CONFIG_KEYS' order)
    "llama3-70b": ("Llama 3 70B", ("llama", 8192, 28672, 80, 64, 8, 128256, False)),
    "llama3.1-8b": ("Llama 3.1 8B", ("llama", 4096, 14336, 32, 32, 8, 128256, False)),
    "llama3.2-3b": ("Llama 3.2 3B", ("llama", 3072, 8192, 28, 24, 8, 128256, True)),
    "mistral-7b": ("Mistral 7B", ("mistral", 4096, 14336, 32, 32, 8, 32000, False)),
    # ibm/PowerLM-3b (GraniteForCausalLM, Llama's layer): the sizes of arXiv 2408.13359's Table 4; the vocabulary
    # of its tokenizer (StarCoder's, 49,152), tied as its 14.05 GB fp32 checkpoint (3.51e9 parameters) says
    "powerlm-3b": ("PowerLM 3B", ("llama", 2304, 9216, 40, 36, 36, 49152, True)),
}
_PUBLISHED_SHAPES = {  # shapes no covered config.json family spells: GPT-2's layer with one key/value head
    "santacoder": DecoderShape("SantaCoder 1.1B", num_layers=24, d_model=2048, nhead=16, vocab_size=49280,
                               dim_feedforward=8192, num_kv_heads=1, bias=True, max_positions=2048,
                               source="bigcode/gpt_bigcode-santacoder config.json (multi_query: one key/value head)"),
}


def published_model(model: str | int) -> DecoderShape | int:
    """A row's model: a preset name, ``"llama3-70b"``, ``"llama3.1-8b"``, ``"llama3.2-3b"``,
    ``"mistral-7b"`` or ``"powerlm-3b"`` (their published sizes), ``"santacoder"`` (a GPT-2 layer
    with one key/value head), or a parameter count as the source states it."""
    if isinstance(model, int):
        return model
    if model in _PUBLISHED_SHAPES:
        return _PUBLISHED_SHAPES[model]
    if model not in _PUBLISHED_CONFIGS:
        return get_shape(model)
    name, sizes = _PUBLISHED_CONFIGS[model]
    return decoder_shape_from_hf(dict(zip(_CONFIG_KEYS, sizes)), name)


def _params(model: str | int) -> int:
    m = published_model(model)
    return m if isinstance(m, int) else m.num_params


_IBM = ("PyTorch and IBM, 'Maximizing training throughput using PyTorch FSDP', "
        "pytorch.org/blog/maximizing-training (2024): "
        "Llama 2 architecture, 4,096-token sequences, 2 per GPU, bf16, FSDP; 128 A100 80GB or 96 H100")
_TITAN_A100 = ("pytorch/torchtitan docs/performance.md (2024): FSDP2 on 64 A100 80GB, tokens/s per GPU "
               "(WPS) and MFU")


def _foundry_label(run: FoundryRun) -> str:
    size, seq, gpus, gpu, *_ = run
    extra = (", AC" if run[8] else "") + {"FULL_SHARD": ""}.get(run[11], f", {run[11]}")
    name = {"a100-40gb": "A100 40GB", "a100-80gb": "A100 80GB", "h100-80gb": "H100"}[gpu]
    return f"MPT {size.upper()}, {seq:,} tok x {run[6]}, {gpus} {name}{extra}"


def _foundry_calibration(run: FoundryRun) -> bool:
    """The rows :data:`~handbook_lib.models.timing.UTILIZATION_MAX` and its width were fitted on:
    one node of 8 GPUs, 2,048-token sequences, no activation checkpointing (every size there)."""
    return run[2] == 8 and run[1] == 2048 and not run[8]


@dataclass(frozen=True)
class PublishedThroughput:
    """One published training throughput."""

    label: str
    model: str | int
    """A preset name, ``"llama3-70b"``, or the parameter count the source states."""
    gpu: str
    gpus: int
    seq_len: int
    micro_batch: int
    activation_checkpointing: bool
    tokens_per_s_per_gpu: float
    """The published figure."""
    published_mfu: float
    """The utilization the source reports for it (its own FLOP count), a fraction."""
    source: str
    calibration: bool = False
    """A row the utilization's constants were fitted on (:func:`utilization_points`): shown, not
    counted in the error. (Llama 3 405B's row set
    :data:`~handbook_lib.models.timing.DEFAULT_UTILIZATION`, which only GPUs with no published run
    take, so the H100 model it is compared with was not fitted on it.)"""
    attention: tuple[int, int] = (0, 0)
    """``(layers, query width)`` where :attr:`model` is a bare count, from the model's published
    config; a preset knows its own. They price attention's FLOPs."""


PUBLISHED_THROUGHPUT: tuple[PublishedThroughput, ...] = (
    PublishedThroughput("Llama 3 405B, 16,384 H100", 405_000_000_000, "h100-80gb", 16384, 8192, 16, False,
                        400e12 / (6 * 405e9 + 12 * 126 * 16384 * 8192), 0.41,
                        "Grattafiori et al. 2024, The Llama 3 Herd of Models (arXiv:2407.21783), Table 4: "
                        "400 TFLOP/s per GPU, BF16 MFU 41 % (TP 8, PP 16, FSDP 128); tokens/s per GPU are "
                        "400 TFLOP/s over 6P + 12·L·w·s (the paper states FLOP/s, not tokens)",
                        attention=(126, 16384)),
    PublishedThroughput("Llama 2 7B, 128 A100", "llama2-7b", "a100-80gb", 128, 4096, 2, False, 3700, 0.57, _IBM),
    PublishedThroughput("Llama 2 70B, 128 A100, AC", "llama2-70b", "a100-80gb", 128, 4096, 2, True, 370, 0.50, _IBM),
    PublishedThroughput("Llama 2 7B, 96 H100", "llama2-7b", "h100-80gb", 96, 4096, 2, False, 7500, 0.37, _IBM),
    PublishedThroughput("Llama 2 70B, 96 H100, AC", "llama2-70b", "h100-80gb", 96, 4096, 2, True, 800, 0.34, _IBM),
    PublishedThroughput("Llama 2 13B, 64 A100", "llama2-13b", "a100-80gb", 64, 4096, 2, False, 2162, 0.611,
                        _TITAN_A100),
    PublishedThroughput("Llama 2 70B, 64 A100, AC", "llama2-70b", "a100-80gb", 64, 4096, 2, True, 353, 0.505,
                        _TITAN_A100),
    PublishedThroughput("Llama 3 70B, 64 A100, AC", "llama3-70b", "a100-80gb", 64, 8192, 1, True, 331, 0.517,
                        _TITAN_A100),
    *(PublishedThroughput(_foundry_label(run), run[9], run[3], run[2], run[1], run[6], run[8], run[7], run[4] / 100,
                          FOUNDRY_SOURCE, calibration=_foundry_calibration(run), attention=MPT_SHAPES[run[0]])
      for run in FOUNDRY_RUNS),
)
"""Published training throughputs: FSDP jobs, and Llama 3 405B's (FSDP with tensor and pipeline
parallelism); every bf16 row of MosaicML's benchmark tables (:mod:`handbook_lib.models.foundry_runs`)."""


@dataclass(frozen=True)
class ThroughputRow:
    """A published throughput beside the compute model's."""

    published: PublishedThroughput
    model_tokens_per_s: float
    """Tokens per second per GPU at the model's utilization: tokens of a step over its compute."""
    utilization: float
    """The utilization the model assumed for it (the executed FLOPs' share of the peak)."""

    @property
    def error(self) -> float:
        """Model over published, minus one."""
        return self.model_tokens_per_s / self.published.tokens_per_s_per_gpu - 1


def _shape(row: PublishedThroughput) -> tuple[int, int]:
    """``(layers, query width)`` of a row's model."""
    model = published_model(row.model)
    return row.attention if isinstance(model, int) else (model.num_layers, model.attention_width)


def utilization_points(rows: tuple[PublishedThroughput, ...] = PUBLISHED_THROUGHPUT,
                       ) -> dict[str, list[tuple[int, float]]]:
    """The calibration rows' ``(width, utilization)`` by accelerator name: the share of the GPU's
    bf16 peak their hardware FLOPs (:func:`~handbook_lib.models.timing.estimate_step_flops`) reached
    at the published tokens per second. What
    :func:`~handbook_lib.models.timing.fit_utilizations` turns into
    :data:`~handbook_lib.models.timing.UTILIZATION_MAX` and
    :data:`~handbook_lib.models.timing.UTILIZATION_HALF_WIDTH`."""
    points: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        if row.calibration:
            layers, width = _shape(row)
            acc = get_accelerator(row.gpu)
            flops = estimate_step_flops(_params(row.model), row.seq_len, seq_len=row.seq_len, num_layers=layers,
                                        attention_width=width, activation_checkpointing=row.activation_checkpointing)
            u = flops.hardware / row.seq_len * row.tokens_per_s_per_gpu / acc.peak_flops_bf16
            points.setdefault(acc.name, []).append((width, u))
    return points


def throughput_rows(rows: tuple[PublishedThroughput, ...] = PUBLISHED_THROUGHPUT,
                    utilization: float | None = None) -> list[ThroughputRow]:
    """Each published throughput with the compute model's: ``micro_batch x seq_len`` tokens over
    their hardware FLOPs (:func:`~handbook_lib.models.timing.estimate_step_flops`: 6PT, attention,
    and the forward again with activation checkpointing) at ``utilization`` of the GPU's bf16
    peak (``None``: :func:`~handbook_lib.models.timing.expected_utilization` for the GPU and the
    model's width). Communication is taken as hidden: these jobs run on machines with a network
    port per GPU, where chapter 4's planner finds FSDP compute-bound."""
    out = []
    for row in rows:
        tokens, acc = row.micro_batch * row.seq_len, get_accelerator(row.gpu)
        layers, width = _shape(row)
        u = expected_utilization(acc, width) if utilization is None else utilization
        seconds = estimate_compute_time(_params(row.model), tokens, acc.peak_flops_bf16, u,
                                        activation_checkpointing=row.activation_checkpointing,
                                        seq_len=row.seq_len, num_layers=layers, attention_width=width)
        out.append(ThroughputRow(row, tokens / seconds, u))
    return out


PUBLISHED_SOURCES = {
    "NVIDIA (NCCL maintainers)": ("NVIDIA/nccl-tests#212", "NVIDIA/nccl#812"),
    "Voltage Park and Georgia Tech": ("aigatech/vpbenchmarking",),
    "Microsoft Azure": ("Azure/AI-benchmarking-guide",),
    "NCCL users' clusters": ("NVIDIA/nccl-tests#100", "NVIDIA/nccl-tests#119", "NVIDIA/nccl-tests#283"),
    "Meta (Llama 3 paper)": ("arXiv:2407.21783",),
    "PyTorch and IBM": ("pytorch.org/blog/maximizing-training",),
    "PyTorch (torchtitan)": ("pytorch/torchtitan", "pytorch/torchtitan#165"),
    "PyTorch (torchtune)": ("pytorch/torchtune",),
    "IBM (fms-acceleration)": ("foundation-model-stack/fms-acceleration",),
    "MosaicML (llm-foundry)": ("mosaicml/llm-foundry",),
    "Microsoft (DeepSpeed)": ("deepspeedai/DeepSpeed",),
}
"""Who published the rows, and where: independent groups, each with its own machines."""
