"""What a rank does for sequence parallelism beyond the model's layout: check its attention.

Chapter 9 uses it through the ``sequence_parallel`` and ``tensor_parallel`` runs. Rank
``r`` holds rows ``dp_rank`` of the global batch and positions ``sp_rank`` of each sequence
(:func:`handbook_lib.runtime.axes.layout_batches`); the parameters are the same on every rank of
an sp group and each computes gradients from its own tokens, so FSDP2 shards them over ``dp × sp``
(:func:`handbook_lib.runtime.build.apply_axes`, as torchtitan folds its context-parallel
axis into FSDP's mesh). Every rank holds as many tokens, so the mean of the ranks' mean losses
is the global batch's mean loss: the same as one process
(:func:`handbook_lib.runtime.training.train_one_process`).

:func:`measure_attention_error` runs the distributed attention core once on random q, k, v
against full causal attention, before training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from handbook_lib.core.parallel_config import ParallelConfig
from handbook_lib.runtime.mesh import LayoutMesh
from handbook_lib.runtime.parallel_model import AttentionCore, causal_attention

__all__ = ["AttentionError", "measure_attention_error"]


@dataclass(frozen=True)
class AttentionError:
    """The distributed core against full causal attention, on this rank's chunk: the
    reference's largest magnitude and the largest difference, for the output and for the q, k, v
    gradients (of the sum of the output times a fixed random weight)."""

    out_scale: float
    out_diff: float
    grad_scale: float
    grad_diff: float


def measure_attention_error(core: AttentionCore, config: ParallelConfig, mesh: LayoutMesh,
                            device: torch.device, batch: int = 2) -> AttentionError:
    """Run ``core`` on random q, k, v (``batch`` × ``seq_len`` × ``nhead`` × head_dim, drawn
    from ``config.seed``, the same on every rank) split by this rank's sp position, and compare
    its output and gradients with :func:`causal_attention` on the whole sequence."""
    gen = torch.Generator().manual_seed(config.seed + 9_999)
    heads = config.nhead // mesh.layout.tp  # a tensor-parallel rank attends with its heads
    shape = (batch, config.seq_len, heads, config.d_model // config.nhead)
    q, k, v, weight = (torch.randn(shape, generator=gen).to(device) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = causal_attention(*full)
    (reference * weight).sum().backward()
    chunk = config.seq_len // mesh.layout.sp
    part = slice(mesh.sp_rank * chunk, (mesh.sp_rank + 1) * chunk)
    mine = [t[:, part].clone().requires_grad_() for t in (q, k, v)]
    out = core(*mine)
    (out * weight[:, part]).sum().backward()
    grads = [(m.grad, f.grad[:, part]) for m, f in zip(mine, full)]
    return AttentionError(
        out_scale=reference[:, part].abs().max().item(),
        out_diff=(out.detach() - reference.detach()[:, part]).abs().max().item(),
        grad_scale=max(want.abs().max().item() for _, want in grads),
        grad_diff=max((got - want).abs().max().item() for got, want in grads))
