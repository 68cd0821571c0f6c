"""Ring attention on the CPU: causal attention over a sequence split across ranks, by point-to-
point sends of K and V blocks around a ring.

Chapter 9 teaches it (Liu et al. 2023, "Ring Attention with Blockwise Transformers",
arXiv 2310.01889). Rank r of the sequence-parallel group holds chunk r of every sequence (its
queries, keys and values). In forward, P steps: at each one it attends its queries to the K, V
block it holds — all of an earlier chunk, its own causally, none of a later one — merges that
block's output into its running output by their log-sum-exps (the online softmax), and passes
the block to rank r+1 while receiving rank r-1's (``isend``/``irecv``, started before the block's
attention, so the transfer can hide behind it). It saves only its own q, k, v, its output and
its log-sum-exp. In backward, it recomputes each block's probabilities from the saved
log-sum-exp, and passes K and V around the ring again with their dK and dV accumulators, which
arrive home after one more step.

On GPUs this is what PyTorch's ``context_parallel``
(``torch.distributed.tensor.experimental.context_parallel``) does inside
``scaled_dot_product_attention``, with a head-tail load balancer; it supports only the CUDA
flash, memory-efficient and cuDNN kernels, so the book's CPU runs use this ring.
:mod:`handbook_lib.models.sequence_parallel` counts its transfers
(:func:`~handbook_lib.models.sequence_parallel.estimate_sp_collectives`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["RingAttention", "causal_ring_attention", "ring_core"]


class _Ring:
    """The sp group's ring from this rank: its position, the global ranks before and after it."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensors: list[torch.Tensor], tag: int = 0) -> tuple[list[torch.Tensor], list[dist.Work]]:
        """Send ``tensors`` to the next rank and receive as many from the previous one, without
        waiting, with tags ``tag``, ``tag + 1`` ...: ``(receive buffers, works)``."""
        received = [torch.empty_like(t) for t in tensors]
        works = []
        for i, (out, into) in enumerate(zip(tensors, received)):
            works.append(dist.isend(out, self.next, group=self.group, tag=tag + i))
            works.append(dist.irecv(into, self.prev, group=self.group, tag=tag + i))
        return received, works


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    """q kᵀ · scale, (b, h, s_q, s_k); the diagonal block masks the future (upper triangle)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if diagonal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's chunk against every earlier chunk of the ring, and its
    gradient. Tensors (batch, seq/P, heads, head_dim), as the layer's projections give them;
    the output is contiguous in that order (as the CPU SDPA kernel's), so the layer's reshape is
    a view."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                group: dist.ProcessGroup) -> torch.Tensor:
        ring = _Ring(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        query = q.transpose(1, 2)  # (b, h, s, hd) views
        out = lse = None
        block = [k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()]
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size  # whose chunk ``block`` is
            incoming, works = ring.start(block) if step < ring.size - 1 else (None, [])
            if source <= ring.rank:  # an earlier chunk, or its own (causal); later ones skipped
                scores = _scores(query, block[0], scale, diagonal=source == ring.rank)
                block_lse = torch.logsumexp(scores, dim=-1)
                block_out = torch.matmul(torch.exp(scores - block_lse.unsqueeze(-1)), block[1])
                if out is None:
                    out, lse = block_out, block_lse
                else:
                    merged = torch.logaddexp(lse, block_lse)
                    out = (out * torch.exp(lse - merged).unsqueeze(-1)
                           + block_out * torch.exp(block_lse - merged).unsqueeze(-1))
                    lse = merged
            _wait(works)
            if incoming is not None:
                block = incoming
        assert out is not None  # step 0 is the rank's own chunk
        out = out.transpose(1, 2).contiguous()
        ctx.group = group
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        query, dout = q.transpose(1, 2), dout.transpose(1, 2)
        delta = (dout * out.transpose(1, 2)).sum(dim=-1, keepdim=True)  # rowsum(dO * O), (b, h, s, 1)
        dq = torch.zeros_like(query)
        block = [k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()]
        grads = [torch.zeros_like(block[0]), torch.zeros_like(block[1])]
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            incoming, works = ring.start(block) if step < ring.size - 1 else (None, [])
            if source <= ring.rank:
                scores = _scores(query, block[0], scale, diagonal=source == ring.rank)
                probs = torch.exp(scores - lse.unsqueeze(-1))
                grads[1] = grads[1] + torch.matmul(probs.transpose(-1, -2), dout)
                dscores = probs * (torch.matmul(dout, block[1].transpose(-1, -2)) - delta) * scale
                dq = dq + torch.matmul(dscores, block[0])
                grads[0] = grads[0] + torch.matmul(dscores.transpose(-1, -2), query)
            # the block's dK, dV travel with it; after the last step they arrive home
            grads, grad_works = ring.start(grads, tag=2)
            _wait(works + grad_works)
            if incoming is not None:
                block = incoming
        return dq.transpose(1, 2), grads[0].transpose(1, 2), grads[1].transpose(1, 2), None


def causal_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention of the sequence split over ``group`` (its rank i holds chunk i), on
    tensors (batch, seq/P, heads, head_dim) of this rank's chunk; returns this chunk's output,
    the same shape.

    Autograd keeps exactly what
    :func:`~handbook_lib.models.sequence_parallel.estimate_sp_activation_bytes` counts for the
    ring: q, k, v (the projections' outputs), this output and its fp32 log-sum-exp.
    """
    return RingAttention.apply(q, k, v, group)


def ring_core(group: dist.ProcessGroup):
    """An :data:`~handbook_lib.runtime.parallel_model.AttentionCore` for ``model.set_core``: the
    ring over ``group``."""

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_ring_attention(q, k, v, group)

    return core
