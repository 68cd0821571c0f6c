"""Checkpoints a long training job can rely on: sharded, atomic, reshardable, exportable.

Chapter 6 teaches it. Everything is written with ``torch.distributed.checkpoint`` (DCP) and the
state-dict helpers of ``torch.distributed.checkpoint.state_dict``; there is no format of our own.
On disk, under a root directory::

    root/latest              "step_000004": the name of the newest complete checkpoint
    root/job.json            the job whose checkpoints these are (run, model shape, optimizer)
    root/step_000004/        one complete checkpoint
        __0_0.distcp ...     one file per rank: that rank's shards (DCP)
        .metadata            DCP's index: every tensor's global shape and where its pieces are
        checkpoint.json      our manifest, written last: step, world size, extra state, every
                             file's size and the SHA-256 of each of its items
    root/step_000006.tmp/    a save in progress (or one that died): never loaded

A save is written into ``step_K.tmp``, and becomes ``step_K`` (a rename) and ``latest`` (a
pointer file replaced atomically) only after every rank's shard, DCP's ``.metadata`` and the
manifest are on disk: the steps of :data:`~handbook_lib.models.checkpoint.COMMIT_STEPS`, in that
order. A job killed at any moment therefore leaves ``latest`` pointing to a complete
checkpoint; loading an incomplete one raises :class:`CheckpointError` naming what is missing.
Each rank hashes the file it wrote, item by item, all ranks at once, and at load verifies the
items it reads (:mod:`handbook_lib.runtime.checkpoint_verify`; SHA-256, ~1.3 GB/s on a CPU with
SHA extensions), so bytes changed after the save — even with the file's size unchanged — are
refused by name; the model's tensor names and shapes are compared with DCP's index before any
tensor is read, so a checkpoint of another model is refused naming the tensors that differ.
An asynchronous save (``asynchronous=True``) copies the state to CPU memory and writes it in a
background thread; it is committed, just as a synchronous one, by :meth:`PendingCheckpoint.wait`.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
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
from handbook_lib.runtime.checkpoint_job import agree_job, claim_job, prune
from handbook_lib.runtime.checkpoint_room import check_room
from handbook_lib.runtime.checkpoint_verify import (
    METADATA,
    CheckpointError,
    ShardWriter,
    VerifyingReader,
    aside_path,
    check_model_shapes,
    file_checksum,  # noqa: F401 - re-exported: still found here
    load_refusal,
    manifest_files,
    read_metadata,
    resolve_checkpoint,
    summary,
    validate_checkpoint,
    verify_items,
)
from handbook_lib.runtime.model import SimpleTransformer
from handbook_lib.runtime.random_state import rng_state, set_rng_state

__all__ = [
    "SavedCheckpoint", "LoadedCheckpoint", "PendingCheckpoint", "save_checkpoint", "load_checkpoint",
    "export_full_state_dict", "load_exported", "RESERVED_KEYS",
]
# CheckpointError, resolve_checkpoint, validate_checkpoint, file_checksum, check_model_shapes and
# read_metadata live in checkpoint_verify; imported here, they are still found where they were.

RESERVED_KEYS = ("model", "optim", "rng")
"""The top-level keys of every checkpoint; a caller's own ``stateful`` parts take other names."""


@dataclass(frozen=True)
class SavedCheckpoint:
    """What :func:`save_checkpoint` wrote (or :meth:`PendingCheckpoint.wait` committed)."""

    path: Path
    step: int
    seconds: float
    """Wall time of the save on this rank, seconds: from the call to the commit (an
    asynchronous save: to the end of ``wait()``, whatever ran in between)."""
    files: dict[str, int] = field(default_factory=dict)
    """File name → bytes on disk, every file of the checkpoint (empty on ranks other than 0)."""
    checksum_s: float = 0.0
    """Time this rank spent hashing the files it wrote (rank 0: and ``.metadata``), seconds."""
    hashed: dict[str, int] = field(default_factory=dict)
    """File name → bytes, of the files this rank hashed: its own (rank 0: and ``.metadata``)."""
    blocked_s: float = 0.0
    """Seconds the save call blocked its caller: all of ``seconds`` for a synchronous save; the
    copy to CPU memory (staging) for an asynchronous one."""
    wait_s: float = 0.0
    """Seconds ``wait()`` blocked its caller (an asynchronous save; 0 otherwise)."""
    asynchronous: bool = False


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
    verified: dict[str, int] = field(default_factory=dict)
    """File name → bytes this rank verified: ``.metadata`` and the items it read (empty without
    ``verify_checksums``)."""
    read: dict[str, int] = field(default_factory=dict)
    """File name → bytes of the items DCP read from it on this rank."""
    verify_s: float = 0.0
    """Of ``seconds``: time this rank spent verifying checksums."""


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


_ASYNC_GROUP: list[Any] = []
"""The gloo process group of asynchronous saves, created once (collectively) by the first."""


def _async_group() -> Any:
    """A process group of its own for DCP's collectives in the background thread (``None``
    without a process group). The training loop's collectives run on the default group at the
    same time; collectives of two threads on one group would be issued in different orders on
    different ranks and mismatch. Gloo, because DCP's ``async_save`` needs a CPU backend."""
    if _single():
        return None
    if not _ASYNC_GROUP:
        _ASYNC_GROUP.append(dist.new_group(backend="gloo"))
    return _ASYNC_GROUP[0]


class PendingCheckpoint:
    """An asynchronous save in flight (:func:`save_checkpoint` with ``asynchronous=True``): the
    state was copied to CPU memory, and a background thread writes and hashes the shards into
    ``step_K.tmp``. Nothing is committed until :meth:`wait`: a job that dies first leaves only
    ``step_K.tmp``, never loaded.

    Attributes:
        step: The step being saved.
        path: The directory being written, ``step_K.tmp``.
        blocked_s: Seconds the save call blocked its caller (state dict and staging).
    """

    def __init__(self, future: Future, commit: Callable[[float], SavedCheckpoint], step: int, path: Path,
                 blocked_s: float) -> None:
        self._future, self._commit = future, commit
        self._saved: SavedCheckpoint | None = None
        self.step, self.path, self.blocked_s = step, path, blocked_s

    def done(self) -> bool:
        """True once the background write has ended (it may have failed: :meth:`wait` raises)."""
        return self._future.done()

    def wait(self) -> SavedCheckpoint:
        """Wait for the background write, then commit the save exactly as a synchronous one does
        (gather every rank's checksums, manifest, rename, ``latest``, pruning). Collective: every
        rank calls it, at a step boundary (the next save does it first, if not done). A second
        call returns the same result.

        Raises:
            torch.distributed.checkpoint.CheckpointException: if the background write failed
                (on every rank: DCP gathers the failures); nothing is committed.
        """
        if self._saved is None:
            begin = time.perf_counter()
            try:
                self._future.result()
                self._saved = self._commit(begin)
            finally:
                _PENDING.clear()
        return self._saved


_PENDING: list[PendingCheckpoint] = []
"""This process's asynchronous save not yet committed (at most one)."""


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
    checksums: bool = True,
    asynchronous: bool = False,
    job: Mapping[str, Any] | None = None,
) -> SavedCheckpoint | PendingCheckpoint:
    """Save model, optimizer, every rank's random generators and the caller's other
    state as ``root/step_K``; point ``latest`` at it.

    Collective: every rank calls it. Each rank writes its own shards (DCP) and hashes
    them, item by item, all ranks at once; rank 0 gathers the sizes and checksums,
    writes the manifest (``step``, the world size, ``extra``, every file with its size
    and checksums), renames the directory from ``.tmp`` and replaces the ``latest``
    pointer: the steps of :data:`~handbook_lib.models.checkpoint.COMMIT_STEPS`, in
    that order. Chapter 6 shows this function: its lines fit the book's 86 columns.

    Args:
        root: Directory holding the checkpoints.
        step: Optimizer steps done; names the checkpoint.
        extra: JSON-ready state to resume with (e.g. ``{"data_position": step}``).
        keep_last: Keep only this many complete checkpoints: this one and the
            newest others (0: keep all). Old ones are deleted only after ``latest``
            points to this one, and only saves: a folder of yours named ``step_*``
            is left (and said so, once).
        after_shard_written: Called on this rank once its shard file is on disk,
            before the save is committed. Chapter 6 kills the rank there to show an
            interrupted save.
        stateful: More of the job's state, by name: objects with ``state_dict()``
            and ``load_state_dict()`` (DCP's ``Stateful`` protocol), e.g. the LR
            scheduler, the gradient scaler, the data loader. Their state must be the
            same on every rank (DCP keeps one copy of a key every rank saves). Names
            other than :data:`RESERVED_KEYS`.
        device: This rank's device: its CUDA generator is saved with the others
            (:func:`rng_state`).
        checksums: Hash the files (False: sizes only; such a checkpoint loads only
            with ``verify_checksums=False``; chapter 6 measures what the hashing
            costs with it).
        asynchronous: Copy the state to CPU memory, write it in a background thread
            (DCP's ``async_save``) and return a :class:`PendingCheckpoint` at once;
            its ``wait()`` commits. A pending save of this process is committed first.
        job: The job's identity (run, model shape, optimizer: see
            :func:`~handbook_lib.runtime.checkpoint_job.job_identity`), recorded in
            ``root/job.json`` by the first save; a root that records another job
            is refused. ``None``: neither checked nor recorded.

    Returns:
        The :class:`SavedCheckpoint`, or with ``asynchronous`` a
        :class:`PendingCheckpoint`.

    Raises:
        ValueError: if a ``stateful`` name is one of :data:`RESERVED_KEYS`.
        CheckpointError: before anything is written, on every rank, if ``root``
            holds another job's checkpoints or a folder named as this save that is
            not one (:func:`~handbook_lib.runtime.checkpoint_job.agree_job`), or if
            the save would not fit
            (:func:`~handbook_lib.runtime.checkpoint_room.check_room`).
    """
    for pending in list(_PENDING):
        pending.wait()
    start = time.perf_counter()
    parts = _stateful_parts(stateful)
    root = Path(root)
    rank, world = _world()
    name = checkpoint_name(step)
    tmp, final = root / f"{name}.tmp", root / name
    model_sd, optim_sd = get_state_dict(model, optimizer)
    rng = {_rng_key(rank): rng_state(device)}
    state = {"model": model_sd, "optim": optim_sd, "rng": rng, **parts}
    shapes = {key: tuple(value.shape) for key, value in model_sd.items()}
    agree_job(root, job, shapes, step, device)  # another job's: refused, none written
    check_room(root, name, state, device)  # no room: refused, none written
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if job is not None:
            claim_job(root, job)  # the first save records the root's job
        shutil.rmtree(tmp, ignore_errors=True)  # a save of an earlier job that died
    _barrier()
    writer = ShardWriter(tmp, after_shard_written, checksums)

    def commit(wait_begin: float) -> SavedCheckpoint:
        files, hashed, hash_s = _commit(root, name, step, world, extra, keep_last,
                                        writer, checksums)
        end = time.perf_counter()
        return SavedCheckpoint(final, step, end - start, files, hash_s, hashed,
                               blocked_s if asynchronous else end - start,
                               end - wait_begin if asynchronous else 0.0,
                               asynchronous)

    with _single_process_quiet():  # returns once .metadata is written (async: staged)
        if not asynchronous:
            try:
                dcp.save(state, storage_writer=writer, no_dist=_single())
            except dcp.CheckpointException as err:  # one line per rank, no tracebacks
                where = f"{tmp}: {summary(err)}"
                raise CheckpointError(f"cannot write checkpoint {where}; it is never "
                                      f"loaded, and {LATEST!r} still names the "
                                      "previous one") from None
            return commit(start)
        future = dcp.async_save(state, storage_writer=writer,
                                process_group=_async_group(), no_dist=_single())
        while _single() and not (writer.started.wait(0.001) or future.done()):
            pass  # DCP's thread warns that it saves in one process: still silenced
    blocked_s = time.perf_counter() - start
    _PENDING.append(PendingCheckpoint(future, commit, step, tmp, blocked_s))
    return _PENDING[-1]


def _commit(root: Path, name: str, step: int, world: int, extra: Mapping[str, Any] | None, keep_last: int,
            writer: ShardWriter, checksums: bool) -> tuple[dict[str, int], dict[str, int], float]:
    """Gather every rank's files and checksums on rank 0, which writes the manifest, renames
    ``step_K.tmp`` and points ``latest`` at it; then a barrier. Returns (on this rank) the
    checkpoint's files (rank 0; else empty), the files this rank hashed and its seconds hashing."""
    tmp, final = root / f"{name}.tmp", root / name
    report = (writer.written, writer.digests)
    reports: list[Any] | None = [report]
    if world > 1:
        reports = [None] * world if dist.get_rank() == 0 else None
        dist.gather_object(report, reports, dst=0)
    hashed = dict(writer.written) if checksums else {}
    hash_s, files = writer.hash_s, dict[str, int]()
    if reports is not None:  # rank 0
        files, sums, meta_s = manifest_files(tmp, reports, checksums)
        if checksums:
            hashed[METADATA], hash_s = files[METADATA], hash_s + meta_s
        manifest = {"schema": CHECKPOINT_SCHEMA, "step": step, "world_size": world,
                    "extra": dict(extra or {}), "files": files}
        write_json_atomic(tmp / MANIFEST, {**manifest, CHECKSUM: sums} if checksums else manifest)
        files[MANIFEST] = (tmp / MANIFEST).stat().st_size
        fsync_dir(tmp)
        aside = aside_path(final)
        if final.exists():  # a save of this step by an earlier job: moved aside in one rename
            shutil.rmtree(aside, ignore_errors=True)  # (a leftover of a commit that finished)
            os.replace(final, aside)  # until the next rename, resolve_checkpoint reads `aside`
        os.replace(tmp, final)
        write_text_atomic(root / LATEST, name + "\n")
        fsync_dir(root)
        shutil.rmtree(aside, ignore_errors=True)
        if keep_last > 0:
            prune(root, keep_last, name)
    _barrier()
    return files, hashed, hash_s


def _stateful_parts(stateful: Mapping[str, Stateful] | None) -> dict[str, Stateful]:
    """The caller's own parts of a checkpoint, refused if one would overwrite a reserved key."""
    parts = dict(stateful or {})
    taken = sorted(set(parts) & set(RESERVED_KEYS))
    if taken:
        raise ValueError(f"stateful names {taken} are reserved; use names other than {list(RESERVED_KEYS)}")
    return parts


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
    stateful: Mapping[str, Stateful] | None = None,
    device: torch.device | None = None,
    verify_checksums: bool = True,
) -> LoadedCheckpoint:
    """Load a checkpoint into ``model`` (and ``optimizer``, and the ``stateful`` parts saved
    with it), resharding to this job's ranks.

    Collective when a process group exists. ``path`` is a checkpoint directory or a root (its
    ``latest`` is loaded). Works at any world size, and without a process group into a plain
    module. Each rank's random generators (:func:`rng_state`; the CUDA one of ``device``) are
    restored only at the world size that saved them. ``stateful`` names the same parts as at
    save; each gets ``load_state_dict`` with what was saved.

    Every rank checks that every file has its recorded size, verifies ``.metadata``'s checksum
    and, before DCP reads any tensor, the checksum of every item its load plan reads (not the
    files other ranks alone read: :class:`~handbook_lib.runtime.checkpoint_verify.VerifyingReader`;
    ``verify_checksums=False``: sizes only), and compares the model's tensor names and shapes
    with the checkpoint's (:func:`check_model_shapes`).

    Raises:
        CheckpointError: if the checkpoint is incomplete, corrupt or does not fit the model, or
            lacks a ``stateful`` part (named); a damaged item is refused naming its file and bytes
            (and the ranks that found it).
    """
    start = time.perf_counter()
    parts = _stateful_parts(stateful)
    ckpt = resolve_checkpoint(path)
    manifest = validate_checkpoint(ckpt, verify_checksums=verify_checksums, verify=())  # sizes
    begin, meta_s = time.perf_counter(), 0.0
    if verify_checksums:
        verify_items(ckpt, manifest, METADATA, [(o, n) for o, n, _ in manifest[CHECKSUM][METADATA]])
        meta_s = time.perf_counter() - begin
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
    reader = VerifyingReader(ckpt, manifest if verify_checksums else None)
    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=reader, no_dist=_single())
    except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is a BaseException
        raise load_refusal(ckpt, err, _single()) from err
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if rng:
        try:
            set_rng_state(state["rng"][_rng_key(rank)], device)
        except ValueError as err:
            raise CheckpointError(f"checkpoint {ckpt}: {err}") from None
    verified = {METADATA: manifest["files"][METADATA], **reader.verified} if verify_checksums else {}
    return LoadedCheckpoint(ckpt, manifest["step"], manifest["world_size"], manifest["extra"], rng,
                            time.perf_counter() - start, verified, reader.read, meta_s + reader.verify_s)


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
