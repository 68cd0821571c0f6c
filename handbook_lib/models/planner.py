"""Choosing a strategy: every option's memory and time, and a recommendation with its reasons.

Chapter 4 teaches it. :func:`plan` prices every lever — DDP, SHARD_GRAD_OP, FULL_SHARD,
HYBRID_SHARD across nodes, activation checkpointing, CPU offload, more GPUs — with the chapter-2
memory model (peak per GPU, mixed precision, activations, FSDP's buffers) and the chapter-3
communication model (link speeds, overlap), then recommends the option that fits with headroom
and comes first under :func:`recommend` (fastest, steps within 1 % tied; a tie to fewer levers,
then less communication, then less memory), and says why in words. :func:`seed_recommendation` keeps the simplified rule this
course started from, to compare. Pure arithmetic.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from handbook_lib.core.checks import check_int
from handbook_lib.core.config import get_precision
from handbook_lib.core.strategies import get_strategy
from handbook_lib.models.hardware import (
    Accelerator,
    Link,
    Node,
    get_accelerator,
    get_link,
    node_preset,
)
from handbook_lib.models.layout import ModelLayout, ModelLike, model_layout
from handbook_lib.models.memory import PHASE_WORDS, estimate_memory, min_gpus_to_fit
from handbook_lib.models.seed import seed_recommendation
from handbook_lib.models.timing import estimate_compute_time, estimate_step_time
from handbook_lib.models.topology import Route, route_collective
from handbook_lib.models.traffic import CollectiveRecord, estimate_step_traffic

__all__ = ["Option", "Plan", "plan", "preference", "recommend", "STEP_TIE", "check_whole_nodes", "OFFLOAD_LINK"]


OFFLOAD_LINK = "pcie4"
"""Host link the CPU-offload option moves sharded parameters and gradients over."""
_ORDER = ("DDP", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD")


@dataclass(frozen=True)
class Option:
    """One way to run the job, priced."""

    name: str
    strategy: str
    gpus: int
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    shard_group_size: int | None = None
    peak_bytes: int = 0
    """Predicted peak device memory per GPU, bytes."""
    fits: bool = False
    """Peak within the GPU's memory less the headroom."""
    comm_s: float = 0.0
    """Communication per step, seconds (all collectives back to back, plus offload traffic)."""
    compute_s: float = 0.0
    """Compute per step, seconds (recomputation included)."""
    step_s: float = 0.0
    """Step time with communication overlapped with compute, seconds."""
    bound: str = ""
    """``communication`` or ``compute``."""
    peak_phase: str = ""
    activation_bytes: int = 0
    model_state_bytes: int = 0
    host_bytes: int = 0
    """Host (CPU) memory per GPU the option needs for what it offloads, bytes (0: none)."""
    routes: tuple[str, ...] = ()
    """How its collectives travel, one line per route with the kinds that take it:
    ``"all_gather, reduce_scatter: ring on NVLink 4 (H100 SXM) at 369 GB/s"``."""


@dataclass(frozen=True)
class Plan:
    """Every option, the recommendation, and the reasons for it."""

    model: str
    num_params: int
    gpu: str
    gpus: int
    options: list[Option]
    recommended: Option | None
    reasons: list[str] = field(default_factory=list)
    seed_answer: str = ""
    """What the seed's rule (fp32 model state only) would have answered."""
    gpus_per_node: int = 0
    """GPUs per node the plan assumed (sharing the intra-node link)."""
    nics_per_node: int = 0
    """Network ports per node the plan assumed."""


def check_whole_nodes(gpus: int, gpus_per_node: int, *,
                      names: tuple[str, str] = ("gpus={}", "gpus_per_node={}")) -> None:
    """Refuse a GPU count that is more than one node and not a whole number of nodes.

    ``names`` formats the two values in the caller's words (the CLI passes ``"--gpus {}"``).

    Raises:
        ValueError: for ``gpus_per_node`` not an int >= 1, or e.g. ``gpus=12 is not a whole
            number of nodes of gpus_per_node=8``.
    """
    check_int("gpus_per_node", gpus_per_node, 1)
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ValueError(f"{names[0].format(gpus)} is not a whole number of nodes of "
                         f"{names[1].format(gpus_per_node)}")


STEP_TIE = 0.01
"""Step times within this fraction of the fastest count as equal: the time model is not finer
than that (a latency of a few microseconds never decides a plan)."""


def preference(option: Option) -> tuple[bool, bool, float, int]:
    """The planner's tie-break, as a sort key (smaller is better) over options whose step times
    tie (:func:`recommend`): fewer levers (no activation recomputation, then no CPU offload),
    then less communication per step, then less memory. So when compute hides the communication
    of both, SHARD_GRAD_OP beats FULL_SHARD: same step time, fewer bytes on the wire, a busier
    link left for everything else.
    """
    return (option.activation_checkpointing, option.cpu_offload, round(option.comm_s, 6), option.peak_bytes)


def _ties(options: list[Option], step_s: float) -> list[Option]:
    return [o for o in options if o.step_s <= step_s * (1 + STEP_TIE)]


def recommend(options: list[Option]) -> Option | None:
    """The planner's one rule over options that fit: the fastest step, where every step within
    :data:`STEP_TIE` (1 %) of the fastest ties, and a tie goes to :func:`preference`.
    ``None`` for no options."""
    if not options:
        return None
    return min(_ties(options, min(o.step_s for o in options)), key=preference)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def plan(
    model: ModelLike,
    gpu: Accelerator | str,
    gpus: int,
    *,
    micro_batch: int = 1,
    seq_len: int = 2048,
    gpus_per_node: int | None = None,
    intra_link: Link | str | None = None,
    inter_link: Link | str = "ib-ndr400",
    nics_per_node: int | None = None,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    headroom: float = 0.10,
    utilization: float = 0.4,
) -> Plan:
    """Price every option for training ``model`` on ``gpus`` GPUs and recommend one.

    Args:
        model: A :class:`~handbook_lib.models.presets.DecoderShape`, a preset name (``llama2-7b``
            ...), a layout, or the handbook's own
            :class:`~handbook_lib.core.architecture.ModelConfig` (to compare the plan with runs on
            this machine).
        gpu: An :class:`Accelerator` or a preset name (``h100-80gb`` ...).
        gpus: GPUs in the job.
        micro_batch: Sequences per GPU per step.
        seq_len: Tokens per sequence.
        gpus_per_node: GPUs sharing the intra-node link (default: the accelerator preset's
            usual node, 8 for an H100; refused for an accelerator that states none).
        intra_link: Link inside a node (default: the accelerator preset's own, e.g. NVLink 4
            for an H100; refused for an accelerator that states none).
        inter_link: One network port between nodes (InfiniBand NDR by default).
        nics_per_node: Ports of ``inter_link`` per node (default: one per GPU for InfiniBand,
            one for Ethernet; :func:`~handbook_lib.models.hardware.node_preset`). A collective
            over several nodes is priced on its route over them
            (:func:`~handbook_lib.models.topology.route_collective`).
        precision: As for :func:`~handbook_lib.models.memory.estimate_memory`.
        optimizer: As for :func:`~handbook_lib.models.memory.estimate_memory`.
        headroom: Fraction of the GPU's memory kept free (CUDA context, NCCL, fragmentation).
        utilization: Fraction of the bf16 peak that compute achieves.

    Raises:
        ValueError: for unknown presets or precision, ``gpus < 1``, ``gpus_per_node < 1`` or
            ``gpus`` more than one node and not a whole number of nodes, ``micro_batch``/``seq_len``
            < 1, or a headroom outside [0, 1).
    """
    layout = model_layout(model)
    acc = get_accelerator(gpu) if isinstance(gpu, str) else gpu
    check_int("gpus", gpus, 1)
    if gpus_per_node is None:
        gpus_per_node = node_preset(acc).gpus_per_node
    check_whole_nodes(gpus, gpus_per_node)
    get_precision(precision)
    check_int("micro_batch", micro_batch, 1)
    check_int("seq_len", seq_len, 1)
    if not 0 <= headroom < 1:  # also refuses NaN
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    node = node_preset(acc, inter_link=inter_link, intra_link=intra_link, gpus_per_node=min(gpus_per_node, gpus),
                       nics_per_node=nics_per_node)
    job = _Job(layout, node, precision, optimizer, micro_batch, seq_len, utilization,
               acc.memory_bytes * (1 - headroom))
    price = functools.partial(_price, job)
    options = []
    for strategy in _ORDER:
        if get_strategy(strategy).hybrid and gpus <= node.gpus_per_node:
            continue  # one node: hybrid is FULL_SHARD
        for ac in (False, True):
            options.append(price(strategy, gpus, ac, False, strategy + (" + AC" if ac else "")))
    options.append(price("FULL_SHARD", gpus, True, True, "FULL_SHARD + AC + offload"))
    more = min_gpus_to_fit(layout, acc.memory_bytes, headroom=headroom, strategy="FULL_SHARD",
                           precision=precision, optimizer=optimizer, micro_batch=micro_batch,
                           seq_len=seq_len, activation_checkpointing=True)
    if more is not None and more > gpus:
        options.append(price("FULL_SHARD", more, True, False, f"FULL_SHARD + AC on {more} GPUs"))

    here = [o for o in options if o.fits and o.gpus == gpus]
    recommended = recommend(here)
    if recommended is None:
        bigger = [o for o in options if o.fits]
        recommended = bigger[0] if bigger else None
    reasons = _reasons(options, recommended, acc, job.budget, gpus, gpus_per_node)
    return Plan(layout.name, layout.num_params, acc.name, gpus, options, recommended, reasons,
                seed_recommendation(layout.num_params, acc.memory_bytes, gpus), gpus_per_node,
                node.nics_per_node)


@dataclass(frozen=True)
class _Job:
    """What every option of one plan shares."""

    layout: ModelLayout
    node: Node
    """The machines: the GPU, GPUs per node (at most the job's), the links inside and between."""
    precision: str
    optimizer: str
    micro_batch: int
    seq_len: int
    utilization: float
    budget: float
    """Bytes of a GPU's memory an option may use (less the headroom)."""


def _price(job: _Job, strategy: str, n: int, ac: bool, offload: bool, name: str) -> Option:
    """One option on ``n`` GPUs: its peak memory (chapter 2's model), its step's collectives on
    the links they cross and its compute (chapter 3's), overlapped; offload adds the sharded
    fp32 parameters up and the fp32 gradients down over the host link, not hidden."""
    row = get_strategy(strategy)
    group = job.node.gpus_per_node if row.hybrid else None
    mem = estimate_memory(job.layout, n, strategy, job.precision, job.optimizer, micro_batch=job.micro_batch,
                          seq_len=job.seq_len, shard_group_size=group, activation_checkpointing=ac,
                          cpu_offload=offload)
    param_dtype, reduce_dtype = get_precision(job.precision)
    traffic = estimate_step_traffic(job.layout.units(), n, strategy, param_dtype=param_dtype,
                                    reduce_dtype=reduce_dtype, shard_group_size=group)

    routes: dict[str, dict[str, None]] = {}  # description -> the kinds that take it

    def link_of(record: CollectiveRecord) -> Route:
        route = route_collective(record, job.node, n, strategy)
        routes.setdefault(route.description, {})[record.kind] = None
        return route

    acc = job.node.accelerator
    peak_flops = acc.peak_flops_bf16 if job.precision != "fp32" else acc.peak_flops_fp32
    compute = estimate_compute_time(job.layout.num_params, job.micro_batch * job.seq_len, peak_flops,
                                    job.utilization)
    compute *= 4 / 3 if ac else 1  # recomputing the forward: 8PT instead of 6PT
    time = estimate_step_time(traffic, link_of, compute, overlap=True)
    comm, step = time.comm_s, time.total_s
    if offload:
        moved = 8 * -(-job.layout.num_params // n)
        extra = moved / get_link(OFFLOAD_LINK).achievable_bytes_per_s
        comm, step = comm + extra, step + extra
    return Option(name, strategy, n, ac, offload, group, mem.peak, mem.peak <= job.budget, comm,
                  compute, step, "communication" if comm > compute else "compute",
                  mem.peak_phase, mem.components["activations"], mem.model_state, mem.host,
                  tuple(f"{', '.join(kinds)}: {d}" for d, kinds in routes.items()))


def _reasons(options: list[Option], chosen: Option | None, acc: Accelerator, budget: float,
             gpus: int, gpus_per_node: int) -> list[str]:
    reasons = []
    by_name = {o.name: o for o in options}
    for name in ("DDP", "SHARD_GRAD_OP", "FULL_SHARD"):
        o = by_name.get(name)
        if o and not o.fits:
            what = ("activations decide" if o.activation_bytes > o.model_state_bytes
                    else "model state decides")
            reasons.append(f"{name} does not fit: {_gb(o.peak_bytes)} per GPU against {_gb(budget)} "
                           f"usable on {acc.name}; {what} ({_gb(o.activation_bytes)} "
                           f"activations, {_gb(o.model_state_bytes)} model state).")
    if chosen is None:
        reasons.append("No option fits, even with activation checkpointing on more GPUs: the "
                       "activations of one sequence exceed a GPU; shorten the sequence or add "
                       "tensor/sequence parallelism (not covered by FSDP).")
        return reasons
    faster = [o for o in options if o.gpus == gpus and o.fits and o is not chosen]
    reasons.append(f"Recommended: {chosen.name} on {chosen.gpus} GPUs — peak {_gb(chosen.peak_bytes)} "
                   f"per GPU {PHASE_WORDS.get(chosen.peak_phase, (chosen.peak_phase,))[0]}, step "
                   f"{chosen.step_s:.3f} s, {chosen.bound}-bound.")
    if chosen.cpu_offload:
        per_node = min(gpus_per_node, chosen.gpus)
        node = f" ({_gb(chosen.host_bytes * per_node)} per node of {per_node} GPUs)" if per_node > 1 else ""
        reasons.append(f"CPU offload needs {_gb(chosen.host_bytes)} of host RAM per GPU{node} for the "
                       "offloaded parameters, gradients and optimizer state: check the machine has it.")
    if chosen.gpus > gpus:
        reasons.append(f"Nothing fits on {gpus} GPUs; {chosen.gpus} are the fewest that do.")
    plain = by_name.get(chosen.strategy)
    if chosen.activation_checkpointing and chosen.gpus == gpus and plain is not None and not plain.fits:
        reasons.append("Activation checkpointing is needed: it trades one more forward pass "
                       "(a third more compute) for keeping only each layer's input.")
    tied = [o for o in _ties(faster, chosen.step_s) if (o.activation_checkpointing, o.cpu_offload)
            == (chosen.activation_checkpointing, chosen.cpu_offload)]
    for o in tied:
        if o.comm_s > chosen.comm_s:
            reasons.append(f"{o.name} takes the same step time (compute hides both), but "
                           f"{chosen.name} spends {o.comm_s - chosen.comm_s:.3f} s less per step "
                           "on the links; it wins the tie.")
    if faster:
        runner = min(faster, key=lambda o: o.step_s)
        reasons.append(f"Next best: {runner.name} ({runner.step_s:.3f} s per step, "
                       f"{_gb(runner.peak_bytes)} per GPU).")
    if chosen.bound == "communication":
        reasons.append("Communication is not hidden by compute on these links: a faster "
                       "interconnect, HYBRID_SHARD, or a larger micro-batch would help.")
    return reasons
