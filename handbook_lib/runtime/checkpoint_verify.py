"""Finding a checkpoint and trusting it, at any number of ranks: each rank hashes what it wrote
and verifies what it reads.

Chapter 6 teaches it; :mod:`handbook_lib.runtime.checkpoint` saves and loads through it. The unit
of a checksum is DCP's *item* (one tensor piece or one pickled value: the byte range a load
reads in one go), so the manifest holds, for every file, the SHA-256 of each item as
``[offset, length, hex]``, together covering the file:

- at save, DCP's writer on each rank hashes the file it has just written, item by item (the
  write results say which items, where), all ranks at once (:class:`ShardWriter`); rank 0
  gathers the digests and adds ``.metadata``'s;
- at load, each rank checks every file's size and ``.metadata``'s checksum, then verifies the
  items its load plan reads, before DCP reads any tensor (:class:`VerifyingReader`), and
  refuses a damaged one by name;
- :func:`validate_checkpoint`, called from one process (a learner, the CLI), verifies every item
  of every file.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from handbook_lib.models.checkpoint import CHECKPOINT_SCHEMA, CHECKSUM, LATEST, MANIFEST

__all__ = ["CheckpointError", "file_checksum", "resolve_checkpoint", "validate_checkpoint", "read_metadata",
           "check_model_shapes"]
# (ShardWriter, VerifyingReader, manifest_files, verify_items, load_refusal, aside_path, METADATA
# and summary are runtime.checkpoint's plumbing, not an API)

METADATA = ".metadata"
"""DCP's index file, in every checkpoint directory."""

_CHUNK = 1 << 20
"""Bytes read at a time while hashing: a whole file is never in memory."""

Digest = list  # [offset, length, hex]: one item's bytes and their SHA-256
"""One entry of the manifest's checksums: ``[offset, length, hex digest]`` of one item."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or unreadable. The message says what and where.

    ``refused_by``: at a load, the ranks whose own verification found the damage (empty
    otherwise).
    """

    def __init__(self, message: str, refused_by: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.refused_by = tuple(refused_by)


def file_checksum(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a whole file as hex (what ``sha256sum`` prints), read in 1 MiB chunks."""
    digest = hashlib.new(CHECKSUM)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _hash_spans(path: Path, spans: Iterable[tuple[int, int]]) -> list[Digest]:
    """``[offset, length, hex]`` of each byte range of ``path``, read in 1 MiB chunks."""
    out: list[Digest] = []
    with open(path, "rb") as f:
        for offset, length in sorted(spans):
            f.seek(offset)
            digest, left = hashlib.new(CHECKSUM), length
            while left > 0 and (chunk := f.read(min(_CHUNK, left))):
                digest.update(chunk)
                left -= len(chunk)
            out.append([offset, length, digest.hexdigest()])
    return out


def _cover(spans: Iterable[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """``spans`` sorted, with a span added for every gap, so that together they cover ``[0, size)``."""
    out, end = [], 0
    for offset, length in sorted(set(spans)):
        if offset > end:
            out.append((end, offset - end))
        out.append((offset, length))
        end = max(end, offset + length)
    if end < size or not out:
        out.append((end, size - end))
    return out


class ShardWriter(FileSystemWriter):
    """DCP's file writer that, on each rank, hashes the files this rank wrote, item by item,
    right after writing them (in DCP's write step: all ranks at once), and records them.

    Args:
        path: The checkpoint directory being written (``step_K.tmp``).
        after_write: Called once this rank's files are on disk, before they are hashed.
        checksums: Hash the files (False: record their sizes only).
    """

    def __init__(self, path: Path, after_write: Callable[[], None] | None, checksums: bool = True) -> None:
        super().__init__(path)
        self._after_write = after_write
        self._checksums = checksums
        self.written: dict[str, int] = {}
        """File name → bytes, of the files this rank wrote."""
        self.digests: dict[str, list[Digest]] = {}
        """File name → its items' ``[offset, length, hex]`` (empty without ``checksums``)."""
        self.hash_s = 0.0
        """Seconds this rank spent hashing its files."""
        self.started = threading.Event()
        """Set once DCP's save has begun with this writer (in an asynchronous save, in its thread)."""

    def set_up_storage_writer(self, *args, **kwargs) -> None:
        super().set_up_storage_writer(*args, **kwargs)
        self.started.set()

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        results = future.wait()  # DCP's file writer has finished when it returns
        if self._after_write is not None:
            self._after_write()
        spans: dict[str, list[tuple[int, int]]] = {}
        for result in results:
            info = result.storage_data
            spans.setdefault(info.relative_path, []).append((info.offset, info.length))
        prefix = plan.storage_data.prefix  # "__{rank}_": also a file that received no item
        for i in range(self.thread_count):  # (one file per writing thread), without listing the folder
            if (Path(self.path) / f"{prefix}{i}{DEFAULT_SUFFIX}").exists():
                spans.setdefault(f"{prefix}{i}{DEFAULT_SUFFIX}", [])
        begin = time.perf_counter()
        for name, items in sorted(spans.items()):
            size = (Path(self.path) / name).stat().st_size
            self.written[name] = size
            if self._checksums:
                self.digests[name] = _hash_spans(Path(self.path) / name, _cover(items, size))
        self.hash_s = time.perf_counter() - begin if self._checksums else 0.0
        return future


def manifest_files(directory: Path, reports: Iterable[tuple[dict[str, int], dict[str, list[Digest]]]],
                   checksums: bool) -> tuple[dict[str, int], dict[str, list[Digest]], float]:
    """Every rank's ``(written, digests)`` merged, with ``.metadata``'s size and checksum added
    (hashed here, on rank 0): ``(files, digests, seconds hashing .metadata)``.

    Raises:
        CheckpointError: if two ranks report one file, or ``directory`` holds a file no rank wrote.
    """
    files: dict[str, int] = {}
    digests: dict[str, list[Digest]] = {}
    for written, sums in reports:
        twice = sorted(set(written) & set(files))
        if twice:
            raise CheckpointError(f"corrupt save in {directory}: two ranks report writing {', '.join(twice)}")
        files.update(written)
        digests.update(sums)
    meta = directory / METADATA
    files[METADATA] = meta.stat().st_size
    begin = time.perf_counter()
    if checksums:
        digests[METADATA] = _hash_spans(meta, [(0, files[METADATA])])
    seconds = time.perf_counter() - begin
    stray = sorted({p.name for p in directory.iterdir()} - set(files))
    if stray:
        raise CheckpointError(f"corrupt save in {directory}: no rank reports writing {', '.join(stray)}")
    return dict(sorted(files.items())), dict(sorted(digests.items())), seconds


def aside_path(final: Path) -> Path:
    """Where a re-save of ``final``'s step keeps the older copy until the new one is in place."""
    return final.with_name(final.name + ".old")


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory ``path`` names: itself, or the target of ``path/latest``.

    Raises:
        CheckpointError: if ``path`` is neither a checkpoint nor a root with a valid pointer.
    """
    p = Path(path)
    pointer = p / LATEST
    if pointer.is_file():
        target = p / pointer.read_text().strip()
        if not target.is_dir() and aside_path(target).is_dir():
            return aside_path(target)  # a re-save of this step died between its two renames
        if not target.is_dir():
            raise CheckpointError(f"{pointer} points to {target.name!r}, which does not exist")
        return target
    if p.is_dir() and ((p / MANIFEST).exists() or (p / METADATA).exists() or p.name.startswith("step_")):
        return p
    raise CheckpointError(f"no checkpoint at {p}: neither a checkpoint directory nor a root with "
                          f"a {LATEST!r} pointer")


def _corrupt(ckpt: Path, name: str, offset: int, length: int) -> CheckpointError:
    return CheckpointError(
        f"corrupt checkpoint {ckpt}: {name} does not match its {CHECKSUM} checksum (bytes {offset}-"
        f"{offset + length - 1}: they changed after the save, though its size did not); load an earlier "
        "checkpoint")


def verify_items(ckpt: Path, manifest: Mapping[str, Any], name: str, spans: Iterable[tuple[int, int]]) -> int:
    """Hash the items of file ``name`` at ``spans`` (``(offset, length)``) and compare each with
    the manifest. Returns the bytes verified.

    Raises:
        CheckpointError: naming the file and the bytes that differ, or that the manifest has no
            checksum for.
    """
    recorded = {(o, n): hex_ for o, n, hex_ in manifest[CHECKSUM].get(name, [])}
    spans = sorted(set(spans))
    unknown = [s for s in spans if s not in recorded]
    if unknown:
        raise CheckpointError(f"corrupt checkpoint {ckpt}: its manifest has no {CHECKSUM} checksum for "
                              f"bytes {unknown[0][0]}-{sum(unknown[0]) - 1} of {name}")
    for offset, length, hex_ in _hash_spans(ckpt / name, spans):
        if hex_ != recorded[offset, length]:
            raise _corrupt(ckpt, name, offset, length)
    return sum(length for _, length in spans)


def validate_checkpoint(path: str | os.PathLike[str], *, verify_checksums: bool = True,
                        verify: Iterable[str] | None = None) -> dict[str, Any]:
    """Check that a checkpoint is complete and intact, and return its manifest.

    Complete means: the manifest exists and parses, and every file it lists (DCP's
    ``.metadata`` among them) exists with the listed size in bytes. Intact (with
    ``verify_checksums``): every item of the files named in ``verify`` (default: all) has the
    SHA-256 recorded at save, read in 1 MiB chunks — about 1 ms per MB here. What a single
    process (a learner, the CLI) calls; a load verifies only what each rank reads.

    Raises:
        CheckpointError: naming the first thing missing or wrong.
    """
    ckpt = resolve_checkpoint(path)
    manifest_path = ckpt / MANIFEST
    if not manifest_path.exists():
        dcp_done = "present" if (ckpt / METADATA).exists() else "missing too"
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
    if METADATA not in files:
        raise CheckpointError(f"corrupt checkpoint {ckpt}: its manifest lists no DCP .metadata")
    for name, size in files.items():
        file = ckpt / name
        if not file.exists():
            raise CheckpointError(f"incomplete checkpoint {ckpt}: file {name} is missing")
        if file.stat().st_size != size:
            raise CheckpointError(f"corrupt checkpoint {ckpt}: {name} has {file.stat().st_size} bytes, "
                                  f"the manifest says {size}")
    if not verify_checksums:
        return manifest
    sums = manifest.get(CHECKSUM)
    if not isinstance(sums, dict) or set(sums) != set(files) or any(
            _cover([(o, n) for o, n, _ in sums[name]], size) != sorted((o, n) for o, n, _ in sums[name])
            for name, size in files.items()):
        raise CheckpointError(f"corrupt checkpoint {ckpt}: its manifest has no {CHECKSUM} checksum for "
                              f"every file it lists")
    for name in files if verify is None else verify:
        verify_items(ckpt, manifest, name, [(o, n) for o, n, _ in sums[name]])
    return manifest


class VerifyingReader(FileSystemReader):
    """DCP's file reader that verifies, on this rank, the items its load plan reads before any is
    read (DCP's planning step: a rank that refuses makes every rank's load fail, nothing read),
    and records what it verified and read.

    Args:
        path: The checkpoint directory.
        manifest: Its manifest (:func:`validate_checkpoint`), or ``None``: verify nothing.
    """

    def __init__(self, path: Path, manifest: Mapping[str, Any] | None) -> None:
        super().__init__(path)
        self._ckpt, self._manifest = Path(path), manifest
        self._done: set[tuple[str, int, int]] = set()
        self.verified: dict[str, int] = {}
        """File name → bytes of its items this rank verified."""
        self.read: dict[str, int] = {}
        """File name → bytes of its items DCP read on this rank."""
        self.verify_s = 0.0
        """Seconds this rank spent verifying."""

    def _spans(self, items) -> dict[str, set[tuple[int, int]]]:
        spans: dict[str, set[tuple[int, int]]] = {}
        for item in items:
            info = self.storage_data[item.storage_index]
            spans.setdefault(info.relative_path, set()).add((info.offset, info.length))
        return spans

    def _verify(self, spans: Mapping[str, set[tuple[int, int]]]) -> None:
        if self._manifest is None:
            return
        begin = time.perf_counter()
        for name, wanted in sorted(spans.items()):
            todo = {s for s in wanted if (name, *s) not in self._done}
            if todo:
                self.verified[name] = self.verified.get(name, 0) + verify_items(
                    self._ckpt, self._manifest, name, todo)
                self._done |= {(name, *s) for s in todo}
        self.verify_s += time.perf_counter() - begin

    def prepare_local_plan(self, plan):
        self._verify(self._spans(plan.items))
        return super().prepare_local_plan(plan)

    def read_data(self, plan, planner):
        spans = self._spans(plan.items)
        self._verify(spans)  # the final plan: nothing new unless a global plan changed it
        for name, wanted in spans.items():
            self.read[name] = self.read.get(name, 0) + sum(length for _, length in wanted)
        return super().read_data(plan, planner)


def load_refusal(ckpt: Path, err: BaseException, single: bool) -> CheckpointError:
    """The error a failed ``dcp.load`` becomes: where ranks refused the checkpoint (a damaged
    item, found by :class:`VerifyingReader`), their message once with the ranks named; else
    ``cannot load checkpoint ...`` with one line per failing rank (:func:`summary`). ``single``: a
    load in one process (no ranks to name)."""
    failures = err.failures if isinstance(err, dcp.CheckpointException) else {}
    refusals = {rank: exc for rank, (exc, _) in failures.items() if isinstance(exc, CheckpointError)}
    if failures and len(refusals) == len(failures):
        by_message: dict[str, list[int]] = {}
        for rank, exc in sorted(refusals.items()):
            by_message.setdefault(str(exc), []).append(rank)
        ranks = tuple(sorted(refusals))
        if single:
            return CheckpointError(next(iter(by_message)), ranks)
        return CheckpointError("; ".join(f"{message} (found by rank {', '.join(map(str, who))})"
                                         for message, who in by_message.items()), ranks)
    return CheckpointError(f"cannot load checkpoint {ckpt}: {summary(err)}")


def summary(err: BaseException) -> str:
    """One line per failing rank: DCP's exception carries every rank's error and traceback."""
    if isinstance(err, dcp.CheckpointException):
        return "; ".join(f"rank {rank}: {summary(exc)}" for rank, (exc, _) in sorted(err.failures.items()))
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
        raise CheckpointError(f"cannot read DCP metadata of {path}: {summary(err)}") from None


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
