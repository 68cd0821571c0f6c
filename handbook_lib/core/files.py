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

__all__ = ["write_text_atomic", "write_json_atomic", "fsync_dir"]


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
