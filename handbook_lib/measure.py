"""Read what a rank really holds: bytes of parameter shards, gradients, optimizer state.

Chapter 1 introduces it. After ``fully_shard``, every parameter is a ``DTensor``; its local
tensor is this rank's shard. Counting those local tensors' bytes is a measurement of the run,
independent of the memory model's arithmetic, which is why the two can be compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = [
    "ParamBytes",
    "local_tensor",
    "measure_param_bytes",
    "measure_grad_bytes",
    "measure_optimizer_bytes",
]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor, or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class ParamBytes:
    """Measured bytes of one rank's parameters."""

    shard_bytes: int
    """Bytes of the parameter values this rank holds (sum of local tensors)."""
    storage_bytes: int
    """Bytes of the storage behind them: FSDP pads each shard to equal size on every rank."""

    @property
    def padding_bytes(self) -> int:
        """``storage_bytes - shard_bytes``: the padding FSDP allocated on this rank."""
        return self.storage_bytes - self.shard_bytes


def measure_param_bytes(module: nn.Module) -> ParamBytes:
    """Measure the bytes of ``module``'s parameters held by this rank.

    FSDP2 keeps each parameter's shard in its own padded buffer and exposes the unpadded rows as
    the DTensor's local tensor (a view of that buffer), so the buffer's size reveals the padding.
    For a plain (unsharded) module both numbers are the full parameter bytes.
    """
    shard = storage = 0
    for p in module.parameters():
        local = local_tensor(p)
        shard += _nbytes(local)
        storage += local.untyped_storage().nbytes() if local.numel() else 0
    return ParamBytes(shard_bytes=shard, storage_bytes=storage)


def measure_grad_bytes(module: nn.Module) -> int:
    """Bytes of the gradients this rank holds for ``module`` (0 for parameters without one)."""
    return sum(_nbytes(local_tensor(p.grad)) for p in module.parameters() if p.grad is not None)


def measure_optimizer_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Bytes of optimizer state on this rank.

    Returns:
        ``(sharded, other)``: bytes of state tensors with one element per parameter element
        (Adam's two moments, SGD's momentum buffer: DTensors sharded like the parameters), and
        bytes of all other state tensors (Adam's per-parameter ``step`` scalars, replicated).
    """
    sharded = other = 0
    for param, state in optimizer.state.items():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            local = local_tensor(value)
            if value.shape == param.shape:
                sharded += _nbytes(local)
            else:
                other += _nbytes(local)
    return sharded, other
