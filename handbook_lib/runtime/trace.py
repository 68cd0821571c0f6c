"""One training step under ``torch.profiler``, and FSDP2's own ranges read from its trace.

FSDP2 names what it does with ``record_function``: ``FSDP::pre_forward (layers.0)``,
``FSDP::all_gather (layers.0)``, ``FSDP::backward_prefetch for layers.0``,
``FSDP::post_backward_reduce (layers.1)``, and so on, the unit's name in brackets (none, or
empty brackets, for the root). The reference page "Measured on GPUs" reads them from a CPU run
(``trace_step``); the same names sit on a GPU trace's CPU rows, above the kernels they launch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FSDP_RANGE", "TraceRange", "fsdp_ranges", "profiled"]

FSDP_RANGE = re.compile(r"^FSDP::(\w+)(?: for (\S+)| \(([^)]*)\))?$")
"""A range FSDP2 names: ``FSDP::<kind>``, then ``(<unit>)``, ``for <unit>`` or nothing (the root)."""


@dataclass(frozen=True)
class TraceRange:
    """One of FSDP2's ranges on a rank's CPU thread."""

    kind: str
    """What FSDP2 was doing: ``all_gather``, ``pre_forward``, ``post_backward_reduce``, ..."""
    unit: str
    """The unit's name (``layers.0``), or ``root``."""
    start_ms: float
    """Milliseconds from the first event of the profiled step."""
    duration_ms: float
    """Milliseconds the range lasted (on a CPU rank: issuing the work and, for gloo's
    collectives, waiting for the other ranks; on a GPU: issuing only)."""


def fsdp_ranges(events: Iterable[Any]) -> list[TraceRange]:
    """FSDP2's ranges among a profiler's ``events`` (objects with ``name`` and ``time_range``,
    whose ``start`` and ``end`` are microseconds, as ``torch.profiler.profile().events()``
    gives them), in the order they began, timed from the first event of all."""
    events = list(events)
    if not events:
        return []
    origin = min(e.time_range.start for e in events)
    found = []
    for event in sorted(events, key=lambda e: e.time_range.start):
        match = FSDP_RANGE.match(event.name)
        if match:
            unit = match.group(2) or match.group(3) or "root"
            found.append(TraceRange(match.group(1), unit, (event.time_range.start - origin) / 1e3,
                                    (event.time_range.end - event.time_range.start) / 1e3))
    return found


@contextmanager
def profiled(device: torch.device) -> Iterator[torch.profiler.profile]:
    """``torch.profiler.profile`` over the block: CPU activity, and CUDA's on a GPU. Its
    ``events()`` feed :func:`fsdp_ranges`; ``export_chrome_trace(path)`` writes the file that
    Perfetto (ui.perfetto.dev) or ``chrome://tracing`` opens."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield prof
