"""Checks the launcher makes before it starts NCCL ranks, each a one-line warning (issue 29, S3).

NCCL moves data between the GPUs of one node through shared memory (``/dev/shm``); in a
container that is often 64 MB (Docker's default, many Kubernetes pods), and a multi-GPU job then
dies at its first collective with "unhandled system error". :func:`shm_warning` says so before
the job starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["SHM_MIN_BYTES", "shm_warning"]

SHM_MIN_BYTES = 256 * 1024 * 1024
"""Below this size of ``/dev/shm`` (bytes) a multi-GPU NCCL job is warned about; Docker's
default, 64 MiB, is well below it."""


def shm_warning(nproc: int, cuda: bool, path: str = "/dev/shm",
                statvfs: Callable[[str], os.statvfs_result] = os.statvfs) -> str | None:
    """One line when ``nproc`` NCCL ranks on this node would share a ``/dev/shm`` smaller than
    :data:`SHM_MIN_BYTES` (``cuda``: the ranks see GPUs), else ``None`` (also when ``path``
    cannot be read: nothing to say)."""
    if nproc < 2 or not cuda:
        return None
    try:
        stat = statvfs(path)
    except OSError:
        return None
    size = stat.f_frsize * stat.f_blocks
    if size >= SHM_MIN_BYTES:
        return None
    return f"{path} is {size / 2**20:.0f} MiB: NCCL may fail; run the container with --shm-size=1g"
