"""Micro-benchmark: time all-gather, reduce-scatter and all-reduce over message sizes, fit alpha/beta.

The torch-free half of :mod:`handbook_lib.runs.comm_bench`: its config, the checks the launcher
makes before any process starts, and the host bytes it checks against this machine's memory
(:class:`~handbook_lib.core.run_spec.RunSpec`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from handbook_lib.core.config import FlatConfig
from handbook_lib.core.run_spec import RunSpec

@dataclass(frozen=True)
class BenchConfig(FlatConfig):
    """Message sizes and repetitions of the benchmark."""

    MINIMUMS: ClassVar[Mapping[str, int]] = {"points": 2, "repeats": 2, "warmup": 0}

    min_bytes: int = 4096
    """Smallest full buffer (all-gather output, reduce-scatter input), bytes."""
    max_bytes: int = 8 * 2**20
    """Largest full buffer, bytes."""
    points: int = 7
    """Buffer sizes, spaced geometrically between the two."""
    repeats: int = 5
    """Timed calls per size (the median is kept)."""
    warmup: int = 2
    """Untimed calls per size before the timed ones."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.min_bytes < self.max_bytes:
            raise ValueError(f"need 0 < min_bytes < max_bytes, got {self.min_bytes}, {self.max_bytes}")


CONFIG = BenchConfig


def validate(config: BenchConfig, world_size: int) -> None:
    """Raises ValueError for a single rank: a collective over one rank moves nothing."""
    if world_size < 2:
        raise ValueError("comm_bench needs at least 2 ranks (nproc >= 2)")


def host_bytes(config: BenchConfig, world_size: int) -> int:
    """Bytes one rank holds at the largest size: the full buffer, its 1/N shard, and room for one
    more full buffer, the most a backend copies it into (gloo's all-gather and reduce-scatter
    stage the full buffer through a temporary). Checked against the host's memory before the
    benchmark starts (:func:`handbook_lib.launch.preflight.check_resources`)."""
    largest = buffer_sizes(config, world_size)[-1]
    return 2 * largest + largest // world_size


def buffer_sizes(config: BenchConfig, world_size: int) -> list[int]:
    """Geometric sizes, each rounded to a whole number of fp32 elements per rank."""
    quantum = 4 * world_size
    ratio = (config.max_bytes / config.min_bytes) ** (1 / (config.points - 1))
    sizes = {max(quantum, round(config.min_bytes * ratio**i / quantum) * quantum) for i in range(config.points)}
    return sorted(sizes)


SPEC = RunSpec("comm_bench", __doc__, CONFIG, validate, host_bytes=host_bytes)
