"""Memory at initialisation: what a rank holds while the model is built, sharded and filled.

Pure arithmetic. Chapter 5 measures it (``init="meta"`` against ``init="full"``): every
``fsdp_train`` run checks :func:`estimate_init_bytes` against a memory tracker, to the byte.
"""

from __future__ import annotations

from collections.abc import Sequence

from handbook_lib.core.checks import check_world, lookup
from handbook_lib.core.config import INITS
from handbook_lib.core.strategies import get_strategy
from handbook_lib.models.layout import ModelLike, model_layout
from handbook_lib.models.sharding import Unit

__all__ = ["model_part_numels", "estimate_init_bytes"]


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
) -> int:
    """Peak bytes a rank holds while :func:`handbook_lib.runtime.build.parallelize` builds and
    wraps the model (fp32, FSDP2, DDP or one process), exact to the byte.

    ``meta``: the rank materialises only what it keeps — its padded parameter shards with a
    sharding strategy, the whole model otherwise — plus one top-level part
    (:func:`model_part_numels`) built on the CPU to copy its values in. ``full``: every rank
    first builds the whole seeded model (4 bytes per parameter); FSDP2 then shards unit by unit,
    deepest first, and the peak comes with the first unit's shards, while every original is
    still alive. FSDP's device mesh keeps one 4-byte rank id per rank. DDP allocates its
    gradient buckets (a copy of every gradient, the strategy table's ``grad_bucket_copy``) when
    it wraps, after the part is dropped: the peak is the larger of the two moments. FSDP1,
    which flattens as it materialises, is measured but not predicted.

    Args:
        model: The handbook's model (anything :func:`~handbook_lib.models.layout.model_layout`
            accepts that has exact tensors).
        units: The FSDP units, root first (default: the layout's, one per layer).

    Raises:
        ValueError: for a strategy DeepSpeed applies, a bad world size or rank, an unknown
            ``init``, or a model known by its sizes only.
    """
    row = get_strategy(strategy).torch_only("estimate_init_bytes")
    check_world(world_size, rank)
    lookup(dict.fromkeys(INITS), init, "init")
    layout = model_layout(model)
    layout.require_exact("estimate_init_bytes")
    n = layout.num_params
    group = row.shard_group(world_size, shard_group_size if row.hybrid else None)
    buckets = 4 * n if row.grad_bucket_copy else 0  # allocated by DDP's wrap, after the init
    mesh = 4 * world_size if row.wrapper == "fsdp" else 0
    if init == "full":
        first = 0
        if row.shards_params:
            units = list(units) if units is not None else layout.units()
            order = sorted((u for u in units if not u.root), key=lambda u: -u.name.count("."))
            unit = next((u for u in order if u.numel), units[0])
            first = 4 * unit.padded_numel(group) // group
        return 4 * n + max(first + mesh, buckets)
    held = 4 * n
    if row.shards_params:
        held = layout.shard_bytes(group, rank % group).padded_bytes
    return held + max(4 * max(layout.part_numels().values()) + mesh, buckets)
