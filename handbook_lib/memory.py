"""The memory model: how many bytes of training state each rank holds. Pure: no ``torch``.

Chapter 1 uses the first two ideas — model state costs 16 bytes per parameter in fp32 with Adam,
and FSDP splits each parameter along its first dimension into equal, padded chunks. Chapter 2
builds the full per-component model on top of them.

FSDP's sharding rule (FSDP2 ``fully_shard`` and FSDP1 alike): a parameter whose first dimension
is ``n`` is cut into ``world_size`` chunks of ``ceil(n / world_size)`` rows; rank ``r`` holds rows
``[r·c, min((r+1)·c, n))`` (possibly none), and the storage of every shard is padded up to ``c``
rows so that all ranks' shards have equal size for the all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from handbook_lib.model import ModelConfig, param_count, param_shapes

__all__ = [
    "DTYPE_BYTES",
    "OPTIMIZER_STATES",
    "optimizer_states",
    "ModelStateBytes",
    "ShardBytes",
    "dtype_bytes",
    "shard_rows",
    "estimate_shard_bytes",
    "estimate_model_state_bytes",
]

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of each floating-point dtype the book uses."""


OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}
"""State tensors per parameter, each the parameter's shape: Adam's two moments, SGD's momentum.

(Adam also keeps one ``step`` scalar per parameter tensor; it is not sharded and not counted here.)
"""


def optimizer_states(optimizer: str) -> int:
    """How many parameter-shaped state tensors ``optimizer`` keeps (see :data:`OPTIMIZER_STATES`).

    Raises:
        ValueError: for an unknown optimizer, listing the accepted ones.
    """
    try:
        return OPTIMIZER_STATES[optimizer]
    except KeyError:
        raise ValueError(
            f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r}"
        ) from None


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (one of :data:`DTYPE_BYTES`).

    Raises:
        ValueError: for an unknown dtype, listing the accepted ones.
    """
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}"
        ) from None


def _check_world(world_size: int, rank: int | None = None) -> None:
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
    _check_world(world_size, rank)
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
        world_size: Number of ranks sharing the parameters.
        rank: The rank to predict for.
        dtype: Element type of the sharded copy (``fp32`` for FSDP's sharded parameters).
    """
    _check_world(world_size, rank)
    size = dtype_bytes(dtype)
    real = padded = 0
    for _, shape in param_shapes(config):
        rows, chunk = shard_rows(shape[0], world_size, rank)
        row = prod(shape[1:])
        real += rows * row * size
        padded += chunk * row * size
    return ShardBytes(shard_bytes=real, padding_bytes=padded - real)


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of unsharded model state: parameters, gradients and optimizer states."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        """Sum of the three components, bytes."""
        return self.params + self.grads + self.optimizer


def estimate_model_state_bytes(
    num_params: int | ModelConfig,
    *,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optimizer_bytes: int = 8,
) -> ModelStateBytes:
    """Model-state bytes of an unsharded model: the chapter-1 "16 bytes per parameter".

    The defaults are fp32 training with Adam: 4 B parameter + 4 B gradient + 8 B optimizer state
    (two fp32 moments) per parameter. Activations, temporary buffers and the Adam step counters
    are not included.

    Args:
        num_params: Number of parameters, or a model config to count.
        param_bytes: Bytes per parameter of the weights.
        grad_bytes: Bytes per parameter of the gradients.
        optimizer_bytes: Bytes per parameter of the optimizer states.
    """
    n = param_count(num_params) if isinstance(num_params, ModelConfig) else num_params
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"num_params must be an int >= 0 or a ModelConfig, got {num_params!r}")
    for name, value in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes),
                        ("optimizer_bytes", optimizer_bytes)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    return ModelStateBytes(params=n * param_bytes, grads=n * grad_bytes, optimizer=n * optimizer_bytes)
