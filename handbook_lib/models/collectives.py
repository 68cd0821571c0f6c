"""Collectives: the bytes one rank sends in a ring all-gather, reduce-scatter, all-reduce or
broadcast, its ring schedule step by step, and how long it takes (the alpha-beta model).

Pure arithmetic: no ``torch.distributed``. Chapter 3 teaches it.

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
all_to_all     (N-1)/N · B       N-1         one block of B/N to each other rank
send           B (received: 0)   1           point to point, one peer
recv           0 (received: B)   1           point to point, one peer
============== ================= =========== ======================================

The last three are not FSDP's: sequence parallelism (chapter 9) moves activations with them
(DeepSpeed Ulysses' all-to-alls, a ring attention's sends and receives).

A training step is a schedule of these over the model's FSDP units
(:mod:`handbook_lib.models.traffic`); :mod:`handbook_lib.models.timing` prices it on a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.core.checks import check_int
from handbook_lib.models.hardware import Link

__all__ = ["COLLECTIVES", "TRANSFER_KINDS", "CollectiveCost", "estimate_collective", "RING_KINDS", "RingTransfer",
           "ring_schedule", "estimate_collective_time", "AlphaBeta", "fit_alpha_beta"]


COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
"""Collective kinds FSDP, DDP and ZeRO issue, spelled as ``torch.distributed`` spells their
functions."""

TRANSFER_KINDS = (*COLLECTIVES, "all_to_all", "send", "recv")
"""Every kind :func:`estimate_collective` prices: :data:`COLLECTIVES` and the all-to-all and
point-to-point transfers of sequence and context parallelism (chapter 9)."""

@dataclass(frozen=True)
class CollectiveCost:
    """What one rank does in one ring collective. Bytes are integers."""

    kind: str
    """One of :data:`TRANSFER_KINDS`."""
    buffer_bytes: int
    """The full, unsharded buffer B, bytes (all-to-all: the input a rank holds; send, recv:
    the tensor sent or received)."""
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
    2(N-1)/N·B from the root instead). An all-to-all keeps one of its N equal blocks and sends
    each of the others to its rank, in N-1 pairwise steps. A send or receive is one transfer
    between two ranks of a group of N >= 2. N = 1 moves nothing.

    Args:
        kind: One of :data:`TRANSFER_KINDS`.
        buffer_bytes: The full buffer B, bytes.
        group_size: Ranks in the group, N.

    Raises:
        ValueError: for an unknown kind, a negative buffer, a group below 1, or an all-gather /
            reduce-scatter buffer that N does not divide.
    """
    if kind not in TRANSFER_KINDS:
        raise ValueError(f"kind must be one of {', '.join(TRANSFER_KINDS)}, got {kind!r}")
    check_int("buffer_bytes", buffer_bytes, 0)
    check_int("group_size", group_size, 1)
    n, b = group_size, buffer_bytes
    if n == 1:
        return CollectiveCost(kind, b, n, 0, 0, 0)
    if kind in ("send", "recv"):
        return CollectiveCost(kind, b, n, b if kind == "send" else 0, b if kind == "recv" else 0, 1)
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        if b % n:
            raise ValueError(f"buffer_bytes={b} must be a multiple of group_size={n} for {kind} "
                             "(FSDP pads every buffer so that it is; an all-to-all's blocks are equal)")
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
    check_int("group_size", group_size, 1)
    n = group_size
    reduce = [RingTransfer(s, r, (r + 1) % n, (r - s - 1) % n, tuple((r - k) % n for k in range(s, -1, -1)))
              for s in range(n - 1) for r in range(n)]
    gather = [RingTransfer(s, r, (r + 1) % n, (r - s) % n, ()) for s in range(n - 1) for r in range(n)]
    if kind == "all_gather":
        return tuple(gather)
    if kind == "reduce_scatter":
        return tuple(reduce)
    return tuple(reduce) + tuple(RingTransfer(t.step + n - 1, t.sender, t.receiver, t.chunk, ()) for t in gather)

def estimate_collective_time(cost: CollectiveCost, link: Link) -> float:
    """Seconds one ring collective takes on one link: the alpha-beta model,
    ``steps·alpha + sent/bandwidth``.

    Each ring step pays the link latency alpha (seconds) once; the bytes a rank sends cross the
    link at its achievable one-way bandwidth (:attr:`Link.achievable_bytes_per_s`: the line rate
    times the collective library's published efficiency), while the bytes it receives arrive in
    parallel on the other direction. Contention is ignored. A collective over several machines
    is priced by :func:`handbook_lib.models.topology.route_collective` instead.
    """
    return cost.steps * link.latency_s + cost.sent_bytes / link.achievable_bytes_per_s

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
    check_int("group_size", group_size, 2)
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
