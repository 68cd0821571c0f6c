"""When compute hides FSDP's communication: the roofline of one step. Pure arithmetic.

Chapter 3 teaches it (the FSDP sections of How to Scale Your Model and of the Ultra-Scale
Playbook derive the same bound). Per optimizer step and micro-step, a rank of an ``N``-way
sharded job sends about ``b·P·(N-1)/N`` bytes, ``b`` the bytes per parameter on the wire
(:func:`wire_bytes_per_param`: FULL_SHARD's two all-gathers of the parameters and one
reduce-scatter of the gradients, ``2 + 2 + 4 = 8`` in bf16 with fp32 reduction), and computes
``k·P·T`` FLOPs on its ``T`` tokens (``k = 6``, or 8 with full recomputation,
:func:`~handbook_lib.models.timing.estimate_compute_time`). With overlap, compute hides the
communication while

    k·P·T / (F·MFU)  >=  b·P·(N-1)/N / beta,   that is   T >= T_min = b·(N-1)/N · F·MFU / (k·beta)

``F`` the accelerator's peak FLOP/s, ``MFU`` the fraction of it achieved, ``beta`` the
bandwidth each GPU's ring gets each way. ``P`` cancels: the threshold depends on the link and
on how fast the GPU computes, not on the model's size, and on ``N`` only through ``(N-1)/N``.
The latency term (``alpha`` per ring step) is left out: it matters for small buffers and many
ranks, not for a layer's gigabytes.

**Per phase.** Overlap happens inside a phase, not across the step: forward's all-gathers hide
behind forward's ``2PT`` only, backward's all-gathers and reduce-scatters behind backward's
``4PT`` (``6PT`` with the forward recomputed). FULL_SHARD in bf16 with fp32 reduction carries 2
of its 8 bytes per parameter in forward and 6 in backward: backward needs
``T >= 6/4 · (N-1)/N · F·MFU/beta``, an eighth more than the whole step's ``8/6``
(:func:`min_tokens_by_phase`); with full recomputation both phases need ``1·(N-1)/N·F·MFU/beta``.
"""

from __future__ import annotations

from handbook_lib.core.checks import check_int
from handbook_lib.core.config import dtype_bytes
from handbook_lib.core.strategies import get_strategy
from handbook_lib.models.timing import DEFAULT_UTILIZATION

__all__ = ["min_tokens_per_gpu", "min_tokens_by_phase", "phase_wire_bytes", "wire_bytes_per_param"]

def wire_bytes_per_param(strategy: str = "FULL_SHARD", param_dtype: str = "bf16",
                         reduce_dtype: str = "fp32") -> int:
    """Bytes per parameter a rank's collectives carry per step, before the ring's ``(N-1)/N``:
    FULL_SHARD ``2·p + r`` (two all-gathers, one reduce-scatter), SHARD_GRAD_OP ``p + r``,
    DDP ``2·r`` (one all-reduce of the gradients), ``p`` and ``r`` the bytes of one parameter
    in ``param_dtype`` and of one gradient in ``reduce_dtype``. The hybrid strategies count
    their shard group's collectives only (the replicas' all-reduce of a ``1/S`` shard comes on
    top). E.g. 8 for FULL_SHARD in bf16 with fp32 reduction, 6 for SHARD_GRAD_OP.
    """
    row = get_strategy(strategy).torch_only("wire_bytes_per_param")
    if not row.distributed:
        raise ValueError(f"strategy must be one that communicates, got {row.name!r}")
    p, r = dtype_bytes(param_dtype, "param_dtype"), dtype_bytes(reduce_dtype, "reduce_dtype")
    if not row.shards_params:  # DDP, NO_SHARD: one all-reduce of the gradients
        return 2 * r
    # the parameters gathered for forward, and again for backward where they were freed
    return (2 if row.reshard_after_forward else 1) * p + r


def min_tokens_per_gpu(bandwidth_bytes_per_s: float, peak_flops: float,
                       utilization: float = DEFAULT_UTILIZATION, *,
                       wire_bytes: float = 8.0, ranks: int | None = None,
                       activation_checkpointing: bool = False) -> float:
    """Tokens each GPU must process per micro-step for compute to hide the communication:
    ``T_min = b·(N-1)/N · F·MFU / (k·beta)`` (module docstring), ``k`` 6, or 8 with
    ``activation_checkpointing``.

    Args:
        bandwidth_bytes_per_s: beta, the bandwidth one GPU's ring gets each way (a link's
            ``achievable_bytes_per_s``, or a route's).
        peak_flops: F, the accelerator's peak FLOP/s (``Accelerator.peak_flops_bf16``).
        utilization: MFU, the fraction of the peak achieved, in (0, 1].
        wire_bytes: b, bytes per parameter on the wire (:func:`wire_bytes_per_param`).
        ranks: N, the ranks sharing the collectives; ``None`` for the limit of many ranks
            (``(N-1)/N -> 1``).
        activation_checkpointing: Count the recomputed forward (8PT): fewer tokens suffice.
    """
    if not bandwidth_bytes_per_s > 0:
        raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {bandwidth_bytes_per_s!r}")
    if not peak_flops > 0:
        raise ValueError(f"peak_flops must be > 0 FLOP/s, got {peak_flops!r}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    if not wire_bytes > 0:
        raise ValueError(f"wire_bytes must be > 0, got {wire_bytes!r}")
    ring = 1.0
    if ranks is not None:
        check_int("ranks", ranks, 2)
        ring = (ranks - 1) / ranks
    flops_per_token_param = 8 if activation_checkpointing else 6
    return (wire_bytes * ring * peak_flops * utilization
            / (flops_per_token_param * bandwidth_bytes_per_s))


def phase_wire_bytes(strategy: str = "FULL_SHARD", param_dtype: str = "bf16",
                     reduce_dtype: str = "fp32") -> dict[str, int]:
    """:func:`wire_bytes_per_param` by phase: ``{"forward": p, "backward": p + r}`` for
    FULL_SHARD (the all-gather for forward; backward's all-gather again and the reduce-scatter),
    ``{"forward": p, "backward": r}`` for SHARD_GRAD_OP, ``{"forward": 0, "backward": 2·r}`` for
    DDP (hybrid strategies: their shard group's, as :func:`wire_bytes_per_param`)."""
    total = wire_bytes_per_param(strategy, param_dtype, reduce_dtype)
    row = get_strategy(strategy)
    forward = dtype_bytes(param_dtype, "param_dtype") if row.shards_params else 0
    return {"forward": forward, "backward": total - forward}


def min_tokens_by_phase(bandwidth_bytes_per_s: float, peak_flops: float,
                        utilization: float = DEFAULT_UTILIZATION, *,
                        wire_bytes: dict[str, float] | None = None, ranks: int | None = None,
                        activation_checkpointing: bool = False) -> dict[str, float]:
    """:func:`min_tokens_per_gpu` for each phase, ``{"forward": ..., "backward": ...}``: the
    tokens each GPU needs per micro-step for the phase's compute (2PT forward; 4PT backward,
    6PT with the forward recomputed) to hide its collectives' bytes (``wire_bytes``, by
    default :func:`phase_wire_bytes` of FULL_SHARD in bf16 with fp32 reduction). Compute hides
    the step's communication above the larger of the two."""
    wire: dict[str, float] = {**phase_wire_bytes()} if wire_bytes is None else wire_bytes
    flops = {"forward": 2, "backward": 6 if activation_checkpointing else 4}
    return {phase: min_tokens_per_gpu(bandwidth_bytes_per_s, peak_flops, utilization, wire_bytes=wire[phase],
                                      ranks=ranks) * 6 / flops[phase] if wire[phase] else 0.0
            for phase in ("forward", "backward")}
