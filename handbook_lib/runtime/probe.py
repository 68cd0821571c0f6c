"""Which FSDP2 units hold gathered parameters while each unit computes: the probe behind
chapter 5's prefetching measurements (``fsdp_train`` with ``count_gathered`` or a tuning knob).
Its findings are checked against :func:`handbook_lib.models.traffic.estimate_gathered_units`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["GatheredProbe", "GatheredSnapshot"]


@dataclass(frozen=True)
class GatheredSnapshot:
    """Which FSDP2 units hold gathered parameters at one moment of a micro-step."""

    phase: str
    """``forward`` (a unit's compute is about to start) or ``backward`` (its backward has just
    computed the gradient of its input, before its own reduce-scatter)."""
    unit: str
    """The unit computing, as :func:`handbook_lib.runtime.measure.measure_fsdp_units` names it."""
    gathered: tuple[str, ...]
    """Units whose all-gather has been issued and not yet freed (in flight or unsharded)."""
    gathered_bytes: int
    """Bytes of their all-gather outputs (padded, in the all-gather's dtype)."""


class GatheredProbe:
    """Record, at each unit's compute in forward and backward, which FSDP2 units are gathered:
    what prefetching changes (chapter 5). Hooks on the units' modules (after FSDP's own
    pre-forward hook, so a prefetch it issues is seen); a new pass starts at each root forward.

    It reads FSDP2's private parameter-group state (``_fsdp_param_group``, ``is_unsharded``,
    ``_all_gather_result``, ``all_gather_outputs``): if a torch release renames it, the probe
    records nothing and says so (``available`` False), and nothing else breaks.
    """

    def __init__(self, model: nn.Module, names: dict[str, nn.Module]) -> None:
        """``names``: unit name → its FSDP2 module, the root included (``"root"``)."""
        self.passes: list[list[GatheredSnapshot]] = []
        self._groups: dict[str, Any] = {}
        self._handles = []
        try:
            for name, module in names.items():
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    self._groups[name] = group
        except AttributeError:
            self._groups = {}
        self.available = bool(self._groups)
        if not self.available:
            return
        self._handles.append(model.register_forward_pre_hook(lambda *_: self.passes.append([])))
        for name, module in names.items():
            if name != "root" and name in self._groups:
                self._handles.append(module.register_forward_pre_hook(self._pre_forward(name)))

    def _gathered(self) -> tuple[tuple[str, ...], int]:
        names, total = [], 0
        for name, group in self._groups.items():
            result = getattr(group, "_all_gather_result", None)
            if result is not None:
                names.append(name)
                total += result.all_gather_output.untyped_storage().nbytes()
            elif group.is_unsharded:
                names.append(name)
                total += sum(t.untyped_storage().nbytes() for p in group.fsdp_params for t in p.all_gather_outputs)
        return tuple(names), total

    def _snap(self, phase: str, unit: str) -> None:
        if self.passes:
            self.passes[-1].append(GatheredSnapshot(phase, unit, *self._gathered()))

    def _pre_forward(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if torch._C._current_graph_task_id() != -1:
                return  # activation checkpointing's recomputation
            self._snap("forward", name)
            x = next((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), None)
            if x is not None:
                x.register_hook(lambda grad: self._snap("backward", name))
        return hook

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
