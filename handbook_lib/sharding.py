"""How FSDP cuts parameters into shards, and how it groups them into units.

Pure arithmetic: no ``torch.distributed``, no side effects.

Chapter 1 introduces the shard rule; chapters 2 and 3 use the units. FSDP (FSDP2's
``fully_shard`` and FSDP1 alike) shards each parameter along its first dimension: a first
dimension of ``n`` rows is cut into ``world_size`` chunks of ``ceil(n / world_size)`` rows; rank
``r`` holds rows ``[r·c, min((r+1)·c, n))`` (possibly none), and every rank's storage is padded to
``c`` rows so that all shards have equal size for the all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from handbook_lib.architecture import ModelConfig, param_shapes
from handbook_lib.names import lookup

__all__ = [
    "DTYPE_BYTES",
    "ShardBytes",
    "Unit",
    "dtype_bytes",
    "shard_rows",
    "estimate_shard_bytes",
    "fsdp_units",
]

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of each floating-point dtype the book uses."""


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

    def padded_numel(self, world_size: int) -> int:
        """Elements of the unit's unsharded buffer: every dim 0 padded to a multiple of N."""
        check_world(world_size)
        return sum(-(-s[0] // world_size) * world_size * prod(s[1:]) for s in self.shapes)


def fsdp_units(config: ModelConfig) -> list[Unit]:
    """The units :func:`handbook_lib.training.apply_fsdp2` creates, in forward order.

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
