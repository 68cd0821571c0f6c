"""The micro-batch sweep of ``make gpu-check``: what is the largest micro-batch a GPU runs, and
what does the memory model say it is? Pure parts, tested on the CPU.

- recognising a CUDA out-of-memory failure (:func:`is_cuda_oom`);
- the sweep (:func:`sweep_micro_batch`): doubling from a size known to fit until a run runs out
  of memory, then bisecting the bracket down to the exact largest fit, within a time budget;
- the memory model's peak of a sweep run (:func:`sweep_peak_bytes`) and its largest micro-batch
  within a capacity (:func:`predict_max_micro_batch`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from handbook_lib.core.architecture import ModelConfig
from handbook_lib.core.checks import check_int
from handbook_lib.models.layout import wrap_units

__all__ = ["is_cuda_oom", "SweepTry", "Sweep", "sweep_micro_batch", "sweep_peak_bytes", "predict_max_micro_batch"]


_CUDA_OOM = re.compile(
    r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|cudaErrorMemoryAllocation|"
    r"CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|Cuda failure '?out of memory|"
    r"NCCL (?:error|WARN).*(?:out of memory|Failed to CUDA calloc|cudaMalloc)",
    re.IGNORECASE,
)


def is_cuda_oom(error: BaseException | str) -> bool:
    """True if a failed run (a :class:`~handbook_lib.launch.errors.RunFailed`, or its message) ran out
    of GPU memory: PyTorch's ``OutOfMemoryError`` ("CUDA out of memory. Tried to allocate ..."),
    a raw CUDA, cuBLAS or cuDNN allocation error, or NCCL failing to allocate. A rank killed by
    the host's out-of-memory killer is not one (that is host memory), nor is a timeout.
    """
    texts = [str(error)]
    if not isinstance(error, str):
        texts.append(getattr(error, "rank_traceback", "") or "")
        texts.extend(getattr(error, "log_tail", None) or [])
    return any(_CUDA_OOM.search(t) for t in texts if t)


@dataclass(frozen=True)
class SweepTry:
    """One size tried by :func:`sweep_micro_batch`."""

    micro_batch: int
    outcome: str
    """``fits``, ``oom``, or ``error`` (failed otherwise: the sweep stops, undecided)."""
    seconds: float
    detail: str = ""
    """First line of the failure, for ``oom`` and ``error``."""


@dataclass(frozen=True)
class Sweep:
    """The result of a sweep: doubling, then bisection between the last fit and the first OOM."""

    largest_fit: int
    """The largest micro-batch that ran (0: none did)."""
    first_oom: int | None
    """The smallest that ran out of memory (``None``: none did, the sweep stopped before)."""
    stopped: str
    """Why it stopped: ``oom`` (bracketed by out-of-memory), ``budget`` (out of time), ``limit``
    (reached ``max_micro_batch``) or ``error`` (a failure that is not out-of-memory)."""
    tries: list[SweepTry] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        """True when ``first_oom`` is ``largest_fit + 1``: the largest fit is known, not bracketed."""
        return self.first_oom is not None and self.first_oom == self.largest_fit + 1

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "exact": self.exact}


def sweep_micro_batch(try_size: Callable[[int], None], *, start: int = 1, known_fit: int = 0,
                      max_micro_batch: int = 4096, time_left_s: Callable[[], float] | None = None,
                      clock: Callable[[], float] = time.monotonic, bisect: bool = True) -> Sweep:
    """Double the micro-batch from ``start`` until a run runs out of GPU memory, then bisect.

    Args:
        try_size: Runs the experiment at one micro-batch (sequences per rank); returns if it
            fit, raises if not (an exception :func:`is_cuda_oom` recognises is out of memory).
        start: The first size (>= 1).
        known_fit: A size already known to fit (an earlier run), below ``start``; 0 for none.
        max_micro_batch: The largest size tried.
        time_left_s: Seconds left of the caller's budget; before each try the sweep stops
            (``budget`` while doubling; the bracket so far while bisecting) unless the time left
            exceeds the longest try so far times 1.5.
        clock: Seconds, for timing the tries (tests pass a fake).
        bisect: After the first out-of-memory, halve the bracket ``(largest_fit, first_oom)``
            until it is one wide (:attr:`Sweep.exact`) or the time is spent.

    Returns:
        A :class:`Sweep`: the largest size that fits lies in ``[largest_fit, first_oom)``.
    """
    check_int("start", start, 1)
    check_int("known_fit", known_fit, 0, below=start, context=f"(below start={start})")
    tries: list[SweepTry] = []

    def attempt(size: int) -> str | None:
        """``fits``, ``oom``, ``error``, or None when the time left would not cover a try."""
        longest = max((t.seconds for t in tries), default=0.0)
        if time_left_s is not None and time_left_s() <= 1.5 * longest:
            return None
        begin = clock()
        try:
            try_size(size)
        except Exception as err:  # noqa: BLE001 - classified, recorded and reported
            detail = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
            outcome = "oom" if is_cuda_oom(err) else "error"
            tries.append(SweepTry(size, outcome, clock() - begin, detail))
            return outcome
        tries.append(SweepTry(size, "fits", clock() - begin))
        return "fits"

    size, largest = start, known_fit
    while True:
        if size > max_micro_batch:
            return Sweep(largest, None, "limit", tries)
        outcome = attempt(size)
        if outcome is None:
            return Sweep(largest, None, "budget", tries)
        if outcome == "error":
            return Sweep(largest, None, "error", tries)
        if outcome == "oom":
            break
        largest, size = size, size * 2
    first_oom = size
    while bisect and first_oom - largest > 1:
        mid = (largest + first_oom) // 2
        outcome = attempt(mid)
        if outcome is None or outcome == "error":
            break
        if outcome == "fits":
            largest = mid
        else:
            first_oom = mid
    return Sweep(largest, first_oom, "oom", tries)


def sweep_peak_bytes(config: Mapping[str, Any], world_size: int, micro_batch: int, *, reserved: bool = False,
                     root_reshard_after_forward: bool = False) -> int:
    """The memory model's peak per rank, in bytes, of an ``fsdp_train`` run of the micro-batch
    sweep (:data:`SWEEP_CONFIG`, or a result set's ``max_micro_batch.config``) at ``micro_batch``
    sequences per rank: the allocated peak, or with ``reserved`` the caching allocator's reserve
    on top (:func:`handbook_lib.models.allocator.reserved_bytes`). ``root_reshard_after_forward``:
    the run resharded its root after forward (sets measured before the runs kept FSDP2's
    default, :func:`handbook_lib.face.gpu_results.root_resharded`)."""
    from handbook_lib.models import estimate_memory, reserved_bytes

    model = ModelConfig(**{k: config[k] for k in ModelConfig.__dataclass_fields__ if k in config})
    peak = estimate_memory(model, world_size, config["strategy"], config["precision"], "adamw",
                           micro_batch=micro_batch, seq_len=config["seq_len"], units=wrap_units(model, "layer"),
                           backend="nccl", root_reshard_after_forward=root_reshard_after_forward).peak
    return reserved_bytes(peak) if reserved else peak


def predict_max_micro_batch(peak_bytes: Callable[[int], int], capacity_bytes: int, limit: int = 1 << 20) -> int:
    """The largest micro-batch whose predicted peak fits in ``capacity_bytes`` (0: not even 1).

    ``peak_bytes(m)`` must not decrease with ``m`` (a memory model's peak does not); it is
    searched by doubling, then bisection, up to ``limit``.
    """
    if peak_bytes(1) > capacity_bytes:
        return 0
    low = 1
    while low * 2 <= limit and peak_bytes(low * 2) <= capacity_bytes:
        low *= 2
    high = min(low * 2, limit + 1)  # first size known (or assumed, at the limit) not to fit
    while high - low > 1:
        mid = (low + high) // 2
        if peak_bytes(mid) <= capacity_bytes:
            low = mid
        else:
            high = mid
    return low
