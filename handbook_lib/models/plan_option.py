"""One way to run a job, priced: the row of a plan (:func:`~handbook_lib.models.planner.plan`).
Pure."""

from __future__ import annotations

import math

from dataclasses import dataclass

from handbook_lib.models.offload import OffloadCost

__all__ = ["Option"]


@dataclass(frozen=True)
class Option:
    """One way to run the job, priced."""

    name: str
    strategy: str
    gpus: int
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    shard_group_size: int | None = None
    peak_bytes: int = 0
    """Predicted peak device memory per GPU, bytes: what the tensors hold (``allocated``)."""
    peak_reserved_bytes: int = 0
    """The same peak as the caching allocator reserves it, bytes (what ``nvidia-smi`` shows,
    less the process's context): what must fit."""
    budget_bytes: int = 0
    """Bytes of a GPU the plan lets an option reserve: the usable memory
    (:func:`~handbook_lib.models.hardware.usable_memory_bytes`, less NCCL's buffers for this
    option's process groups), less the headroom."""
    fits: bool = False
    """The reserved peak within the budget, and (offloading) the node's host bytes within its
    RAM."""
    comm_s: float = 0.0
    """Communication per step, seconds: in each phase the busiest link's collectives (and offload's
    copies on the host link), summed over the phases (:attr:`~handbook_lib.models.timing.StepTime.comm_s`)."""
    compute_s: float = 0.0
    """Compute per step, seconds (recomputation included)."""
    step_s: float = 0.0
    """Step time with communication overlapped with compute, seconds."""
    bound: str = ""
    """``communication`` or ``compute``."""
    peak_phase: str = ""
    activation_bytes: int = 0
    model_state_bytes: int = 0
    host_bytes: int = 0
    """Host (CPU) memory per GPU the option needs for what it offloads, bytes (0: none)."""
    host_node_bytes: int = 0
    """The same for a whole machine (every GPU of it), bytes, against its RAM."""
    offload: OffloadCost | None = None
    """What CPU offload costs it per step (copies and the CPU optimizer step); ``None``: none."""
    routes: tuple[str, ...] = ()
    """How its collectives travel, one line per route with the kinds that take it:
    ``"all_gather, reduce_scatter: ring on NVLink 4 (H100 SXM) at 369 GB/s"``."""
    nccl_bytes: int = 0
    """NCCL's buffers for its process groups, bytes, taken off the budget
    (:func:`~handbook_lib.models.nccl_buffers.nccl_buffer_bytes`)."""
    compute_margin: float = math.inf
    """How far compute may shrink before a phase waits on its links
    (:attr:`~handbook_lib.models.timing.StepTime.compute_margin`): the utilization at which the
    bound flips is the planned one times this."""

    @property
    def cpu_step_s(self) -> float:
        """The optimizer step on the host's CPU (offload), seconds, part of ``step_s`` and never
        hidden; 0 without offload."""
        return self.offload.optimizer_s if self.offload else 0.0

    @property
    def margin_bytes(self) -> int:
        """Budget less reserved peak, bytes: negative when the option does not fit the GPU."""
        return self.budget_bytes - self.peak_reserved_bytes

    @property
    def margin(self) -> float:
        """:attr:`margin_bytes` as a fraction of the budget."""
        return self.margin_bytes / self.budget_bytes
