"""Count the collectives a rank issues: kind, dtype, buffer bytes, group, FSDP2 unit, phase, time.

Chapter 3 introduces it (:class:`CollectiveCounter` under a training step); chapter 9 adds the
functional collectives of tensor parallelism and the all-to-alls and point-to-point transfers of
sequence parallelism. What it records is compared, call by call, with
:mod:`handbook_lib.models.traffic` and the chapter-9 models.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from types import FrameType
from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from handbook_lib.core.config import DTYPES
from handbook_lib.models.collectives import estimate_collective
from handbook_lib.runtime.measure import nbytes

__all__ = ["CollectiveCall", "CollectiveCounter", "collective_totals", "tensors_in"]


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
    """When the host issued it, seconds after the counter was entered (the step's start). On
    CPU ranks (gloo) that is when it began; on CUDA it is only the issue time: NCCL runs the
    collective later, on its own stream, so these times give the order, not the overlap (a
    profiler trace gives that)."""
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

    frame: FrameType | None = sys._getframe(2)
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
    reads their tensor arguments. The functional ones are recorded only with
    ``functional=True`` (chapter 9's runs): FSDP2's gradient clipping also issues them (one
    8-byte all-reduce per gradient's norm), which the FSDP traffic model of chapter 3 leaves out.
    It does not see collectives a DTensor issues inside its own dispatch (e.g. FSDP2's gradient
    scaler reducing its inf flag): a dispatch mode is switched off while it handles an operator.
    What it records is the logical collective; how many bytes each rank then puts on the wire
    depends on the algorithm (the ring model of chapter 3 says ``(N-1)/N`` of the buffer), and
    gloo on CPU even runs FSDP's reduce-scatter as an all-reduce.
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

    def __init__(self, record_ends: bool = False, functional: bool = False) -> None:
        super().__init__()
        self.record_ends = record_ends
        self.functional = functional
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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        functional = (self.functional and func.namespace in self._FUNCTIONAL_NAMESPACES
                      and func._opname in self._FUNCTIONAL_OPS)
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
            buffer_bytes=scale * sum(nbytes(t) for t in buffers),
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
