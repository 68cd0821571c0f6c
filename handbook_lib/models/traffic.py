"""One training step's collectives: which unit is gathered or reduced, when, in which dtype,
and how many bytes each rank sends. Pure arithmetic: no ``torch.distributed``.

Chapter 3 teaches it. A training strategy is a schedule of ring collectives
(:mod:`handbook_lib.models.collectives`) over the model's FSDP units (one per transformer layer,
plus the root); :func:`estimate_step_traffic` lists it, and
:func:`handbook_lib.models.timing.estimate_step_time` turns it into seconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from math import prod

from handbook_lib.core.checks import check_int
from handbook_lib.core.config import dtype_bytes
from handbook_lib.core.strategies import get_strategy, strategies_where
from handbook_lib.models.collectives import (
    COLLECTIVES,
    CollectiveCost,
    estimate_collective,
)
from handbook_lib.models.init_bytes import device_storage_bytes
from handbook_lib.models.layout import model_layout
from handbook_lib.models.sharding import Unit

__all__ = ["CollectiveRecord", "StepTraffic", "estimate_step_traffic", "estimate_step_bytes_for_params",
           "GatheredState", "estimate_gathered_units", "estimate_held_between_micro_steps"]


@dataclass(frozen=True)
class CollectiveRecord(CollectiveCost):
    """One collective of a training step: its cost, and which unit, when, in which dtype."""

    unit: str
    """Unit name (``"model"`` for DDP's all-reduce of every gradient)."""
    phase: str
    """``"forward"`` or ``"backward"``."""
    dtype: str
    """Element type on the wire, a key of :data:`handbook_lib.core.config.DTYPES`."""
    micro_step: int
    """Index of the micro-step within the optimizer step, from 0."""

@dataclass(frozen=True)
class StepTraffic:
    """Every collective of one optimizer step, in execution order, and their totals per rank."""

    strategy: str
    world_size: int
    grad_accum_steps: int
    records: tuple[CollectiveRecord, ...]

    @property
    def counts(self) -> dict[str, int]:
        """Number of collectives of each kind (every kind of :data:`COLLECTIVES`, 0 if absent)."""
        return {k: sum(r.kind == k for r in self.records) for k in COLLECTIVES}

    @property
    def sent_bytes(self) -> int:
        """Bytes one rank sends in the step."""
        return sum(r.sent_bytes for r in self.records)

    @property
    def received_bytes(self) -> int:
        """Bytes one rank receives in the step."""
        return sum(r.received_bytes for r in self.records)

def estimate_step_traffic(
    units: Iterable[Unit], world_size: int, strategy: str, *,
    param_dtype: str = "fp32", reduce_dtype: str = "fp32", root_reshard_after_forward: bool = False,
    grad_accum_steps: int = 1, sync_every_micro_step: bool = True, shard_group_size: int | None = None,
    flat_params: bool = False, grad_scaler_group: int | None = None,
    reshard_after_forward_size: int | None = None, reshard_after_backward: bool = True,
    issue_order: int | None = None,
) -> StepTraffic:
    """List the collectives of one optimizer step of ``strategy`` on ``world_size`` ranks.

    Per micro-step (``NONE``, one plain process, communicates nothing):

    - ``DDP``: one all-reduce of every gradient (``reduce_dtype``, unpadded). Real DDP cuts it
      into ~25 MB buckets; the bytes are the same, so we record one collective.
    - ``NO_SHARD``: one all-reduce of each unit's gradients.
    - ``FULL_SHARD``: forward all-gather of every unit (``param_dtype``); in backward, an
      all-gather again of every unit resharded after forward (all but the root, unless
      ``root_reshard_after_forward``: FSDP2 keeps the root unsharded between the two), then a
      reduce-scatter of its gradients (``reduce_dtype``). Buffers are padded as FSDP pads them.
    - ``SHARD_GRAD_OP``: as FULL_SHARD without the backward all-gathers.
    - ``HYBRID_SHARD`` / ``HYBRID_SHARD_ZERO2``: FULL_SHARD / SHARD_GRAD_OP within shard groups of
      ``shard_group_size`` = S ranks (padding to multiples of S), then an all-reduce of each
      reduce-scattered shard (1/S of the buffer) across the R = world_size / S replicas.

    FSDP skips collectives over a group of one rank: on a single rank it issues none, and HSDP
    with one replica issues no all-reduce.

    With ``grad_accum_steps`` = k > 1 and ``sync_every_micro_step=False`` (DDP's ``no_sync``,
    FSDP2's ``set_requires_gradient_sync(False)``), gradients are reduced only on the last
    micro-step; all-gathers still happen on every micro-step. The price is memory: until that
    last micro-step every rank keeps the *unsharded* gradients of every unit (P·grad bytes,
    instead of P/N), which undoes FSDP's gradient saving; DDP pays nothing extra.

    Args:
        units: The FSDP units in forward order (a layout's: :meth:`ModelLayout.units
            <handbook_lib.models.layout.ModelLayout.units>`).
        world_size: Ranks in the job.
        strategy: One of :data:`~handbook_lib.core.strategies.STRATEGIES`.
        param_dtype: Dtype of the all-gathered parameters.
        reduce_dtype: Dtype of the reduced gradients.
        root_reshard_after_forward: Whether the root unit is resharded after forward.
        grad_accum_steps: Micro-steps per optimizer step.
        sync_every_micro_step: Reduce gradients on every micro-step, or only on the last.
        shard_group_size: S, for the hybrid strategies only; must divide ``world_size``.
        flat_params: FSDP1's ``FlatParameter``: each unit's buffer is its numel padded once to
            a multiple of the group (:meth:`Unit.flat_padded_numel`), not each parameter.
        grad_scaler_group: With fp16's gradient scaler: the ranks over which it all-reduces its
            found-inf flag (one fp32 scalar, 4 bytes) once per optimizer step — FSDP1's
            ``ShardedGradScaler`` over the world, FSDP2's DTensors over the shard group.

        reshard_after_forward_size: FSDP2's ``reshard_after_forward`` as an int g (for every
            unit, the root included, where ``root_reshard_after_forward``): after forward each
            unit keeps a 1/g shard of its gathered buffer, so backward all-gathers the same
            padded buffer within groups of g ranks ((g-1)/g of it sent, instead of (S-1)/S).
            g must divide the shard group S, 2 <= g < S; strategies that reshard after forward.
        reshard_after_backward: ``False``: FSDP2's ``set_reshard_after_backward(False)`` in every
            micro-step but the last; each unit stays gathered into the next micro-step, whose
            forward then all-gathers nothing (with k micro-steps, k-1 fewer forward all-gathers
            per unit).
        issue_order: ``None`` lists the collectives unit by unit (the order above). An int n
            lists them in the order FSDP2 issues them, with n units of explicit prefetch
            (0: FSDP2's implicit prefetching): forward, the root, then each unit followed by
            the next n not yet issued; backward, the root's all-gather (if resharded) and its
            implicit prefetch of the last unit, then for each unit from the last: its
            prefetches (the previous unit, or the previous n), its reduce-scatter (and HSDP
            all-reduce); the root's reduction last, in FSDP's final callback. FSDP2 only
            (not ``flat_params``).

    A unit without parameters (e.g. a root whose children are all wrapped) issues nothing.

    Raises:
        ValueError: for a bad strategy, dtype, world size, shard group or micro-step count.
    """
    units = list(units)
    if not units or not all(isinstance(u, Unit) for u in units):
        raise ValueError(f"units must be a non-empty list of Unit, got {units!r}")
    check_int("world_size", world_size, 1)
    row = get_strategy(strategy).torch_only("estimate_step_traffic")
    p_size, r_size = dtype_bytes(param_dtype, "param_dtype"), dtype_bytes(reduce_dtype, "reduce_dtype")
    check_int("grad_accum_steps", grad_accum_steps, 1)
    group = world_size
    if row.hybrid:
        check_int("shard_group_size", shard_group_size, 1)
        group = row.shard_group(world_size, shard_group_size)
    elif shard_group_size is not None:
        raise ValueError(f"shard_group_size applies only to {', '.join(strategies_where(hybrid=True))}, "
                         f"not {strategy!r}")
    replicas = world_size // group
    back_group = group
    if reshard_after_forward_size is not None:
        check_int("reshard_after_forward_size", reshard_after_forward_size, 2)
        if not row.reshard_after_forward or group % reshard_after_forward_size or reshard_after_forward_size >= group:
            raise ValueError(f"reshard_after_forward_size={reshard_after_forward_size} must divide the shard "
                             f"group of {group} ranks and be smaller, with a strategy that reshards after "
                             f"forward ({', '.join(strategies_where(reshard_after_forward=True))}); "
                             f"got strategy {strategy!r}")
        back_group = reshard_after_forward_size
    if issue_order is not None:
        check_int("issue_order", issue_order, 0)
        if flat_params or row.wrapper != "fsdp" or not row.shards_grads:
            raise ValueError("issue_order is FSDP2's schedule: a sharded FSDP strategy without flat_params")

    records: list[CollectiveRecord] = []
    units = [u for u in units if u.numel]

    def padded(u: Unit) -> int:
        return u.flat_padded_numel(group) if flat_params else u.padded_numel(group)

    def add(kind: str, unit: str, phase: str, dtype: str, buffer: int, size: int) -> None:
        cost = estimate_collective(kind, buffer, size)
        records.append(CollectiveRecord(cost.kind, cost.buffer_bytes, cost.group_size, cost.sent_bytes,
                                        cost.received_bytes, cost.steps, unit, phase, dtype, m))

    for m in range(grad_accum_steps):
        sync = sync_every_micro_step or m == grad_accum_steps - 1
        if not row.distributed:
            continue
        if not row.shards_grads:  # replicas: every gradient all-reduced, whole
            if sync and row.wrapper == "ddp":  # DDP's buckets: recorded as one collective
                add("all_reduce", "model", "backward", reduce_dtype,
                    sum(u.numel for u in units) * r_size, world_size)
            elif sync:
                for u in reversed(units):
                    add("all_reduce", u.name, "backward", reduce_dtype, u.numel * r_size, world_size)
            continue
        if group == 1 and replicas == 1:
            continue  # FSDP on one rank issues no collectives at all
        gather_forward = m == 0 or reshard_after_backward

        def regathered(u: Unit) -> bool:
            return group > 1 and row.reshard_after_forward and (not u.root or root_reshard_after_forward)

        def reduce(u: Unit, sync: bool = sync) -> None:
            if sync and group > 1:
                add("reduce_scatter", u.name, "backward", reduce_dtype, padded(u) * r_size, group)
            if sync and row.hybrid and replicas > 1:
                add("all_reduce", u.name, "backward", reduce_dtype, padded(u) * r_size // group, replicas)

        if issue_order is not None:
            _fsdp2_order(units, issue_order, group > 1 and gather_forward, regathered, reduce,
                         lambda u, phase: add("all_gather", u.name, phase, param_dtype, padded(u) * p_size,
                                              group if phase == "forward" else back_group))
            continue
        for u in units:
            if group > 1 and gather_forward:
                add("all_gather", u.name, "forward", param_dtype, padded(u) * p_size, group)
        for u in reversed(units):
            if regathered(u):
                add("all_gather", u.name, "backward", param_dtype, padded(u) * p_size, back_group)
            reduce(u)
    if grad_scaler_group is not None and grad_scaler_group > 1:
        m = grad_accum_steps - 1
        add("all_reduce", "grad_scaler", "optimizer", "fp32", 4, grad_scaler_group)
    return StepTraffic(strategy, world_size, grad_accum_steps, tuple(records))


def _fsdp2_order(units: list[Unit], ahead: int, gather_forward: bool, regathered, reduce, gather) -> None:
    """One micro-step's collectives in FSDP2's issue order (see ``issue_order`` of
    :func:`estimate_step_traffic`); ``units`` has the root first, then the rest in forward order."""
    root = [u for u in units if u.root]
    rest = [u for u in units if not u.root]
    if gather_forward:
        issued: set[str] = set()
        for u in root + rest:
            ahead_of = rest[rest.index(u) + 1:rest.index(u) + 1 + ahead] if not u.root else []
            for v in [u, *ahead_of]:
                if v.name not in issued:
                    issued.add(v.name)
                    gather(v, "forward")
    pending = [u for u in rest if regathered(u)]  # resharded after forward, not yet gathered again

    def prefetch(v: Unit) -> None:
        if v in pending:
            pending.remove(v)
            gather(v, "backward")

    for u in root:
        if regathered(u):
            gather(u, "backward")
        if rest:
            prefetch(rest[-1])  # the root's implicit prefetch: the last unit of the forward
    for i in range(len(rest) - 1, -1, -1):
        prefetch(rest[i])  # its own pre-backward, if nothing prefetched it
        for v in rest[max(0, i - max(ahead, 1)):i][::-1]:
            prefetch(v)
        reduce(rest[i])
    for u in root:
        reduce(u)


@dataclass(frozen=True)
class GatheredState:
    """The units holding gathered parameters while one unit computes (FSDP2, CPU timing:
    each collective completes when issued)."""

    phase: str
    """``forward`` (the unit's compute starts) or ``backward`` (its backward has computed the
    gradient of its input, before its reduce-scatter)."""
    unit: str
    """The unit computing."""
    gathered: tuple[str, ...]
    """Units gathered (all-gather issued, not yet freed), root first, then in forward order."""
    gathered_bytes: int
    """Their all-gather buffers, padded, in ``param_dtype``."""


def estimate_gathered_units(
    units: Iterable[Unit], world_size: int, strategy: str, *, explicit_prefetch: int = 0,
    param_dtype: str = "fp32", shard_group_size: int | None = None,
) -> tuple[GatheredState, ...]:
    """Which units are gathered at each unit's compute, forward then backward, under FSDP2's
    prefetching (every unit but the root; the root holds the embedding and the head and stays
    gathered through forward and backward).

    Forward, with n = ``explicit_prefetch`` units of explicit prefetch: unit i computes with
    units i … i+n gathered (0: FSDP2's implicit prefetching issues nothing ahead of a unit's own
    pre-forward, so on a CPU — where a collective completes as it is issued — one unit; on a
    GPU the CPU runs ahead and the next unit's all-gather is in flight too). Backward: unit i
    finishes with units i-max(n, 1) … i gathered (FSDP2 prefetches one unit by default). With
    ``SHARD_GRAD_OP`` nothing is freed before backward ends: every unit gathered so far stays.
    These are the extra gathered bytes a prefetch costs at the peak: one unit per unit ahead.

    Raises:
        ValueError: for a strategy that does not shard parameters, or as
            :func:`estimate_step_traffic`.
    """
    units = [u for u in units if u.numel]
    check_int("explicit_prefetch", explicit_prefetch, 0)
    row = get_strategy(strategy).torch_only("estimate_gathered_units")
    if row.wrapper != "fsdp" or not row.shards_params:
        raise ValueError(f"estimate_gathered_units needs a strategy that shards parameters, got {strategy!r}")
    group = row.shard_group(world_size, shard_group_size)
    size = dtype_bytes(param_dtype, "param_dtype")
    root = [u for u in units if u.root]
    rest = [u for u in units if not u.root]
    out = []

    def state(phase: str, u: Unit, lo: int, hi: int) -> GatheredState:
        held = root + rest[lo:hi + 1]
        return GatheredState(phase, u.name, tuple(v.name for v in held),
                             sum(v.padded_numel(group) * size for v in held))

    keep = not row.reshard_after_forward
    for i, u in enumerate(rest):
        out.append(state("forward", u, 0 if keep else i, min(i + explicit_prefetch, len(rest) - 1)))
    for i in range(len(rest) - 1, -1, -1):
        out.append(state("backward", rest[i], 0 if keep else max(0, i - max(explicit_prefetch, 1)), i))
    return tuple(out)


def estimate_step_bytes_for_params(
    num_params: int, world_size: int, strategy: str, param_dtype: str = "fp32",
    reduce_dtype: str = "fp32", *, shard_group_size: int | None = None,
) -> int:
    """Bytes one rank sends per optimizer step for a model known only by its parameter count P.

    The model is one flat, non-root unit of P elements (padded, as FSDP pads a flat parameter,
    to a multiple of N: choose P divisible by N for no padding). At equal dtypes of b bytes:
    DDP sends 2(N-1)/N·P·b (one all-reduce), FULL_SHARD 3(N-1)/N·P·b (two all-gathers and a
    reduce-scatter), so FULL_SHARD / DDP = 1.5: the ZeRO paper's "1.5× the communication of
    data parallelism" for stage 3. The widely repeated claim that FULL_SHARD moves 3× the bytes
    of DDP is wrong by this model; SHARD_GRAD_OP moves exactly what DDP moves.

    Raises:
        ValueError: as :func:`estimate_step_traffic`, or for a negative ``num_params``.
    """
    check_int("num_params", num_params, 0)
    return estimate_step_traffic(model_layout(num_params).units(), world_size, strategy, param_dtype=param_dtype,
                                 reduce_dtype=reduce_dtype, shard_group_size=shard_group_size).sent_bytes


def estimate_held_between_micro_steps(
    units: Iterable[Unit], world_size: int, strategy: str, *, param_dtype: str = "fp32",
    reduce_dtype: str = "fp32", sync_every_micro_step: bool = False, reshard_after_backward: bool = True,
    shard_group_size: int | None = None, device: str = "cpu",
) -> int:
    """Bytes a rank holds after one micro-step's backward beyond what it held before it, for
    the two accumulation modes and FSDP2's ``set_reshard_after_backward`` (chapter 5):

    - gradient sync off (``sync_every_micro_step=False``): every parameter's unsharded
      gradient, P·r bytes (:func:`handbook_lib.models.model_state.estimate_accumulation_bytes`);
      reduce-scattered every micro-step: nothing, the shards accumulate in place;
    - ``reshard_after_backward=False``: every unit's gathered parameters too, its padded buffer
      in ``param_dtype`` (the root's included), so the next forward gathers nothing.

    Replicating strategies (DDP, NO_SHARD) accumulate in the gradients they hold anyway: 0.

    ``device="cuda"``: every gradient, and every parameter's gathered copy (FSDP2 keeps one
    all-gather output per parameter), is its own storage, rounded up to the caching allocator's
    512 B (:func:`~handbook_lib.models.init_bytes.device_storage_bytes`). Not yet measured on a GPU.

    Raises:
        ValueError: as :func:`estimate_step_traffic`, or for a device other than cpu or cuda.
    """
    units = [u for u in units if u.numel]
    row = get_strategy(strategy).torch_only("estimate_held_between_micro_steps")
    if not row.shards_grads:
        return 0
    group = row.shard_group(world_size, shard_group_size)
    reduce, param = dtype_bytes(reduce_dtype, "reduce_dtype"), dtype_bytes(param_dtype, "param_dtype")
    device_storage_bytes(0, device)  # checks the device
    if device == "cuda":
        shapes = [shape for u in units for shape in u.shapes]
        held = 0 if sync_every_micro_step else sum(device_storage_bytes(prod(s) * reduce, device) for s in shapes)
        if not reshard_after_backward and row.shards_params:
            held += sum(device_storage_bytes(-(-s[0] // group) * group * prod(s[1:]) * param, device)
                        for s in shapes)
        return held
    held = 0 if sync_every_micro_step else sum(u.numel for u in units) * reduce
    if not reshard_after_backward and row.shards_params:
        held += sum(u.padded_numel(group) for u in units) * param
    return held
