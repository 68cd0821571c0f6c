"""Whose checkpoints a folder holds, as recorded in its ``job.json``: the record, read without torch.

Chapter 6 teaches the rule (:mod:`handbook_lib.runtime.checkpoint_job` applies it at a save): the
first save of a job into a root writes ``root/job.json``, the job's identity (:func:`job_identity`),
and a job of another identity is refused there. Reading and comparing that record is plain JSON,
so a run's spec checks it before any process starts, without importing torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from handbook_lib.core.architecture import ModelConfig

__all__ = ["JOB_FILE", "JOB_SCHEMA", "job_identity", "read_job", "recorded_job_refusal"]

JOB_FILE = "job.json"
"""The file, under a checkpoint root, that names the job its checkpoints belong to."""
JOB_SCHEMA = "handbook.checkpoint-job/1"
"""Version tag of :data:`JOB_FILE`."""
_JOB_BYTES = 64 * 1024
"""Largest ``job.json`` read, bytes: the file holds a dozen keys (about 300 B)."""


def job_identity(run: str, model: ModelConfig, optimizer: str) -> dict[str, Any]:
    """What makes two jobs' checkpoints interchangeable: the run's name, every key of the model's
    shape, and the optimizer (its state is in the checkpoint). The world size, the strategy and
    the layout are not part of it: DCP reshards a checkpoint to any of them."""
    return {"run": run, **model.to_dict(), "optimizer": optimizer}


def read_job(root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The identity recorded in ``root/job.json``, or ``None`` when there is none.

    Raises:
        ValueError: if the file is over 64 KiB, unreadable, or not a job record (the runtime's
            :func:`~handbook_lib.runtime.checkpoint_job.read_job` raises it as a ``CheckpointError``).
    """
    path = Path(root) / JOB_FILE
    if not path.is_file():
        return None
    try:
        if path.stat().st_size > _JOB_BYTES:
            raise ValueError(f"over {_JOB_BYTES:,} B")
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is unreadable ({err}); it names the job ckpt_dir belongs to") from None
    if not isinstance(record, dict) or record.get("schema") != JOB_SCHEMA or not isinstance(record.get("job"), dict):
        raise ValueError(f"{path} is not a {JOB_SCHEMA!r} record; it names the job ckpt_dir belongs to")
    return record["job"]


def recorded_job_refusal(root: str | os.PathLike[str], job: Mapping[str, Any],
                         recorded: Mapping[str, Any] | None = None) -> str | None:
    """One line refusing ``job`` in ``root`` when its ``job.json`` names another job, else ``None``
    (also when there is no ``job.json``). ``recorded``: the record already read (:func:`read_job`).

    Raises:
        ValueError: as :func:`read_job`.
    """
    recorded = read_job(root) if recorded is None else recorded
    if recorded is None:
        return None
    wanted = json.loads(json.dumps(dict(job)))  # as it would be recorded
    differ = [key for key in [*wanted, *(k for k in recorded if k not in wanted)]
              if wanted.get(key) != recorded.get(key)]
    if not differ:
        return None
    key, more = differ[0], f" (and {', '.join(differ[1:])})" if differ[1:] else ""
    return (f"ckpt_dir {str(Path(root))!r} holds another job's checkpoints: {key}={wanted.get(key)!r} here, "
            f"{recorded.get(key)!r} in its {JOB_FILE}{more}; use another ckpt_dir")
