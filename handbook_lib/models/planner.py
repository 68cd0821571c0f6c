"""Choosing a strategy: every option's memory and time, and a recommendation with its reasons.

Chapter 4 teaches it. :func:`plan` prices every lever — DDP, SHARD_GRAD_OP, FULL_SHARD,
HYBRID_SHARD across nodes, activation checkpointing, CPU offload, more GPUs — with the chapter-2
memory model (peak per GPU, mixed precision, activations, FSDP's buffers) and the chapter-3
communication model (link speeds, overlap), then recommends the option that fits with headroom
and comes first under :func:`recommend` (fastest, steps within 1 % tied; a tie to fewer levers,
then less communication, then less memory), and says why in words. :func:`seed_recommendation`
keeps the simplified rule this course started from, to compare. Pure arithmetic.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from handbook_lib.core.checks import check_int
from handbook_lib.core.config import get_precision
from handbook_lib.core.strategies import get_strategy
from handbook_lib.models.allocator import RESERVE_FRACTION, reserved_bytes
from handbook_lib.models.hardware import (
    Accelerator,
    Link,
    Node,
    datasheet_bytes,
    get_accelerator,
    node_preset,
)
from handbook_lib.models.budget import memory_budget
from handbook_lib.models.layout import ModelLayout, ModelLike, model_layout
from handbook_lib.models.memory import PHASE_WORDS, MemoryEstimate, estimate_memory
from handbook_lib.models.nccl_buffers import strategy_nccl
from handbook_lib.models.offload import (
    CPU_ADAM_PARAMS_PER_S_PER_CORE,
    OffloadCost,
    estimate_offload,
)
from handbook_lib.models.seed import seed_recommendation
from handbook_lib.models.timing import (
    DEFAULT_UTILIZATION, estimate_compute_time, estimate_step_time, expected_utilization,
)
from handbook_lib.models.topology import Route, route_collective
from handbook_lib.models.traffic import CollectiveRecord, estimate_step_traffic

__all__ = ["Option", "Plan", "plan", "preference", "recommend", "STEP_TIE", "check_whole_nodes"]
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
    """Predicted peak device memory per GPU, bytes: what the tensors hold (``allocated``)."""
    peak_reserved_bytes: int = 0
    """The same peak as the caching allocator reserves it, bytes (what ``nvidia-smi`` shows,
    less the process's context): what must fit."""
    budget_bytes: int = 0
    """Bytes of a GPU the plan lets an option reserve: the usable memory
    (:func:`~handbook_lib.models.hardware.usable_memory_bytes`, less NCCL's buffers for this
    option's process groups), less the headroom."""
    fits: bool = False
    """The reserved peak within the budget, and (offloading) the node's host bytes within its
    RAM."""
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
    host_node_bytes: int = 0
    """The same for a whole machine (every GPU of it), bytes, against its RAM."""
    offload: OffloadCost | None = None
    """What CPU offload costs it per step (copies and the CPU optimizer step); ``None``: none."""
    routes: tuple[str, ...] = ()
    """How its collectives travel, one line per route with the kinds that take it:
    ``"all_gather, reduce_scatter: ring on NVLink 4 (H100 SXM) at 369 GB/s"``."""
    nccl_bytes: int = 0
    """NCCL's buffers for its process groups, bytes, taken off the budget
    (:func:`~handbook_lib.models.nccl_buffers.nccl_buffer_bytes`)."""

    @property
    def cpu_step_s(self) -> float:
        """The optimizer step on the host's CPU (offload), seconds, part of ``step_s`` and never
        hidden; 0 without offload."""
        return self.offload.optimizer_s if self.offload else 0.0

    @property
    def margin_bytes(self) -> int:
        """Budget less reserved peak, bytes: negative when the option does not fit the GPU."""
        return self.budget_bytes - self.peak_reserved_bytes

    @property
    def margin(self) -> float:
        """:attr:`margin_bytes` as a fraction of the budget."""
        return self.margin_bytes / self.budget_bytes


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
    headroom: float = 0.0
    """Fraction of usable memory the plan kept free."""
    utilization: float = DEFAULT_UTILIZATION
    """Utilization the plan assumed: the executed FLOPs' share of the peak."""
    context_bytes: int = 0
    """Device bytes the plan took off each GPU for a training process's context."""


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
    optimizer_impl: str = "default",
    grad_accum_steps: int = 1,
    sync_every_micro_step: bool = False,
    headroom: float = 0.0,
    utilization: float | None = None,
    memory_bytes: int | None = None,
    cpu_params_per_s_per_core: float = CPU_ADAM_PARAMS_PER_S_PER_CORE,
    reserve_fraction: float = RESERVE_FRACTION,
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
        optimizer, optimizer_impl: As for :func:`~handbook_lib.models.memory.estimate_memory`
            (``default``: torch's choice on the accelerator, foreach on a GPU).
        grad_accum_steps: Micro-steps per optimizer step, each of ``micro_batch`` sequences
            per GPU: compute and all-gathers K times; gradients reduced in the last micro-step
            only (held unsharded in between, as :func:`~handbook_lib.models.memory.estimate_memory`
            prices), or in every one with ``sync_every_micro_step``.
        headroom: Fraction of the usable memory kept free beyond what the model prices (the CUDA
            context and the allocator's reserve are priced already): 0 by default, so every
            option's margin is shown as it is.
        utilization: Fraction of the peak the executed FLOPs achieve; ``None``: the GPU's at the
            model's width (:func:`~handbook_lib.models.timing.expected_utilization`).
        memory_bytes: Overrides the memory CUDA reports, bytes, before the training context is
            taken off (e.g. 80e9 to see a verdict with the datasheet's GB read as decimal).
        cpu_params_per_s_per_core: CPU optimizer speed for the offload option
            (:data:`~handbook_lib.models.offload.CPU_ADAM_PARAMS_PER_S_PER_CORE`).
        reserve_fraction: The caching allocator's reserve over the allocated peak
            (:data:`~handbook_lib.models.allocator.RESERVE_FRACTION`).

    Raises:
        ValueError: for unknown presets or precision, ``gpus < 1``, ``gpus_per_node < 1`` or
            ``gpus`` more than one node and not a whole number of nodes, ``micro_batch``/``seq_len``
            < 1, a headroom or reserve fraction outside [0, 1), a utilization outside (0, 1], a
            ``memory_bytes`` not above the CUDA context, or a CPU speed not > 0.
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
    check_int("grad_accum_steps", grad_accum_steps, 1)
    if sync_every_micro_step and grad_accum_steps < 2:
        raise ValueError(f"sync_every_micro_step needs grad_accum_steps >= 2, got {grad_accum_steps}")
    if not 0 <= headroom < 1:  # also refuses NaN
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    if memory_bytes is not None:
        check_int("memory_bytes", memory_bytes, acc.context_bytes + 1)
        acc = dataclasses.replace(acc, memory_bytes=memory_bytes, runtime_memory_bytes=None)
    node = node_preset(acc, inter_link=inter_link, intra_link=intra_link, gpus_per_node=min(gpus_per_node, gpus),
                       nics_per_node=nics_per_node)
    reserved_bytes(0, fraction=reserve_fraction)  # refuses a fraction outside [0, 1)
    if not cpu_params_per_s_per_core > 0:  # also refuses NaN
        raise ValueError(f"cpu_params_per_s_per_core must be > 0, got {cpu_params_per_s_per_core!r}")
    u = expected_utilization(acc, layout.d_model) if utilization is None else utilization
    job = _Job(layout, node, precision, (optimizer, optimizer_impl), micro_batch, seq_len, u, headroom,
               cpu_params_per_s_per_core, reserve_fraction, (grad_accum_steps, sync_every_micro_step))
    price = functools.partial(_price, job)
    options = []
    for strategy in _ORDER:
        if get_strategy(strategy).hybrid and gpus <= node.gpus_per_node:
            continue  # one node: hybrid is FULL_SHARD
        for ac in (False, True):
            options.append(price(strategy, gpus, ac, False, strategy + (" + AC" if ac else "")))
    if acc.host is not None:
        options.append(price("FULL_SHARD", gpus, True, True, "FULL_SHARD + AC + offload"))
    here = [o for o in options if o.fits and o.gpus == gpus]
    widest, fewer = next(o for o in options if o.name == "FULL_SHARD + AC"), 0
    if not widest.fits:  # more GPUs, their memory priced as every option's: the fewest that fit
        counts = _more_gpus(gpus)
        more = next((n for n in counts if _fits(job, "FULL_SHARD", n, True)), counts[-1])
        widest = price("FULL_SHARD", more, True, False, f"FULL_SHARD + AC on {more} GPUs")
        options += [widest] if widest.fits else []
        fewer = next((n for n in counts if n < more and acc.host and _fits(job, "FULL_SHARD", n, True, True)), 0)
    recommended = recommend(here)
    if recommended is None:
        bigger = [o for o in options if o.fits]
        recommended = bigger[0] if bigger else None
    reasons = _reasons(options, recommended, acc, gpus, gpus_per_node)
    if recommended is None:
        reasons.append(_what_would_fit(job, widest))
    if fewer:
        reasons.append(f"With CPU offload, FULL_SHARD + AC would fit {fewer} GPUs (GPU and host memory priced as "
                       "above), its optimizer step on the CPU.")
    return Plan(layout.name, layout.num_params, acc.name, gpus, options, recommended, reasons,
                seed_recommendation(layout.num_params, datasheet_bytes(acc), gpus), gpus_per_node,
                node.nics_per_node, headroom, u, acc.context_bytes)


@dataclass(frozen=True)
class _Job:
    """What every option of one plan shares."""

    layout: ModelLayout
    node: Node
    """The machines: the GPU, GPUs per node (at most the job's), the links inside and between."""
    precision: str
    optimizer: tuple[str, str]
    """The optimizer and its implementation (``adamw``, ``default``)."""
    micro_batch: int
    seq_len: int
    utilization: float
    headroom: float
    """The fraction of the usable memory an option leaves free."""
    cpu_speed: float
    """CPU optimizer parameters/s per core (offload)."""
    reserve: float
    """The allocator's reserve over the allocated peak, a fraction."""
    accum: tuple[int, bool] = (1, False)
    """Micro-steps per optimizer step, and whether each one reduces its gradients."""


def _memory(job: _Job, strategy: str, n: int, ac: bool, offload: bool = False) -> MemoryEstimate:
    """One option's memory on ``n`` GPUs: chapter 2's model, on the accelerator's own backend."""
    group = job.node.gpus_per_node if get_strategy(strategy).hybrid else None  # hybrid: a node's GPUs
    return estimate_memory(job.layout, n, strategy, job.precision, job.optimizer[0], micro_batch=job.micro_batch,
                           seq_len=job.seq_len, shard_group_size=group, activation_checkpointing=ac,
                           cpu_offload=offload, backend=job.node.accelerator.backend, optimizer_impl=job.optimizer[1],
                           grad_accum_steps=job.accum[0], sync_every_micro_step=job.accum[1])


def _budget(job: _Job, strategy: str, n: int) -> tuple[int, int]:
    """``(budget, nccl)``: what an option may reserve per GPU, after NCCL's buffers and the headroom."""
    nccl = strategy_nccl(job.node, strategy, n)
    return memory_budget(job.node.accelerator, job.headroom, nccl).budget_bytes, nccl.total


def _fits(job: _Job, strategy: str, n: int, ac: bool, offload: bool = False) -> bool:
    """Whether the option fits, as :func:`_price` judges it: the reserved peak within the
    budget, and (offloading) a machine's host bytes within its RAM."""
    mem = _memory(job, strategy, n, ac, offload)
    host = job.node.accelerator.host
    return (reserved_bytes(mem.peak, fraction=job.reserve) <= _budget(job, strategy, n)[0]
            and (not offload or host is not None and mem.host * job.node.gpus_per_node <= host.memory_bytes))


def _price(job: _Job, strategy: str, n: int, ac: bool, offload: bool, name: str) -> Option:
    """One option on ``n`` GPUs: its peak memory (chapter 2's model, as the allocator reserves
    it), its step's collectives on the links they cross and its compute (chapter 3's),
    overlapped; offload adds its copies to the communication and the CPU optimizer step to the
    step (:func:`~handbook_lib.models.offload.estimate_offload`)."""
    group = job.node.gpus_per_node if get_strategy(strategy).hybrid else None
    mem = _memory(job, strategy, n, ac, offload)
    param_dtype, reduce_dtype = get_precision(job.precision)
    traffic = estimate_step_traffic(job.layout.units(), n, strategy, param_dtype=param_dtype,
                                    reduce_dtype=reduce_dtype, shard_group_size=group,
                                    grad_accum_steps=job.accum[0], sync_every_micro_step=job.accum[1])

    routes: dict[str, dict[str, None]] = {}  # description -> the kinds that take it

    def link_of(record: CollectiveRecord) -> Route:
        route = route_collective(record, job.node, n, strategy)
        routes.setdefault(route.description, {})[record.kind] = None
        return route

    acc, lay = job.node.accelerator, job.layout
    tokens = job.micro_batch * job.seq_len * job.accum[0]
    compute = estimate_compute_time(lay.num_params, tokens, acc.peak_flops(job.precision),
                                    job.utilization, activation_checkpointing=ac, seq_len=job.seq_len,
                                    num_layers=lay.num_layers, attention_width=lay.attention_width)
    cost = None
    if offload:
        assert acc.host is not None  # plan() offers offload only with a host
        cost = estimate_offload(traffic, job.layout.num_params, acc.host, job.node.gpus_per_node,
                                shard_group_size=group, params_per_s_per_core=job.cpu_speed)
    time = estimate_step_time(traffic, link_of, compute, overlap=True, extra_comm_s=cost.copy_s if cost else 0.0)
    step, per_node = time.total_s, 0
    reserved = reserved_bytes(mem.peak, fraction=job.reserve)
    budget, nccl = _budget(job, strategy, n)
    fits = reserved <= budget
    if cost is not None:
        assert acc.host is not None
        routes.setdefault(f"host copies over {cost.link}", {})["offload"] = None
        step += cost.optimizer_s  # between the last reduce-scatter and the next forward: never hidden
        per_node = mem.host * job.node.gpus_per_node
        fits = fits and per_node <= acc.host.memory_bytes
    return Option(name, strategy, n, ac, offload, group, mem.peak, reserved, budget, fits,
                  time.comm_s, compute, step, time.bound,
                  mem.peak_phase, mem.components["activations"], mem.model_state, mem.host, per_node,
                  cost, tuple(f"{', '.join(kinds)}: {d}" for d, kinds in routes.items()), nccl)


MAX_GPUS = 4096
"""The most GPUs :func:`plan` tries when none of its options fits the GPUs it was given."""


def _more_gpus(gpus: int) -> list[int]:
    """The GPU counts :func:`plan` tries beyond ``gpus`` when nothing fits: the powers of two
    above it, up to :data:`MAX_GPUS` (or the first above ``gpus``, if larger)."""
    counts = [1 << k for k in range(max(MAX_GPUS, 2 * gpus).bit_length()) if gpus < 1 << k <= max(MAX_GPUS, gpus)]
    return counts or [1 << gpus.bit_length()]


def _what_would_fit(job: _Job, widest: Option) -> str:
    """Why no option fits, and what would: ``widest`` is FULL_SHARD with activation
    checkpointing on the most GPUs tried; the micro-batch, then the sequence, halved until
    it fits there."""
    what = (f"No option fits: even {widest.name.removesuffix(f' on {widest.gpus} GPUs')} on {widest.gpus:,} GPUs "
            f"reserves {_gb(widest.peak_reserved_bytes)} per GPU against {_gb(widest.budget_bytes)} usable "
            f"({_gb(widest.activation_bytes)} of it activations, {_gb(widest.model_state_bytes)} model state, "
            f"{_gb(widest.peak_bytes - widest.activation_bytes - widest.model_state_bytes)} gathered units, "
            "their gradients and buffers, the logits).")
    micro_batch, seq_len = job.micro_batch, job.seq_len
    while micro_batch > 1 or seq_len > 1:
        micro_batch, seq_len = (micro_batch // 2, seq_len) if micro_batch > 1 else (1, seq_len // 2)
        if _fits(dataclasses.replace(job, micro_batch=micro_batch, seq_len=seq_len), "FULL_SHARD", widest.gpus, True):
            return (f"{what} There it fits with a micro-batch of {micro_batch} x {seq_len:,} tokens; or add "
                    "tensor or sequence parallelism (chapter 9), which divide a sequence's activations.")
    return (f"{what} Not even one token fits: a gathered unit and its buffers alone exceed the GPU; a larger "
            "GPU, or tensor parallelism (chapter 9), which splits each layer's weights, is needed.")


def _reasons(options: list[Option], chosen: Option | None, acc: Accelerator, gpus: int,
             gpus_per_node: int) -> list[str]:
    reasons = []
    by_name = {o.name: o for o in options}
    for name in ("DDP", "SHARD_GRAD_OP", "FULL_SHARD"):
        o = by_name.get(name)
        if o and not o.fits:
            if o.peak_phase == "optimizer_step":  # no activations then: Adam's temporary on the state
                what, parts = "the optimizer step decides", (
                    f"{_gb(o.model_state_bytes)} model state, "
                    f"{_gb(o.peak_bytes - o.model_state_bytes)} of Adam's temporaries and buckets")
            else:
                what = ("activations decide" if o.activation_bytes > o.model_state_bytes
                        else "model state decides")
                parts = f"{_gb(o.activation_bytes)} activations, {_gb(o.model_state_bytes)} model state"
            reasons.append(f"{name} does not fit: {_gb(o.peak_reserved_bytes)} reserved per GPU against "
                           f"{_gb(o.budget_bytes)} usable on {acc.name}; {what} ({parts}).")
    for o in options:
        if o.cpu_offload and not o.fits and o.margin_bytes >= 0 and acc.host is not None:
            reasons.append(f"{o.name} fits the GPU ({_gb(o.peak_reserved_bytes)} reserved) but not the host: "
                           f"{_gb(o.host_node_bytes)} of host RAM per node against {_gb(acc.host.memory_bytes)} "
                           f"in a {acc.host.name} host.")
    if chosen is None:
        return reasons  # plan() says what would fit
    faster = [o for o in options if o.gpus == gpus and o.fits and o is not chosen]
    when = PHASE_WORDS.get(chosen.peak_phase, (chosen.peak_phase,))[0]
    reasons.append(f"Recommended: {chosen.name.removesuffix(f' on {chosen.gpus} GPUs')} on {chosen.gpus} GPUs — "
                   f"peak {_gb(chosen.peak_reserved_bytes)} reserved per GPU {when}, "
                   f"margin {_gb(chosen.margin_bytes)} ({100 * chosen.margin:.1f} % of {_gb(chosen.budget_bytes)} "
                   "usable), "
                   f"step {chosen.step_s:.3f} s, {chosen.bound}-bound.")
    if chosen.cpu_offload:
        host = acc.host
        assert host is not None
        per_node = min(gpus_per_node, chosen.gpus)
        reasons.append(f"CPU offload needs {_gb(chosen.host_bytes)} of host RAM per GPU, "
                       f"{_gb(chosen.host_node_bytes)} per node of {per_node} GPUs against "
                       f"{_gb(host.memory_bytes)} in a {host.name} host; its optimizer step runs "
                       f"on that CPU: {chosen.cpu_step_s:.2f} s of the step, never hidden.")
    elif acc.host is None:
        reasons.append(f"CPU offload not priced: the {acc.name} preset names no host machine "
                       "(its CPU cores, RAM and PCIe).")
    if chosen.gpus > gpus:
        reasons.append(f"Nothing fits on {gpus} GPUs; {chosen.gpus} are the fewest on which FULL_SHARD + AC fits "
                       f"(of the powers of two above {gpus}, each priced as every option is).")
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
                       f"{_gb(runner.peak_reserved_bytes)} reserved per GPU).")
    if chosen.bound == "communication":
        reasons.append("Communication is not hidden by compute on these links: a faster "
                       "interconnect, HYBRID_SHARD, or a larger micro-batch would help.")
    return reasons
