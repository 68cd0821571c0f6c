"""Files a reader can trust: written whole or not at all. Pure Python, no ``torch``.

Chapter 6 teaches why (a job killed mid-write must never leave a half-written file that looks
complete); every JSON file the library writes (``result.json``, rank states, checkpoint
manifests, GPU result sets) and every pointer file goes through :func:`write_text_atomic`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["write_text_atomic", "write_json_atomic", "fsync_dir", "check_writable_dir"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a folder's entries (a rename into it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` so that a reader never sees a half-written file.

    The text goes to a temporary file beside ``path`` (named after it and this process), is
    flushed to disk, then renamed over it (``os.replace``: the old content or the new, never
    a mix).
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """:func:`write_text_atomic` of ``data`` as indented JSON with a final newline."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def check_writable_dir(key: str, value: str | os.PathLike[str]) -> Path:
    """Refuse, before a run starts, a directory a config key names that the run could not
    create or write: a file, a path under a file, or one whose nearest existing folder takes no
    new entry (``/proc``, a read-only mount, no permission). Nothing is left behind: the check
    creates a probe folder in the nearest existing folder and removes it (the only thing it
    removes is what it made).

    Returns:
        The path, as given.

    Raises:
        ValueError: one line naming ``key``, e.g. ``"config key 'ckpt_dir'='/proc/x' cannot be
            created: /proc takes no new folder (No such file or directory)"``.
    """
    import tempfile

    path = Path(value)
    where = f"config key {key!r}={str(value)!r}"
    if path.exists() and not path.is_dir():
        raise ValueError(f"{where} is a file, not a folder: give a folder (it is created if missing)")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{where} cannot be created: {existing} is a file")
    try:
        probe = tempfile.mkdtemp(prefix=".handbook-probe-", dir=existing)
    except OSError as err:
        verb = "is not writable" if existing == path else "cannot be created"
        raise ValueError(f"{where} {verb}: {existing} takes no new folder ({err.strerror})") from None
    os.rmdir(probe)
    return path
