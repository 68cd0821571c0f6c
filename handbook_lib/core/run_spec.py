"""A run's contract with the launcher, without torch: its config class and its checks.

Each run of :mod:`handbook_lib.runs` has a spec module, ``handbook_lib/runs/specs/<name>.py``,
that defines its config dataclass, its ``validate(config, world_size)`` and one
:class:`RunSpec`; the run module imports them from there. The launcher, the CLI's ``runs`` and
``run --help``, and the Slurm writer read the specs (:func:`handbook_lib.runs.run_spec`), so a
config is checked once, before anything starts, without importing torch (about 2 s).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from handbook_lib.core.config import FlatConfig

__all__ = ["RunSpec"]


@dataclass(frozen=True)
class RunSpec:
    """What the launcher needs of a run, torch-free.

    Attributes:
        name: The run's module name under :mod:`handbook_lib.runs`, e.g. ``"fsdp_train"``.
        doc: The spec module's docstring; its first line is the run's one-line description.
        config: The run's config dataclass (``CONFIG``).
        validate: ``validate(config, world_size)``: raises ``ValueError`` (one line naming the key
            and what is accepted) for a config the run cannot execute on ``world_size`` ranks.
        preemptible: The run saves and stops on SIGTERM or SIGUSR1: the launcher forwards them.
        host_bytes: ``host_bytes(config, world_size) -> int``: host bytes one rank holds, for a run
            the memory model does not price (the benchmark's buffers), checked before launch.
    """

    name: str
    doc: str
    config: type[FlatConfig]
    validate: Callable[[Any, int], None] | None = None
    preemptible: bool = False
    host_bytes: Callable[[Any, int], int] | None = None

    @property
    def summary(self) -> str:
        """The first line of :attr:`doc` (``python -m handbook_lib runs`` lists it)."""
        lines = (self.doc or "").strip().splitlines()
        return lines[0] if lines else ""

    def check(self, config: Mapping[str, Any] | None, world_size: int) -> FlatConfig:
        """``config`` as the run's :attr:`config`, validated for ``world_size`` ranks.

        Raises:
            ValueError: an unknown key or value (naming it and what is accepted), or what
                :attr:`validate` refuses.
        """
        cfg = self.config.from_mapping(config)
        if self.validate is not None:
            self.validate(cfg, world_size)
        return cfg
