"""How FSDP cuts parameters into shards, and how it groups them into units.

Pure arithmetic: no ``torch.distributed``, no side effects.

Chapter 1 introduces the shard rule; chapters 2 and 3 use the units. FSDP (FSDP2's
``fully_shard`` and FSDP1 alike) shards each parameter along its first dimension: a first
dimension of ``n`` rows is cut into ``world_size`` chunks of ``ceil(n / world_size)`` rows; rank
``r`` holds rows ``[r·c, min((r+1)·c, n))`` (possibly none), and every rank's storage is padded to
``c`` rows so that all shards have equal size for the all-gather.

FSDP1 (``FullyShardedDataParallel``, ``use_orig_params=False``) differs in one detail that
chapter 5 measures: it flattens each unit's parameters into one ``FlatParameter`` and pads and
shards that flat vector, so its padding is per unit, not per parameter
(:func:`estimate_flat_shard_bytes`). Which modules become units is the wrapping policy
(:data:`~handbook_lib.core.config.WRAPS`, :func:`policy_units`).

These rules read tensor shapes and names, not a model: a model's shards and units come from its
layout (:func:`handbook_lib.models.layout.estimate_shard_bytes`,
:func:`handbook_lib.models.layout.wrap_units`), which applies them to its tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import prod

from handbook_lib.core.checks import check_int, check_world, is_int, lookup
from handbook_lib.core.config import WRAPS, dtype_bytes

__all__ = [
    "post_forward_shard_bytes",
    "ShardBytes",
    "Unit",
    "shard_rows",
    "estimate_tensor_shards",
    "policy_units",
    "estimate_flat_shard_bytes",
]

def shard_rows(dim0: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows of a first dimension of size ``dim0`` that ``rank`` holds under FSDP.

    Returns:
        ``(rows, padded_rows)``: the rows holding real values on ``rank``, and the rows its
        storage is padded to (the same on every rank: ``ceil(dim0 / world_size)``).
    """
    check_world(world_size, rank)
    check_int("dim0", dim0, 0)
    chunk = -(-dim0 // world_size)
    rows = max(0, min(chunk, dim0 - rank * chunk))
    return rows, chunk


@dataclass(frozen=True)
class ShardBytes:
    """Bytes of one rank's shards of every parameter (one copy: parameters, or gradients)."""

    shard_bytes: int
    """Bytes of real values this rank holds."""
    padding_bytes: int
    """Bytes of zero padding FSDP adds so that every rank's shard has equal size."""

    @property
    def padded_bytes(self) -> int:
        """Bytes of storage the rank allocates: ``shard_bytes + padding_bytes``."""
        return self.shard_bytes + self.padding_bytes


def estimate_tensor_shards(shapes: Iterable[tuple[int, ...]], world_size: int, rank: int,
                           dtype: str = "fp32") -> ShardBytes:
    """One rank's bytes of FSDP's per-parameter shards of tensors of these ``shapes``.

    Every tensor is sharded separately along dim 0 (see :func:`shard_rows`): rank r holds
    ``rows_r × prod(shape[1:])`` elements and is padded to ``ceil(dim0 / N) × prod(shape[1:])``.
    Over all ranks the ``shard_bytes`` sum to the tensors' bytes; the padding is extra.

    Args:
        shapes: Each tensor's shape, in elements.
        world_size: Ranks sharing the parameters (the shard group), N.
        rank: The rank to predict for (its index within the shard group).
        dtype: Element type of the sharded copy (``fp32`` for FSDP's sharded parameters).
    """
    check_world(world_size, rank)
    size = dtype_bytes(dtype)
    real = padded = 0
    for shape in shapes:
        rows, chunk = shard_rows(shape[0], world_size, rank)
        row = prod(shape[1:])
        real += rows * row * size
        padded += chunk * row * size
    return ShardBytes(shard_bytes=real, padding_bytes=padded - real)


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: the parameters one ``fully_shard`` call gathers and reduces together."""

    name: str
    """e.g. ``"layers.0"`` or ``"root"``."""
    shapes: tuple[tuple[int, ...], ...]
    """Shape of each parameter, in elements; FSDP shards (and pads) dimension 0."""
    root: bool = False
    """True for the root unit (the module ``fully_shard`` was called on last)."""

    def __post_init__(self) -> None:
        shapes = tuple(tuple(s) for s in self.shapes)
        for shape in shapes:
            if not shape or not all(is_int(d) and d >= 0 for d in shape):
                raise ValueError(f"shapes of unit {self.name!r} must be non-empty tuples of ints "
                                 f">= 0, got {shape!r}")
        object.__setattr__(self, "shapes", shapes)

    @property
    def numel(self) -> int:
        """Elements of the unit's parameters (unpadded)."""
        return sum(prod(s) for s in self.shapes)

    def flat_padded_numel(self, world_size: int) -> int:
        """Elements of FSDP1's unsharded ``FlatParameter``: the unit's numel padded to a multiple
        of N (one padding per unit, not per parameter)."""
        check_world(world_size)
        return -(-self.numel // world_size) * world_size

    def padded_numel(self, world_size: int) -> int:
        """Elements of the unit's unsharded buffer: every dim 0 padded to a multiple of N."""
        check_world(world_size)
        return sum(-(-s[0] // world_size) * world_size * prod(s[1:]) for s in self.shapes)


_LEAF_MODULES = ("self_attn",)
"""Path components of ``nn.MultiheadAttention`` modules: FSDP1's size policy neither recurses
into them nor wraps them (``force_leaf_modules``), so their parameters count for the parent."""


def policy_units(tensors: Sequence[tuple[str, tuple[int, ...]]], wrap: str = "layer", min_params: int = 100_000,
                 *, containers: tuple[str, ...] = ("layers",)) -> list[Unit]:
    """The FSDP units a wrapping policy makes of a model's named parameter tensors (in
    ``named_parameters()`` order): root first, then the wrapped submodules in forward order.

    - ``layer``: each child of a container module (an ``nn.ModuleList`` such as ``layers``)
      becomes a unit (``layers.0`` ...), what :func:`handbook_lib.runtime.build.apply_fsdp2`
      shards; the root keeps the rest (the embedding and the output head);
    - ``model``: one unit, the root, holding every parameter;
    - ``size``: FSDP1's ``size_based_auto_wrap_policy`` from the names alone: visiting modules
      children-first, a module (not the root, not a container) becomes a unit when the elements
      of its parameters not already inside a unit reach ``min_params``; an
      ``nn.MultiheadAttention`` is neither visited nor wrapped (its parameters count for its
      layer). The root unit keeps what is left (possibly nothing: a root unit with no shapes).

    Raises:
        ValueError: for an unknown ``wrap`` or a ``min_params`` below 1.
    """
    lookup(dict.fromkeys(WRAPS), wrap, "wrap")
    if wrap == "model":
        return [Unit("root", tuple(s for _, s in tensors), root=True)]
    if wrap == "layer":
        layers: dict[str, list[tuple[int, ...]]] = {}
        root: list[tuple[int, ...]] = []
        for name, shape in tensors:
            owner = next((c for c in containers if name.startswith(c + ".")), None)
            if owner is None:
                root.append(shape)
            else:
                index = name[len(owner) + 1:].split(".", 1)[0]
                layers.setdefault(f"{owner}.{index}", []).append(shape)
        return [Unit("root", tuple(root), root=True)] + [Unit(n, tuple(s)) for n, s in layers.items()]
    check_int("min_params", min_params, 1)
    modules: dict[str, list[tuple[int, ...]]] = {"": []}
    children: dict[str, list[str]] = {}
    for name, shape in tensors:
        parts = name.split(".")[:-1]
        # a parameter inside a MultiheadAttention belongs to the attention's parent module
        for i, part in enumerate(parts):
            if part in _LEAF_MODULES:
                parts = parts[:i]
                break
        path = ".".join(parts)
        for depth in range(len(parts) + 1):
            prefix = ".".join(parts[:depth])
            modules.setdefault(prefix, [])
            if depth:
                parent = ".".join(parts[: depth - 1])
                kids = children.setdefault(parent, [])
                if prefix not in kids:
                    kids.append(prefix)
        modules[path].append(shape)
    units: list[Unit] = []

    def visit(path: str) -> list[tuple[int, ...]]:
        """Shapes under ``path`` not yet in a unit, after wrapping what qualifies below it."""
        left = list(modules[path])
        for child in children.get(path, []):
            left += visit(child)
        if path and path not in containers and sum(prod(s) for s in left) >= min_params:
            units.append(Unit(path, tuple(left)))
            return []
        return left

    root_left = visit("")
    order = {path: i for i, path in enumerate(modules)}  # first-parameter order = forward order
    units.sort(key=lambda u: order[u.name])
    return [Unit("root", tuple(root_left), root=True), *units]


def estimate_flat_shard_bytes(
    units: list[Unit], world_size: int, rank: int, dtype: str = "fp32"
) -> ShardBytes:
    """One rank's bytes of FSDP1's sharded ``FlatParameter``s (``use_orig_params=False``).

    Each unit's parameters are flattened into one vector of ``numel`` elements, cut into chunks
    of ``ceil(numel / N)``; rank ``r`` holds ``min(chunk, numel - r·chunk)`` real elements
    (possibly none) and is padded to ``chunk``. A unit without parameters has no flat parameter.
    """
    check_world(world_size, rank)
    size = dtype_bytes(dtype)
    real = padded = 0
    for unit in units:
        if unit.numel:
            rows, chunk = shard_rows(unit.numel, world_size, rank)
            real += rows * size
            padded += chunk * size
    return ShardBytes(shard_bytes=real, padding_bytes=padded - real)


def post_forward_shard_bytes(units: Iterable[Unit], group: int, reshard_after_forward_size: int,
                             param_dtype: str = "fp32") -> int:
    """With FSDP2's ``reshard_after_forward`` = g ranks (``reshard_after_forward_size``): the 1/g
    shards of every layer unit's gathered buffer (padded for ``group`` ranks, in ``param_dtype``)
    kept from forward to backward (``_sharded_post_forward_param_data``, a clone made in forward,
    which the memory tracker files with the activations), bytes; 0 for g = 0 (the strategy's
    own resharding). The root is not resharded after forward: it stays gathered."""
    if not reshard_after_forward_size:
        return 0
    check_int("reshard_after_forward_size", reshard_after_forward_size, 1)
    total = sum(u.padded_numel(group) for u in units if u.numel and not u.root)
    return total * dtype_bytes(param_dtype) // reshard_after_forward_size
