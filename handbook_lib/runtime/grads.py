"""Gradients across ranks: their total norm, clipping, and how many are exactly zero.

Chapter 5 uses it: clipping sharded gradients must give the norm one process would compute
(:func:`clip_grad_norm` against :func:`full_grad_norm`), and fp16 without loss scaling shows as
gradients that underflow to exactly zero (:func:`grad_zero_fraction`).
"""

from __future__ import annotations

import torch
from torch import nn

from handbook_lib.runtime.measure import local_tensor

__all__ = ["grad_zero_fraction", "clip_grad_norm", "full_grad_norm", "is_fsdp1"]


def grad_zero_fraction(model: nn.Module) -> float:
    """Fraction of this rank's gradient elements that are exactly zero (0.0–1.0).

    Embedding rows of tokens absent from the batch have zero gradients in any precision; in
    fp16 without loss scaling, gradients below ~6e-8 also round to zero (underflow), which this
    fraction makes visible.
    """
    zeros = total = 0
    for p in model.parameters():
        if p.grad is not None:
            g = local_tensor(p.grad)
            zeros += int((g == 0).sum())
            total += g.numel()
    return zeros / total if total else 0.0

def _total_norm(grads: list[torch.Tensor]) -> float:
    """The L2 norm of all ``grads`` together, each tensor's summed in float64 (a DTensor's norm
    is reduced across its mesh by ``full_tensor()``)."""
    norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]
    norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip the gradients to a total L2 norm of ``max_norm``; return the norm before clipping.

    The norm is the whole model's, over every rank's shard: FSDP2's gradients are DTensors,
    whose norms are reduced across the mesh; DDP and a plain module hold whole gradients; FSDP1
    needs its own ``FullyShardedDataParallel.clip_grad_norm_``. As ``clip_grad_norm_`` does,
    gradients are scaled by ``max_norm / (norm + 1e-6)`` when that is below 1 — but each
    tensor's norm is summed in float64: ``clip_grad_norm_``'s fp32 sums drift by about 1e-4
    relative on a 2.56M-element gradient on a CPU (chapter 5), more than sharding changes.
    The same gradient then gives the same norm on one process and on N ranks.
    """
    if is_fsdp1(model):
        return float(model.clip_grad_norm_(max_norm))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = _total_norm(grads)
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1:
        for g in grads:
            g.mul_(coefficient)
    return total

def is_fsdp1(model: nn.Module) -> bool:
    """True for a model wrapped by FSDP1's ``FullyShardedDataParallel``."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    return isinstance(model, FSDP1)

def full_grad_norm(model: nn.Module) -> float:
    """The total L2 norm of the gradient as one process computes it: every gradient made
    whole first (a DTensor's ``full_tensor()``, an all-gather), then each tensor's norm summed
    in float64, as :func:`clip_grad_norm` does with the shards.

    A check on :func:`clip_grad_norm`, which combines the norms of the shards across ranks
    instead. Gathering costs a copy of every gradient; FSDP1's flat gradients are not DTensors
    and are refused.

    Raises:
        TypeError: for an FSDP1 model.
    """
    if is_fsdp1(model):
        raise TypeError("full_grad_norm needs DTensor or whole gradients; FSDP1's are flat shards")
    return _total_norm([p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                        for p in model.parameters() if p.grad is not None])
