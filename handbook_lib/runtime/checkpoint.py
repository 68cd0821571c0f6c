"""Checkpoints a long training job can rely on: sharded, atomic, reshardable, exportable.

Chapter 6 teaches it. Everything is written with ``torch.distributed.checkpoint`` (DCP) and the
state-dict helpers of ``torch.distributed.checkpoint.state_dict``; there is no format of our own.
On disk, under a root directory::

    root/latest              "step_000004": the name of the newest complete checkpoint
    root/step_000004/        one complete checkpoint
        __0_0.distcp ...     one file per rank: that rank's shards (DCP)
        .metadata            DCP's index: every tensor's global shape and where its pieces are
        checkpoint.json      our manifest, written last: step, world size, extra state, every
                             file with its size and SHA-256 checksum
    root/step_000006.tmp/    a save in progress (or one that died): never loaded

A save is written into ``step_K.tmp``, and becomes ``step_K`` (a rename) and ``latest`` (a
pointer file replaced atomically) only after every rank's shard, DCP's ``.metadata`` and the
manifest are on disk: the steps of :data:`~handbook_lib.models.checkpoint.COMMIT_STEPS`, in that
order. A job killed at any moment therefore leaves ``latest`` pointing to a complete
checkpoint; loading an incomplete one raises :class:`CheckpointError` naming what is missing.
Loading verifies every file's checksum (streamed, ~1.3 GB/s with SHA-256 on a CPU with SHA
extensions), so a file changed after the save — even with its size unchanged — is refused by
name, and the model's tensor names and shapes are compared with DCP's index before any tensor is
read, so a checkpoint of another model is refused naming the tensors that differ.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from handbook_lib.core.architecture import ModelConfig
from handbook_lib.core.files import fsync_dir, write_json_atomic, write_text_atomic
from handbook_lib.models.checkpoint import (
    CHECKPOINT_SCHEMA,
    CHECKSUM,
    LATEST,
    MANIFEST,
    checkpoint_name,
)
from handbook_lib.runtime.model import SimpleTransformer
from handbook_lib.runtime.random_state import rng_state, set_rng_state

__all__ = [
    "CheckpointError", "SavedCheckpoint", "LoadedCheckpoint", "save_checkpoint", "resolve_checkpoint",
    "validate_checkpoint", "load_checkpoint", "export_full_state_dict", "load_exported", "file_checksum",
    "check_model_shapes", "read_metadata", "RESERVED_KEYS",
]

RESERVED_KEYS = ("model", "optim", "rng")
"""The top-level keys of every checkpoint; a caller's own ``stateful`` parts take other names."""

_CHUNK = 1 << 20
"""Bytes read at a time while hashing: the whole file is never in memory."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or unreadable. The message says what and where."""


@dataclass(frozen=True)
class SavedCheckpoint:
    """What :func:`save_checkpoint` wrote."""

    path: Path
    step: int
    seconds: float
    """Wall time of the save on this rank, seconds (state dict, DCP write, commit)."""
    files: dict[str, int] = field(default_factory=dict)
    """File name → bytes on disk (empty on ranks other than 0)."""
    checksum_s: float = 0.0
    """Of ``seconds``: time rank 0 spent hashing the files, seconds (0 on other ranks)."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :func:`load_checkpoint` read."""

    path: Path
    step: int
    world_size: int
    """World size of the job that saved it."""
    extra: dict[str, Any]
    """The ``extra`` state saved with it (e.g. the data position)."""
    rng_restored: bool
    """True if this rank's RNG state was restored (only at the saving world size)."""
    seconds: float
    """Wall time of the load on this rank, seconds."""


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _single() -> bool:
    """True without a process group: DCP then reads and writes in this process alone."""
    return not (dist.is_available() and dist.is_initialized())


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it saves or loads in one process: that is intended here."""
    with warnings.catch_warnings():
        if _single():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if _world()[1] > 1:
        dist.barrier()


def _rng_key(rank: int) -> str:
    return f"rank{rank}"


class _Writer(FileSystemWriter):
    """DCP's file writer, with a hook called once this rank's shard file is on disk."""

    def __init__(self, path: Path, after_write: Callable[[], None] | None) -> None:
        super().__init__(path)
        self._after_write = after_write

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        if self._after_write is not None:
            future.wait()
            self._after_write()
        return future


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    extra: Mapping[str, Any] | None = None,
    keep_last: int = 0,
    after_shard_written: Callable[[], None] | None = None,
    stateful: Mapping[str, Stateful] | None = None,
    device: torch.device | None = None,
) -> SavedCheckpoint:
    """Save model, optimizer, every rank's random generators and the caller's other state as
    ``root/step_K``; point ``latest`` at it.

    Collective: every rank calls it. Each rank writes its own shards (DCP); rank 0
    writes the manifest (``step``, the world size, ``extra``, every file with its
    size), renames the directory from ``.tmp`` and replaces the ``latest`` pointer:
    the steps of :data:`~handbook_lib.models.checkpoint.COMMIT_STEPS`, in that order.

    Args:
        root: Directory holding the checkpoints.
        step: Optimizer steps done; names the checkpoint.
        extra: JSON-ready state to resume with (e.g. ``{"data_position": step}``).
        keep_last: Keep only this many complete checkpoints: this one and the
            newest others (0: keep all). Old ones are deleted only after ``latest``
            points to this one.
        after_shard_written: Called on this rank once its shard file is on disk,
            before the save is committed. Chapter 6 kills the rank there to show an
            interrupted save.
        stateful: More of the job's state, by name: objects with ``state_dict()`` and
            ``load_state_dict()`` (DCP's ``Stateful`` protocol), e.g. the LR scheduler, the
            gradient scaler, the data loader. Their state must be the same on every rank (DCP
            keeps one copy of a key every rank saves). Names other than
            :data:`RESERVED_KEYS`.
        device: This rank's device: its CUDA generator is saved with the others
            (:func:`rng_state`).

    Raises:
        ValueError: if a ``stateful`` name is one of :data:`RESERVED_KEYS`.
    """
    start = time.perf_counter()
    parts = _stateful_parts(stateful)
    root = Path(root)
    rank, world = _world()
    name = checkpoint_name(step)
    tmp, final = root / f"{name}.tmp", root / name
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save of an earlier job that died
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    rng = {_rng_key(rank): rng_state(device)}
    state = {"model": model_sd, "optim": optim_sd, "rng": rng, **parts}
    with _single_process_quiet():  # returns once .metadata is written
        writer = _Writer(tmp, after_shard_written)
        dcp.save(state, storage_writer=writer, no_dist=_single())
    files: dict[str, int] = {}
    checksum_s = 0.0
    if rank == 0:
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        begin = time.perf_counter()
        sums = {name: file_checksum(tmp / name) for name in files}
        checksum_s = time.perf_counter() - begin
        write_json_atomic(tmp / MANIFEST, {
            "schema": CHECKPOINT_SCHEMA, "step": step, "world_size": world,
            "extra": dict(extra or {}), "files": files, CHECKSUM: sums,
        })
        files[MANIFEST] = (tmp / MANIFEST).stat().st_size
        fsync_dir(tmp)
        aside = _aside(final)
        if final.exists():  # a save of this step by an earlier job: moved aside in one rename
            shutil.rmtree(aside, ignore_errors=True)  # (a leftover of a commit that finished)
            os.replace(final, aside)  # until the next rename, resolve_checkpoint reads `aside`
        os.replace(tmp, final)
        write_text_atomic(root / LATEST, name + "\n")
        fsync_dir(root)
        shutil.rmtree(aside, ignore_errors=True)
        if keep_last > 0:
            _prune(root, keep_last, name)
    _barrier()
    elapsed = time.perf_counter() - start
    return SavedCheckpoint(final, step, elapsed, files, checksum_s)


def _stateful_parts(stateful: Mapping[str, Stateful] | None) -> dict[str, Stateful]:
    """The caller's own parts of a checkpoint, refused if one would overwrite a reserved key."""
    parts = dict(stateful or {})
    taken = sorted(set(parts) & set(RESERVED_KEYS))
    if taken:
        raise ValueError(f"stateful names {taken} are reserved; use names other than {list(RESERVED_KEYS)}")
    return parts


def _aside(final: Path) -> Path:
    """Where a re-save of ``final``'s step keeps the older copy until the new one is in place."""
    return final.with_name(final.name + ".old")


def file_checksum(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file as hex, read in 1 MiB chunks (constant memory)."""
    digest = hashlib.new(CHECKSUM)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _prune(root: Path, keep_last: int, current: str) -> None:
    """Delete complete checkpoints but ``current`` (the new ``latest``) and the newest others."""
    others = sorted(p for p in root.glob("step_*")
                    if p.is_dir() and not p.name.endswith((".tmp", ".old")) and p.name != current)
    for old in others[:max(0, len(others) - (keep_last - 1))]:
        shutil.rmtree(old)


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory ``path`` names: itself, or the target of ``path/latest``.

    Raises:
        CheckpointError: if ``path`` is neither a checkpoint nor a root with a valid pointer.
    """
    p = Path(path)
    pointer = p / LATEST
    if pointer.is_file():
        target = p / pointer.read_text().strip()
        if not target.is_dir() and _aside(target).is_dir():
            return _aside(target)  # a re-save of this step died between its two renames
        if not target.is_dir():
            raise CheckpointError(f"{pointer} points to {target.name!r}, which does not exist")
        return target
    if p.is_dir() and ((p / MANIFEST).exists() or (p / ".metadata").exists() or p.name.startswith("step_")):
        return p
    raise CheckpointError(f"no checkpoint at {p}: neither a checkpoint directory nor a root with "
                          f"a {LATEST!r} pointer")


def validate_checkpoint(path: str | os.PathLike[str], *, verify_checksums: bool = True) -> dict[str, Any]:
    """Check that a checkpoint is complete and intact, and return its manifest.

    Complete means: the manifest exists and parses, and every file it lists (DCP's
    ``.metadata`` among them) exists with the listed size in bytes. Intact (with
    ``verify_checksums``): every file's SHA-256 equals the one recorded at save, read in 1 MiB
    chunks — about 1 ms per MB here.

    Raises:
        CheckpointError: naming the first thing missing or wrong.
    """
    ckpt = resolve_checkpoint(path)
    manifest_path = ckpt / MANIFEST
    if not manifest_path.exists():
        dcp_done = "present" if (ckpt / ".metadata").exists() else "missing too"
        raise CheckpointError(
            f"incomplete checkpoint {ckpt}: {MANIFEST} is missing (DCP's .metadata is {dcp_done}), "
            "so the save never finished: a rank died or the job was stopped mid-save. "
            f"Load the previous checkpoint (the root's {LATEST!r} pointer never points to this one)."
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"corrupt checkpoint {ckpt}: {MANIFEST} is unreadable ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != CHECKPOINT_SCHEMA:
        raise CheckpointError(f"corrupt checkpoint {ckpt}: {MANIFEST} is not a {CHECKPOINT_SCHEMA!r} manifest")
    files = manifest.get("files", {})
    if ".metadata" not in files:
        raise CheckpointError(f"corrupt checkpoint {ckpt}: its manifest lists no DCP .metadata")
    for name, size in files.items():
        file = ckpt / name
        if not file.exists():
            raise CheckpointError(f"incomplete checkpoint {ckpt}: file {name} is missing")
        if file.stat().st_size != size:
            raise CheckpointError(f"corrupt checkpoint {ckpt}: {name} has {file.stat().st_size} bytes, "
                                  f"the manifest says {size}")
    sums = manifest.get(CHECKSUM)
    if not isinstance(sums, dict) or set(sums) != set(files):
        raise CheckpointError(f"corrupt checkpoint {ckpt}: its manifest has no {CHECKSUM} checksum for "
                              f"every file it lists")
    if verify_checksums:
        for name in files:
            if file_checksum(ckpt / name) != sums[name]:
                raise CheckpointError(
                    f"corrupt checkpoint {ckpt}: {name} does not match its {CHECKSUM} checksum (its "
                    f"bytes changed after the save, though its size did not); load an earlier checkpoint")
    return manifest


def check_model_shapes(path: str | os.PathLike[str], expected: Mapping[str, tuple[int, ...]],
                       limit: int = 5) -> None:
    """Refuse a checkpoint whose model tensors differ from ``expected``, before anything is loaded.

    Reads DCP's ``.metadata`` only (no tensor data) and compares the names and global shapes of
    the saved ``model`` tensors with ``expected``: a parameter name → its shape, e.g.
    ``dict(param_shapes(config))`` or a model's state dict shapes.

    Raises:
        CheckpointError: naming (up to ``limit`` of each) the tensors missing from the
            checkpoint, those it has that the model lacks, and those whose shapes differ.
    """
    ckpt = resolve_checkpoint(path)
    saved = {key.split(".", 1)[1]: tuple(item.size)
             for key, item in read_metadata(ckpt).state_dict_metadata.items()
             if key.startswith("model.") and isinstance(item, TensorStorageMetadata)}
    expected = {k: tuple(v) for k, v in expected.items()}
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    differ = [f"{k} saved {saved[k]}, model {expected[k]}" for k in expected
              if k in saved and saved[k] != expected[k]]

    def listed(title: str, items: list[str]) -> str:
        more = f" and {len(items) - limit} more" if len(items) > limit else ""
        return f"{title} ({len(items)}): {', '.join(items[:limit])}{more}"

    parts = [listed(title, items) for title, items in (
        ("missing from the checkpoint", missing), ("in the checkpoint, not in the model", unexpected),
        ("shapes differ", differ)) if items]
    if parts:
        raise CheckpointError(f"checkpoint {ckpt} holds another model's tensors ({len(saved)} saved, "
                              f"{len(expected)} in the model); nothing was loaded. " + "; ".join(parts))


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
    stateful: Mapping[str, Stateful] | None = None,
    device: torch.device | None = None,
) -> LoadedCheckpoint:
    """Load a checkpoint into ``model`` (and ``optimizer``, and the ``stateful`` parts saved
    with it), resharding to this job's ranks.

    Collective when a process group exists. ``path`` is a checkpoint directory or a root (its
    ``latest`` is loaded). Works at any world size, and without a process group into a plain
    module. Each rank's random generators (:func:`rng_state`; the CUDA one of ``device``) are
    restored only at the world size that saved them. ``stateful`` names the same parts as at
    save; each gets ``load_state_dict`` with what was saved.

    Every rank verifies every file's checksum (:func:`validate_checkpoint`) and compares the
    model's tensor names and shapes with the checkpoint's (:func:`check_model_shapes`) before
    any tensor is read.

    Raises:
        CheckpointError: if the checkpoint is incomplete, corrupt or does not fit the model, or
            lacks a ``stateful`` part (named).
    """
    start = time.perf_counter()
    parts = _stateful_parts(stateful)
    ckpt = resolve_checkpoint(path)
    manifest = validate_checkpoint(ckpt)
    rank, world = _world()
    if optimizer is None:
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    check_model_shapes(ckpt, {k: tuple(v.shape) for k, v in state["model"].items()})
    saved_keys = {key.split(".", 1)[0] for key in read_metadata(ckpt).state_dict_metadata}
    missing = sorted(set(parts) - saved_keys)
    if missing:
        raise CheckpointError(f"checkpoint {ckpt} holds no {', '.join(missing)} state (it has "
                              f"{', '.join(sorted(saved_keys))}); nothing was loaded")
    state.update(parts)
    rng = restore_rng and manifest["world_size"] == world
    if rng:
        state["rng"] = {_rng_key(rank): rng_state(device)}
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=ckpt, no_dist=_single())
    except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is a BaseException
        raise CheckpointError(f"cannot load checkpoint {ckpt}: {_summary(err)}") from err
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if rng:
        try:
            set_rng_state(state["rng"][_rng_key(rank)], device)
        except ValueError as err:
            raise CheckpointError(f"checkpoint {ckpt}: {err}") from None
    return LoadedCheckpoint(ckpt, manifest["step"], manifest["world_size"], manifest["extra"], rng,
                            time.perf_counter() - start)


def _summary(err: BaseException) -> str:
    """One line per failing rank: DCP's exception carries every rank's error and traceback."""
    if isinstance(err, dcp.CheckpointException):
        return "; ".join(f"rank {rank}: {_summary(exc)}" for rank, (exc, _) in sorted(err.failures.items()))
    first = next((line for line in str(err).splitlines() if line.strip()), "")
    return f"{type(err).__name__}: {first}"


def read_metadata(path: Path) -> Any:
    """DCP's index of a checkpoint (``.metadata``): every tensor's global shape and where its
    pieces are.

    Raises:
        CheckpointError: if the file is missing or unreadable.
    """
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as err:  # noqa: BLE001 - a missing file or a bad pickle: both mean "unreadable"
        raise CheckpointError(f"cannot read DCP metadata of {path}: {_summary(err)}") from None


def export_full_state_dict(model: nn.Module, path: str | os.PathLike[str]) -> int:
    """Gather the full (unsharded) model state to rank 0's CPU; ``torch.save`` it.

    Collective: every rank calls it; only rank 0 holds the full tensors and writes
    (atomically: a temporary file, then a rename). The file loads into a plain module
    (:func:`load_exported`).

    Returns:
        Bytes of the file on rank 0 (0 on other ranks).
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if _world()[0] != 0:
        return 0
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, target)
    return target.stat().st_size


def load_exported(path: str | os.PathLike[str], config: ModelConfig) -> SimpleTransformer:
    """A plain :class:`SimpleTransformer` with the weights of an exported file (``weights_only``).

    Raises:
        RuntimeError: if the file's tensors do not match ``config``'s parameters (strict load).
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    model = SimpleTransformer(config)
    model.load_state_dict(state, strict=True)
    return model
