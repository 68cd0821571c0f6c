"""Time DDP and FSDP steps side by side in one job: the price of sharding in step time.

The torch-free half of :mod:`handbook_lib.runs.step_time`: its config and the checks the launcher
makes before any process starts (:class:`~handbook_lib.core.run_spec.RunSpec`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from handbook_lib.core.config import RunConfig
from handbook_lib.core.run_spec import RunSpec
from handbook_lib.core.strategies import STRATEGIES, get_strategy

BASELINE = "DDP"
"""The variant every other is timed against (first in ``variants``)."""


@dataclass(frozen=True)
class StepTimeConfig(RunConfig):
    """A :class:`RunConfig` plus what to time: ``steps`` is the timed steps per repeat."""

    MINIMUMS: ClassVar[Mapping[str, int]] = {**RunConfig.MINIMUMS, "repeats": 1, "warmup": 0}

    variants: str = "DDP,FULL_SHARD,SHARD_GRAD_OP"
    """Comma-separated strategies to time, DDP first (the reference of every ratio)."""
    repeats: int = 5
    """Rounds of ``steps`` timed steps per variant."""
    warmup: int = 1
    """Untimed steps per variant before the first round (lazy initialisation, allocator)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        names = self.variant_list()
        if names[:1] != [BASELINE] or len(set(names)) != len(names):
            raise ValueError(f"config key 'variants' must start with {BASELINE} and not repeat, "
                             f"got {self.variants!r}")
        accepted = [s for s in STRATEGIES if get_strategy(s).distributed and get_strategy(s).wrapper != "deepspeed"]
        bad = [n for n in names if n not in accepted]
        if bad:
            raise ValueError(f"config key 'variants': unknown strategy {bad[0]!r}; accepted: "
                             f"{', '.join(accepted)}")

    def variant_list(self) -> list[str]:
        """The strategies of ``variants``, in order."""
        return [v.strip() for v in self.variants.split(",") if v.strip()]


CONFIG = StepTimeConfig


def validate(config: StepTimeConfig, world_size: int) -> None:
    """Reject, before any process starts, a config this run cannot execute."""
    if world_size < 2:
        raise ValueError(f"step_time compares DDP with FSDP: launch it with 2 or more ranks "
                         f"(nproc >= 2), got {world_size}")
    config.check_batch(world_size)
    if config.precision != "fp32" or config.cpu_offload:
        raise ValueError(f"step_time times fp32 runs without offload (DDP's setting): needs "
                         f"precision=fp32 and cpu_offload=false, got precision={config.precision!r}, "
                         f"cpu_offload={config.cpu_offload}")
    config.check_constant_lr("step_time")


SPEC = RunSpec("step_time", __doc__, CONFIG, validate)
