"""Whether a save fits where it is going, asked before a byte is written.

Chapter 6's table of faults has the full disk: a save that runs out of space half way leaves a
``step_K.tmp`` that is never loaded, but the error it raises is torch's zip writer's
("unexpected pos 704 vs 598"), not "the disk is full". So every rank first adds up the bytes of
its shards, and the ranks agree in two small all-reduces whether the whole save fits in the free
space of the folder and whether any rank's file would pass the process's file-size limit
(``ulimit -f``, which Python reports as ``EFBIG``). If not, every rank refuses the same save with
the same one line, before anything is written.
"""

from __future__ import annotations

import pickle
import resource
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from handbook_lib.runtime.checkpoint_verify import CheckpointError

__all__ = ["ITEM_BYTES", "local_state_size", "check_room"]

ITEM_BYTES = 1_600
"""Bytes a shard file holds per item beyond the item's own data: DCP writes each item as its own
``torch.save`` record. Measured (file size minus data, over the items in the file) 1,533 to
1,558 B on three models of 75 to 171 items; the check rounds it up."""


def local_state_size(state: Any) -> tuple[int, int]:
    """``(bytes, items)`` of what this rank saves of a (nested) state dict: tensor bytes, each
    DTensor by its local shard, other values by their pickle (DCP writes them so), and the
    leaves DCP writes as items; a ``Stateful`` part counts as its ``state_dict()``."""
    if isinstance(state, Stateful) and not isinstance(state, (torch.Tensor, Mapping)):
        return local_state_size(state.state_dict())
    if isinstance(state, DTensor):
        local = state.to_local()
        return local.numel() * local.element_size(), 1
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size(), 1
    values = list(state.values()) if isinstance(state, Mapping) else list(state) if isinstance(
        state, (list, tuple)) else None
    if values is not None and (isinstance(state, Mapping) or any(
            isinstance(v, (Mapping, torch.Tensor)) for v in values)):  # DCP's flattening goes in
        parts = [local_state_size(v) for v in values]
        return sum(b for b, _ in parts), sum(n for _, n in parts)
    return len(pickle.dumps(state)), 1


def _all_reduce(values: list[int], op: Any, device: torch.device) -> list[int]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=op)
    return [int(v) for v in tensor.tolist()]


def check_room(folder: Path, name: str, state: Mapping[str, Any], device: torch.device | None = None) -> None:
    """Collective: refuse, on every rank, a save that would not fit.

    Args:
        folder: Where the save goes (its free space is read; the folder or its nearest
            existing parent).
        name: The checkpoint's name, for the message (``step_000004``).
        state: This rank's state dict, as it will be saved.
        device: This rank's device (the all-reduces run there: NCCL needs a GPU tensor).

    Raises:
        CheckpointError: one line, the same on every rank: e.g. ``cannot save step_000004:
            rank 1 would write 1,272,188 B into one file, over the file-size limit of 409,600 B
            (ulimit -f); nothing was written, the previous checkpoint is still latest``.
    """
    device = device or torch.device("cpu")
    data, items = local_state_size(state)
    mine = data + ITEM_BYTES * items
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    over = limit != resource.RLIM_INFINITY and mine > limit
    total = _all_reduce([mine], dist.ReduceOp.SUM, device)[0]
    worst, too_big = _all_reduce([rank + 1 if over else 0, mine if over else 0], dist.ReduceOp.MAX, device)
    where = folder
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    short = _all_reduce([1 if free < total else 0], dist.ReduceOp.MAX, device)[0]
    tail = "nothing was written, the previous checkpoint is still latest"
    if worst:
        raise CheckpointError(f"cannot save {name}: rank {worst - 1} would write about {too_big:,} B into one "
                              f"file, over the file-size limit of {limit:,} B (ulimit -f); {tail}")
    if short:
        raise CheckpointError(f"cannot save {name}: it needs about {total:,} B and {where} has {free:,} B "
                              f"free (on some rank); {tail}")
