"""Experiments, one module each, started with ``torchrun`` (see :mod:`handbook_lib.launch`).

Every run module defines ``CONFIG`` (its config dataclass), ``run(config, ctx)`` and optionally
``validate(config, world_size)``, and ends by calling :func:`handbook_lib.runs.entry.main`.
"""

from __future__ import annotations

import pkgutil

__all__ = ["available_runs"]

_NOT_RUNS = {"entry"}


def available_runs() -> list[str]:
    """Names of the runs that can be launched, sorted."""
    return sorted(
        m.name for m in pkgutil.iter_modules(__path__)
        if not m.name.startswith("_") and m.name not in _NOT_RUNS
    )
