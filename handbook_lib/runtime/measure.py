"""Read what a rank really holds: bytes of parameter shards, gradients, optimizer state, peak.

Chapter 1 introduces it; chapter 2 adds the step's peak and activations (:class:`StepMemoryTracker`);
:mod:`handbook_lib.runtime.collectives` counts a step's collectives. After ``fully_shard``, every
parameter is a ``DTensor``; its local
tensor is this rank's shard. Counting those local tensors' bytes is a measurement of the run,
independent of the memory model's arithmetic, which is why the two can be compared.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from handbook_lib.core.checks import check_int

__all__ = [
    "ParamBytes",
    "local_tensor",
    "nbytes",
    "measure_param_bytes",
    "measure_grad_bytes",
    "measure_optimizer_bytes",
    "smallest_soon",
    "measure_fsdp_units",
    "DeviceMemory",
    "measure_device_memory",
    "UNTRACKED_WORDS",
    "StepMemory",
    "StepMemoryTracker",
    "NewBytesPeak",
    "measure_cpu_adam",
]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor, or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (numel × element size), not of its storage."""
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class ParamBytes:
    """Measured bytes of one rank's parameters."""

    shard_bytes: int
    """Bytes of the parameter values this rank holds (sum of local tensors)."""
    storage_bytes: int
    """Bytes of the storage behind them: FSDP pads each shard to equal size on every rank."""

    @property
    def padding_bytes(self) -> int:
        """``storage_bytes - shard_bytes``: the padding FSDP allocated on this rank."""
        return self.storage_bytes - self.shard_bytes


def measure_param_bytes(module: nn.Module) -> ParamBytes:
    """Measure the bytes of ``module``'s parameters held by this rank.

    FSDP2 keeps each parameter's shard in its own padded buffer and exposes the unpadded rows as
    the DTensor's local tensor (a view of that buffer), so the buffer's size reveals the padding.
    FSDP1 (``use_orig_params=False``) exposes one ``FlatParameter`` per unit instead: its local
    shard includes the padding, whose size it records (``_shard_numel_padded``). For a plain
    (unsharded) module both numbers are the full parameter bytes.
    """
    shard = storage = 0
    for p in module.parameters():
        local = local_tensor(p)
        padding = getattr(p, "_shard_numel_padded", None)
        if padding is not None:  # FSDP1's FlatParameter: one unit's shard, padded at its end
            shard += (local.numel() - padding) * local.element_size()
            storage += nbytes(local)
            continue
        shard += nbytes(local)
        # an empty shard still has its padded buffer: FSDP2 gives every rank one as large as
        # rank 0's (a first dimension of 1 row on 2 ranks: rank 1 holds none and pads one)
        storage += local.untyped_storage().nbytes()
    return ParamBytes(shard_bytes=shard, storage_bytes=storage)


def measure_grad_bytes(module: nn.Module) -> int:
    """Bytes of the gradients this rank holds for ``module`` (0 for parameters without one)."""
    return sum(nbytes(local_tensor(p.grad)) for p in module.parameters() if p.grad is not None)


def measure_optimizer_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Bytes of optimizer state on this rank.

    Returns:
        ``(sharded, other)``: bytes of state tensors with one element per parameter element
        (Adam's two moments, SGD's momentum buffer: DTensors sharded like the parameters), and
        bytes of all other state tensors (Adam's per-parameter ``step`` scalars, replicated).
    """
    sharded = other = 0
    for param, state in optimizer.state.items():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            local = local_tensor(value)
            if value.shape == param.shape:
                sharded += nbytes(local)
            else:
                other += nbytes(local)
    return sharded, other


def measure_fsdp_units(model: nn.Module) -> list[str]:
    """Names of the FSDP units that hold parameters, as the wrapped model reports them
    (``root`` for the outermost), in module order; ``[]`` for a model FSDP did not wrap.

    FSDP2: modules ``fully_shard`` was applied to that manage a parameter group; FSDP1: the
    ``FullyShardedDataParallel`` instances that own a ``FlatParameter``.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    names = []
    for name, module in model.named_modules():
        if isinstance(module, FSDP1):
            holds = module._flat_param is not None
        elif isinstance(module, FSDPModule):
            holds = module._get_fsdp_state()._fsdp_param_group is not None
        else:
            continue
        if holds:
            parts = [p for p in name.split(".") if p not in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")]
            names.append(".".join(parts) or "root")
    return names


def smallest_soon(read: Callable[[], int], readings: int = 11, pause_s: float = 0.003) -> int:
    """The smallest of ``readings`` values of ``read()``, ``pause_s`` apart (about 30 ms): bytes
    alive while nothing is allocated can only fall as the backend's thread frees a finished
    collective's buffers, so the smallest is what the step itself holds."""
    values = [read()]
    for _ in range(readings - 1):
        time.sleep(pause_s)
        values.append(read())
    return min(values)


@dataclass(frozen=True)
class DeviceMemory:
    """A rank's GPU memory at one moment, as the CUDA driver and PyTorch's caching allocator
    report it, bytes."""

    free_bytes: int
    """``torch.cuda.mem_get_info()[0]``: memory no process holds (the driver's count)."""
    total_bytes: int
    """``torch.cuda.mem_get_info()[1]``: the device's memory, as ``total_memory`` says."""
    reserved_bytes: int
    """``torch.cuda.memory_reserved()``: the caching allocator's segments, in use or cached."""

    @property
    def usable_bytes(self) -> int:
        """What this process's tensors can still grow into: ``free + reserved``."""
        return self.free_bytes + self.reserved_bytes

    @property
    def outside_allocator_bytes(self) -> int:
        """``total - free - reserved``: the CUDA context, NCCL's buffers and communicators,
        library handles and any other process on the GPU (no tensor of PyTorch's)."""
        return self.total_bytes - self.usable_bytes


def measure_device_memory(device: torch.device) -> DeviceMemory | None:
    """:class:`DeviceMemory` of ``device`` now (``None`` for a CPU device)."""
    return _device_memory_now(device) if device.type == "cuda" else None


def _device_memory_now(device: torch.device) -> DeviceMemory:
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(int(free), int(total), int(torch.cuda.memory_reserved(device)))


UNTRACKED_WORDS = ("cuBLAS/cuBLASLt workspaces and the caching allocator's 512-B block rounding: "
                   "allocated through the allocator, unseen by the memory tracker (not a prefetched unit)")
"""What ``torch.cuda.max_memory_allocated`` holds beyond the memory tracker's peak, in words."""


@dataclass(frozen=True)
class StepMemory:
    """Memory measured over one training step on one rank."""

    peak_bytes: int
    """Peak bytes of live tensors on the rank's device during the step."""
    activation_bytes: int
    """Bytes of tensors created by the forward pass and still alive when it returns."""
    peak_breakdown: dict[str, int]
    """The tracker's categories at the peak (bytes), e.g. ``Sharded Param``, ``Activation``."""
    allocator_peak_bytes: int | None = None
    """On CUDA: ``torch.cuda.max_memory_allocated`` over the step (``None`` on CPU)."""
    allocator_reserved_bytes: int | None = None
    """On CUDA: ``torch.cuda.max_memory_reserved`` over the step, the caching allocator's
    segments (what ``nvidia-smi`` shows less the CUDA context; ``None`` on CPU)."""
    held_between_micro_steps: int | None = None
    """With gradient accumulation: bytes alive after the first micro-step's backward beyond
    those alive when the step began (the unsharded gradients kept until the last micro-step
    reduces them); ``None`` without accumulation."""
    tracked_at_enter_bytes: int | None = None
    """Bytes the tracker saw alive as the step began (the state at rest)."""
    allocator_at_enter_bytes: int | None = None
    """On CUDA: ``torch.cuda.memory_allocated`` as the step began (``None`` on CPU)."""
    device_memory: DeviceMemory | None = None
    """On CUDA: the GPU's memory as the step began, after the run's earlier steps and their
    collectives (:func:`measure_device_memory`; ``None`` on CPU)."""
    optimizer_temporary_bytes: int | None = None
    """The most bytes the optimizer step allocated beyond what it updates in place
    (:class:`NewBytesPeak` around ``optimizer.step()``; ``None`` if the step did not run, as
    when a gradient scaler skips it)."""

    @property
    def tracker_step_bytes(self) -> int | None:
        """The step's rise as the tracker sees it: ``peak - tracked at the start``."""
        return None if self.tracked_at_enter_bytes is None else self.peak_bytes - self.tracked_at_enter_bytes

    @property
    def allocator_step_bytes(self) -> int | None:
        """The step's rise as the allocator sees it: ``max_memory_allocated - memory_allocated``
        at the start (CUDA; ``None`` on CPU)."""
        if self.allocator_peak_bytes is None or self.allocator_at_enter_bytes is None:
            return None
        return self.allocator_peak_bytes - self.allocator_at_enter_bytes

    def allocator_metrics(self) -> dict[str, object]:
        """The CUDA readings as a rank's result keys (empty on CPU): the allocator's peaks, its
        and the tracker's counts as the step began and their rises over it, and the GPU's
        free, reserved and total bytes then. ``untracked_*`` is the allocator's excess over the
        tracker (:data:`UNTRACKED_WORDS`), as the step began and over the step."""
        if self.allocator_peak_bytes is None:
            return {}
        out: dict[str, object] = {"allocator_peak_bytes": self.allocator_peak_bytes,
                                  "allocator_reserved_bytes": self.allocator_reserved_bytes,
                                  "allocator_at_enter_bytes": self.allocator_at_enter_bytes,
                                  "tracked_at_enter_bytes": self.tracked_at_enter_bytes,
                                  "allocator_step_bytes": self.allocator_step_bytes,
                                  "tracker_step_bytes": self.tracker_step_bytes}
        if (self.allocator_at_enter_bytes is not None and self.tracked_at_enter_bytes is not None
                and self.allocator_step_bytes is not None and self.tracker_step_bytes is not None):
            out["untracked_at_enter_bytes"] = self.allocator_at_enter_bytes - self.tracked_at_enter_bytes
            out["untracked_step_bytes"] = self.allocator_step_bytes - self.tracker_step_bytes
            out["untracked_what"] = UNTRACKED_WORDS
        if self.device_memory is not None:
            out.update(device_free_bytes=self.device_memory.free_bytes,
                       device_reserved_bytes=self.device_memory.reserved_bytes,
                       device_total_bytes=self.device_memory.total_bytes)
        return out


def _storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages behind ``t``: its own, or a wrapper subclass's inner tensors' (a DTensor's
    local shard)."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
    else:
        yield t.untyped_storage()


class NewBytesPeak(TorchDispatchMode):
    """The peak of bytes allocated by the operators run under it and still alive, ``peak``.

    An operator's output storage counts when it is none of its inputs' (an in-place update or a
    view allocates nothing) and the mode has not seen it; it stops counting when Python frees
    it. What existed before (parameters, gradients, optimizer states) is never counted, so
    around ``optimizer.step()`` this measures the step's temporaries, independently of the
    memory model that predicts them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _freed(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {st.data_ptr() for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)
                  for st in _storages(a)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            for st in _storages(t):
                key, size = st.data_ptr(), st.nbytes()
                if size and key not in inputs and key not in self._seen:
                    self._seen.add(key)
                    self.live += size
                    weakref.finalize(st, self._freed, key, size)
        self.peak = max(self.peak, self.live)
        return out


class StepMemoryTracker:
    """Measure one training step's memory with PyTorch's memory trackers.

    ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` follows every tensor's storage
    and files it under a category (sharded or unsharded parameter, gradient, activation,
    all-gather or reduce-scatter buffer, optimizer state, temporary); for a DDP (or plain) model
    its parent ``MemTracker`` does the same with fewer categories. It works on CPU and GPU
    alike; on CUDA the caching allocator's own peak is reported too, as a cross-check, with
    ``memory_allocated`` and the GPU's free memory (``mem_get_info``) as the step begins, so
    that the allocator's rise over the step (``max_memory_allocated - memory_allocated`` at
    the start) stands beside the tracker's (``peak - tracked at the start``); their difference
    is what the tracker cannot see (:data:`UNTRACKED_WORDS`).

    Usage (the training loop calls :meth:`after_forward` once the loss is computed)::

        tracker = StepMemoryTracker(model, optimizer, device)
        with tracker:
            loss = model(x)...; tracker.after_forward(); loss.backward(); optimizer.step()
        tracker.result
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            self._tracker = FSDPMemTracker(model, optimizer)
        else:  # DDP or a plain module: the generic tracker, told what to watch
            self._tracker = MemTracker()
            # DDP's gradient buckets exist since the wrap; recorded by the parallelize step's
            # comm hook during the previous step (none before the first backward)
            buckets = list(getattr(model, "ddp_bucket_buffers", {}).values())
            self._tracker.track_external(model, optimizer, *buckets)
        self._device = device
        self._cuda = device.type == "cuda"
        self._optimizer = optimizer
        self._in_step: NewBytesPeak | None = None
        self._step_peak: int | None = None
        self._activations = 0
        self._start: int | None = None
        self._between: int | None = None
        self.result: StepMemory | None = None

    def _current_total(self) -> int:
        snap = self._tracker.get_tracker_snapshot("current").get(self._device, {})
        return int(sum(v for k, v in snap.items() if str(getattr(k, "value", k)) != "Total"))

    def mark_start(self) -> None:
        """Record the bytes alive as the step begins (gradient accumulation: before micro-step 1)."""
        self._start = self._current_total()

    def mark_between_micro_steps(self) -> None:
        """Record the bytes alive after the first micro-step's backward.

        A collective that has completed can still hold its buffer for a moment: gloo's worker
        thread releases a finished work's tensors just after waking the caller, and under load
        that thread may not have run yet (one CI run measured the root's reduce-scatter input,
        517,032 B, between the micro-steps of a run that reduce-scatters each one). Nothing is
        allocated while the loop waits here, so the bytes alive can only fall: the smallest of
        a few readings over about 30 ms is what the step itself holds.
        """
        self._between = smallest_soon(self._current_total)

    def next_micro_step(self) -> None:
        """Let the next forward of the same modules be tracked (gradient accumulation): the
        trackers follow one forward per module, so their per-module records are cleared; the
        step's peak and the tensors alive are kept."""
        self._tracker.reset_mod_stats()

    def __enter__(self) -> StepMemoryTracker:
        self._allocated_at_enter = self._memory = None
        if self._cuda:
            torch.cuda.synchronize(self._device)
            torch.cuda.reset_peak_memory_stats(self._device)
            self._allocated_at_enter = int(torch.cuda.memory_allocated(self._device))
            self._memory = _device_memory_now(self._device)
        self._tracker.__enter__()
        self._tracked_at_enter = self._current_total()
        self._hooks = (self._optimizer.register_step_pre_hook(self._step_begins),
                       self._optimizer.register_step_post_hook(self._step_ends))
        return self

    def _step_begins(self, *_: object) -> None:
        self._in_step = NewBytesPeak()
        self._in_step.__enter__()

    def _step_ends(self, *_: object) -> None:
        if self._in_step is not None:
            self._in_step.__exit__(None, None, None)
            self._step_peak, self._in_step = self._in_step.peak, None

    def _current_activations(self) -> int:
        snap = self._tracker.get_tracker_snapshot("current").get(self._device, {})
        return int(sum(v for k, v in snap.items() if str(getattr(k, "value", k)) == "Activation"))

    def after_forward(self, settle: bool = False) -> None:
        """Record the bytes of activations alive now (call after the loss is computed).

        ``settle``: the smallest of a few readings over about 30 ms instead, for a loss whose
        collectives run inside DTensor's dispatch (chapter 9's ``loss_parallel``): gloo's worker
        thread may still hold a finished one's buffer (64 B in the tests, filed as an
        activation) when the loss returns (see :meth:`mark_between_micro_steps`)."""
        self._activations = smallest_soon(self._current_activations) if settle else self._current_activations()

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        if self._in_step is not None:  # the step raised: its mode is still entered
            self._in_step.__exit__(*exc)
            self._in_step = None
        self._tracker.__exit__(*exc)
        peak = self._tracker.get_tracker_snapshot("peak").get(self._device, {})
        breakdown = {str(getattr(k, "value", k)): int(v) for k, v in peak.items() if v}
        allocator = reserved = None
        if self._cuda:
            torch.cuda.synchronize(self._device)
            allocator = int(torch.cuda.max_memory_allocated(self._device))
            reserved = int(torch.cuda.max_memory_reserved(self._device))
        self.result = StepMemory(
            peak_bytes=breakdown.pop("Total", 0),
            activation_bytes=self._activations,
            peak_breakdown=breakdown,
            allocator_peak_bytes=allocator,
            allocator_reserved_bytes=reserved,
            held_between_micro_steps=(self._between - self._start
                                      if self._start is not None and self._between is not None else None),
            tracked_at_enter_bytes=self._tracked_at_enter,
            allocator_at_enter_bytes=self._allocated_at_enter,
            device_memory=self._memory,
            optimizer_temporary_bytes=self._step_peak,
        )


def measure_cpu_adam(numel: int = 2**24, *, tensors: int = 16, threads: int = 1, repeats: int = 5,
                     fused: bool = False) -> float:
    """fp32 parameters per second that ``torch.optim.AdamW`` steps on this CPU: the offloaded
    optimizer step's speed (:data:`handbook_lib.models.offload.CPU_ADAM_PARAMS_PER_S_PER_CORE`).

    Times ``repeats`` steps over ``numel`` parameters in ``tensors`` equal tensors, every one with
    a gradient, after one warm-up step that creates Adam's moments, on ``threads`` intra-op
    threads, and returns ``numel / fastest step``. Changes torch's thread count for the call
    and restores it.

    Args:
        numel: Parameters in all, a multiple of ``tensors``.
        tensors: How many tensors they come in (a model's are many).
        threads: Intra-op threads (cores) the step may use.
        repeats: Timed steps; the fastest counts.
        fused: AdamW's fused CPU kernel instead of its default for-loop implementation.

    Raises:
        ValueError: for a count < 1 or ``numel`` not a multiple of ``tensors``.
    """
    for name, value in (("numel", numel), ("tensors", tensors), ("threads", threads), ("repeats", repeats)):
        check_int(name, value, 1)
    if numel % tensors:
        raise ValueError(f"numel={numel} must be a multiple of tensors={tensors}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(numel // tensors, generator=gen)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt = torch.optim.AdamW(params, lr=1e-3, **({"fused": True} if fused else {}))
        opt.step()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            opt.step()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return numel / best
