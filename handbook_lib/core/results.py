"""The shape of ``result.json``: what every run writes and the launcher hands back.

Chapter 1 introduces it. A run writes one file; its ``checks`` list is where the book's models
meet reality: each record puts a prediction beside a measurement of the same quantity on the
same rank. Pure arithmetic: no ``torch.distributed``, no side effects.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from handbook_lib.core.protocol import RESULT_FILE

__all__ = ["SCHEMA", "Check", "RunResult", "load_result", "max_relative_difference", "model_state_bytes"]

SCHEMA = "handbook.result/1"
"""Version tag of the result format; bump it when a key changes meaning."""

_REQUIRED = ("schema", "run", "config", "world_size", "backend", "device", "torch_version",
             "ranks", "checks")


@dataclass(frozen=True)
class Check:
    """One prediction beside one measurement.

    ``predicted`` and ``measured`` are in ``unit`` (``"bytes"`` are ints). ``rank`` is ``None``
    for a quantity of the whole job. ``tolerance`` is the relative error the model claims for this
    quantity: 0 for exact quantities (a single byte off is a failure).
    """

    quantity: str
    rank: int | None
    predicted: float
    measured: float
    unit: str
    tolerance: float = 0.0

    @property
    def error(self) -> float:
        """``measured - predicted``, in ``unit``."""
        return self.measured - self.predicted

    @property
    def relative_error(self) -> float:
        """``(measured - predicted) / predicted`` (0 when both are 0)."""
        if self.predicted == 0:
            return 0.0 if self.measured == 0 else float("inf")
        return self.error / self.predicted

    @property
    def exact(self) -> bool:
        """True when the measurement equals the prediction."""
        return self.measured == self.predicted

    @property
    def ok(self) -> bool:
        """True when the relative error is within ``tolerance`` (equality when it is 0)."""
        return self.exact or abs(self.relative_error) <= self.tolerance

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RunResult:
    """A finished run's ``result.json``, parsed. Field names are the file's top-level keys."""

    schema: str
    run: str
    config: dict[str, Any]
    world_size: int
    backend: str
    device: str
    torch_version: str
    ranks: list[dict[str, Any]]
    checks: list[Check]
    extra: dict[str, Any] = field(default_factory=dict)
    """Run-specific top-level keys beyond the required ones."""
    path: Path | None = None
    """Where the file was read from (``None`` if built in memory)."""

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: Path | None = None) -> RunResult:
        """Parse the JSON object of a result file.

        Raises:
            ValueError: if a required key is missing or the schema is not :data:`SCHEMA`.
        """
        missing = [key for key in _REQUIRED if key not in data]
        if missing:
            raise ValueError(f"result is missing key(s) {', '.join(missing)}")
        if data["schema"] != SCHEMA:
            raise ValueError(f"result schema is {data['schema']!r}; this library reads {SCHEMA!r}")
        return cls(
            **{key: data[key] for key in _REQUIRED if key != "checks"},
            checks=[Check(**c) for c in data["checks"]],
            extra={k: v for k, v in data.items() if k not in _REQUIRED},
            path=path,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the result file (``path`` is not part of it)."""
        data = {key: getattr(self, key) for key in _REQUIRED}
        data["checks"] = [c.to_dict() for c in self.checks]
        data.update(self.extra)
        return data

    def metric(self, name: str) -> list[Any]:
        """One per-rank metric, in rank order: ``result.metric("losses")``."""
        return [r[name] for r in sorted(self.ranks, key=lambda r: r["rank"])]

    def failed_checks(self) -> list[Check]:
        """Checks whose measurement is outside the check's own tolerance."""
        return [c for c in self.checks if not c.ok]


def max_relative_difference(values: Sequence[float], reference: Sequence[float]) -> float:
    """``max |a - b| / |b|`` over paired values (e.g. two runs' per-step losses); 0.0 for none.

    Raises:
        ValueError: if the sequences differ in length or a reference value is 0.
    """
    if len(values) != len(reference):
        raise ValueError(f"cannot compare {len(values)} values with {len(reference)}")
    if any(b == 0 for b in reference):
        raise ValueError("a reference value is 0: the relative difference is undefined")
    return max((abs(a - b) / abs(b) for a, b in zip(values, reference)), default=0.0)


def model_state_bytes(rank: Mapping[str, Any]) -> int:
    """A training run's rank's model state at rest, bytes: parameter shards and their padding,
    gradients, optimizer state and the optimizer's other (step) tensors, from its metrics."""
    return (rank["param_shard_bytes"] + rank["param_padding_bytes"] + rank["grad_shard_bytes"]
            + rank["optimizer_state_bytes"] + rank["optimizer_other_bytes"])


def load_result(path: str | os.PathLike[str]) -> RunResult:
    """Read a ``result.json`` file, or ``DIR/result.json`` when given a directory."""
    p = Path(path)
    if p.is_dir():
        p = p / RESULT_FILE
    with open(p) as f:
        return RunResult.from_dict(json.load(f), path=p)
