"""Whose checkpoints a folder holds, and which of its folders a save may delete.

Chapter 6 teaches it; :func:`~handbook_lib.runtime.checkpoint.save_checkpoint` calls it. Two
rules keep a save from destroying what it did not write:

- **One job per root.** The first save of a job into a root writes ``root/job.json``: the
  job's identity (:func:`job_identity`: the run, the model's shape, the optimizer; not the world
  size, the strategy or the layout, since a checkpoint is resharded at load). A later save, or a
  run's check before it starts (:func:`job_refusal`), of a job with another identity is refused
  in one line naming the key that differs and the root, before anything is written; a root
  without ``job.json`` but with a ``latest`` checkpoint (saved without an identity) is compared
  by its model's tensor shapes instead.
- **Only saves are pruned.** ``keep_last`` deletes a folder only if it is a save
  (:func:`is_save`): named exactly as the saver names one (``step_000004``), holding a manifest
  for that step, and nothing the manifest does not list; it deletes the listed files and the
  manifest, then the empty folder. Another folder named ``step_*`` is left, and said so once.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from handbook_lib.core import checkpoint_job as _record
from handbook_lib.core.checkpoint_job import JOB_FILE, JOB_SCHEMA, job_identity, recorded_job_refusal
from handbook_lib.core.files import write_json_atomic
from handbook_lib.models.checkpoint import CHECKPOINT_SCHEMA, LATEST, MANIFEST, checkpoint_name
from handbook_lib.runtime.checkpoint_verify import CheckpointError, check_model_shapes

__all__ = ["JOB_FILE", "JOB_SCHEMA", "job_identity", "read_job", "job_refusal", "agree_job", "claim_job",
           "is_save", "saves_to_prune", "remove_save", "mention_once", "prune"]

_SAVE_NAME = re.compile(r"step_(\d{6,})")
"""The names :func:`~handbook_lib.models.checkpoint.checkpoint_name` gives (6 digits or more)."""
_MENTIONED: set[str] = set()
"""Roots whose look-alike folders this process has already mentioned (once each)."""


def read_job(root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The identity recorded in ``root/job.json``, or ``None`` when there is none
    (:func:`handbook_lib.core.checkpoint_job.read_job`, which reads it without torch).

    Raises:
        CheckpointError: if the file is over 64 KiB, unreadable, or not a job record.
    """
    try:
        return _record.read_job(root)
    except ValueError as err:
        raise CheckpointError(str(err)) from None


def job_refusal(root: str | os.PathLike[str], job: Mapping[str, Any],
                shapes: Mapping[str, tuple[int, ...]] | None = None) -> str | None:
    """One line refusing ``job`` in ``root`` when ``root`` holds another job's checkpoints, else
    ``None``. Reads ``root/job.json``; without it, and given the model's parameter ``shapes``
    (name → shape), the tensors of the checkpoint ``latest`` names (DCP's index only)."""
    root = Path(root)
    recorded = read_job(root)
    if recorded is not None:  # plain JSON (core.checkpoint_job): what a run's spec checks without torch
        return recorded_job_refusal(root, job, recorded)
    if shapes is None or not (root / LATEST).is_file():
        return None
    try:
        check_model_shapes(root, shapes)
    except CheckpointError as err:
        return f"ckpt_dir {str(root)!r} holds another job's checkpoints: {err}; use another ckpt_dir"
    return None


def agree_job(root: Path, job: Mapping[str, Any] | None, shapes: Mapping[str, tuple[int, ...]], step: int,
              device: torch.device | None = None) -> None:
    """Collective: rank 0 decides whether this save may go into ``root`` and tells every rank;
    every rank refuses the same save with the same line, before anything is written.

    Refused: ``root`` holds another job's checkpoints (:func:`job_refusal`; not checked when
    ``job`` is ``None``), or this save's folder exists and is not a save (a folder of the
    user's, which a save would replace).

    Raises:
        CheckpointError: one line naming the key that differs (or the folder) and ``root``.
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    verdict: list[str | None] = [None]
    if rank == 0:
        try:
            verdict[0] = None if job is None else job_refusal(root, job, shapes)
        except CheckpointError as err:
            verdict[0] = str(err)
        final = root / checkpoint_name(step)
        if verdict[0] is None and final.exists() and not is_save(final):
            verdict[0] = (f"cannot save {final.name}: {final} exists and is not a save (no {MANIFEST} of step "
                          f"{step} lists all it holds); it is left as it is: move it, or use another ckpt_dir")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0, device=device if device and device.type == "cuda" else None)
    if verdict[0] is not None:
        raise CheckpointError(verdict[0])


def claim_job(root: Path, job: Mapping[str, Any]) -> bool:
    """Write ``root/job.json`` for ``job`` unless it exists (rank 0, at the first save, once the
    save is known to fit). Returns True if it wrote it."""
    if (root / JOB_FILE).exists():
        return False
    write_json_atomic(root / JOB_FILE, {"schema": JOB_SCHEMA, "job": dict(job)})
    return True


def _manifest(folder: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _save_entries(folder: Path) -> list[str] | None:
    """The names in ``folder`` if it is a save (:func:`is_save`), else ``None``."""
    match = _SAVE_NAME.fullmatch(folder.name)
    if match is None or checkpoint_name(int(match.group(1))) != folder.name or folder.is_symlink():
        return None
    manifest = _manifest(folder)
    schema = CHECKPOINT_SCHEMA.rsplit("/", 1)[0] + "/"
    if (manifest is None or not str(manifest.get("schema", "")).startswith(schema)
            or manifest.get("step") != int(match.group(1)) or not isinstance(manifest.get("files"), dict)):
        return None
    listed = {*manifest["files"], MANIFEST}
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return None
    if all(entry.name in listed and entry.is_file(follow_symlinks=False) for entry in entries):
        return [entry.name for entry in entries]
    return None


def is_save(folder: Path) -> bool:
    """True if ``folder`` is a save of :func:`~handbook_lib.runtime.checkpoint.save_checkpoint`:
    named ``step_K`` exactly as it names one, holding a manifest of this code's schema for step
    ``K`` and no entry but plain files that manifest lists (some may be missing: a prune that
    was interrupted) and the manifest itself."""
    return _save_entries(folder) is not None


def saves_to_prune(root: Path, keep_last: int, current: str) -> tuple[list[Path], list[Path]]:
    """``(saves to delete, look-alikes left)``: of the saves in ``root`` (:func:`is_save`) other
    than ``current``, all but the newest ``keep_last - 1``; and the other folders whose names
    start with ``step_`` but that no save wrote (a save in progress, ``.tmp``, and one moved
    aside, ``.old``, are neither)."""
    saves: list[Path] = []
    others: list[Path] = []
    for path in sorted(root.glob("step_*")):
        if path.name == current or path.name.endswith((".tmp", ".old")) or not path.is_dir():
            continue
        (saves if is_save(path) else others).append(path)
    return saves[:max(0, len(saves) - (keep_last - 1))], others


def remove_save(folder: Path) -> bool:
    """Delete a save: the files found in it (each one its manifest lists), the manifest last,
    then the folder if it is empty. Returns False (and deletes nothing) if ``folder`` is not a
    save (:func:`is_save`); a name the manifest lists outside the folder is never touched."""
    names = _save_entries(folder)
    if names is None:
        return False
    for name in sorted(names, key=lambda n: n == MANIFEST):  # the manifest last
        (folder / name).unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:  # something appeared meanwhile: left, with it
        return False
    return True


def mention_once(root: Path, keep_last: int, left: list[Path]) -> str | None:
    """The one line that says which look-alike folders ``keep_last`` left in ``root`` (printed by
    the caller; ``None`` when there are none or ``root`` was mentioned before in this process)."""
    if not left or str(root) in _MENTIONED:
        return None
    _MENTIONED.add(str(root))
    return (f"keep_last={keep_last} left {', '.join(p.name for p in left)} in {root}: not saves "
            f"(no {MANIFEST} of theirs lists all they hold), so never deleted")


def prune(root: Path, keep_last: int, current: str) -> None:
    """Delete the saves in ``root`` but ``current`` (the new ``latest``) and the newest
    ``keep_last - 1`` others (:func:`saves_to_prune`); print once the folders left."""
    old, left = saves_to_prune(root, keep_last, current)
    for path in old:
        remove_save(path)
    if line := mention_once(root, keep_last, left):
        print(line, flush=True)
