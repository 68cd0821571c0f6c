"""The handbook's model with its attention split open, for tensor and sequence parallelism.

Chapter 9 introduces it. :class:`~handbook_lib.runtime.model.SimpleTransformer` computes
attention with ``nn.MultiheadAttention``, whose query, key and value projections are one fused
``in_proj_weight`` of shape (3d, d). Tensor parallelism splits projections by heads
(``ColwiseParallel`` on each of Q, K and V, ``RowwiseParallel`` on the output), and sequence
parallelism replaces the attention core (DeepSpeed Ulysses' all-to-alls, a ring of sends), so
both need the projections as separate ``nn.Linear`` modules and the core as a function.

:class:`ParallelTransformer` is that model. :func:`from_simple` copies a
:class:`SimpleTransformer`'s weights into it (``in_proj_weight`` cut into its three (d, d)
blocks), so the two compute the same function from the same seed: a run of chapter 9 is checked
against one process of the book's model (:func:`handbook_lib.runtime.training.train_one_process`).
The parameters are the same numbers in a different arrangement: 4d² + 4d per layer's attention,
as chapter 1 counts them.

Per layer (post-norm, as the book's model)::

    q, k, v = q_proj(x), k_proj(x), v_proj(x)      # (b, s, h, d/h) each, h = the heads held
    x = norm1(x + out_proj(core(q, k, v)))         # core: causal attention over the sequence
    x = norm2(x + linear2(gelu(linear1(x))))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn
from torch.nn import functional as F

from handbook_lib.core.architecture import ModelConfig
from handbook_lib.runtime.model import SimpleTransformer, TransformerLayer

__all__ = ["PAD_LOGIT_BIAS", "AttentionCore", "causal_attention", "SplitAttention", "ParallelLayer",
           "ParallelTransformer", "from_simple"]

AttentionCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``core(q, k, v) -> out``: causal attention on tensors of shape (batch, seq, heads, head_dim),
the heads and the sequence this rank holds; ``out`` has the shape of ``q``. Sequence
parallelism swaps it for a distributed one (Ulysses, a ring) that sees the whole sequence."""


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The default :data:`AttentionCore`: softmax(q kᵀ / √head_dim) v over the local sequence,
    each position attending to itself and the positions before it (``scaled_dot_product_attention``
    with ``is_causal=True``). Shapes (batch, seq, heads, head_dim) in and out."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True)
    return out.transpose(1, 2)


class SplitAttention(nn.Module):
    """Multi-head self-attention with separate ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj``
    (each ``nn.Linear(d, d)`` with a bias) and a replaceable :attr:`core`.

    The number of heads is read from the projections' output width at each call (width divided
    by ``head_dim``), so once ``ColwiseParallel`` has cut Q, K and V to 1/tp of their rows, each
    rank computes its h/tp heads with no other change.
    """

    def __init__(self, d_model: int, nhead: int) -> None:
        super().__init__()
        if d_model % nhead:
            raise ValueError(f"nhead={nhead} must divide d_model={d_model}")
        self.head_dim = d_model // nhead
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.core: AttentionCore = causal_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (batch, seq, d_model) → (batch, seq, d_model)."""
        b, s = x.shape[0], x.shape[1]
        q, k, v = (proj(x).view(b, s, -1, self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(self.core(q, k, v).reshape(b, s, -1))


class ParallelLayer(nn.Module):
    """One post-norm block of the book's model with :class:`SplitAttention`: what
    :class:`~handbook_lib.runtime.model.TransformerLayer` computes, with the same parameter names
    outside the attention (``linear1``, ``linear2``, ``norm1``, ``norm2``)."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int) -> None:
        super().__init__()
        self.self_attn = SplitAttention(d_model, nhead)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.self_attn(x))
        return self.norm2(x + self.linear2(F.gelu(self.linear1(x))))


class ParallelTransformer(nn.Module):
    """Token embedding, ``num_layers`` :class:`ParallelLayer` blocks, linear output head: the
    book's model, ready for tensor and sequence parallelism (build it with :func:`from_simple`).

    ``forward(tokens)`` takes int64 token ids (batch, seq) and returns logits (batch, seq,
    vocab_size); attention is causal. Under sequence parallelism ``tokens`` is this rank's slice
    of the sequence and the layers' :attr:`SplitAttention.core` sees the rest.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(ParallelLayer(config.d_model, config.nhead, config.dim_feedforward)
                                    for _ in range(config.num_layers))
        self.output = nn.Linear(config.d_model, config.vocab_size)
        self.core: AttentionCore = causal_attention
        """Every layer's attention core (:meth:`set_core`)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(x)

    def set_core(self, core: AttentionCore) -> None:
        """Use ``core`` as every layer's attention core."""
        self.core = core
        for layer in self.layers:
            layer.self_attn.core = core


def _copy_layer(src: TransformerLayer, dst: ParallelLayer) -> None:
    attn = src.self_attn
    for proj, weight, bias in zip((dst.self_attn.q_proj, dst.self_attn.k_proj, dst.self_attn.v_proj),
                                  attn.in_proj_weight.chunk(3), attn.in_proj_bias.chunk(3)):
        proj.weight.copy_(weight)
        proj.bias.copy_(bias)
    for name in ("weight", "bias"):
        getattr(dst.self_attn.out_proj, name).copy_(getattr(attn.out_proj, name))
    for part in ("linear1", "linear2", "norm1", "norm2"):
        getattr(dst, part).load_state_dict(getattr(src, part).state_dict())


PAD_LOGIT_BIAS = -1e4
"""The head's bias on padded vocabulary rows: their logits sit 10,000 below the others, so
``exp`` underflows to 0 in fp32 and bf16 and the softmax, the loss and every gradient are those
of the unpadded model (the rows' own gradients are 0, so they stay as built)."""


@torch.no_grad()
def from_simple(model: SimpleTransformer, vocab_size: int | None = None) -> ParallelTransformer:
    """A :class:`ParallelTransformer` holding ``model``'s weights: the same function of the
    tokens (causal), its attention projections split.

    Args:
        model: The book's causal model.
        vocab_size: The rows of the embedding and the head, at least ``model``'s vocabulary
            (``None``: the same): a tensor-parallel group pads its vocabulary to a multiple of its
            size. The padded rows hold zeros, and the head's bias there is :data:`PAD_LOGIT_BIAS`.

    Raises:
        ValueError: if ``model`` is not causal (chapter 9's runs train the causal model only),
            or ``vocab_size`` is below its vocabulary.
    """
    if not model.causal:
        raise ValueError("from_simple takes the causal model (build_model(..., causal=True))")
    vocab = model.config.vocab_size
    padded = vocab if vocab_size is None else vocab_size
    if padded < vocab:
        raise ValueError(f"vocab_size={padded} is below the model's vocabulary ({vocab}): padding only adds rows")
    out = ParallelTransformer(replace(model.config, vocab_size=padded))
    for name in ("embedding", "output"):
        for key, value in getattr(model, name).state_dict().items():
            target = getattr(getattr(out, name), key)
            target.zero_()
            target[:vocab].copy_(value)
    out.output.bias[vocab:] = PAD_LOGIT_BIAS
    for src, dst in zip(model.layers, out.layers):
        _copy_layer(src, dst)
    return out
