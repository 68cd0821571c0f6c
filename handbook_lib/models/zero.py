"""DeepSpeed ZeRO's layout of one rank's state, and the collectives of one ZeRO step. Pure: no
``torch``, no DeepSpeed.

Chapter 7 checks both against real DeepSpeed runs (``deepspeed_zero``), byte for byte, beside
FSDP's layout of the same model (:mod:`handbook_lib.models.memory`, :mod:`handbook_lib.models.sharding`).
The rules are DeepSpeed's (release 0.19, the one ``pyproject.toml`` pins), read from its source
and confirmed by those runs:

- **ZeRO-1 and ZeRO-2** flatten every parameter into one buffer, padded to a multiple of
  2 × N elements (``nccl_start_alignment_factor`` = 2 per rank), and keep it whole on every
  rank in the compute dtype. Rank r owns the r-th of N equal partitions of it: an fp32 master
  copy of that partition (kept even when training in fp32) and the optimizer state of it.
  After backward a rank keeps the gradients of the tensors that overlap its partition — whole
  tensors, in the compute dtype, the last rank also the padding —, or, with
  ``offload_optimizer``, the fp32 gradient of its partition. Gradients are all-reduced (the
  reduce dtype), and after the optimizer step the updated partitions are all-gathered into
  the flat buffer.
- **ZeRO-3** pads every tensor to a multiple of N and keeps 1/N of each (``ds_tensor``), plus an
  fp32 master partition, a gradient partition (kept between steps) and the optimizer state.
  A tensor of at most ``persistence_threshold`` elements is *persistent*: kept whole on every
  rank as well (DeepSpeed's default threshold, 100000, keeps every tensor of a small model
  whole — nothing is saved). The others are all-gathered when their module runs: module by
  module in forward and again in backward with prefetching and reuse off (the book's
  measurement config); with them on, as a production config has them, a module's fetch also
  gathers the next tensors of the step's trace, up to ``stage3_prefetch_bucket_size`` elements,
  in one call, and a tensor used again within ``stage3_max_reuse_distance`` elements stays
  gathered (:func:`zero3_gathers`). The gradients are reduce-scattered; the persistent tensors
  are all-gathered once after the optimizer step.

Every stage also all-reduces a few bytes of bookkeeping (:func:`bookkeeping_reductions`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from handbook_lib.core.architecture import forward_modules
from handbook_lib.core.checks import check_int, check_world, lookup
from handbook_lib.core.config import DTYPES, PRECISIONS, state_dtype
from handbook_lib.core.strategies import STRATEGY_TABLE, get_strategy
from handbook_lib.models.collectives import estimate_collective
from handbook_lib.models.layout import ModelLike, model_layout
from handbook_lib.models.model_state import ModelStateBytes, RankState, optimizer_states, optimizer_step_bytes
from handbook_lib.models.traffic import CollectiveRecord, StepTraffic

__all__ = [
    "ZERO_STAGES",
    "estimate_zero_memory",
    "ALIGNMENT",
    "DEFAULT_PERSISTENCE_THRESHOLD",
    "zero_stage",
    "flat_partition",
    "partition_overlaps",
    "gather_units",
    "estimate_zero_rank_bytes",
    "bookkeeping_reductions",
    "zero3_gathers",
    "zero3_replay",
    "estimate_zero_step_traffic",
    "largest_module_params",
    "deepspeed_own_estimate",
    "zero_redundancy_partition",
    "estimate_zero_redundancy_rank_bytes",
]

ALIGNMENT = 2
"""ZeRO-1/2 pad their flat buffer to a multiple of ``ALIGNMENT × N`` elements (DeepSpeed's
``nccl_start_alignment_factor``: 4-byte alignment of 2-byte elements)."""
DEFAULT_PERSISTENCE_THRESHOLD = 100_000
"""DeepSpeed's ``stage3_param_persistence_threshold``: tensors of at most this many elements
stay whole on every rank under ZeRO-3 unless the config says otherwise."""
MAX_LIVE_PARAMETERS = 1_000_000_000
"""DeepSpeed's ``stage3_max_live_parameters`` (elements): prefetching stops short of holding
more gathered than this."""


ZERO_STAGES: dict[int, str | None] = {
    stage: next((s.name for s in STRATEGY_TABLE.values()
                  if s.zero_stage == stage and not s.hybrid and s.wrapper != "deepspeed"), None)
    for stage in range(4)
}
"""DeepSpeed ZeRO stage → the first FSDP strategy with the same sharding (from the strategy
table): DDP, none, SHARD_GRAD_OP, FULL_SHARD. ZeRO-1 shards only the optimizer states; FSDP has
no such strategy. ZeRO-2 keeps parameters replicated at rest, while FSDP's SHARD_GRAD_OP shards
them between steps (both hold them unsharded from forward to backward)."""


def estimate_zero_memory(num_params: ModelLike, world_size: int, stage: int, *, k: int = 12) -> ModelStateBytes:
    """Per-GPU model state in the ZeRO paper's accounting (Rajbhandari et al., 2020, Figure 1).

    Mixed-precision Adam keeps fp16 parameters (2 B) and gradients (2 B), plus K = 12 bytes of
    fp32 optimizer state (a master copy of the weights, momentum and variance): 2 + 2 + 12 = 16
    bytes per parameter — the same total as fp32 Adam's 4 + 4 + 8, for different reasons.
    Stage 1 shards the K bytes, stage 2 also the gradients, stage 3 also the parameters.
    """
    n = model_layout(num_params).num_params
    check_world(world_size)
    if stage not in ZERO_STAGES:
        raise ValueError(f"stage must be one of 0, 1, 2, 3, got {stage!r}")
    check_int("k", k, 0)
    shard = lambda b, from_stage: b * n / world_size if stage >= from_stage else b * n  # noqa: E731
    return ModelStateBytes(params=round(shard(2, 3)), grads=round(shard(2, 2)),
                           optimizer=round(shard(k, 1)))


def zero_stage(strategy: str) -> int:
    """The ZeRO stage of a strategy that DeepSpeed runs (``ZERO1``/``ZERO2``/``ZERO3``).

    Raises:
        ValueError: for a strategy of another wrapper, naming the ones accepted.
    """
    row = get_strategy(strategy)
    if row.wrapper != "deepspeed" or row.zero_stage is None:
        raise ValueError(f"strategy must be a DeepSpeed ZeRO row (ZERO1, ZERO2, ZERO3), got {row.name!r}")
    return row.zero_stage


def _numels(model: ModelLike) -> list[int] | None:
    """Elements of each parameter tensor (DeepSpeed lays them out one by one); ``None`` for a
    model known by its sizes only (then its parameters are taken as one flat block)."""
    layout = model_layout(model)
    return [math.prod(shape) for _, shape in layout.tensors] if layout.exact else None


def _check(world_size: int, rank: int, persistence_threshold: int) -> None:
    """Refuse a bad world size or rank (:func:`~handbook_lib.core.checks.check_world`) or a
    negative persistence threshold (elements)."""
    check_world(world_size, rank)
    check_int("persistence_threshold", persistence_threshold, 0)


def flat_partition(num_params: int, world_size: int) -> tuple[int, int]:
    """``(padded, partition)``: ZeRO-1/2's flat buffer, in elements, padded to a multiple of
    ``ALIGNMENT × world_size``, and each rank's partition of it (``padded / world_size``)."""
    step = ALIGNMENT * world_size
    padded = -(-num_params // step) * step
    return padded, padded // world_size


def partition_overlaps(numels: list[int], world_size: int, rank: int) -> list[tuple[int, int]]:
    """ZeRO-1/2: the parameter tensors of ``numels`` elements (in order) that overlap ``rank``'s
    partition of the flat buffer, each as ``(its elements, its elements inside the partition)``;
    the last rank's padding is none of them."""
    part = flat_partition(sum(numels), world_size)[1]
    start, end, offset, out = rank * part, (rank + 1) * part, 0, []
    for n in numels:
        if offset < end and offset + n > start:
            out.append((n, min(end, offset + n) - max(start, offset)))
        offset += n
    return out


def gather_units(model: ModelLike) -> list[tuple[str, list[int]]]:
    """The modules ZeRO-3 gathers, in the order the model registers them, with their tensors'
    element counts: every module that owns parameters — but ``nn.MultiheadAttention`` reads its
    ``out_proj`` tensors itself, so those are gathered with the attention module. (The order a
    step gathers them in is :func:`zero3_gathers`'.)"""
    units: dict[str, list[int]] = {}
    layout = model_layout(model)
    layout.require_exact("ZeRO-3's gathered modules")
    for name, shape in layout.tensors:
        module = name.rsplit(".", 1)[0].replace(".out_proj", "")
        units.setdefault(module, []).append(math.prod(shape))
    return list(units.items())


def estimate_zero_rank_bytes(
    model: ModelLike, world_size: int, strategy: str, precision: str = "fp32", optimizer: str = "adamw",
    *, rank: int = 0, persistence_threshold: int = 0, cpu_offload: bool = False,
) -> RankState:
    """Predict what DeepSpeed holds on ``rank`` for ``model`` under ZeRO ``strategy``, in the five
    parts of :class:`~handbook_lib.models.model_state.RankState`: parameters (ZeRO-1/2: the whole flat buffer;
    ZeRO-3: every tensor's partition plus the persistent tensors whole; compute dtype), the fp32
    master partition, the gradients held between backward and the optimizer step (ZeRO-3: also
    between steps), the optimizer state of the master partition, and Adam's one ``step`` scalar.

    Args:
        model: Anything :func:`~handbook_lib.models.layout.model_layout` accepts. Without its
            tensors (a preset known by its sizes), the parameters are one flat block: ZeRO-1/2's
            gradients are the partition's own (the whole tensors overlapping it are unknown) and
            ZeRO-3 keeps no tensor whole (those under the threshold are unknown).
        world_size: Ranks, N.
        strategy: ``ZERO1``, ``ZERO2`` or ``ZERO3``.
        precision: A key of :data:`handbook_lib.core.config.PRECISIONS`: parameters and gradients are
            kept in its compute dtype; master and optimizer state in fp32, or in bf16 for ``bf16``
            (DeepSpeed's ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``).
        optimizer: ``adamw``/``adam`` (2 states), ``sgd-momentum`` (1), ``sgd`` (0).
        rank: Which rank (ZeRO-1/2's gradients depend on where its partition falls).
        persistence_threshold: ZeRO-3 keeps tensors of at most this many elements whole.
        cpu_offload: ``offload_optimizer`` (ZeRO-1/2 then hold the fp32 partition's gradient).

    Raises:
        ValueError: for a strategy that is not a ZeRO row, or a bad world size, rank,
            threshold, precision or optimizer.
    """
    stage = zero_stage(strategy)
    _check(world_size, rank, persistence_threshold)
    compute = DTYPES[lookup(PRECISIONS, precision, "precision").compute].bytes
    master = DTYPES[state_dtype(precision)].bytes  # bf16: bf16_master_weights_and_grads, bf16_optimizer_states
    if master != 4 and cpu_offload:
        raise ValueError("precision 'bf16' (DeepSpeed's bf16 master and optimizer states) is priced on the "
                         "device: DeepSpeed offloads them only to its compiled CPU Adam")
    states = optimizer_states(optimizer)
    numels = _numels(model)
    total = model_layout(model).num_params
    step_bytes = 4 if states == 2 else 0
    if stage < 3:
        padded, part = flat_partition(total, world_size)
        if cpu_offload:
            grads = 4 * part
        elif numels is None:
            grads = compute * part
        else:
            held = sum(n for n, _ in partition_overlaps(numels, world_size, rank))
            if rank == world_size - 1:
                held += padded - sum(numels)
            grads = compute * held
        return RankState(params=compute * padded, master=master * part, grads=grads,
                             optimizer=master * states * part, optimizer_step=step_bytes)
    numels = numels if numels is not None else [total]
    part = sum(-(-n // world_size) for n in numels)
    whole = sum(-(-n // world_size) * world_size for n in numels if n <= persistence_threshold)
    return RankState(params=compute * (part + whole), master=master * part, grads=compute * part,
                         optimizer=master * states * part, optimizer_step=step_bytes)


def bookkeeping_reductions(strategy: str, precision: str = "fp32", *, cpu_offload: bool = False) -> list[int]:
    """Bytes of the small all-reduces DeepSpeed adds to every step, from its source (0.19):

    - the squared gradient norm (computed even without clipping): ZeRO-3 reduces it in the
      norm dtype, float64 (8 B), on the device path and as an fp32 scalar (4 B) on the offload
      path; ZeRO-1/2 as an fp32 scalar (4 B);
    - with a 16-bit compute dtype, ZeRO-1/2 also reduce a 1-byte overflow flag.
    """
    stage = zero_stage(strategy)
    compute = lookup(PRECISIONS, precision, "precision").compute
    if stage == 3:
        return [4 if cpu_offload else 8]
    return [4] + ([1] if DTYPES[compute].bytes == 2 else [])


def _step_trace(model: ModelLike) -> list[tuple[str, str]]:
    """ZeRO-3's trace of one step, ``(module, phase)`` each: the modules in the order forward
    enters them (:func:`~handbook_lib.core.architecture.forward_modules`), then in the order
    backward reaches them, the reverse of the order forward leaves them (a block before the
    modules it called)."""
    layout = model_layout(model)
    entered = forward_modules(layout.num_layers or 0)
    left: list[str] = []
    open_: list[str] = []
    for name in entered:
        while open_ and not name.startswith(f"{open_[-1]}." if open_[-1] else ""):
            left.append(open_.pop())
        open_.append(name)
    left.extend(reversed(open_))
    return [(m, "forward") for m in entered] + [(m, "backward") for m in reversed(left)]


def zero3_gathers(model: ModelLike, *, persistence_threshold: int = 0, prefetch_bucket_size: int = 0,
                  max_reuse_distance: int = 0) -> list[tuple[str, list[int], str]]:
    """ZeRO-3's all-gathers of one training step, in order: ``(modules, tensors' elements, phase)``
    each, phase ``forward`` or ``backward`` (:func:`zero3_replay`)."""
    return zero3_replay(model, persistence_threshold=persistence_threshold, prefetch_bucket_size=prefetch_bucket_size,
                        max_reuse_distance=max_reuse_distance)[0]


def zero3_replay(model: ModelLike, *, persistence_threshold: int = 0, prefetch_bucket_size: int = 0,
                 max_reuse_distance: int = 0) -> tuple[list[tuple[str, list[int], str]], int]:
    """``(gathers, most)``: ZeRO-3's all-gathers of one training step (:func:`zero3_gathers`) and
    the most elements of sharded tensors it holds gathered at once.

    DeepSpeed's ``PartitionedParameterCoordinator`` (release 0.19) replayed on the step's trace
    (:func:`_step_trace`: every module called, those without tensors of their own too), each
    tensor queued once per use. A module's fetch gathers its tensors that are not gathered yet,
    in one call; then (``prefetch_bucket_size`` > 0) it pops the queue until it has taken that
    many elements, and gathers the popped tensors that are not gathered in one more call. After
    a module runs its tensors are released, unless persistent, queued for a later use that a
    prefetch has already passed, or used again within ``max_reuse_distance`` elements of the
    trace. The trace is DeepSpeed's from its third step on (it records it in the first two).

    Raises:
        ValueError: for a negative threshold, bucket or distance (elements), or a model not known
            tensor by tensor.
    """
    for name, value in (("persistence_threshold", persistence_threshold),
                        ("prefetch_bucket_size", prefetch_bucket_size), ("max_reuse_distance", max_reuse_distance)):
        check_int(name, value, 0)
    units = dict(gather_units(model))
    trace = _step_trace(model)
    tensors = {name: [(name, j) for j in range(len(sizes))] for name, sizes in units.items()}
    numel = {(name, j): x for name, sizes in units.items() for j, x in enumerate(sizes)}
    queue = deque((t, step) for step, (m, _) in enumerate(trace) for t in tensors.get(m, []))
    gathered = {t for t, x in numel.items() if x <= persistence_threshold}  # persistent: always whole
    fetched_for: dict[tuple[str, int], int] = {}  # the last queued use a fetch or prefetch passed
    live, most, out = 0, 0, []  # elements gathered now, at most; the gathers

    def gather(taken: list[tuple[str, int]], phase: str) -> None:
        nonlocal live, most
        if taken:
            names = list(dict.fromkeys(m for m, _ in taken))
            out.append((" + ".join(names), [numel[t] for t in taken], phase))
            gathered.update(taken)
            live += sum(numel[t] for t in taken)
            most = max(most, live)

    for step, (module, phase) in enumerate(trace):
        mine = tensors.get(module, [])
        gather([t for t in mine if t not in gathered], phase)
        for _ in range(sum(fetched_for.get(t, -1) < step for t in mine)):  # its own uses, off the queue
            t, use = queue.popleft()
            fetched_for[t] = use
        if prefetch_bucket_size:
            limit = min(MAX_LIVE_PARAMETERS - live, prefetch_bucket_size)
            taken: list[tuple[str, int]] = []
            while queue and sum(numel[t] for t in taken) < limit:
                t, use = queue.popleft()
                fetched_for[t] = max(fetched_for.get(t, -1), use)
                if t not in gathered and t not in taken:
                    taken.append(t)
            gather(taken, phase)
        release = {t for t in mine if numel[t] > persistence_threshold and fetched_for.get(t, -1) <= step + 1}
        passed = 0
        for later, _ in trace[step + 1:]:
            if passed >= max_reuse_distance:
                break
            release -= set(tensors.get(later, []))
            passed += sum(units.get(later, []))
        freed = release & gathered
        gathered -= freed
        live -= sum(numel[t] for t in freed)
    return out, most


def estimate_zero_step_traffic(
    model: ModelLike, world_size: int, strategy: str, precision: str = "fp32",
    *, persistence_threshold: int = 0, cpu_offload: bool = False, prefetch_bucket_size: int = 0,
    max_reuse_distance: int = 0,
) -> StepTraffic:
    """The collectives of one ZeRO optimizer step (one micro-step), in order, per rank.

    DeepSpeed cuts its gradient reductions into buckets (``reduce_bucket_size``, 5e8 elements by
    default: one bucket for the book's models); the records give one collective per reduction
    and the bytes are exact — count only what the bucketing does not change. ZeRO-3's
    all-gathers are :func:`zero3_gathers`' (``prefetch_bucket_size`` and ``max_reuse_distance``
    in elements; 0, the book's measurement config, gathers every module in forward and again
    in backward).

    Raises:
        ValueError: as :func:`estimate_zero_rank_bytes`.
    """
    stage = zero_stage(strategy)
    _check(world_size, 0, persistence_threshold)
    compute, reduce = lookup(PRECISIONS, precision, "precision")
    c, r = DTYPES[compute].bytes, DTYPES[reduce].bytes
    n = world_size
    records: list[CollectiveRecord] = []

    def record(kind: str, buffer: int, unit: str, phase: str, dtype: str) -> None:
        cost = estimate_collective(kind, buffer, n)
        records.append(CollectiveRecord(**vars(cost), unit=unit, phase=phase, dtype=dtype, micro_step=0))

    model_layout(model).require_exact("DeepSpeed's ZeRO traffic")
    numels = _numels(model) or []
    if stage < 3:
        padded, _ = flat_partition(sum(numels), n)
        record("all_reduce", r * sum(numels), "gradients", "backward", reduce)
        for size in bookkeeping_reductions(strategy, precision, cpu_offload=cpu_offload):
            record("all_reduce", size, "bookkeeping", "step", "fp32" if size == 4 else "flag")
        record("all_gather", c * padded, "flat parameters", "step", compute)
        return StepTraffic(strategy, n, 1, tuple(records))
    padded_numel = lambda sizes: sum(-(-x // n) * n for x in sizes)  # noqa: E731
    for name, sizes, phase in zero3_gathers(model, persistence_threshold=persistence_threshold,
                                            prefetch_bucket_size=prefetch_bucket_size,
                                            max_reuse_distance=max_reuse_distance):
        record("all_gather", c * padded_numel(sizes), name, phase, compute)
    record("reduce_scatter", r * padded_numel(numels), "gradients", "backward", reduce)
    for size in bookkeeping_reductions(strategy, precision, cpu_offload=cpu_offload):
        record("all_reduce", size, "bookkeeping", "step", "fp64" if size == 8 else "fp32")
    for x in numels:
        if x <= persistence_threshold:
            record("all_gather", c * padded_numel([x]), "persistent tensor", "step", compute)
    return StepTraffic(strategy, n, 1, tuple(records))


def largest_module_params(model: ModelLike) -> int:
    """Parameters of the largest module that owns them directly, what DeepSpeed's ZeRO-3 estimate
    calls the largest layer: the largest tensor for a model known tensor by tensor (a weight and
    its bias counted apart: a bound below), else the largest of the embedding (``V·d``), a
    feed-forward projection (``d·f``) and the query projection (``d·q``)."""
    layout = model_layout(model)
    if layout.exact:
        return layout.largest_tensor
    d = layout.d_model
    return max(layout.vocab_size * d, d * layout.dim_feedforward, d * layout.attention_width)


def deepspeed_own_estimate(model: ModelLike, world_size: int, strategy: str) -> int:
    """DeepSpeed's own estimate of a GPU's model-state bytes without offload, as its
    ``estimate_zero2_model_states_mem_needs`` (``2·P + 18·P/N``: 16-bit parameters whole, then
    16-bit and fp32 gradients, fp32 master and Adam's two moments over N) and
    ``estimate_zero3_model_states_mem_needs`` (``4·largest module + 18·P/N``) compute it, on one
    node of ``world_size`` GPUs; ZeRO-1 takes ZeRO-2's (DeepSpeed publishes none of its own).
    ``tests/test_zero.py`` checks it against DeepSpeed's functions."""
    stage = zero_stage(strategy)
    check_world(world_size)
    total = model_layout(model).num_params
    if stage == 3:
        return 4 * largest_module_params(model) + int(18 * total / world_size)
    return 2 * total + int(18 * total / world_size)



def zero_redundancy_partition(numels: Sequence[int], world_size: int) -> list[list[int]]:
    """PyTorch's own ZeRO-1 (``torch.distributed.optim.ZeroRedundancyOptimizer``): the tensors
    each rank keeps optimizer state for and updates, as indices into ``numels`` (elements of
    each parameter tensor, in the model's order). Whole tensors, largest first (a stable sort),
    each to the rank that holds the fewest elements so far, the lowest such rank on a tie, as
    its ``_partition_parameters`` does: the ranks' shares differ by up to the largest tensor,
    where DeepSpeed's ZeRO-1 splits one flat buffer evenly (:func:`flat_partition`)."""
    check_world(world_size)
    sizes = [0] * world_size
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(numels)), key=lambda k: numels[k], reverse=True):
        owner = sizes.index(min(sizes))
        ranks[owner].append(i)
        sizes[owner] += numels[i]
    return [sorted(r) for r in ranks]


def estimate_zero_redundancy_rank_bytes(model: ModelLike, world_size: int, precision: str = "fp32",
                                        optimizer: str = "adamw", *, rank: int = 0) -> RankState:
    """Predict one rank's state under DDP + ``ZeroRedundancyOptimizer``: the whole model's
    parameters and gradients (DDP replicas, in the precision's state dtype), the optimizer state
    of this rank's tensors only (:func:`zero_redundancy_partition`) and their step counters; no
    master copy (the optimizer updates the parameters)."""
    check_world(world_size, rank)
    numels = _numels(model)
    if numels is None:
        raise ValueError("ZeroRedundancyOptimizer's shares need the model's tensors: pass a ModelConfig, "
                         "not a parameter count")
    element = DTYPES[state_dtype(precision)].bytes
    mine = zero_redundancy_partition(numels, world_size)[rank]
    whole = element * sum(numels)
    steps = optimizer_step_bytes(model, optimizer) * len(mine) // len(numels)
    return RankState(params=whole, master=0, grads=whole,
                     optimizer=optimizer_states(optimizer) * element * sum(numels[i] for i in mine),
                     optimizer_step=steps)
