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

from handbook_lib.core.checks import check_int, lookup
from handbook_lib.core.config import get_precision
from handbook_lib.core.parallel_layout import ParallelLayout
from handbook_lib.core.strategies import PLAN_STRATEGIES, get_strategy
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
from handbook_lib.models.memory import MemoryEstimate, estimate_memory
from handbook_lib.models.nccl_buffers import strategy_nccl
from handbook_lib.models.offload import (
    CPU_ADAM_PARAMS_PER_S_PER_CORE,
    estimate_offload,
)
from handbook_lib.models.plan_option import Option
from handbook_lib.models.plan_reasons import STEP_TIE, plan_reasons, ties
from handbook_lib.models.plan_reasons import gb as _gb
from handbook_lib.models.recompute import FULL, CheckpointPolicy, recompute_flops
from handbook_lib.models.seed import seed_recommendation
from handbook_lib.models.timing import (
    DEFAULT_UTILIZATION,
    compute_forward_share,
    estimate_compute_time,
    estimate_step_flops,
    estimate_step_time,
    expected_utilization,
)
from handbook_lib.models.topology import Route, route_collective
from handbook_lib.models.traffic import CollectiveRecord, estimate_step_traffic
from handbook_lib.models.zero_peak import DEEPSPEED_DEFAULTS, ZeroKnobs, ZeroPeak, estimate_zero_peak, zero_plan_traffic

__all__ = ["Option", "Plan", "plan", "preference", "recommend", "STEP_TIE", "check_whole_nodes", "shard_groups"]
_ORDER = tuple(s for s in PLAN_STRATEGIES if get_strategy(s).wrapper != "deepspeed")
"""PyTorch's strategies, each priced by default."""


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
    checkpointing: str = "full"
    """The checkpointing policy of the options marked ``+ AC``, in words
    (:attr:`~handbook_lib.models.recompute.CheckpointPolicy.label`)."""


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


def preference(option: Option) -> tuple[bool, bool, float, int]:
    """The planner's tie-break, as a sort key (smaller is better) over options whose step times
    tie (:func:`recommend`): fewer levers (no activation recomputation, then no CPU offload),
    then less communication per step, then less memory. So when compute hides the communication
    of both, SHARD_GRAD_OP beats FULL_SHARD: same step time, fewer bytes on the wire, a busier
    link left for everything else.
    """
    return (option.activation_checkpointing, option.cpu_offload, round(option.comm_s, 6), option.peak_bytes)


def recommend(options: list[Option]) -> Option | None:
    """The planner's one rule over options that fit: the fastest step, where every step within
    :data:`STEP_TIE` (1 %) of the fastest ties, and a tie goes to :func:`preference`.
    ``None`` for no options."""
    if not options:
        return None
    return min(ties(options, min(o.step_s for o in options)), key=preference)


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
    checkpointing: CheckpointPolicy = FULL,
    shard_group_size: int | None = None,
    loss_chunks: int = 1,
    strategy: str | None = None,
    zero: ZeroKnobs = DEEPSPEED_DEFAULTS,
    checkpointed_only: bool = False,
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
        checkpointing: The activation-checkpointing policy the ``+ AC`` options apply, memory
            and recomputation priced (:class:`~handbook_lib.models.recompute.CheckpointPolicy`;
            full recomputation of every layer by default).
        shard_group_size: HYBRID_SHARD's shard group, GPUs (:func:`shard_groups`): ``None``, a
            node's; 0, every size that is a whole number of nodes, each its own option
            (``HYBRID_SHARD/16``).
        loss_chunks: The cross-entropy in k chunks of each sequence (must divide ``seq_len``), as
            :func:`~handbook_lib.models.memory.estimate_memory` prices it.
        strategy: Price this strategy's options only: one of
            :data:`~handbook_lib.core.strategies.PLAN_STRATEGIES`, PyTorch's or DeepSpeed's ZeRO stages (priced by
            :func:`~handbook_lib.models.zero_peak.estimate_zero_peak` with ``zero``'s keys and
            :func:`~handbook_lib.models.zero_peak.zero_plan_traffic`; gradients reduced while
            backward runs only with ``overlap_comm``); ``None``: PyTorch's, and CPU offload.
        zero: DeepSpeed's ``zero_optimization`` keys for the ZeRO options (its defaults).
        checkpointed_only: Price the options with checkpointing only, and nothing beyond them
            (no more GPUs when none fits, no counsel on what would fit): a search of policies
            prices those without once and reads the options alone
            (:func:`~handbook_lib.models.plan_search.search_plan`).

    Raises:
        ValueError: for unknown presets or precision, ``gpus < 1``, ``gpus_per_node < 1`` or
            ``gpus`` more than one node and not a whole number of nodes, ``micro_batch``/``seq_len``
            < 1, a headroom or reserve fraction outside [0, 1), a utilization outside (0, 1], a
            ``memory_bytes`` not above the CUDA context, a CPU speed not > 0, or a shard group
            :func:`shard_groups` refuses, or another strategy.
    """
    order = _ORDER if strategy is None else (lookup({s: s for s in PLAN_STRATEGIES}, strategy, "strategy"),)
    layout = model_layout(model)
    acc = get_accelerator(gpu) if isinstance(gpu, str) else gpu
    check_int("gpus", gpus, 1)
    if gpus_per_node is None:
        gpus_per_node = node_preset(acc).gpus_per_node
    check_whole_nodes(gpus, gpus_per_node)
    get_precision(precision)
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len), ("grad_accum_steps", grad_accum_steps)):
        check_int(name, value, 1)
    if seq_len % check_int("loss_chunks", loss_chunks, 1):
        raise ValueError(f"loss_chunks={loss_chunks} must divide seq_len={seq_len}")
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
    groups = shard_groups(gpus, node.gpus_per_node, shard_group_size)
    job = _Job(layout, node, precision, (optimizer, optimizer_impl), micro_batch, seq_len, u, headroom,
               cpu_params_per_s_per_core, reserve_fraction, (grad_accum_steps, sync_every_micro_step), checkpointing,
               loss_chunks, zero)
    price = functools.partial(_price, job)
    options = []
    for row in order:
        for group in groups if get_strategy(row).hybrid else [None]:
            name = f"{row}/{group}" if group and shard_group_size is not None else row
            for ac in (True,) if checkpointed_only else (False, True):
                options.append(price(row, gpus, ac, False, name + (" + AC" if ac else ""), group))
    if acc.host is not None and strategy is None:
        options.append(price("FULL_SHARD", gpus, True, True, "FULL_SHARD + AC + offload"))
    here = [o for o in options if o.fits and o.gpus == gpus]
    base = strategy or "FULL_SHARD"
    widest, fewer = next(o for o in options if o.strategy == base and o.activation_checkpointing), 0
    if not widest.fits and not checkpointed_only:  # more GPUs, their memory priced alike: the fewest that fit
        counts = _more_gpus(gpus)
        more = next((n for n in counts if _fits(job, base, n, True)), counts[-1])
        widest = price(base, more, True, False, f"{base} + AC on {more} GPUs")
        options += [widest] if widest.fits else []
        fewer = next((n for n in counts if not here and n < more and acc.host and strategy is None
                      and _fits(job, "FULL_SHARD", n, True, True)), 0)
    recommended = recommend(here)
    if recommended is None:
        bigger = [o for o in options if o.fits]
        recommended = bigger[0] if bigger else None
    reasons = plan_reasons(options, recommended, acc, gpus, gpus_per_node,
                           None if checkpointing == FULL else (checkpointing.label, _recompute_share(job)))
    if recommended is None and not checkpointed_only:
        reasons.append(_what_would_fit(job, widest, base))
    if fewer:
        reasons.append(f"With CPU offload, FULL_SHARD + AC would fit {fewer} GPUs (GPU and host memory priced as "
                       "above), its optimizer step on the CPU.")
    return Plan(layout.name, layout.num_params, acc.name, gpus, options, recommended, reasons,
                seed_recommendation(layout.num_params, datasheet_bytes(acc), gpus), gpus_per_node,
                node.nics_per_node, headroom, u, acc.context_bytes, checkpointing.label)


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
    policy: CheckpointPolicy = FULL
    """What the checkpointing options keep and recompute."""
    loss_chunks: int = 1
    """The cross-entropy's chunks of each sequence."""
    zero: ZeroKnobs = DEEPSPEED_DEFAULTS
    """DeepSpeed's keys for the ZeRO options."""


def shard_groups(gpus: int, gpus_per_node: int, shard_group_size: int | None = None, *,
                 flag: str = "shard_group_size={}") -> list[int]:
    """The shard groups :func:`plan` prices HYBRID_SHARD with, GPUs each: none on one node
    (there it is FULL_SHARD); ``None``: a node's GPUs; 0: every whole number of nodes that the
    layout allows (:class:`~handbook_lib.core.parallel_layout.ParallelLayout`), below ``gpus``;
    else ``shard_group_size`` itself, which the layout must allow and which must be a whole
    number of nodes or a part of one, below ``gpus``. ``flag`` names the value in the caller's
    words (the CLI passes ``"--shard-group-size {}"``).

    Raises:
        ValueError: for any other ``shard_group_size``, naming what is accepted.
    """
    if shard_group_size is None:
        return [gpus_per_node] if gpus > gpus_per_node else []
    if not isinstance(shard_group_size, int) or isinstance(shard_group_size, bool) or shard_group_size < 0:
        raise ValueError(f"{flag.format(repr(shard_group_size))} must be a whole number >= 0")
    if gpus <= gpus_per_node:
        raise ValueError(f"{flag.format(shard_group_size)} shapes HYBRID_SHARD, which a plan offers on more than "
                         f"one node only ({gpus} GPUs, {gpus_per_node} per node)")
    nodes = [gpus_per_node * k for k in range(1, gpus // gpus_per_node)
             if ParallelLayout.allows(gpus, shard_group=gpus_per_node * k)]
    if shard_group_size == 0:
        return nodes
    ParallelLayout.for_world(gpus, shard_group=shard_group_size, names={"dp_shard": flag, "world": "the {} GPUs"})
    parts = [g for g in range(2, gpus_per_node) if ParallelLayout.allows(gpus_per_node, shard_group=g)]
    if shard_group_size not in parts + nodes:
        raise ValueError(f"{flag.format(shard_group_size)}: HYBRID_SHARD's groups are whole nodes of {gpus_per_node} "
                         f"GPUs or a part of one, fewer than the {gpus} GPUs: one of "
                         f"{', '.join(map(str, parts + nodes))}, or 0 for every whole number of nodes")
    return [shard_group_size]


def _recompute_share(job: _Job) -> float:
    """What the job's checkpointing policy recomputes, as a share of the step's model FLOPs."""
    lay, tokens = job.layout, job.micro_batch * job.seq_len
    flops = estimate_step_flops(lay.num_params, tokens, seq_len=job.seq_len, num_layers=lay.num_layers,
                                attention_width=lay.attention_width)
    return recompute_flops(lay, tokens, job.seq_len, job.policy) / flops.model


def _group(job: _Job, strategy: str, group: int | None) -> int | None:
    """An option's shard group: ``group`` (else a node's GPUs) under a hybrid strategy, else None."""
    return (group or job.node.gpus_per_node) if get_strategy(strategy).hybrid else None


def _memory(job: _Job, strategy: str, n: int, ac: bool, offload: bool = False,
            group: int | None = None) -> MemoryEstimate:
    """One option's memory on ``n`` GPUs: chapter 2's model, on the accelerator's own backend."""
    policy = job.policy.memory_args() if ac else {}
    return estimate_memory(job.layout, n, strategy, job.precision, job.optimizer[0], micro_batch=job.micro_batch,
                           seq_len=job.seq_len, shard_group_size=_group(job, strategy, group),
                           cpu_offload=offload, backend=job.node.accelerator.backend, optimizer_impl=job.optimizer[1],
                           grad_accum_steps=job.accum[0], sync_every_micro_step=job.accum[1],
                           loss_chunks=job.loss_chunks, **policy)


def _zero_memory(job: _Job, strategy: str, n: int, ac: bool) -> ZeroPeak:
    """One ZeRO option's memory on ``n`` GPUs (:func:`~handbook_lib.models.zero_peak.estimate_zero_peak`)."""
    policy = job.policy.memory_args() if ac else {}
    return estimate_zero_peak(job.layout, n, strategy, job.precision, job.optimizer[0], micro_batch=job.micro_batch,
                              seq_len=job.seq_len, optimizer_impl=job.optimizer[1],
                              backend=job.node.accelerator.backend, knobs=job.zero, loss_chunks=job.loss_chunks,
                              **policy)


def _peak(job: _Job, strategy: str, n: int, ac: bool, offload: bool = False,
          group: int | None = None) -> tuple[int, str, int, int, int]:
    """``(peak, peak phase, activations, model state, host bytes)`` of one option, PyTorch's
    (:func:`_memory`) or DeepSpeed's (:func:`_zero_memory`)."""
    if get_strategy(strategy).wrapper == "deepspeed":
        zero = _zero_memory(job, strategy, n, ac)
        return zero.peak, zero.peak_phase, zero.activations, zero.model_state, 0
    mem = _memory(job, strategy, n, ac, offload, group)
    return mem.peak, mem.peak_phase, mem.components["activations"], mem.model_state, mem.host


def _budget(job: _Job, strategy: str, n: int, group: int | None = None) -> tuple[int, int]:
    """``(budget, nccl)``: what an option may reserve per GPU, after NCCL's buffers and the headroom."""
    nccl = strategy_nccl(job.node, strategy, n, group)
    return memory_budget(job.node.accelerator, job.headroom, nccl).budget_bytes, nccl.total


def _fits(job: _Job, strategy: str, n: int, ac: bool, offload: bool = False) -> bool:
    """Whether the option fits, as :func:`_price` judges it: the reserved peak within the
    budget, and (offloading) a machine's host bytes within its RAM."""
    peak, *_, host_bytes = _peak(job, strategy, n, ac, offload)
    host = job.node.accelerator.host
    return (reserved_bytes(peak, fraction=job.reserve) <= _budget(job, strategy, n)[0]
            and (not offload or host is not None and host_bytes * job.node.gpus_per_node <= host.memory_bytes))


def _price(job: _Job, strategy: str, n: int, ac: bool, offload: bool, name: str,
           group: int | None = None) -> Option:
    """One option on ``n`` GPUs: its peak memory (chapter 2's model, as the allocator reserves
    it), its step's collectives on the links they cross and its compute (chapter 3's),
    overlapped; offload adds its copies to the communication and the CPU optimizer step to the
    step (:func:`~handbook_lib.models.offload.estimate_offload`)."""
    group = _group(job, strategy, group)
    peak, peak_phase, activations, model_state, host_bytes = _peak(job, strategy, n, ac, offload, group)
    param_dtype, reduce_dtype = get_precision(job.precision)
    row = get_strategy(strategy)
    traffic = (zero_plan_traffic(job.layout, n, strategy, job.precision) if row.wrapper == "deepspeed" else
               estimate_step_traffic(job.layout.units(), n, strategy, param_dtype=param_dtype,
                                     reduce_dtype=reduce_dtype, shard_group_size=group,
                                     grad_accum_steps=job.accum[0], sync_every_micro_step=job.accum[1]))
    overlap = row.wrapper != "deepspeed" or job.zero.overlaps(row.zero_stage or 0)

    routes: dict[str, dict[str, None]] = {}  # description -> the kinds that take it
    priced: dict[tuple[str, int, int], Route] = {}  # one route per collective and buffer: units repeat

    def link_of(record: CollectiveRecord) -> Route:
        key = (record.kind, record.buffer_bytes, record.group_size)
        route = priced.get(key)
        if route is None:
            route = priced[key] = route_collective(record, job.node, n, strategy)
            routes.setdefault(route.description, {})[record.kind] = None
        return route

    acc, lay = job.node.accelerator, job.layout
    tokens = job.micro_batch * job.seq_len * job.accum[0]
    recompute = recompute_flops(lay, tokens, job.seq_len, job.policy)
    compute = estimate_compute_time(lay.num_params, tokens, acc.peak_flops(job.precision), job.utilization,
                                    activation_checkpointing=ac, seq_len=job.seq_len, num_layers=lay.num_layers,
                                    attention_width=lay.attention_width, recompute_flops=recompute)
    forward_share = compute_forward_share(lay.num_params, tokens, activation_checkpointing=ac, seq_len=job.seq_len,
                                          num_layers=lay.num_layers, attention_width=lay.attention_width,
                                          recompute_flops=recompute)
    cost = None
    if offload:
        assert acc.host is not None  # plan() offers offload only with a host
        cost = estimate_offload(traffic, job.layout.num_params, acc.host, job.node.gpus_per_node,
                                shard_group_size=group, params_per_s_per_core=job.cpu_speed)
    time = estimate_step_time(traffic, link_of, compute, overlap=overlap, extra_comm_s=cost.copy_s if cost else 0.0,
                              forward_share=forward_share)
    step, per_node = time.total_s, 0
    reserved = reserved_bytes(peak, fraction=job.reserve)
    budget, nccl = _budget(job, strategy, n, group)
    fits = reserved <= budget
    if cost is not None:
        assert acc.host is not None
        routes.setdefault(f"host copies over {cost.link}", {})["offload"] = None
        step += cost.optimizer_s  # between the last reduce-scatter and the next forward: never hidden
        per_node = host_bytes * job.node.gpus_per_node
        fits = fits and per_node <= acc.host.memory_bytes
    return Option(name, strategy, n, ac, offload, group, peak, reserved, budget, fits,
                  time.comm_s, compute, step, time.bound,
                  peak_phase, activations, model_state, host_bytes, per_node,
                  cost, tuple(f"{', '.join(kinds)}: {d}" for d, kinds in routes.items()), nccl, time.compute_margin)


MAX_GPUS = 4096
"""The most GPUs :func:`plan` tries when none of its options fits the GPUs it was given."""


def _more_gpus(gpus: int) -> list[int]:
    """The GPU counts :func:`plan` tries beyond ``gpus`` when nothing fits: the powers of two
    above it, up to :data:`MAX_GPUS` (or the first above ``gpus``, if larger)."""
    counts = [1 << k for k in range(max(MAX_GPUS, 2 * gpus).bit_length()) if gpus < 1 << k <= max(MAX_GPUS, gpus)]
    return counts or [1 << gpus.bit_length()]


def _what_would_fit(job: _Job, widest: Option, base: str = "FULL_SHARD") -> str:
    """Why no option fits, and what would: ``widest`` is ``base`` (FULL_SHARD, or the one strategy
    asked for) with activation checkpointing on the most GPUs tried; the micro-batch, then the
    sequence, halved until it fits there."""
    what = (f"No option fits: even {widest.name.removesuffix(f' on {widest.gpus} GPUs')} on {widest.gpus:,} GPUs "
            f"reserves {_gb(widest.peak_reserved_bytes)} per GPU against {_gb(widest.budget_bytes)} usable "
            f"({_gb(widest.activation_bytes)} of it activations, {_gb(widest.model_state_bytes)} model state, "
            f"{_gb(widest.peak_bytes - widest.activation_bytes - widest.model_state_bytes)} gathered units, "
            "their gradients and buffers, the logits).")
    micro_batch, seq_len = job.micro_batch, job.seq_len
    while micro_batch > 1 or seq_len > 1:
        micro_batch, seq_len = (micro_batch // 2, seq_len) if micro_batch > 1 else (1, seq_len // 2)
        smaller = dataclasses.replace(job, micro_batch=micro_batch, seq_len=seq_len)
        whole_chunks = seq_len % job.loss_chunks == 0
        if whole_chunks and _fits(smaller, base, widest.gpus, True):
            return (f"{what} There it fits with a micro-batch of {micro_batch} x {seq_len:,} tokens; or add "
                    "tensor or sequence parallelism (chapter 9), which divide a sequence's activations.")
    return (f"{what} Not even one token fits: a gathered unit and its buffers alone exceed the GPU; a larger "
            "GPU, or tensor parallelism (chapter 9), which splits each layer's weights, is needed.")
