"""What verifying a checkpoint costs, and how long an asynchronous save blocks (chapter 6).

The torch-free half of :mod:`handbook_lib.runs.checkpoint_cost`: its config and the checks the
launcher makes before any process starts (:class:`~handbook_lib.core.run_spec.RunSpec`). A
``ckpt_dir`` that holds another job's checkpoints is refused by the ``job.json`` of each of its
folders (:mod:`handbook_lib.core.checkpoint_job`: plain JSON).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from handbook_lib.core.checkpoint_job import job_identity, recorded_job_refusal
from handbook_lib.core.config import RunConfig
from handbook_lib.core.files import check_writable_dir
from handbook_lib.core.run_spec import RunSpec
from handbook_lib.core.strategies import STRATEGIES, get_strategy
from handbook_lib.models.checkpoint import scale_model_width


@dataclass(frozen=True)
class CheckpointCostConfig(RunConfig):
    """The model to checkpoint, how much wider, and how many times to time each save and load."""

    MINIMUMS: ClassVar[Mapping[str, int]] = {**RunConfig.MINIMUMS, "scale": 1, "repeats": 1}

    ckpt_dir: str = ""
    """Where to write the checkpoints, kept after the run ("": a temporary directory, removed)."""
    scale: int = 1
    """Parameters (and checkpoint bytes) as a multiple of the config's model, by width."""
    repeats: int = 5
    """Timed rounds of every save and load (after one untimed round)."""


CONFIG = CheckpointCostConfig


def validate(config: CheckpointCostConfig, world_size: int) -> None:
    """Reject, before any process starts, a config this run cannot execute.

    Raises:
        ValueError: naming the key and the values this run accepts.
    """
    row = get_strategy(config.strategy)
    if config.api != "fsdp2" or not row.fsdp2 or row.hybrid:
        accepted = [s for s in STRATEGIES if get_strategy(s).fsdp2 and not get_strategy(s).hybrid]
        raise ValueError(f"checkpoint_cost supports api='fsdp2' with strategy {' or '.join(accepted)}; "
                         f"got api={config.api!r}, strategy={config.strategy!r}")
    if config.precision not in ("fp32", "bf16-mixed") or config.cpu_offload:
        raise ValueError("checkpoint_cost supports precision fp32 or bf16-mixed, without cpu_offload")
    config.check_batch(world_size)
    if config.ckpt_dir:
        check_writable_dir("ckpt_dir", config.ckpt_dir)
        for folder in FOLDERS:  # each records the job of its first save: another one is refused
            try:
                refusal = recorded_job_refusal(Path(config.ckpt_dir) / folder, job_of(config))
            except ValueError as err:  # an unreadable job.json
                refusal = str(err)
            if refusal is not None:
                raise ValueError(refusal)


FOLDERS = ("verified", "plain", "async")
"""The checkpoint roots under ``ckpt_dir``: saves with checksums, without, and asynchronous."""


def job_of(config: CheckpointCostConfig) -> dict[str, Any]:
    """The identity of this run's checkpoints (the widened model's shape)."""
    return job_identity("checkpoint_cost", scale_model_width(config.model_config(), config.scale), config.optimizer)


SPEC = RunSpec("checkpoint_cost", __doc__, CONFIG, validate)
