"""How long one training step's collectives take on a cluster, and its compute: the step time
model. Pure arithmetic: no ``torch.distributed``.

Chapter 3 teaches it; chapter 4's planner and chapter 8's many nodes use it. Each collective of
:func:`handbook_lib.models.traffic.estimate_step_traffic` is priced with the alpha-beta model
(:func:`handbook_lib.models.collectives.estimate_collective_time`) on the link it crosses, or on
the route it takes over several machines (:func:`handbook_lib.models.topology.route_collective`);
compute is the FLOPs a step executes (6PT, attention's, the recomputed forward) at the
utilization published runs reach on the GPU for the model's width; overlap hides what compute can.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from handbook_lib.core.checks import check_int
from handbook_lib.models.collectives import estimate_collective_time
from handbook_lib.models.hardware import Accelerator, Link
from handbook_lib.models.init_bytes import DDP_BUCKET_CAPS
from handbook_lib.models.topology import Route
from handbook_lib.models.traffic import CollectiveRecord, StepTraffic

__all__ = ["StepTime", "PhaseTime", "FORWARD_SHARE", "NETWORK", "HOST", "StepFlops", "bytes_by_link",
           "estimate_step_time", "estimate_compute_time", "estimate_step_flops", "compute_forward_share",
           "DEFAULT_UTILIZATION", "UTILIZATION_SOURCE", "ATTENTION_FLOPS_SOURCE", "UTILIZATION_HALF_WIDTH",
           "UTILIZATION_MAX", "expected_utilization", "width_utilization", "fit_utilization", "fit_utilizations"]

DEFAULT_UTILIZATION = 0.41
"""Utilization assumed for a GPU with no published run (:func:`expected_utilization`) and by
:func:`estimate_compute_time` where none is given: see :data:`UTILIZATION_SOURCE`."""

UTILIZATION_SOURCE = (
    "Llama 3 405B pre-training on 16,384 H100 80GB (TP 8, PP 16, FSDP 128, sequences of 8,192): "
    "400 TFLOP/s per GPU, 'BF16 MFU' 41 %, Grattafiori et al. 2024, The Llama 3 Herd of Models, "
    "Table 4 (43 % on 8,192 GPUs, 38 % with 131,072-token sequences). FSDP alone on fewer GPUs "
    "measures 32 to 37 % on H100 and 47 to 57 % on A100 (PyTorch/IBM, 'Maximizing training "
    "throughput using PyTorch FSDP', 2024, Llama 2 7B to 70B)")
"""Where :data:`DEFAULT_UTILIZATION` comes from."""

UTILIZATION_HALF_WIDTH = 386
"""d_0 of :func:`expected_utilization`, elements: the hidden width at which a GPU reaches half
its :data:`UTILIZATION_MAX`. Fitted with them (:func:`fit_utilizations`, least squares) on the
17 published runs the published page marks as calibration: MosaicML's MPT models from 125M to
13B on one node of 8 A100s (40 and 80 GB) or H100s, 2,048-token sequences, no checkpointing.
Below a few thousand, a layer's pointwise work (norms, activations, residuals: memory-bound,
growing as d) weighs against its matrix products (growing as d²). An eager, unfused stack
weighs more: one H200 running this book's model measured d_0 = 1,058 (``make gpu-check``,
``results/gpu/nvidia-h200-width.json``)."""

_FITTED = ("fitted on 17 published runs marked as calibration on the published page (MosaicML "
           "llm-foundry's MPT benchmarks, 8 GPUs, 2,048-token sequences, no checkpointing)")

UTILIZATION_MAX: dict[str, tuple[float, str]] = {
    "NVIDIA A100 40GB": (0.664, _FITTED),
    "NVIDIA A100 80GB": (0.692, _FITTED),
    "NVIDIA H100 SXM 80GB": (0.468, _FITTED),
    "NVIDIA H200 SXM 141GB": (0.468, "the H100 SXM's (the same chip and peak; no published FSDP run on "
                                     "H200s is in the table); one H200 alone, with no communication, "
                                     "measured 0.703 with this book's unfused model, an upper bound"),
}
"""``u_max`` of :func:`expected_utilization` per accelerator (by :attr:`Accelerator.name`), and
where it comes from. Accelerators not listed (no published run) take :data:`DEFAULT_UTILIZATION`
at every width."""


ATTENTION_FLOPS_SOURCE = (
    "Chowdhery et al. 2022, PaLM (arXiv:2204.02311), appendix B: 6N + 12·L·H·Q·T FLOPs per token "
    "(L layers, H heads of width Q, sequence length T), the count torchtitan and Megatron-LM use for "
    "MFU; the causal mask is not discounted")
"""Where :func:`estimate_step_flops`' attention term comes from."""

LinkOrRoute = Link | Route
"""What prices a collective: one link (chapter 3), or its route on a cluster (chapter 4)."""


@dataclass(frozen=True)
class StepTime:
    """Predicted time of one optimizer step, seconds."""

    comm_s: float
    """The collectives' time: back to back without overlap; with it, each phase's busiest link
    (collectives on different links run at once), summed over the phases."""
    compute_s: float
    """Forward and backward compute, as given."""
    exposed_comm_s: float
    """Communication that no compute hides: ``total_s - compute_s``."""
    total_s: float
    """The step."""
    bound: str
    """``"communication"`` where a phase's collectives on one link outlast its compute (the
    step waits on the link beyond its unavoidable first all-gather and last reduction), else
    ``"compute"``."""
    phases: tuple[PhaseTime, ...] = ()
    """Each micro-step's forward and backward, in order (with overlap; empty without)."""

    @property
    def compute_margin(self) -> float:
        """The factor compute may shrink by (a faster GPU, a higher utilization) before a phase
        waits on its links: the least of each phase's compute over its busiest link's hidden
        time. Above 1 the step is compute-bound, below 1 communication-bound; infinite with no
        collective to hide. Without overlap (no phases), compute over all communication."""
        if not self.phases:
            return self.compute_s / self.comm_s if self.comm_s else math.inf
        return min((p.compute_s / p.hidden_s for p in self.phases if p.hidden_s > 0), default=math.inf)


@dataclass(frozen=True)
class PhaseTime:
    """One phase of one micro-step with overlap: its compute, each link's collectives, and what
    nothing hides, seconds."""

    micro_step: int
    phase: str
    """``"forward"`` or ``"backward"``."""
    compute_s: float
    streams: tuple[tuple[str, float], ...]
    """``(link, seconds)`` of the collectives on each link (NVLink inside a machine, the
    network, the host link), which run at the same time as each other."""
    edge_s: float
    """The collective nothing can hide: forward's first all-gather (nothing computes before it),
    backward's last reduction (nothing computes after it: the last reduce-scatter, and under
    HYBRID_SHARD the all-reduce that follows it; DDP's last bucket of 25 MiB, the rest of its
    buckets reduced while backward runs)."""
    total_s: float
    """``edge + max(compute, each link's time less its part of the edge)``."""
    hidden_s: float = 0.0
    """The busiest link's time less its part of the edge: what compute must outlast to hide it."""

    @property
    def bound(self) -> str:
        """``"communication"`` if a link's collectives outlast the phase's compute."""
        return "communication" if self.total_s > self.edge_s + self.compute_s * (1 + 1e-12) else "compute"


FORWARD_SHARE = 1 / 3
"""The forward's share of a step's compute under the 6PT rule (2PT of 6PT), the default of
:func:`estimate_step_time`; :attr:`StepFlops.forward_share` gives it for a shape and a policy."""

NETWORK = "network"
"""The stream key of a collective whose route leaves its machine (:attr:`Route.machines` > 1)."""
HOST = "host link"
"""The stream key of CPU offload's copies (``extra_comm_s``)."""


def bytes_by_link(traffic: StepTraffic, link_of: Callable[[CollectiveRecord], LinkOrRoute]) -> dict[str, int]:
    """Bytes one rank sends per step on each link (by the link's name; a route's slowest link),
    counted as the ring counts them, in execution order of first use: e.g.
    ``{"NVLink 4 (H100 SXM)": ..., "InfiniBand NDR 400 Gb/s": ...}``."""
    sent: dict[str, int] = {}
    for record in traffic.records:
        name = link_of(record).name
        sent[name] = sent.get(name, 0) + record.sent_bytes
    return sent


def _stream(chosen: LinkOrRoute) -> str:
    """Which link a collective occupies: the network if its route leaves the machine, else the
    link it runs on (one link, or the intra-node one)."""
    return NETWORK if isinstance(chosen, Route) and chosen.machines > 1 else chosen.name


def _phase(micro_step: int, phase: str, timed: list[tuple[CollectiveRecord, str, float]], compute_s: float,
           host_s: float) -> PhaseTime:
    """One phase with overlap (:func:`estimate_step_time`): its collectives ``timed`` (record,
    stream, seconds) in execution order."""
    streams: dict[str, float] = {}
    for _, stream, t in timed:
        streams[stream] = streams.get(stream, 0.0) + t
    if host_s:
        streams[HOST] = streams.get(HOST, 0.0) + host_s
    edge: list[tuple[str, float]] = []
    if phase == "forward" and timed and timed[0][0].kind == "all_gather":
        edge = [timed[0][1:]]
    elif phase == "backward" and timed and timed[-1][0].kind in ("reduce_scatter", "all_reduce"):
        last = timed[-1]
        edge = [last[1:]]
        if (last[0].kind == "all_reduce" and len(timed) > 1 and timed[-2][0].kind == "reduce_scatter"
                and timed[-2][0].unit == last[0].unit):  # HSDP: the last unit's reduce-scatter, then its all-reduce
            edge.insert(0, timed[-2][1:])
    if edge and timed[-1][0].unit == "model":  # DDP's one record: only its last bucket waits for nothing
        edge = [(edge[0][0], edge[0][1] * min(1.0, DDP_BUCKET_CAPS[1] / max(timed[-1][0].buffer_bytes, 1)))]
    hidden = dict(streams)
    for stream, t in edge:
        hidden[stream] -= t
    edge_s = sum(t for _, t in edge)
    busiest = max(hidden.values(), default=0.0)
    return PhaseTime(micro_step, phase, compute_s, tuple(streams.items()), edge_s, edge_s + max(compute_s, busiest),
                     busiest)


def estimate_step_time(
    traffic: StepTraffic,
    link: Link | Callable[[CollectiveRecord], LinkOrRoute],
    compute_s: float,
    overlap: bool,
    *,
    extra_comm_s: float = 0.0,
    forward_share: float = FORWARD_SHARE,
) -> StepTime:
    """Time of one step: its collectives on ``link`` plus ``compute_s`` seconds of compute.

    ``link`` is one link for every collective, or a function choosing the link of each (e.g.
    NVLink inside a node, InfiniBand for HSDP's all-reduce across nodes) or its
    :class:`~handbook_lib.models.topology.Route` on a cluster.

    Without overlap, ``total = comm + compute``. With overlap the step is priced phase by
    phase (each micro-step's forward, then its backward; :class:`PhaseTime`), as FSDP2 runs it:

    - **forward:** each unit's all-gather is prefetched while the previous unit computes; the
      first has nothing to hide behind (its *edge*);
    - **backward:** all-gathers (where forward resharded) and reduce-scatters run while the
      next unit computes; the last reduction has nothing after it to hide behind (the edge);
    - **streams:** collectives on one link share it (their times add), but collectives on
      different links run at once: FSDP2 issues HYBRID_SHARD's all-reduce between replicas on
      a stream of its own, "concurrently with all-gather/reduce-scatter since collectives use
      different network resources" (torch 2.13,
      ``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``). A collective is on the
      network if its route leaves the machine, else on the link it runs on;

    so a phase takes ``edge + max(compute, each link's time less its part of the edge)``,
    compute split between the phases by ``forward_share`` (2PT of 6PT: 1/3;
    :attr:`StepFlops.forward_share` for attention and recomputation, which runs in backward)
    and evenly between micro-steps. NCCL's kernels also take some of the GPU's SMs while they
    overlap compute (``NCCL_MIN_CTAS``/``NCCL_MAX_CTAS`` set how many): that slowdown is not
    added here but is in the utilizations compute is priced at, fitted on FSDP runs whose
    collectives overlapped their compute (:data:`UTILIZATION_MAX`).

    ``extra_comm_s`` is other transfer time beside the collectives, on the host link (CPU
    offload's copies to and from the host, :mod:`handbook_lib.models.offload`), spread over the
    phases as their compute is.
    """
    if not compute_s >= 0:
        raise ValueError(f"compute_s must be >= 0, got {compute_s!r}")
    if not extra_comm_s >= 0:
        raise ValueError(f"extra_comm_s must be >= 0, got {extra_comm_s!r}")
    if not 0 <= forward_share <= 1:
        raise ValueError(f"forward_share must be in [0, 1], got {forward_share!r}")
    choose = link if callable(link) else (lambda record: link)
    timed = []
    for r in traffic.records:
        chosen = choose(r)
        timed.append((r, _stream(chosen), chosen.seconds if isinstance(chosen, Route)
                      else estimate_collective_time(r, chosen)))
    comm = sum(t for *_, t in timed) + extra_comm_s
    if not overlap:
        return StepTime(comm, compute_s, comm, comm + compute_s,
                        "communication" if comm > compute_s else "compute")
    k = traffic.grad_accum_steps
    phases = []
    for m in range(k):
        for phase, share in (("forward", forward_share), ("backward", 1 - forward_share)):
            mine = [x for x in timed if x[0].micro_step == m and x[0].phase == phase]
            phases.append(_phase(m, phase, mine, compute_s * share / k, extra_comm_s * share / k))
    total = sum(p.total_s for p in phases)
    busiest = sum(max((t for _, t in p.streams), default=0.0) for p in phases)
    bound = "communication" if any(p.bound == "communication" for p in phases) else "compute"
    return StepTime(busiest, compute_s, total - compute_s, total, bound, tuple(phases))


def width_utilization(u_max: float, d0: int, d_model: int) -> float:
    """``u_max·d/(d + d_0)``: the utilization a GPU whose ceiling is ``u_max`` reaches at width
    ``d_model``, half of it at ``d0`` (the curve :func:`fit_utilizations` fits)."""
    return u_max * d_model / (d_model + d0)


def expected_utilization(accelerator: Accelerator, d_model: int) -> float:
    """Fraction of ``accelerator``'s peak that a training step's FLOPs reach (hardware FLOPs
    utilization, which is MFU without recomputation) for a model of width ``d_model``:
    ``u_max·d/(d + d_0)``, :data:`UTILIZATION_MAX` and :data:`UTILIZATION_HALF_WIDTH`.
    :data:`DEFAULT_UTILIZATION` for an accelerator with no published run, or a width of 0
    (unknown)."""
    check_int("d_model", d_model, 0)
    u_max = UTILIZATION_MAX.get(accelerator.name)
    if u_max is None or d_model == 0:
        return DEFAULT_UTILIZATION
    return width_utilization(u_max[0], UTILIZATION_HALF_WIDTH, d_model)


def fit_utilizations(points: Mapping[str, Sequence[tuple[int, float]]],
                     widths: range = range(1, 8193)) -> tuple[dict[str, float], int]:
    """``({gpu: u_max}, d_0)`` of ``u = u_max·d/(d + d_0)``, one ``d_0`` for every GPU, closest
    in least squares to measured ``(d_model, utilization)`` ``points`` per GPU; ``d_0`` a whole
    number of ``widths`` (for each, every ``u_max`` is a closed form). How
    :data:`UTILIZATION_MAX` and :data:`UTILIZATION_HALF_WIDTH` were found."""
    if not points or any(len(p) < 2 or any(d < 1 or not 0 < u <= 1 for d, u in p) for p in points.values()):
        raise ValueError(f"points must give each GPU two or more (d_model >= 1, utilization in (0, 1]), "
                         f"got {dict(points)!r}")
    best: tuple[float, dict[str, float], int] | None = None
    for d0 in widths:
        error, u_max = 0.0, {}
        for gpu, pts in points.items():
            f = [width_utilization(1.0, d0, d) for d, _ in pts]
            u_max[gpu] = sum(u * x for (_, u), x in zip(pts, f)) / sum(x * x for x in f)
            error += sum((u - u_max[gpu] * x) ** 2 for (_, u), x in zip(pts, f))
        if best is None or error < best[0]:
            best = (error, u_max, d0)
    assert best is not None
    return best[1], best[2]


def fit_utilization(points: Sequence[tuple[int, float]], widths: range = range(1, 8193)) -> tuple[float, int]:
    """``(u_max, d_0)`` of :func:`fit_utilizations` for one GPU's ``points``."""
    u_max, d0 = fit_utilizations({"gpu": points}, widths)
    return u_max["gpu"], d0


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one rank's forward and backward in one step (its own tokens)."""

    dense: int
    """6·P·T: 2 FLOPs per parameter per token forward, 4 backward (the matrix products)."""
    attention: int
    """12·L·w·s·T: the score and value products, ``Q·K^T`` and ``softmax·V`` (2·s·w FLOPs each
    per token and layer forward, twice that backward), for ``w`` the queries' width; grows with
    the sequence length ``s``. Counted whole, as PaLM counts it (:data:`ATTENTION_FLOPS_SOURCE`):
    a kernel that skips the masked half of a causal product does half of it."""
    recompute: int
    """The forward run again under full activation checkpointing: 2·P·T + 4·L·w·s·T."""

    @property
    def model(self) -> int:
        """The FLOPs model FLOPs utilization (MFU) counts: dense + attention."""
        return self.dense + self.attention

    @property
    def hardware(self) -> int:
        """The FLOPs the GPU executes, hardware FLOPs utilization's (HFU) count: model + recompute."""
        return self.model + self.recompute

    @property
    def forward_share(self) -> float:
        """The forward's share of :attr:`hardware`: a third of :attr:`model` (the rest, and the
        recomputed forward, run in backward); :data:`FORWARD_SHARE` for no FLOPs."""
        return self.model / 3 / self.hardware if self.hardware else FORWARD_SHARE


def estimate_step_flops(num_params: int, tokens: int, *, seq_len: int = 0, num_layers: int = 0,
                        attention_width: int = 0, activation_checkpointing: bool = False) -> StepFlops:
    """One rank's FLOPs for ``tokens`` tokens in sequences of ``seq_len``: :class:`StepFlops`.

    Args:
        num_params: P, parameters (every rank runs the whole model, gathered under FSDP).
        tokens: T, tokens the rank processes in the step.
        seq_len: s, tokens per sequence; 0 leaves attention's term out (the 6PT rule).
        num_layers: L, transformer layers (0: no attention term).
        attention_width: w, the queries' width, heads × head width (``d_model`` for most
            models; grouped-query attention shares keys and values, not queries).
        activation_checkpointing: full recomputation: the forward runs twice.
    """
    for name, value in (("num_params", num_params), ("tokens", tokens), ("seq_len", seq_len),
                        ("num_layers", num_layers), ("attention_width", attention_width)):
        check_int(name, value, 0)
    attention_forward = 4 * num_layers * attention_width * seq_len * tokens
    recompute = 2 * num_params * tokens + attention_forward if activation_checkpointing else 0
    return StepFlops(6 * num_params * tokens, 3 * attention_forward, recompute)


def estimate_compute_time(num_params: int, tokens: int, peak_flops: float,
                          utilization: float = DEFAULT_UTILIZATION, *,
                          activation_checkpointing: bool = False, seq_len: int = 0, num_layers: int = 0,
                          attention_width: int = 0, recompute_flops: int | None = None) -> float:
    """Seconds of one rank's forward + backward: the hardware FLOPs of
    :func:`estimate_step_flops` over ``peak · utilization``. Without the shape (``seq_len``,
    ``num_layers``, ``attention_width`` left 0) that is the 6PT rule, ``6·P·T / (peak ·
    utilization)``; with ``activation_checkpointing`` (full recomputation) the forward runs
    twice, 8PT: a third more.

    Forward costs 2 FLOPs (a multiply and an add) per parameter per token, backward twice that
    (gradients of activations and of weights); every rank runs the whole model (gathered, under
    FSDP) on its own tokens. Attention's score and value products add 12·L·w·s per token, the
    sequence-length term that dominates long contexts. Embedding lookups are counted as matrix
    products.

    Args:
        num_params: P, parameters.
        tokens: T, tokens one rank processes in the step (its share of the global batch).
        peak_flops: Peak FLOP/s of one accelerator, e.g. ``Accelerator.peak_flops_bf16``.
        utilization: Fraction of the peak the executed FLOPs achieve, in (0, 1]: hardware FLOPs
            utilization, which equals MFU without recomputation.
        seq_len, num_layers, attention_width: The shape that prices attention (see
            :func:`estimate_step_flops`).
        recompute_flops: With ``activation_checkpointing``, the FLOPs a policy recomputes
            (:func:`~handbook_lib.models.recompute.recompute_flops`) in place of full
            recomputation's; ``None``: full recomputation.
    """
    if not peak_flops > 0:
        raise ValueError(f"peak_flops must be > 0 FLOP/s, got {peak_flops!r}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    flops = _flops(num_params, tokens, activation_checkpointing, seq_len, num_layers, attention_width, recompute_flops)
    return flops.hardware / (peak_flops * utilization)


def _flops(num_params: int, tokens: int, activation_checkpointing: bool, seq_len: int, num_layers: int,
           attention_width: int, recompute_flops: int | None) -> StepFlops:
    flops = estimate_step_flops(num_params, tokens, seq_len=seq_len, num_layers=num_layers,
                                attention_width=attention_width,
                                activation_checkpointing=activation_checkpointing)
    if activation_checkpointing and recompute_flops is not None:
        flops = dataclasses.replace(flops, recompute=recompute_flops)
    return flops


def compute_forward_share(num_params: int, tokens: int, *, activation_checkpointing: bool = False,
                          seq_len: int = 0, num_layers: int = 0, attention_width: int = 0,
                          recompute_flops: int | None = None) -> float:
    """The forward's share of the compute :func:`estimate_compute_time` prices with the same
    arguments (:attr:`StepFlops.forward_share`): 1/3 without recomputation, 1/4 with full."""
    return _flops(num_params, tokens, activation_checkpointing, seq_len, num_layers, attention_width,
                  recompute_flops).forward_share
