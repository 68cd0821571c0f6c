"""A GPU's memory budget, term by term: from the card's total to what a step may reserve. Pure.

``nvidia-smi``'s total, less what the driver keeps back (what CUDA reports is
``runtime_memory_bytes``), less what a training process holds besides its tensors (the
context, the kernels it loaded, cuBLAS, NCCL's communicator:
:data:`~handbook_lib.models.hardware.TRAINING_CONTEXT_BYTES`), less the buffers NCCL allocates
for the peers of every process group the layout creates
(:func:`~handbook_lib.models.nccl_buffers.nccl_buffer_bytes`, when a layout is given), is the
usable memory; less the plan's headroom, it is the budget a step's reserved peak must fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.core.parallel_layout import ParallelLayout
from handbook_lib.models.hardware import Accelerator, get_accelerator, node_preset, usable_memory_bytes
from handbook_lib.models.nccl_buffers import NcclBuffers, nccl_buffer_bytes

__all__ = ["MemoryBudget", "memory_budget", "layout_budget"]


@dataclass(frozen=True)
class MemoryBudget:
    """One GPU's memory from its total to a step's budget, bytes (``total - driver - context -
    nccl = usable``, ``usable - headroom = budget``)."""

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
    nccl_bytes: int = 0
    """NCCL's buffers for the peers of the layout's process groups (0 where not priced)."""
    nccl_text: str = "NCCL's buffers not priced (no layout given)"
    """The same by communicator, in words."""

    @property
    def budget_bytes(self) -> int:
        """What a step's reserved peak may take: the usable memory less the headroom."""
        return self.usable_bytes - self.headroom_bytes

    def text(self) -> str:
        """The breakdown in one line, GB (10^9)."""
        def gb(b: int) -> str:
            return f"{b / 1e9:.2f} GB"
        return (f"{gb(self.total_bytes)} (nvidia-smi) - {gb(self.driver_bytes)} kept by the driver - "
                f"{gb(self.context_bytes)} training context - {gb(self.nccl_bytes)} NCCL buffers = "
                f"{gb(self.usable_bytes)} usable - {gb(self.headroom_bytes)} headroom = "
                f"{gb(self.budget_bytes)} for the reserved peak; {self.nccl_text}")


def memory_budget(accelerator: Accelerator | str, headroom: float = 0.0,
                  nccl: NcclBuffers | None = None) -> MemoryBudget:
    """The memory budget of one ``accelerator`` (a preset name or an :class:`Accelerator`),
    with ``headroom`` (a fraction in [0, 1)) of its usable memory kept free.

    Args:
        nccl: NCCL's buffers of the job's layout
            (:func:`~handbook_lib.models.nccl_buffers.nccl_buffer_bytes`); ``None``: not priced.

    Raises:
        ValueError: for an unknown preset, a headroom outside [0, 1), or NCCL's buffers leaving
            no usable memory.
    """
    if not 0 <= headroom < 1:  # also refuses NaN
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    acc = get_accelerator(accelerator) if isinstance(accelerator, str) else accelerator
    nccl_bytes = nccl.total if nccl is not None else 0
    usable = usable_memory_bytes(acc) - nccl_bytes
    if usable <= 0:
        raise ValueError(f"NCCL's buffers ({nccl_bytes:,} B) leave no usable memory on {acc.name}")
    runtime = acc.runtime_memory_bytes or acc.memory_bytes
    return MemoryBudget(total_bytes=acc.memory_bytes, driver_bytes=acc.memory_bytes - runtime,
                        context_bytes=acc.context_bytes, usable_bytes=usable,
                        headroom_bytes=usable - int(usable * (1 - headroom)), nccl_bytes=nccl_bytes,
                        nccl_text=nccl.text() if nccl is not None else MemoryBudget.nccl_text)


def layout_budget(gpu: str, layout: ParallelLayout, headroom: float = 0.0) -> MemoryBudget:
    """The budget of one GPU of ``layout`` on ``gpu`` machines (the preset's node, at most the
    layout's ranks to a node): :func:`memory_budget` less the layout's NCCL buffers."""
    node = node_preset(gpu, gpus_per_node=min(node_preset(gpu).gpus_per_node, layout.world_size))
    return memory_budget(gpu, headroom, nccl_buffer_bytes(layout, node))
