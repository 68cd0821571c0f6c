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
(:data:`WRAPS`, :func:`wrap_units`).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from handbook_lib.architecture import ModelConfig, param_shapes
from handbook_lib.config import DTYPES, WRAPS, lookup

__all__ = [
    "DTYPE_BYTES",
    "ShardBytes",
    "Unit",
    "dtype_bytes",
    "shard_rows",
    "estimate_shard_bytes",
    "fsdp_units",
    "WRAPS",
    "wrap_units",
    "estimate_flat_shard_bytes",
]

DTYPE_BYTES: dict[str, int] = {name: d.bytes for name, d in DTYPES.items()}
"""Bytes per element of each floating-point dtype the book uses (from
:data:`handbook_lib.config.DTYPES`)."""


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (one of :data:`DTYPE_BYTES`).

    Raises:
        ValueError: for an unknown dtype, listing the accepted ones.
    """
    return lookup(DTYPE_BYTES, dtype, "dtype")


def check_world(world_size: int, rank: int | None = None) -> None:
    """Raise ``ValueError`` unless ``world_size >= 1`` and ``0 <= rank < world_size``."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if rank is not None and not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")


def shard_rows(dim0: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows of a first dimension of size ``dim0`` that ``rank`` holds under FSDP.

    Returns:
        ``(rows, padded_rows)``: the rows holding real values on ``rank``, and the rows its
        storage is padded to (the same on every rank: ``ceil(dim0 / world_size)``).
    """
    check_world(world_size, rank)
    if dim0 < 0:
        raise ValueError(f"dim0 must be >= 0, got {dim0}")
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


def estimate_shard_bytes(
    config: ModelConfig, world_size: int, rank: int, dtype: str = "fp32"
) -> ShardBytes:
    """Predict one rank's parameter-shard bytes for ``SimpleTransformer(config)`` under FSDP.

    Every parameter is sharded separately along dim 0 (see :func:`shard_rows`). Over all ranks
    the ``shard_bytes`` sum to the whole model's bytes; the padding is extra.

    Args:
        config: The model shape.
        world_size: Number of ranks sharing the parameters (the shard group).
        rank: The rank to predict for (its index within the shard group).
        dtype: Element type of the sharded copy (``fp32`` for FSDP's sharded parameters).
    """
    check_world(world_size, rank)
    size = dtype_bytes(dtype)
    real = padded = 0
    for _, shape in param_shapes(config):
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
            if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
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


def fsdp_units(config: ModelConfig) -> list[Unit]:
    """The units :func:`handbook_lib.parallelize.apply_fsdp2` creates, in forward order.

    The root unit first (the embedding and the output head: what no layer holds; it is gathered
    first in forward), then one unit per transformer layer (``layers.0`` ...).
    """
    layers: dict[str, list[tuple[int, ...]]] = {}
    root: list[tuple[int, ...]] = []
    for name, shape in param_shapes(config):
        if name.startswith("layers."):
            layers.setdefault(".".join(name.split(".")[:2]), []).append(shape)
        else:
            root.append(shape)
    return [Unit("root", tuple(root), root=True)] + [Unit(n, tuple(s)) for n, s in layers.items()]


_MODULE_CONTAINERS = ("layers",)
"""Module paths of ``nn.ModuleList`` containers, never wrapped themselves (FSDP1's
``exclude_wrap_modules``)."""
_LEAF_MODULES = ("self_attn",)
"""Path components of ``nn.MultiheadAttention`` modules: FSDP1's size policy neither recurses
into them nor wraps them (``force_leaf_modules``), so their parameters count for the parent."""


def wrap_units(config: ModelConfig, wrap: str = "layer", min_params: int = 100_000) -> list[Unit]:
    """The FSDP units a wrapping policy makes of ``SimpleTransformer(config)``: root first, then
    the wrapped submodules in forward order.

    ``size`` follows FSDP1's ``size_based_auto_wrap_policy`` from the parameter names alone:
    visiting modules children-first, a module (not the root, not a ``ModuleList``) becomes a unit
    when the elements of its parameters not already inside a unit reach ``min_params``; an
    ``nn.MultiheadAttention`` is neither visited nor wrapped (its parameters count for its layer).
    The root unit keeps what is left (possibly nothing: a root unit with no shapes).

    Raises:
        ValueError: for an unknown ``wrap`` or a ``min_params`` below 1.
    """
    lookup(dict.fromkeys(WRAPS), wrap, "wrap")
    if wrap == "layer":
        return fsdp_units(config)
    shapes = param_shapes(config)
    if wrap == "model":
        return [Unit("root", tuple(s for _, s in shapes), root=True)]
    if isinstance(min_params, bool) or not isinstance(min_params, int) or min_params < 1:
        raise ValueError(f"min_params must be an int >= 1, got {min_params!r}")
    modules: dict[str, list[tuple[int, ...]]] = {"": []}
    children: dict[str, list[str]] = {}
    for name, shape in shapes:
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
        if path and path not in _MODULE_CONTAINERS and sum(prod(s) for s in left) >= min_params:
            units.append(Unit(path, tuple(left)))
            return []
        return left

    root = visit("")
    order = {path: i for i, path in enumerate(modules)}  # first-parameter order = forward order
    units.sort(key=lambda u: order[u.name])
    return [Unit("root", tuple(root), root=True), *units]


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
