"""The learning rate over a run: a linear warm-up, then constant, cosine or linear decay. Pure.

Chapter 6 saves the scheduler that follows it in every checkpoint (a resumed job must continue
the schedule where it stopped, not restart its warm-up). The shapes are those of Hugging Face's
``get_constant_schedule_with_warmup``, ``get_cosine_schedule_with_warmup`` (half a cycle) and
``get_linear_schedule_with_warmup`` (``transformers.optimization``), so a run and the Trainer
given the same keys follow the same rates; a test compares them value by value.
"""

from __future__ import annotations

import math

from handbook_lib.core.config import LR_SCHEDULES

__all__ = ["lr_factor"]


def lr_factor(step: int, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """The multiplier of the base learning rate for the optimizer step that follows ``step``
    steps done (0-based: ``step=0`` is the first step's rate), dimensionless in [0, 1].

    During the first ``warmup_steps`` steps it rises linearly from 0 (``step / warmup_steps``:
    the first step of a warm-up moves nothing, as in Hugging Face's schedules); then it follows
    ``schedule`` over the remaining ``total_steps - warmup_steps`` steps.

    Raises:
        ValueError: if ``schedule`` is not one of :data:`~handbook_lib.core.config.LR_SCHEDULES`, or a
            count is negative.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}; got {schedule!r}")
    if min(step, warmup_steps, total_steps) < 0:
        raise ValueError(f"step, warmup_steps and total_steps must be >= 0, got {step}, {warmup_steps}, "
                         f"{total_steps}")
    if step < warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if schedule == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    return max(0.0, 1.0 - progress)
