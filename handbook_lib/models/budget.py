"""A GPU's memory budget, term by term: from the card's total to what a step may reserve. Pure.

``nvidia-smi``'s total, less what the driver keeps back (what CUDA reports is
``runtime_memory_bytes``), less what a training process holds besides its tensors (the
context, the kernels it loaded, cuBLAS, NCCL's communicator:
:data:`~handbook_lib.models.hardware.TRAINING_CONTEXT_BYTES`), is the usable memory
(:func:`~handbook_lib.models.hardware.usable_memory_bytes`); less the plan's headroom, it is
the budget a step's reserved peak must fit. NCCL's buffers for its peers are not priced.
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.models.hardware import Accelerator, get_accelerator, usable_memory_bytes

__all__ = ["MemoryBudget", "memory_budget"]


@dataclass(frozen=True)
class MemoryBudget:
    """One GPU's memory from its total to a step's budget, bytes (``total - driver - context =
    usable``, ``usable - headroom = budget``)."""

    total_bytes: int
    """The card's total as ``nvidia-smi`` reports it (the preset's ``memory_bytes``)."""
    driver_bytes: int
    """Kept back by the driver: the total less what CUDA reports (0 where no figure is known)."""
    context_bytes: int
    """What a training process holds besides its tensors."""
    usable_bytes: int
    """What a process's tensors and the caching allocator can fill."""
    headroom_bytes: int
    """Kept free on purpose: the plan's ``headroom`` fraction of the usable memory."""

    @property
    def budget_bytes(self) -> int:
        """What a step's reserved peak may take: the usable memory less the headroom."""
        return self.usable_bytes - self.headroom_bytes

    def text(self) -> str:
        """The breakdown in one line, GB (10^9)."""
        def gb(b: int) -> str:
            return f"{b / 1e9:.2f} GB"
        return (f"{gb(self.total_bytes)} (nvidia-smi) - {gb(self.driver_bytes)} kept by the driver - "
                f"{gb(self.context_bytes)} training context = {gb(self.usable_bytes)} usable - "
                f"{gb(self.headroom_bytes)} headroom = {gb(self.budget_bytes)} for the reserved peak "
                "(NCCL's buffers for peers not priced)")


def memory_budget(accelerator: Accelerator | str, headroom: float = 0.0) -> MemoryBudget:
    """The memory budget of one ``accelerator`` (a preset name or an :class:`Accelerator`),
    with ``headroom`` (a fraction in [0, 1)) of its usable memory kept free.

    Raises:
        ValueError: for an unknown preset or a headroom outside [0, 1).
    """
    if not 0 <= headroom < 1:  # also refuses NaN
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    acc = get_accelerator(accelerator) if isinstance(accelerator, str) else accelerator
    usable = usable_memory_bytes(acc)
    runtime = acc.runtime_memory_bytes or acc.memory_bytes
    return MemoryBudget(total_bytes=acc.memory_bytes, driver_bytes=acc.memory_bytes - runtime,
                        context_bytes=acc.context_bytes, usable_bytes=usable,
                        headroom_bytes=usable - int(usable * (1 - headroom)))
