"""A small storage tracker for the byte checks: the bytes of the storages that ops create,
each rounded as a device's allocator would round it, sampled after every op.

It subclasses torch's ``TorchDispatchMode`` (``torch.utils._python_dispatch``), the extension
point torch's own ``MemTracker`` is built on, and patches nothing. Inside ``with tracker:``
every op's output storages are recorded by weak reference, once per storage (views share
theirs), with any tensors handed to :meth:`StorageTracker.track`. A storage counts while it
is alive, at its size when sampled: ``UntypedStorage.resize_`` (FSDP2 frees and refills its
all-gather buffers with it) does not go through the dispatcher, so every sample re-reads each
storage's ``nbytes()`` rather than remembering the size it was recorded at. A sample is taken
on entry and after every op that is not run under a fake-tensor mode newer than the tracker's
(DTensor works out output shapes under one), as ``MemTracker`` samples; ops on DTensors are
declined (``NotImplemented``), so DTensor runs them as ops on its local tensors, which are
seen and recorded instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch._guards import active_fake_mode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages under ``t``: its own, or those of a wrapper subclass's inner tensors."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, name) for name in names)
        return [st for x in inner if isinstance(x, torch.Tensor) for st in _storages(x)]
    return [t.untyped_storage()]


class StorageTracker(TorchDispatchMode):
    """Live storages per device, each counted as ``rounded(nbytes)``; ``peak`` over samples."""

    def __init__(self, rounded: Callable[[int], int] = lambda n: n) -> None:
        super().__init__()
        self._rounded = rounded
        # id(storage) -> weak reference to it; the entry goes when the storage does
        self._live: dict[int, weakref.ref] = {}
        self._peak: dict[torch.device, int] = {}
        self._fake_on_entry = None

    def track(self, *tensors: torch.Tensor) -> None:
        """Count these tensors' storages too (tensors made before the tracker was entered)."""
        for t in tensors:
            self._record(t)

    def _record(self, t: torch.Tensor) -> None:
        for st in _storages(t):
            key = id(st)
            if key not in self._live:
                self._live[key] = weakref.ref(st, lambda _, key=key: self._live.pop(key, None))

    def _totals(self) -> dict[torch.device, int]:
        totals: dict[torch.device, int] = {}
        for ref in list(self._live.values()):
            st = ref()
            if st is not None:
                totals[st.device] = totals.get(st.device, 0) + self._rounded(st.nbytes())
        return totals

    def _sample(self) -> None:
        for device, total in self._totals().items():
            self._peak[device] = max(self._peak.get(device, 0), total)

    def current(self, device: str | torch.device) -> int:
        """The rounded bytes of the storages on ``device`` alive now, at their present sizes."""
        return self._totals().get(torch.device(device), 0)

    def peak(self, device: str | torch.device) -> int:
        """The largest total on ``device`` over the samples taken so far."""
        return self._peak.get(torch.device(device), 0)

    def __enter__(self) -> StorageTracker:
        self._fake_on_entry = active_fake_mode()
        self._sample()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if active_fake_mode() is self._fake_on_entry:
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self._record(leaf)
            self._sample()
        return out


def saved_bytes(model: torch.nn.Module, forward: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``forward()`` runs,
    ``model``'s parameters excluded (a saved-tensors hook sees each tensor an op saves)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())
