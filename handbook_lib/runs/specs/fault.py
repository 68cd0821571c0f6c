"""A run that fails on purpose, to show (and test) what the launcher reports.

The torch-free half of :mod:`handbook_lib.runs.fault`: its config and the checks the launcher
makes before any process starts (:class:`~handbook_lib.core.run_spec.RunSpec`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from handbook_lib.core.config import FlatConfig
from handbook_lib.core.run_spec import RunSpec

@dataclass(frozen=True)
class FaultConfig(FlatConfig):
    """Which rank fails, and how."""

    fail_rank: int = 1
    """The rank that misbehaves."""
    mode: Literal["raise", "exit", "hang", "sleep", "bad_check", "kill_agent", "none"] = "raise"
    """How it misbehaves (see the module docstring)."""
    sleep_s: float = 3600.0
    """Seconds a ``hang`` or ``sleep`` rank sleeps."""


CONFIG = FaultConfig


def validate(config: FaultConfig, world_size: int) -> None:
    """Raises ValueError if ``fail_rank`` is not a rank of a ``world_size``-process run."""
    if not 0 <= config.fail_rank < world_size:
        raise ValueError(f"fail_rank must be in [0, {world_size}), got {config.fail_rank}")


SPEC = RunSpec("fault", __doc__, CONFIG, validate)
