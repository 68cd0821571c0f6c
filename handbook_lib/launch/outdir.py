"""A run's output folder: created or claimed, locked while any process of the run lives, never
shared, and never emptied of a file a run did not write.

Chapter 1 states the rule (``out=``); :func:`prepare_out_dir` enforces it before anything starts.
Three files of the folder carry it:

- the marker (:func:`~handbook_lib.core.protocol.node_marker`) is the lock: ``fcntl.flock``
  held by the launcher for the whole run, and a record of the run's name and of the processes
  that write into the folder (the launcher and each torchrun agent: process id and start time).
  A launcher killed outright (SIGKILL, the out-of-memory killer) takes its ``flock`` with it,
  but its torchrun may still be stopping its ranks: a new claim is refused while any process
  named in the record lives, and a record whose processes are all gone is taken over;
- the manifest (:func:`manifest_name`, written atomically when the run ends) lists every file
  and folder the run wrote, relative to the folder. ``overwrite`` removes exactly those (and
  the folders they leave empty), and refuses a folder that holds anything else, naming it;
- a folder whose run left no manifest (its launcher was killed, or it predates manifests) is
  read by the files a run writes (:func:`~handbook_lib.core.protocol.node_files`, laid out as
  the launcher, torchrun and the ranks' harness name them); anything else in it is the user's.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from handbook_lib.core.files import write_json_atomic
from handbook_lib.core.protocol import RUN_FILES, RUN_MARKER, node_files, node_marker

__all__ = []  # the launcher's own part: prepare_out_dir, OutDir, manifest_name

_OUT_ACCEPTS = "accepted: a new or empty folder, or a run's (overwrite=True, --overwrite)"
_SHOWN = 3
"""How many foreign paths a refusal names before it gives the count of the rest."""

_MARKER_RE = re.compile(re.escape(RUN_MARKER) + r"(\.node(\d+))?(\.files\.json)?")
"""A marker or a manifest, of node None/0 (no suffix) or node K."""
_RUN_FILE_RE = re.compile(
    r"result\.json|config(\.node\d+)?\.json|results/\d+\.json|ranks/rank\d+\.(json|stacks\.txt)"
    r"|logs(/node\d+)?/[^/]+/attempt_\d+/\d+/[^/]+")
"""Every file a run writes: the launcher's config, rank 0's result(s), each rank's state and
stack dump, and torchrun's per-rank logs (``--log-dir``)."""
_RUN_FOLDER_RE = re.compile(r"results|ranks|logs(/node\d+)?(/[^/]+(/attempt_\d+(/\d+)?)?)?")
"""Every folder a run makes."""
_TEMP_RE = re.compile(r"\.(.+)\.tmp\d+")
"""A file being written atomically (:func:`~handbook_lib.core.files.write_text_atomic`)."""


def manifest_name(node: int | None) -> str:
    """The manifest of ``node``'s run in its folder: ``.handbook-run.files.json`` (node 0, or a
    job started from one machine), ``.handbook-run.node{K}.files.json`` for node K."""
    return f"{node_marker(node)}.files.json"


class OutDir:
    """A run's output folder, claimed: its lock held until :meth:`release`.

    Attributes:
        path: The folder.
        removed: How many files of an earlier run ``overwrite`` removed (0 if none).
    """

    def __init__(self, path: Path, lock_fd: int, run: str, node: int | None, before: set[str],
                 removed: int) -> None:
        self.path, self.run, self.node, self.removed = path, run, node, removed
        self._fd: int | None = lock_fd
        self._before = before  # every entry of the folder once claimed: none of it is this run's
        self._writers: list[dict[str, Any]] = []
        self.record_writers([os.getpid()], "launcher")

    def record_writers(self, pids: list[int], what: str) -> None:
        """Name processes that write into the folder in its lock record (``what``: ``launcher``,
        ``torchrun``), so that a claim is refused while any of them lives, even after this one
        is killed."""
        for pid in pids:
            self._writers.append({"pid": pid, "started": _start_time(pid), "what": what})
        self._write_record(self._writers)

    def release(self) -> None:
        """Write the manifest (the files and folders the run wrote), clear the lock record's
        writers, and release the lock. Call it once every process of the run has ended."""
        if self._fd is None:
            return
        try:
            files, folders = _entries(self.path)
            mine = _under(node_files(self.node))
            write_json_atomic(self.path / manifest_name(self.node), {
                "run": self.run, "node": self.node,
                "files": sorted(f for f in files - self._before if mine(f)),
                "folders": sorted(d for d in folders - self._before if mine(d) or _above(d, self.node)),
            })
            self._write_record([])
        except OSError:  # the folder went away: without a manifest, its files are read by their shape
            pass
        finally:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def _write_record(self, writers: list[dict[str, Any]]) -> None:
        assert self._fd is not None
        record = {"run": self.run, "pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                  "writers": writers}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (json.dumps(record) + "\n").encode(), 0)


def _start_time(pid: int) -> float | None:
    """A process's start time (seconds since the epoch, as the kernel records it), or ``None``
    if it is gone."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _live_writer(record: dict[str, Any]) -> dict[str, Any] | None:
    """The first process of a lock record that still runs (the same process id *and* start
    time: a reused id is another process), or ``None``. Another machine's processes (a folder
    on a shared disk) cannot be seen from here: its ``flock`` alone guards them."""
    if record.get("host", socket.gethostname()) != socket.gethostname():
        return None
    for writer in record.get("writers") or []:
        try:
            pid, started = int(writer["pid"]), writer["started"]
        except (KeyError, TypeError, ValueError):
            continue
        now = _start_time(pid)
        if now is not None and started is not None and abs(now - float(started)) < 0.05:
            return writer
    return None


def _read_record(marker: Path) -> dict[str, Any]:
    """A marker's lock record (``{}`` when it cannot be read)."""
    try:
        record = json.loads(marker.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _entries(folder: Path) -> tuple[set[str], set[str]]:
    """Every file (a link counts as one, never followed) and every folder under ``folder``, as
    paths relative to it."""
    files, folders = set(), set()
    for root, dirs, names in os.walk(folder):
        rel = PurePosixPath(Path(root).relative_to(folder))
        for d in list(dirs):
            if (Path(root) / d).is_symlink():
                dirs.remove(d)
                files.add(str(rel / d))
            else:
                folders.add(str(rel / d))
        files.update(str(rel / n) for n in names)
    return files, folders


def _under(roots: tuple[str, ...]) -> Callable[[str], bool]:
    """A test: is a relative path one of ``roots`` or inside one?"""
    return lambda path: any(path == r or path.startswith(r + "/") for r in roots)


def _above(folder: str, node: int | None) -> bool:
    """Whether ``folder`` holds one of ``node``'s own paths (``logs`` above ``logs/node1``)."""
    return any(r.startswith(folder + "/") for r in node_files(node))


def _protocol(path: str) -> bool:
    """A marker or manifest of any node, or one being written."""
    temp = _TEMP_RE.fullmatch(path)
    return bool(_MARKER_RE.fullmatch(temp.group(1) if temp else path))


def _run_shaped(path: str, is_file: bool) -> bool:
    """Whether a path is one a run writes (a file being written atomically counts as the file)."""
    if not is_file:
        return bool(_RUN_FOLDER_RE.fullmatch(path))
    head, _, name = path.rpartition("/")
    temp = _TEMP_RE.fullmatch(name)
    if temp:
        path = f"{head}/{temp.group(1)}" if head else temp.group(1)
    return bool(_RUN_FILE_RE.fullmatch(path))


def _owned(folder: Path, files: set[str], folders: set[str], node: int | None,
           own_roots: tuple[str, ...]) -> tuple[set[str], set[str], str]:
    """The files and folders of ``folder`` that ``node``'s earlier run wrote, and its name.

    Its manifest lists them; without one (a launcher killed, or a folder from before manifests)
    they are the paths under ``own_roots`` shaped as a run writes them."""
    manifest = folder / manifest_name(node)
    try:
        data = json.loads(manifest.read_text())
        listed = set(map(str, data["files"])), set(map(str, data["folders"]))
        run = str(data.get("run", "?"))
    except (OSError, ValueError, KeyError, TypeError):
        inside = _under(own_roots)
        return ({f for f in files if inside(f) and _run_shaped(f, True)},
                {d for d in folders if (inside(d) and _run_shaped(d, False))
                 or any(r.startswith(d + "/") for r in own_roots)},
                str(_read_record(folder / node_marker(node)).get("run", "?")))
    return listed[0] & files, listed[1] & folders, run


def _claims(folder: Path, files: set[str]) -> list[tuple[int | None, tuple[str, ...]]]:
    """Every node's claim in a folder (from its markers and manifests): the node and the paths
    its run may write."""
    nodes = set()
    for f in files:
        m = _MARKER_RE.fullmatch(f)
        if m:
            nodes.add(int(m.group(2)) if m.group(2) else None)
    return [(n, RUN_FILES if n is None else node_files(n)) for n in sorted(nodes, key=lambda n: n or 0)]


def _foreign(folder: Path) -> list[str]:
    """What in ``folder`` no run's claim accounts for: files, and folders that hold nothing."""
    files, folders = _entries(folder)
    owned_files, owned_folders = set(), set()
    for node, roots in _claims(folder, files):
        f, d, _ = _owned(folder, files, folders, node, roots)
        owned_files |= f
        owned_folders |= d
    left = sorted(f for f in files if f not in owned_files and not _protocol(f))
    full = {str(PurePosixPath(f).parent) for f in files} | {str(PurePosixPath(d).parent) for d in folders}
    return left + sorted(d for d in folders if d not in owned_folders and d not in full)


def _remove(folder: Path, files: set[str], folders: set[str]) -> int:
    """Remove ``files``, then ``folders`` and the folders the removal leaves empty (never
    ``folder`` itself, never a folder that still holds anything); return the files removed."""
    for f in files:
        (folder / f).unlink(missing_ok=True)
    parents = set(folders)
    for f in files:
        parents.update(str(p) for p in PurePosixPath(f).parents if str(p) != ".")
    for d in sorted(parents, key=lambda p: -p.count("/")):  # the deepest first
        try:
            (folder / d).rmdir()
        except OSError:  # not empty (or gone): kept
            pass
    return len(files)


def _refuse_foreign(out_dir: Path, foreign: list[str]) -> ValueError:
    shown = ", ".join(foreign[:_SHOWN]) + (f" and {len(foreign) - _SHOWN} more" if len(foreign) > _SHOWN else "")
    return ValueError(f"out (--out) {str(out_dir)!r} holds {len(foreign)} path{'s' * (len(foreign) != 1)} no run "
                      f"wrote ({shown}); nothing removed; accepted: a new or empty folder, or only a run's files "
                      f"(overwrite=True, --overwrite)")


def _lock(out_dir: Path, marker: Path, create: bool) -> int:
    """Open and lock ``marker``; refuse while another launcher holds it or a process its record
    names still runs."""
    try:
        fd = os.open(marker, os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o644)
    except OSError as err:
        raise ValueError(f"out (--out) {str(out_dir)!r} cannot be written: {err.strerror or err}") from None
    record = _read_record(marker)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"out (--out) {str(out_dir)!r} is in use by another run (run {record.get('run', '?')!r}, "
                         f"pid {record.get('pid', '?')}, holds its lock): give each run its own folder") from None
    record = _read_record(marker)
    live = _live_writer(record)
    if live is not None:
        os.close(fd)
        raise ValueError(f"out (--out) {str(out_dir)!r} is in use by another run (run {record.get('run', '?')!r}: "
                         f"its {live.get('what', 'process')} pid {live['pid']} still runs): wait for it to end "
                         f"or give each run its own folder")
    return fd


def prepare_out_dir(run: str, out: str | os.PathLike[str] | None, overwrite: bool = False,
                    node: int | None = None) -> OutDir:
    """Create or claim the folder a run writes into, and lock it for the whole run.

    A folder is accepted when it does not exist yet, is empty, or is an earlier run's (it holds
    a run's marker; only with ``overwrite``, which removes exactly the files and folders that
    run wrote, as its manifest lists them). A folder holding anything else is refused, naming
    the first few such paths and their count. A folder locked by a running run, or whose lock
    record names a process that still runs (a killed launcher's torchrun), is refused at once.
    Nothing is created or removed in a folder that is refused.

    ``node`` is this machine's node in a real multi-node job (``node_rank``): each node claims
    and locks its own marker and owns only its own files
    (:func:`~handbook_lib.core.protocol.node_files`), so the nodes of one job can share one
    folder, as on a cluster's shared disk; two commands of the same node still cannot.

    Returns:
        The claimed folder; :attr:`OutDir.removed` counts the files ``overwrite`` removed.

    Raises:
        ValueError: one line naming ``out`` (``--out``) and what is accepted.
    """
    if out is None:
        out_dir = Path(tempfile.mkdtemp(prefix=f"handbook-{run}-"))
        return OutDir(out_dir, _lock(out_dir, out_dir / node_marker(node), create=True), run, node, set(), 0)
    if not isinstance(out, (str, os.PathLike)) or not str(out).strip():
        raise ValueError(f"out (--out) must be a folder path, got {out!r}")
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"out (--out) {str(out_dir)!r} is a file, not a folder; {_OUT_ACCEPTS}")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not any(
            p.is_file() and p.name.startswith(RUN_MARKER) for p in out_dir.iterdir()):
        raise ValueError(f"out (--out) {str(out_dir)!r} is not empty and no run wrote it; {_OUT_ACCEPTS}")
    marker = out_dir / node_marker(node)
    fd = _lock(out_dir, marker, create=False) if marker.is_file() else None
    try:
        if out_dir.is_dir():
            foreign = _foreign(out_dir)
            if foreign:
                raise _refuse_foreign(out_dir, foreign)
        if fd is None:
            try:
                out_dir.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ValueError(f"out (--out) {str(out_dir)!r} cannot be created: {err.strerror or err}") from None
            fd = _lock(out_dir, marker, create=True)
        files, folders = _entries(out_dir)
        mine_files, mine_folders, earlier = _owned(out_dir, files, folders, node, node_files(node))
        present = [r for r in node_files(node) if any(_under((r,))(f) for f in mine_files | mine_folders)]
        if present and not overwrite:
            raise ValueError(f"out (--out) {str(out_dir)!r} holds the files of an earlier run {earlier!r} "
                             f"({', '.join(present)}); pass overwrite=True (--overwrite) to replace them")
        removed = _remove(out_dir, mine_files, mine_folders)
        # until this run writes its own, its files are read by their shape (as a killed run's)
        (out_dir / manifest_name(node)).unlink(missing_ok=True)
        before = set().union(*_entries(out_dir))
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    return OutDir(out_dir, fd, run, node, before, removed)
