"""Memory at initialisation: what a rank holds while the model is built, sharded and filled.

Pure arithmetic. Chapter 5 measures it (``init="meta"`` against ``init="full"``): every
``fsdp_train`` run checks :func:`estimate_init_bytes` against a memory tracker, to the byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

from handbook_lib.core.checks import check_world, lookup
from handbook_lib.core.config import INITS, dtype_bytes
from handbook_lib.core.strategies import get_strategy
from handbook_lib.models.layout import ModelLike, model_layout
from handbook_lib.models.sharding import Unit, shard_rows

__all__ = ["CUDA_ALLOCATION_BYTES", "DDP_BUCKET_CAPS", "device_storage_bytes", "model_part_numels",
           "estimate_init_bytes"]

CUDA_ALLOCATION_BYTES = 512
"""The CUDA caching allocator's smallest block, bytes: every CUDA storage takes a multiple of it
(torch's ``MemTracker`` counts it so; ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` makes it 1)."""

DDP_BUCKET_CAPS = (1024 * 1024, 25 * 1024 * 1024)
"""DDP's default gradient bucket caps, bytes: the first bucket, then every later one."""

DEVICES = ("cpu", "cuda")


def device_storage_bytes(nbytes: int, device: str = "cpu") -> int:
    """Bytes a storage of ``nbytes`` takes on ``device``: itself on the CPU, rounded up to a
    multiple of :data:`CUDA_ALLOCATION_BYTES` on CUDA.

    Raises:
        ValueError: for a device other than ``cpu`` or ``cuda``.
    """
    lookup(dict.fromkeys(DEVICES), device, "device")
    if device == "cpu":
        return nbytes
    return -(-nbytes // CUDA_ALLOCATION_BYTES) * CUDA_ALLOCATION_BYTES


def model_part_numels(model: ModelLike) -> dict[str, int]:
    """Elements of each top-level part of the handbook's model, in construction order:
    ``embedding``, ``layers.0`` … ``output`` (:meth:`ModelLayout.part_numels
    <handbook_lib.models.layout.ModelLayout.part_numels>`, as
    :func:`handbook_lib.runtime.model.model_parts` builds them)."""
    return model_layout(model).part_numels()


def estimate_init_bytes(
    model: ModelLike,
    world_size: int,
    strategy: str = "FULL_SHARD",
    init: str = "meta",
    *,
    rank: int = 0,
    shard_group_size: int | None = None,
    units: Sequence[Unit] | None = None,
    device: str = "cpu",
    dtype: str = "fp32",
) -> int:
    """Peak bytes a rank holds while :func:`handbook_lib.runtime.build.parallelize` builds and
    wraps the model (fp32, FSDP2, DDP or one process), exact to the byte.

    ``meta``: the rank materialises only what it keeps — its padded parameter shards with a
    sharding strategy, the whole model otherwise — plus one top-level part
    (:func:`model_part_numels`) built on the CPU to copy its values in. ``full``: every rank
    first builds the whole seeded model (4 bytes per parameter); FSDP2 then shards unit by unit,
    deepest first, the root last, each unit's originals freed once its shards exist: the peak
    comes with the first unit's shards, or with the root's when it outweighs the layers
    (:func:`_full_shard_peak`). FSDP's device mesh keeps one 4-byte rank id per rank. DDP allocates its
    gradient buckets (a copy of every gradient, the strategy table's ``grad_bucket_copy``) when
    it wraps, after the part is dropped: the peak is the larger of the two moments. FSDP1,
    which flattens as it materialises, is measured but not predicted.

    ``device="cuda"`` predicts the GPU's bytes only (:func:`_cuda_init_bytes`): the seeded part
    and the mesh live on the host, and every storage is rounded up to
    :data:`CUDA_ALLOCATION_BYTES`. Not yet measured on a GPU.

    Args:
        model: The handbook's model (anything :func:`~handbook_lib.models.layout.model_layout`
            accepts that has exact tensors).
        units: The FSDP units, root first (default: the layout's, one per layer).
        device: ``cpu`` (host bytes) or ``cuda`` (the rank's GPU bytes; no CPU offload).
        dtype: The dtype the model is kept in: ``fp32``, or ``bf16`` for a model built in bf16
            (pure ``bf16``; ``meta`` on the CPU only): its shards and DDP's buckets in bf16, the
            part being copied still built in fp32.

    Raises:
        ValueError: for a strategy DeepSpeed applies, a bad world size or rank, an unknown
            ``init`` or device, or a model known by its sizes only.
    """
    row = get_strategy(strategy).torch_only("estimate_init_bytes")
    check_world(world_size, rank)
    lookup(dict.fromkeys(INITS), init, "init")
    layout = model_layout(model)
    layout.require_exact("estimate_init_bytes")
    n = layout.num_params
    group = row.shard_group(world_size, shard_group_size if row.hybrid else None)
    lookup(dict.fromkeys(DEVICES), device, "device")
    e = dtype_bytes(dtype)
    if e != 4 and (init == "full" or device == "cuda"):
        raise ValueError(f"a model kept in {dtype} is priced with init='meta' on the CPU only")
    if device == "cuda":
        units = list(units) if units is not None else layout.units()
        return _cuda_init_bytes(layout.tensors, units, group, rank % group, init, row.shards_params,
                                row.grad_bucket_copy)
    buckets = e * n if row.grad_bucket_copy else 0  # allocated by DDP's wrap, after the init
    mesh = 4 * world_size if row.wrapper == "fsdp" else 0
    if init == "full":
        if row.shards_params:
            units = list(units) if units is not None else layout.units()
            return _full_shard_peak(layout.tensors, units, group, rank % group, "cpu") + mesh
        return 4 * n + max(mesh, buckets)
    held = e * n
    if row.shards_params:
        held = layout.shard_bytes(group, rank % group, dtype).padded_bytes
    return held + max(4 * max(layout.part_numels().values()) + mesh, buckets)


def _unit_of(name: str, units: Sequence[Unit]) -> str:
    """The deepest non-root unit whose module holds parameter ``name``, else ``root``."""
    owners = [u.name for u in units if not u.root and (name == u.name or name.startswith(u.name + "."))]
    return max(owners, key=lambda o: o.count("."), default="root")


def _ddp_bucket_bytes(sizes: Sequence[int]) -> int:
    """GPU bytes of DDP's gradient buckets for parameters of ``sizes`` bytes (model order): DDP
    fills buckets in reverse order and closes one once it reaches its cap
    (:data:`DDP_BUCKET_CAPS`); each bucket is one storage."""
    total = filled = index = 0
    for size in reversed(sizes):
        filled += size
        if filled >= DDP_BUCKET_CAPS[min(index, 1)]:
            total, filled, index = total + device_storage_bytes(filled, "cuda"), 0, index + 1
    return total + device_storage_bytes(filled, "cuda")


def _full_shard_peak(tensors: Sequence[tuple[str, tuple[int, ...]]], units: Sequence[Unit], group: int,
                     rank: int, device: str) -> int:
    """Peak bytes of ``fully_shard`` on a whole model (``init="full"``): the units are sharded
    deepest first, the root last, and each unit's padded shards are made while its originals
    are alive (they go once the unit is done). The peak is the largest of these moments: the
    first unit's, unless the root outweighs the layers (a small model with a large vocabulary)."""
    owner = {t: _unit_of(t, units) for t, _ in tensors}
    order = [u.name for u in sorted((u for u in units if not u.root), key=lambda u: -u.name.count("."))]
    alive, peak = sum(device_storage_bytes(4 * prod(shape), device) for _, shape in tensors), 0
    for unit in order + ["root"]:
        mine = [shape for t, shape in tensors if owner[t] == unit]
        padded = sum(device_storage_bytes(4 * -(-s[0] // group) * prod(s[1:]), device) for s in mine)
        peak = max(peak, alive + padded)
        alive += padded - sum(device_storage_bytes(4 * prod(s), device) for s in mine)
    return peak


def _cuda_init_bytes(tensors: Sequence[tuple[str, tuple[int, ...]]], units: Sequence[Unit], group: int,
                     rank: int, init: str, shards: bool, buckets: bool) -> int:
    """GPU peak of :func:`estimate_init_bytes` on CUDA, every storage rounded.

    Without sharding: every parameter's storage, plus DDP's buckets. Sharded, ``full``: the
    whole model moved to the GPU, then ``fully_shard`` unit by unit, each unit's padded shards
    made while its originals are alive; the peak is the largest such moment (for a small model
    with a large root, the root's). Sharded, ``meta``:
    ``to_empty`` gives each parameter its unpadded local shard as the modules are walked, then
    FSDP2 re-pads a unit's shards as its module ends (the root's last), each new padded storage
    allocated while the unpadded one is alive; the peak is the largest running total.
    """
    def full(shape: tuple[int, ...]) -> int:
        return device_storage_bytes(4 * prod(shape), "cuda")

    if not shards:
        held = sum(full(shape) for _, shape in tensors)
        return held + (_ddp_bucket_bytes([4 * prod(shape) for _, shape in tensors]) if buckets else 0)
    sizes = {}
    for name, shape in tensors:
        rows, chunk = shard_rows(shape[0], group, rank)
        row = 4 * prod(shape[1:])
        sizes[name] = (device_storage_bytes(rows * row, "cuda"), device_storage_bytes(chunk * row, "cuda"),
                       rows != chunk)
    if init == "full":
        return _full_shard_peak(tensors, units, group, rank, "cuda")
    owner = {t: _unit_of(t, units) for t, _ in tensors}
    last = {owner[t]: i for i, (t, _) in enumerate(tensors)}
    last["root"] = len(tensors) - 1
    ends = sorted(last, key=lambda u: (last[u], u == "root", -u.count(".")))
    alive = peak = 0
    for i, (t, _) in enumerate(tensors):
        alive += sizes[t][0]
        peak = max(peak, alive)
        for unit in (u for u in ends if last[u] == i):
            for name in (m for m, _ in tensors if owner[m] == unit and sizes[m][2]):
                unpadded, padded, _ = sizes[name]
                peak = max(peak, alive + padded)
                alive += padded - unpadded
    return peak
