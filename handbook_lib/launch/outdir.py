"""A run's output folder: created or claimed, locked for the whole run, never shared, and
never emptied of files a run did not write.

Chapter 1 states the rule (``out=``); :func:`prepare_out_dir` enforces it before anything starts.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from handbook_lib.core.protocol import RUN_MARKER, node_files, node_marker

__all__ = []  # the launcher's own part: prepare_out_dir, OutDir

_OUT_ACCEPTS = "accepted: a new or empty folder, or a run's (overwrite=True, --overwrite)"

class OutDir:
    """A run's output folder, claimed: its marker written and its lock held until :meth:`release`."""

    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self._fd: int | None = lock_fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

def _marked_run(marker: Path) -> str:
    """The run named in a marker file (``"?"`` when it cannot be read)."""
    try:
        return str(json.loads(marker.read_text()).get("run", "?"))
    except (OSError, ValueError, AttributeError):
        return "?"

def _run_written(out_dir: Path) -> bool:
    """Whether a run claimed ``out_dir``: it holds :data:`RUN_MARKER` or a node's marker."""
    return any(p.is_file() and p.name.startswith(RUN_MARKER) for p in out_dir.iterdir())


def prepare_out_dir(run: str, out: str | os.PathLike[str] | None, overwrite: bool = False,
                    node: int | None = None) -> OutDir:
    """Create or claim the folder a run writes into, and lock it for the whole run.

    A folder is accepted when it does not exist yet, is empty, or carries a run's marker (an
    earlier run's folder: only with ``overwrite``, and then only the files that run writes are
    removed). A folder locked by a running run is refused at once. Nothing is created or removed
    in a folder that is refused.

    ``node`` is this machine's node in a real multi-node job (``node_rank``): each node claims
    and locks its own marker and owns only its own files
    (:func:`~handbook_lib.core.protocol.node_files`), so the nodes of one job can share one
    folder, as on a cluster's shared disk; two commands of the same node still cannot.

    Raises:
        ValueError: one line naming ``out`` (``--out``) and what is accepted.
    """
    if out is None:
        out_dir = Path(tempfile.mkdtemp(prefix=f"handbook-{run}-"))
    else:
        if not isinstance(out, (str, os.PathLike)) or not str(out).strip():
            raise ValueError(f"out (--out) must be a folder path, got {out!r}")
        out_dir = Path(out)
        if out_dir.exists() and not out_dir.is_dir():
            raise ValueError(f"out (--out) {str(out_dir)!r} is a file, not a folder; {_OUT_ACCEPTS}")
        if out_dir.is_dir() and any(out_dir.iterdir()) and not _run_written(out_dir):
            raise ValueError(f"out (--out) {str(out_dir)!r} is not empty and no run wrote it; {_OUT_ACCEPTS}")
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"out (--out) {str(out_dir)!r} cannot be created: {err.strerror or err}") from None
    marker = out_dir / node_marker(node)
    try:
        fd = os.open(marker, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise ValueError(f"out (--out) {str(out_dir)!r} cannot be written: {err.strerror or err}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"out (--out) {str(out_dir)!r} is in use by another run (run "
                         f"{_marked_run(marker)!r} holds its lock): give each run its own folder") from None
    claimed = OutDir(out_dir, fd)
    try:
        earlier = [name for name in node_files(node) if (out_dir / name).exists()]
        if earlier and not overwrite:
            raise ValueError(f"out (--out) {str(out_dir)!r} holds the files of an earlier run "
                             f"{_marked_run(marker)!r} ({', '.join(earlier)}); pass overwrite=True "
                             f"(--overwrite) to replace them")
        for name in earlier:  # only what a run writes: a user's own files are never touched
            target = out_dir / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink()
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps({"run": run, "pid": os.getpid(), "started": time.time()}) + "\n").encode(), 0)
    except BaseException:
        claimed.release()
        raise
    return claimed
