"""The communication model: bytes each rank sends per collective and per training step, and how
long they take. Pure arithmetic: no ``torch.distributed``. Chapter 3 teaches it.

Collectives run as rings over a group of N ranks on a buffer of B bytes, where B is always the
full, unsharded buffer (all-gather output, reduce-scatter input, all-reduce and broadcast size).
Per rank, each way:

============== ================= =========== ======================================
collective     sent = received   ring steps  why
============== ================= =========== ======================================
all_gather     (N-1)/N · B       N-1         pass the N-1 chunks you lack around
reduce_scatter (N-1)/N · B       N-1         pass and add N-1 partial chunks
all_reduce     2(N-1)/N · B      2(N-1)      reduce-scatter, then all-gather
broadcast      B                 N-1         pipelined chain, NCCL's ring broadcast
============== ================= =========== ======================================

A training strategy is a schedule of those collectives over the model's FSDP units (one per
transformer layer, plus the root); :func:`estimate_step_traffic` lists it, and
:func:`estimate_step_time` turns it into seconds with the alpha-beta model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from handbook_lib.architecture import ModelConfig
from handbook_lib.hardware import Link, Node
from handbook_lib.presets import DecoderShape
from handbook_lib.sharding import DTYPE_BYTES, Unit, dtype_bytes, fsdp_units
from handbook_lib.strategies import STRATEGIES, get_strategy, strategies_where

__all__ = [
    "COLLECTIVES", "STRATEGIES", "CollectiveCost", "estimate_collective", "Unit",
    "units_for_model", "CollectiveRecord", "StepTraffic", "estimate_step_traffic",
    "estimate_step_bytes_for_params", "StepTime", "estimate_collective_time",
    "estimate_step_time", "cluster_link", "bytes_by_link", "estimate_compute_time", "units_for_decoder", "AlphaBeta",
    "fit_alpha_beta", "RING_KINDS", "RingTransfer", "ring_schedule",
]

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
"""Collective kinds, spelled as ``torch.distributed`` spells their functions."""


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _dtype_size(name: str, dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{name} must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return dtype_bytes(dtype)


@dataclass(frozen=True)
class CollectiveCost:
    """What one rank does in one ring collective. Bytes are integers."""

    kind: str
    """One of :data:`COLLECTIVES`."""
    buffer_bytes: int
    """The full, unsharded buffer B, bytes."""
    group_size: int
    """Ranks taking part, N."""
    sent_bytes: int
    """Bytes this rank sends, each rank alike (the busiest rank for broadcast)."""
    received_bytes: int
    """Bytes this rank receives."""
    steps: int
    """Ring steps, each paying the link's latency once."""


def estimate_collective(kind: str, buffer_bytes: int, group_size: int) -> CollectiveCost:
    """Per-rank bytes and ring steps of one collective (see the table in the module docstring).

    All-gather and reduce-scatter need B to be a multiple of N: FSDP pads its buffers so that it
    always is. An all-reduce's ring cuts B into N chunks of ceil(B/N) bytes, so for a B that is
    not a multiple of N the count is that of B padded up (fewer than 2(N-1) bytes above the
    average). Broadcast is NCCL's pipelined chain: every rank but the last forwards all B bytes,
    so the busiest rank sends and receives B (the scatter + all-gather broadcast would move
    2(N-1)/N·B from the root instead). N = 1 moves nothing.

    Args:
        kind: One of :data:`COLLECTIVES`.
        buffer_bytes: The full buffer B, bytes.
        group_size: Ranks in the group, N.

    Raises:
        ValueError: for an unknown kind, a negative buffer, a group below 1, or an all-gather /
            reduce-scatter buffer that N does not divide.
    """
    if kind not in COLLECTIVES:
        raise ValueError(f"kind must be one of {', '.join(COLLECTIVES)}, got {kind!r}")
    _check_int("buffer_bytes", buffer_bytes, 0)
    _check_int("group_size", group_size, 1)
    n, b = group_size, buffer_bytes
    if n == 1:
        return CollectiveCost(kind, b, n, 0, 0, 0)
    if kind in ("all_gather", "reduce_scatter"):
        if b % n:
            raise ValueError(f"buffer_bytes={b} must be a multiple of group_size={n} for {kind} "
                             "(FSDP pads every buffer so that it is)")
        moved, steps = (n - 1) * (b // n), n - 1
    elif kind == "all_reduce":
        moved, steps = 2 * (n - 1) * -(-b // n), 2 * (n - 1)
    else:
        moved, steps = b, n - 1
    return CollectiveCost(kind, b, n, moved, moved, steps)


RING_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
"""Collectives :func:`ring_schedule` lays out step by step."""


@dataclass(frozen=True)
class RingTransfer:
    """One chunk one rank sends to its right-hand neighbour in one step of a ring collective.

    The buffer is cut into N chunks of B/N bytes; chunk ``c`` is the part rank ``c`` owns at
    the end of a reduce-scatter (and starts with in an all-gather)."""

    step: int
    """Ring step, from 0; all N transfers of a step run at the same time."""
    sender: int
    """Rank that sends."""
    receiver: int
    """Rank that receives: ``(sender + 1) % N``."""
    chunk: int
    """Which of the N chunks travels."""
    summed: tuple[int, ...]
    """Reduce phase: the ranks whose contributions the travelling partial sum already holds
    (the receiver then adds its own); gather phase: ``()``, the chunk is complete."""


def ring_schedule(kind: str, group_size: int) -> tuple[RingTransfer, ...]:
    """Every transfer of a ring ``all_gather``, ``reduce_scatter`` or ``all_reduce``, by step.

    All-gather: rank r starts with chunk r; at step s it forwards chunk (r - s) mod N, the one it
    received at the previous step, so after N-1 steps every rank holds every chunk.
    Reduce-scatter: at step s rank r sends its partial sum of chunk (r - s - 1) mod N, holding
    the contributions of ranks r-s … r; the receiver adds its own, so after N-1 steps rank r holds
    the complete sum of chunk r. All-reduce is a reduce-scatter then an all-gather: 2(N-1) steps.
    Each rank sends one chunk (B/N bytes) per step: (N-1)/N·B per all-gather or reduce-scatter,
    as :func:`estimate_collective` counts.

    Raises:
        ValueError: for a kind not in :data:`RING_KINDS` or a group below 1.
    """
    if kind not in RING_KINDS:
        raise ValueError(f"kind must be one of {', '.join(RING_KINDS)}, got {kind!r}")
    _check_int("group_size", group_size, 1)
    n = group_size
    reduce = [RingTransfer(s, r, (r + 1) % n, (r - s - 1) % n, tuple((r - k) % n for k in range(s, -1, -1)))
              for s in range(n - 1) for r in range(n)]
    gather = [RingTransfer(s, r, (r + 1) % n, (r - s) % n, ()) for s in range(n - 1) for r in range(n)]
    if kind == "all_gather":
        return tuple(gather)
    if kind == "reduce_scatter":
        return tuple(reduce)
    return tuple(reduce) + tuple(RingTransfer(t.step + n - 1, t.sender, t.receiver, t.chunk, ()) for t in gather)


def units_for_model(config: ModelConfig) -> list[Unit]:
    """The FSDP units of ``SimpleTransformer(config)``, in forward order (root first): see
    :func:`handbook_lib.sharding.fsdp_units`."""
    return fsdp_units(config)


@dataclass(frozen=True)
class CollectiveRecord(CollectiveCost):
    """One collective of a training step: its cost, and which unit, when, in which dtype."""

    unit: str
    """Unit name (``"model"`` for DDP's all-reduce of every gradient)."""
    phase: str
    """``"forward"`` or ``"backward"``."""
    dtype: str
    """Element type on the wire, a key of ``handbook_lib.memory.DTYPE_BYTES``."""
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
        units: The FSDP units in forward order (see :func:`units_for_model`).
        world_size: Ranks in the job.
        strategy: One of :data:`STRATEGIES`.
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

    A unit without parameters (e.g. a root whose children are all wrapped) issues nothing.

    Raises:
        ValueError: for a bad strategy, dtype, world size, shard group or micro-step count.
    """
    units = list(units)
    if not units or not all(isinstance(u, Unit) for u in units):
        raise ValueError(f"units must be a non-empty list of Unit, got {units!r}")
    _check_int("world_size", world_size, 1)
    row = get_strategy(strategy).torch_only("estimate_step_traffic")
    p_size, r_size = _dtype_size("param_dtype", param_dtype), _dtype_size("reduce_dtype", reduce_dtype)
    _check_int("grad_accum_steps", grad_accum_steps, 1)
    group = world_size
    if row.hybrid:
        _check_int("shard_group_size", shard_group_size, 1)
        group = row.shard_group(world_size, shard_group_size)
    elif shard_group_size is not None:
        raise ValueError(f"shard_group_size applies only to {', '.join(strategies_where(hybrid=True))}, "
                         f"not {strategy!r}")
    replicas = world_size // group

    records: list[CollectiveRecord] = []
    units = [u for u in units if u.numel]

    def padded(u: Unit) -> int:
        return u.flat_padded_numel(group) if flat_params else u.padded_numel(group)

    def add(kind: str, unit: str, phase: str, dtype: str, buffer: int, size: int) -> None:
        cost = asdict(estimate_collective(kind, buffer, size))
        records.append(CollectiveRecord(**cost, unit=unit, phase=phase, dtype=dtype, micro_step=m))

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
        for u in units:
            if group > 1:
                add("all_gather", u.name, "forward", param_dtype, padded(u) * p_size, group)
        for u in reversed(units):
            numel = padded(u)
            if group > 1 and row.reshard_after_forward and (not u.root or root_reshard_after_forward):
                add("all_gather", u.name, "backward", param_dtype, numel * p_size, group)
            if sync and group > 1:
                add("reduce_scatter", u.name, "backward", reduce_dtype, numel * r_size, group)
            if sync and row.hybrid and replicas > 1:
                add("all_reduce", u.name, "backward", reduce_dtype, numel * r_size // group, replicas)
    if grad_scaler_group is not None and grad_scaler_group > 1:
        m = grad_accum_steps - 1
        add("all_reduce", "grad_scaler", "optimizer", "fp32", 4, grad_scaler_group)
    return StepTraffic(strategy, world_size, grad_accum_steps, tuple(records))


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
    _check_int("num_params", num_params, 0)
    unit = Unit("model", ((num_params,),))
    return estimate_step_traffic([unit], world_size, strategy, param_dtype=param_dtype,
                                 reduce_dtype=reduce_dtype, shard_group_size=shard_group_size).sent_bytes


def estimate_collective_time(cost: CollectiveCost, link: Link) -> float:
    """Seconds one ring collective takes: the alpha-beta model, ``steps·alpha + sent/bandwidth``.

    Each ring step pays the link latency alpha (seconds) once; the bytes a rank sends cross the
    link at its one-way bandwidth (bytes/s), while the bytes it receives arrive in parallel on the
    other direction. Contention, protocol overhead and the achievable fraction of the datasheet
    bandwidth are ignored, so real collectives are slower.
    """
    return cost.steps * link.latency_s + cost.sent_bytes / link.bandwidth_bytes_per_s


@dataclass(frozen=True)
class StepTime:
    """Predicted time of one optimizer step, seconds."""

    comm_s: float
    """All collectives, back to back."""
    compute_s: float
    """Forward and backward compute, as given."""
    exposed_comm_s: float
    """Communication that no compute hides."""
    total_s: float
    """The step."""
    bound: str
    """``"communication"`` if ``comm_s > compute_s``, else ``"compute"``."""


def cluster_link(record: CollectiveRecord, node: Node, gpus: int, strategy: str) -> Link:
    """The link one collective of a ``gpus``-GPU job on machines like ``node`` travels.

    Ranks fill whole nodes in order. A collective crosses machines, and runs at
    ``node.inter_link``'s speed, when the job spans several nodes and its group does: a group
    larger than a node (FULL_SHARD over every GPU), or HSDP's all-reduce between replicas, one
    rank per node. Anything else stays on ``node.intra_link`` (NVLink, PCIe).
    """
    per_node = min(node.gpus_per_node, gpus)
    if gpus <= per_node:
        return node.intra_link
    crosses = record.group_size > per_node or (get_strategy(strategy).hybrid and record.kind == "all_reduce")
    return node.inter_link if crosses else node.intra_link


def bytes_by_link(traffic: StepTraffic, link_of: Callable[[CollectiveRecord], Link]) -> dict[str, int]:
    """Bytes one rank sends per step on each link (by the link's name), in execution order of
    first use: e.g. ``{"NVLink 4 (H100 SXM)": ..., "InfiniBand NDR 400 Gb/s": ...}``."""
    sent: dict[str, int] = {}
    for record in traffic.records:
        name = link_of(record).name
        sent[name] = sent.get(name, 0) + record.sent_bytes
    return sent


def estimate_step_time(
    traffic: StepTraffic,
    link: Link | Callable[[CollectiveRecord], Link],
    compute_s: float,
    overlap: bool,
) -> StepTime:
    """Time of one step: its collectives on ``link`` plus ``compute_s`` seconds of compute.

    ``link`` is one link for every collective, or a function choosing the link of each (e.g.
    NVLink inside a node, InfiniBand for HSDP's all-reduce across nodes).

    Without overlap, ``total = comm + compute``. With overlap, FSDP prefetches each unit's
    all-gather while the previous unit computes and reduce-scatters while the next one does;
    only the first forward all-gather of each micro-step has nothing to hide behind. So
    ``total = exposed + max(compute, comm - exposed)``, exposed being those first all-gathers.
    """
    if not compute_s >= 0:
        raise ValueError(f"compute_s must be >= 0, got {compute_s!r}")
    choose = link if callable(link) else (lambda record: link)
    comm = exposed = 0.0
    started: set[int] = set()
    for r in traffic.records:
        t = estimate_collective_time(r, choose(r))
        comm += t
        if r.kind == "all_gather" and r.phase == "forward" and r.micro_step not in started:
            started.add(r.micro_step)
            exposed += t
    if overlap:
        total = exposed + max(compute_s, comm - exposed)
    else:
        exposed, total = comm, comm + compute_s
    bound = "communication" if comm > compute_s else "compute"
    return StepTime(comm, compute_s, exposed, total, bound)


def estimate_compute_time(num_params: int, tokens: int, peak_flops: float,
                          utilization: float = 0.4) -> float:
    """Seconds of one rank's forward + backward: the 6PT rule, ``6·P·T / (peak · utilization)``.

    Forward costs 2 FLOPs (a multiply and an add) per parameter per token, backward twice that
    (gradients of activations and of weights); every rank runs the whole model (gathered, under
    FSDP) on its own tokens. The rule ignores attention's sequence-length
    term, counts embedding lookups as matrix products, and adds nothing for activation
    checkpointing (which recomputes the forward: 8PT).

    Args:
        num_params: P, parameters.
        tokens: T, tokens one rank processes in the step (its share of the global batch).
        peak_flops: Peak FLOP/s of one accelerator, e.g. ``Accelerator.peak_flops_bf16``.
        utilization: Fraction of the peak achieved (model FLOPs utilization), in (0, 1].
    """
    _check_int("num_params", num_params, 0)
    _check_int("tokens", tokens, 0)
    if not peak_flops > 0:
        raise ValueError(f"peak_flops must be > 0 FLOP/s, got {peak_flops!r}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    return 6 * num_params * tokens / (peak_flops * utilization)


def units_for_decoder(shape: DecoderShape) -> list[Unit]:
    """FSDP units of a decoder known by its shape: the root (embeddings, head, final norm) and one
    unit per layer, each as one flat tensor."""
    root = Unit("root", ((shape.root_params,),), root=True)
    return [root] + [Unit(f"layers.{i}", ((shape.layer_params,),)) for i in range(shape.num_layers)]


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted alpha-beta model of one collective on the machine at hand."""

    kind: str
    group_size: int
    alpha_s: float
    """Latency per ring step, seconds."""
    beta_bytes_per_s: float
    """Bandwidth: bytes per second a rank sends."""

    def predict_s(self, buffer_bytes: int) -> float:
        """Predicted seconds for one collective on a buffer of ``buffer_bytes``."""
        cost = estimate_collective(self.kind, buffer_bytes, self.group_size)
        return cost.steps * self.alpha_s + cost.sent_bytes / self.beta_bytes_per_s


def fit_alpha_beta(kind: str, group_size: int, buffer_bytes: list[int], seconds: list[float]) -> AlphaBeta:
    """Least-squares fit of ``t = steps·alpha + sent_bytes/beta`` to measured collective times.

    ``steps`` and ``sent_bytes`` come from :func:`estimate_collective` for each buffer size, so
    the fit is linear in (alpha, 1/beta). Fitting relative errors (each equation divided by its
    time) keeps the small, latency-bound messages from being drowned by the large ones.

    Raises:
        ValueError: with fewer than two distinct sizes, mismatched lists or a group of one rank.
    """
    if len(buffer_bytes) != len(seconds) or len(set(buffer_bytes)) < 2:
        raise ValueError("fit_alpha_beta needs two or more distinct buffer sizes, one time each")
    _check_int("group_size", group_size, 2)
    if any(not t > 0 for t in seconds):
        raise ValueError(f"seconds must all be > 0, got {seconds!r}")
    rows = []
    for b, t in zip(buffer_bytes, seconds):
        cost = estimate_collective(kind, b, group_size)
        rows.append((cost.steps / t, cost.sent_bytes / t))
    # normal equations of min sum (x0*a + x1*g - 1)^2, with g = 1/beta
    s00 = sum(x0 * x0 for x0, _ in rows)
    s01 = sum(x0 * x1 for x0, x1 in rows)
    s11 = sum(x1 * x1 for _, x1 in rows)
    r0 = sum(x0 for x0, _ in rows)
    r1 = sum(x1 for _, x1 in rows)
    det = s00 * s11 - s01 * s01
    alpha = (r0 * s11 - r1 * s01) / det
    inv_beta = (s00 * r1 - s01 * r0) / det
    if inv_beta <= 0:
        raise ValueError("the measured times do not grow with the message size: no bandwidth to fit")
    return AlphaBeta(kind, group_size, max(alpha, 0.0), 1.0 / inv_beta)
