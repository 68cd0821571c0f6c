"""What a saved checkpoint holds, read back: its files, which file holds which tensors, and the
tensors and bytes of every part of the state. Chapter 6 shows each beside its prediction
(:func:`handbook_lib.models.checkpoint.estimate_checkpoint_count`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from handbook_lib.models.checkpoint import TensorCount
from handbook_lib.runtime.checkpoint import read_metadata
from handbook_lib.runtime.measure import local_tensor

__all__ = ["checkpoint_files", "checkpoint_items", "count_state_tensors", "count_checkpoint",
           "reproduces_probe"]


def checkpoint_files(path: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """``(file name, bytes)`` of every file in a checkpoint directory (complete or not), by name."""
    p = Path(path)
    return [(f.name, f.stat().st_size) for f in sorted(p.iterdir()) if f.is_file()]

def checkpoint_items(path: str | os.PathLike[str]) -> dict[str, tuple[int, int]]:
    """Which shard file holds what, from DCP's index: file name → (items, bytes of those items).

    An item is one tensor piece or one non-tensor value (an optimizer hyperparameter); a
    replicated item (Adam's ``step`` counter) is written once, by one rank. Bytes include each
    item's serialization headers, so they add up to the file's size.
    """
    files: dict[str, tuple[int, int]] = {}
    for info in read_metadata(Path(path)).storage_data.values():
        items, size = files.get(info.relative_path, (0, 0))
        files[info.relative_path] = (items + 1, size + info.length)
    return dict(sorted(files.items()))

def count_state_tensors(state: Any, *, nested: bool = True) -> TensorCount:
    """Tensors (and their bytes) in a state dict; for a DTensor, this rank's shard.

    With ``nested=False`` only the top level is looked at — the seed's mistake: an optimizer's
    ``state_dict()`` is ``{"state": {...}, "param_groups": [...]}``, with no tensor at the top,
    so it counted 0.
    """
    if isinstance(state, torch.Tensor):
        local = local_tensor(state)
        return TensorCount(1, local.numel() * local.element_size())
    if isinstance(state, Mapping):
        values: Any = state.values()
    elif isinstance(state, (list, tuple)):
        values = state
    else:
        return TensorCount(0, 0)
    total = TensorCount(0, 0)
    for value in values:
        if nested or isinstance(value, torch.Tensor):
            total += count_state_tensors(value, nested=nested)
    return total

def count_checkpoint(path: str | os.PathLike[str]) -> dict[str, TensorCount]:
    """What a DCP checkpoint holds, read from its ``.metadata``: global tensors, by top-level key.

    Keys are the state's top level (``model``, ``optim``, ``rng``) and ``total``. Each tensor is
    counted once, at its global shape, however many ranks hold pieces of it; nested optimizer
    state (every ``exp_avg``, ``exp_avg_sq`` and ``step``) is included.

    Raises:
        CheckpointError: if ``.metadata`` is missing or unreadable.
    """
    counts: dict[str, TensorCount] = {}
    for key, item in read_metadata(Path(path)).state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            group = key.split(".", 1)[0]
            size = item.size.numel() * item.properties.dtype.itemsize
            counts[group] = counts.get(group, TensorCount(0, 0)) + TensorCount(1, size)
    counts["total"] = sum(counts.values(), TensorCount(0, 0))
    return counts


def reproduces_probe(module: torch.nn.Module, probe_path: str | os.PathLike[str]) -> bool:
    """Whether ``module`` (a plain model, e.g. :func:`~handbook_lib.runtime.checkpoint.load_exported`)
    gives exactly the logits a job saved in ``probe_path``: a dict with ``inputs``, ``logits``
    and ``device`` (where the job computed them, ``cpu`` or ``cuda``; ``cpu`` if absent).

    ``module`` runs where the job ran, so the comparison is of the same kernels: on the CPU with
    one thread, as each rank computed them (a thread count changes how a sum is split); on CUDA
    on this process's current GPU (cuBLAS and MKL round differently, so GPU logits would never
    equal CPU ones bit for bit). ``module`` is left on the CPU.

    Raises:
        ValueError: if the probe was computed on CUDA and this process sees no GPU.
    """
    probe = torch.load(probe_path, map_location="cpu", weights_only=True)
    device = str(probe.get("device", "cpu"))
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{probe_path}: its logits were computed on CUDA and no GPU is visible "
                         "here; compare them on a machine with one")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            logits = module.to(device)(probe["inputs"].to(device)).cpu()
    finally:
        torch.set_num_threads(threads)
        module.to("cpu")
    return torch.equal(logits, probe["logits"])
