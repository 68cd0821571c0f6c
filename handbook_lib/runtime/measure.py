"""Read what a rank really holds: bytes of parameter shards, gradients, optimizer state, peak.

Chapter 1 introduces it; chapter 2 adds the step's peak and activations (:class:`StepMemoryTracker`),
chapter 3 the collectives of a step (:class:`CollectiveCounter`). After ``fully_shard``, every parameter is a ``DTensor``; its local
tensor is this rank's shard. Counting those local tensors' bytes is a measurement of the run,
independent of the memory model's arithmetic, which is why the two can be compared.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from handbook_lib.core.checks import check_int
from handbook_lib.core.config import DTYPES
from handbook_lib.models.collectives import estimate_collective

__all__ = [
    "ParamBytes",
    "local_tensor",
    "measure_param_bytes",
    "measure_grad_bytes",
    "measure_optimizer_bytes",
    "measure_fsdp_units",
    "StepMemory",
    "StepMemoryTracker",
    "CollectiveCall",
    "CollectiveCounter",
    "collective_totals",
    "tensors_in",
    "measure_cpu_adam",
]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor, or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
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
            storage += _nbytes(local)
            continue
        shard += _nbytes(local)
        storage += local.untyped_storage().nbytes() if local.numel() else 0
    return ParamBytes(shard_bytes=shard, storage_bytes=storage)


def measure_grad_bytes(module: nn.Module) -> int:
    """Bytes of the gradients this rank holds for ``module`` (0 for parameters without one)."""
    return sum(_nbytes(local_tensor(p.grad)) for p in module.parameters() if p.grad is not None)


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
                sharded += _nbytes(local)
            else:
                other += _nbytes(local)
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


class StepMemoryTracker:
    """Measure one training step's memory with PyTorch's memory trackers.

    ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` follows every tensor's storage
    and files it under a category (sharded or unsharded parameter, gradient, activation,
    all-gather or reduce-scatter buffer, optimizer state, temporary); for a DDP (or plain) model
    its parent ``MemTracker`` does the same with fewer categories. It works on CPU and GPU
    alike; on CUDA the caching allocator's own peak is reported too, as a cross-check.

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
        readings = [self._current_total()]
        for _ in range(10):
            time.sleep(0.003)
            readings.append(self._current_total())
        self._between = min(readings)

    def next_micro_step(self) -> None:
        """Let the next forward of the same modules be tracked (gradient accumulation): the
        trackers follow one forward per module, so their per-module records are cleared; the
        step's peak and the tensors alive are kept."""
        self._tracker.reset_mod_stats()

    def __enter__(self) -> StepMemoryTracker:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            torch.cuda.reset_peak_memory_stats(self._device)
        self._tracker.__enter__()
        return self

    def after_forward(self) -> None:
        """Record the bytes of activations alive now (call after the loss is computed)."""
        snap = self._tracker.get_tracker_snapshot("current").get(self._device, {})
        self._activations = int(sum(v for k, v in snap.items() if str(getattr(k, "value", k)) == "Activation"))

    def __exit__(self, *exc: object) -> None:
        self._tracker.__exit__(*exc)
        peak = self._tracker.get_tracker_snapshot("peak").get(self._device, {})
        breakdown = {str(getattr(k, "value", k)): int(v) for k, v in peak.items() if v}
        allocator = reserved = None
        if self._device.type == "cuda":
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
        )


@dataclass(frozen=True)
class CollectiveCall:
    """One collective a rank issued, as the dispatcher saw it."""

    kind: str
    """One of :data:`handbook_lib.models.collectives.TRANSFER_KINDS`: ``all_gather``,
    ``reduce_scatter``, ``all_reduce``, ``broadcast``, ``all_to_all``, ``send`` or ``recv``."""
    dtype: str
    """Element type, e.g. ``fp32``."""
    buffer_bytes: int
    """The full buffer: all-gather output, reduce-scatter input, all-reduce/broadcast tensor."""
    group_size: int
    """Ranks in the process group it ran on."""
    unit: str | None = None
    """The FSDP2 unit it serves (``root`` for the outermost), as :func:`measure_fsdp_units`
    names it: the unit whose parameters an all-gather gathers (prefetched or not) or whose
    gradients a reduce-scatter reduces. ``None`` outside FSDP2 (DDP, FSDP1, other callers)."""
    phase: str | None = None
    """``forward``, ``backward`` (issued while autograd runs the backward pass: FSDP's hooks,
    prefetches and its final callback) or ``optimizer`` (after the backward pass)."""
    start_s: float | None = None
    """When it was issued, seconds after the counter was entered (the step's start)."""
    end_s: float | None = None
    """When it completed, seconds after the same origin: recorded only by a counter made with
    ``record_ends=True``, on CPU (gloo); ``None`` otherwise (on CUDA that needs the stream's
    events)."""


_DTYPE_NAMES = {getattr(torch, d.torch_name): name for name, d in DTYPES.items()}
"""``torch.dtype`` → the book's short name: :data:`handbook_lib.core.config.DTYPES` read backwards."""


def tensors_in(value: object) -> list[torch.Tensor]:
    """Every tensor in ``value``: a tensor, or lists, tuples and dicts of them, nested (a
    collective's arguments; an optimizer's buffers)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []


def _group_size(args: tuple) -> int:
    """Size of the process group among a ``c10d`` operator's arguments (boxed as ScriptObjects)."""
    from torch.distributed.distributed_c10d import ProcessGroup

    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return int(ProcessGroup.unbox(arg).size())
            except (RuntimeError, TypeError):
                continue  # another boxed argument, e.g. the reduce op
    raise RuntimeError("no process group among the collective's arguments")


def _functional_group_size(args: tuple) -> int:
    """Size of the process group a functional collective names: its last string argument (the
    group's registered name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    name = next(arg for arg in reversed(args) if isinstance(arg, str))
    return int(_resolve_process_group(name).size())


def _fsdp2_unit() -> str | None:
    """Name of the FSDP2 unit whose parameter group is issuing a collective now, read from the
    call stack: FSDP2 issues its all-gathers in ``FSDPParamGroup.unshard`` (also when another
    unit prefetches it) and its reduce-scatters in ``FSDPParamGroup.post_backward``, so the
    nearest frame of a parameter group's method names the unit, prefetching included."""
    import sys

    try:  # a private module: if a torch release moves it, units go unnamed, nothing breaks
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        return None

    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if isinstance(owner, FSDPParamGroup):
            parts = [p for p in (owner._module_fqn or "").split(".") if p != "_checkpoint_wrapped_module"]
            return ".".join(parts) or "root"
        frame = frame.f_back
    return None


class CollectiveCounter(TorchDispatchMode):
    """Record every collective issued while active: kind, dtype, buffer bytes, group size, the
    FSDP2 unit it serves, the phase of the step, and when it was issued (seconds since
    ``__enter__``).

    With ``record_ends=True`` it also records when each gloo collective finished, through a
    completion callback on the collective's future (gloo's reduce-scatter exposes none). Off by
    default: that callback runs Python on gloo's thread, and until it has run, the collective's
    buffers stay alive; on a busy machine that can be after a memory measurement, which then
    counts them (the training runs check bytes exactly, so they leave it off).

    ``torch.distributed``'s collectives go through the dispatcher as ``c10d`` operators
    (``c10d._allgather_base_``, ``c10d._reduce_scatter_base_``, ``c10d.allreduce_``,
    ``c10d.alltoall_base_``, ``c10d.send``, ``c10d.recv_``, ...), on gloo and NCCL alike, and
    tensor parallelism's through their functional twins (``_c10d_functional.all_reduce``,
    ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``); this mode
    reads their tensor arguments. It does not see collectives a
    DTensor issues inside its own dispatch (e.g. FSDP2's gradient scaler reducing its inf flag):
    a dispatch mode is switched off while it handles an operator. What it records is the logical
    collective; how many bytes each rank then puts on the wire depends on the algorithm (the ring
    model of chapter 3 says ``(N-1)/N`` of the buffer), and gloo on CPU even runs FSDP's
    reduce-scatter as an all-reduce.
    """

    # c10d op name -> (kind, index of the argument holding the full buffer)
    _OPS = {
        "_allgather_base_": ("all_gather", 0),
        "allgather_into_tensor_coalesced_": ("all_gather", 0),
        "allgather_": ("all_gather", 0),
        "_reduce_scatter_base_": ("reduce_scatter", 1),
        "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
        "reduce_scatter_": ("reduce_scatter", 1),
        "allreduce_": ("all_reduce", 0),
        "allreduce_coalesced_": ("all_reduce", 0),
        "broadcast_": ("broadcast", 0),
        "alltoall_base_": ("all_to_all", 1),
        "send": ("send", 0),
        "recv_": ("recv", 0),
    }
    # functional op name (``_c10d_functional``, the ops DTensor and tensor parallelism issue)
    # -> (kind, index of the input); an all-gather's full buffer is its input times the group
    _FUNCTIONAL_OPS = {
        "all_reduce": ("all_reduce", 0),
        "all_reduce_coalesced": ("all_reduce", 0),
        "all_gather_into_tensor": ("all_gather", 0),
        "all_gather_into_tensor_coalesced": ("all_gather", 0),
        "reduce_scatter_tensor": ("reduce_scatter", 0),
        "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
        "all_to_all_single": ("all_to_all", 0),
        "broadcast": ("broadcast", 0),
    }
    _FUNCTIONAL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")

    def __init__(self, record_ends: bool = False) -> None:
        super().__init__()
        self.record_ends = record_ends
        self._calls: list[CollectiveCall] = []
        self._ends: dict[int, float] = {}
        self._done: list = []  # futures done once an end time is recorded
        self._t0 = time.perf_counter()
        self._backward_seen = False

    def __enter__(self) -> CollectiveCounter:
        self._t0 = time.perf_counter()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        # The step has waited for its collectives, but a completion callback may still be running
        # on the backend's thread: give the callbacks a moment (never block on a collective).
        deadline = time.perf_counter() + 1.0
        while not all(f.done() for f in self._done) and time.perf_counter() < deadline:
            time.sleep(0.001)

    @property
    def calls(self) -> list[CollectiveCall]:
        """The collectives recorded, in the order they were issued, with their end times."""
        return [replace(c, end_s=self._ends.get(i)) for i, c in enumerate(self._calls)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        functional = func.namespace in self._FUNCTIONAL_NAMESPACES and func._opname in self._FUNCTIONAL_OPS
        if not (functional or (func.namespace == "c10d" and func._opname in self._OPS)):
            return func(*args, **(kwargs or {}))
        kind, buffer_arg = (self._FUNCTIONAL_OPS if functional else self._OPS)[func._opname]
        buffers = tensors_in(args[buffer_arg])
        group = _functional_group_size(args) if functional else _group_size(args)
        scale = group if functional and kind == "all_gather" else 1
        index = len(self._calls)
        self._calls.append(CollectiveCall(
            kind=kind,
            dtype=_DTYPE_NAMES.get(buffers[0].dtype, str(buffers[0].dtype)),
            buffer_bytes=scale * sum(_nbytes(t) for t in buffers),
            group_size=group,
            unit=_fsdp2_unit(),
            phase=self._phase(),
            start_s=time.perf_counter() - self._t0,
        ))
        out = func(*args, **(kwargs or {}))
        if self.record_ends and buffers[0].device.type == "cpu":
            self._watch(out, index)
        return out

    def _phase(self) -> str:
        if torch._C._current_graph_task_id() != -1:  # inside autograd's backward pass
            self._backward_seen = True
            return "backward"
        return "optimizer" if self._backward_seen else "forward"

    def _watch(self, out: object, index: int) -> None:
        """Record the end of call ``index`` when the ``Work`` among ``out`` completes."""
        from torch.distributed.distributed_c10d import Work

        for item in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(item, torch.ScriptObject):
                try:
                    future = Work.unbox(item).get_future()
                except (RuntimeError, TypeError, AttributeError):
                    continue

                def finished(_, index=index) -> None:
                    self._ends[index] = time.perf_counter() - self._t0

                self._done.append(future.then(finished))
                return

    def totals(self) -> dict[str, dict[str, int]]:
        """:func:`collective_totals` of the calls recorded."""
        return collective_totals(self.calls)


def collective_totals(calls: Iterable[CollectiveCall]) -> dict[str, dict[str, int]]:
    """Per kind: ``count`` of calls, ``buffer_bytes`` summed, and ``sent_bytes``, what one rank
    sends in them by the ring model (:func:`handbook_lib.models.collectives.estimate_collective`)."""
    out: dict[str, dict[str, int]] = {}
    for call in calls:
        entry = out.setdefault(call.kind, {"count": 0, "buffer_bytes": 0, "sent_bytes": 0})
        entry["count"] += 1
        entry["buffer_bytes"] += call.buffer_bytes
        entry["sent_bytes"] += estimate_collective(call.kind, call.buffer_bytes, call.group_size).sent_bytes
    return out


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
