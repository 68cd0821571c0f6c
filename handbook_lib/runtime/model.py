"""The handbook's model: a small decoder-style transformer, as a ``torch`` module.

Chapter 1 introduces it. Every later chapter trains, shards, measures and checkpoints this
model. Its config and its parameter count, which need no ``torch``, live in
:mod:`handbook_lib.core.architecture`.

Architecture (per layer, post-norm)::

    x = norm1(x + self_attn(x))        # nn.MultiheadAttention, batch_first, causal mask
                                       # (``causal=False`` drops it: see SimpleTransformer)
    x = norm2(x + linear2(gelu(linear1(x))))

and around the layers: a token embedding in front, a linear output head (with bias) behind.
There is no positional embedding and no final norm: the model is a teaching object, kept to the
parameters whose counts the book derives by hand.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from handbook_lib.core.architecture import ModelConfig

__all__ = [
    "TransformerLayer",
    "SimpleTransformer",
    "model_parts",
    "build_model",
    "count_parameters",
]


class TransformerLayer(nn.Module):
    """One post-norm transformer block: self-attention then a GELU feed-forward.

    This is the unit that FSDP wraps (one ``fully_shard`` call per layer).
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, batch_first=True)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the block to ``x`` of shape (batch, seq, d_model)."""
        attn, _ = self.self_attn(x, x, x, attn_mask=attn_mask, need_weights=False)
        x = self.norm1(x + attn)
        return self.norm2(x + self.linear2(F.gelu(self.linear1(x))))


class SimpleTransformer(nn.Module):
    """Token embedding, ``num_layers`` :class:`TransformerLayer` blocks, linear output head.

    ``forward(tokens)`` takes int64 token ids of shape (batch, seq) and returns logits of shape
    (batch, seq, vocab_size). Attention is causal, so position t sees tokens 0..t only and the
    model can be trained on next-token prediction.

    Args:
        config: The model shape.
        causal: ``True`` (the default) masks attention to later positions. ``False`` drops the
            mask, as the course's seed does: a bidirectional encoder, in which position t also
            sees tokens t+1.. — including the one it is asked to predict. Chapter 1 trains both
            on next-token prediction (:mod:`handbook_lib.lessons.causality`). It changes no parameter.
    """

    def __init__(self, config: ModelConfig = ModelConfig(), *, causal: bool = True) -> None:
        super().__init__()
        if not isinstance(causal, bool):
            raise ValueError(f"causal must be True or False, got {causal!r}")
        self.config = config
        self.causal = causal
        made = {name: make() for name, make in model_parts(config)}  # in the RNG's order
        self.embedding = made["embedding"]
        self.layers = nn.ModuleList(made[f"layers.{i}"] for i in range(config.num_layers))
        self.output = made["output"]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        # Boolean mask: True marks a position that may NOT be attended to.
        mask = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).triu(1) if self.causal else None
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x, attn_mask=mask)
        return self.output(x)


def model_parts(config: ModelConfig) -> list[tuple[str, Callable[[], nn.Module]]]:
    """The model's top-level parts, ``(name, constructor)``, in the order
    :class:`SimpleTransformer` builds them: ``embedding``, ``layers.0`` ... ``layers.{L-1}``,
    ``output``.

    Each constructor draws its initial weights from torch's global random generator, so building
    the parts one by one in this order from the same seed gives the very weights of
    ``build_model(config, seed=...)``: :func:`handbook_lib.runtime.seeded_init.seeded_parts` uses that to
    initialise a model built on the meta device without ever holding all of it.
    """
    layer = lambda: TransformerLayer(config.d_model, config.nhead, config.dim_feedforward)  # noqa: E731
    return [("embedding", lambda: nn.Embedding(config.vocab_size, config.d_model)),
            *((f"layers.{i}", layer) for i in range(config.num_layers)),
            ("output", lambda: nn.Linear(config.d_model, config.vocab_size))]


def build_model(config: ModelConfig = ModelConfig(), *, seed: int | None = None,
                causal: bool = True) -> SimpleTransformer:
    """Construct a :class:`SimpleTransformer` on the CPU.

    Args:
        config: The model shape.
        seed: If given, ``torch.manual_seed(seed)`` is called first, so every process that builds
            the model with the same seed holds the same initial weights.
        causal: Mask attention to later positions (the default); ``False`` builds the seed's
            bidirectional variant, with the same weights for the same seed.
    """
    if seed is not None:
        torch.manual_seed(seed)
    return SimpleTransformer(config, causal=causal)


def count_parameters(module: nn.Module) -> tuple[int, int]:
    """Count a module's parameters by walking it.

    Returns:
        ``(total, trainable)``: numbers of scalar parameters (elements, not bytes).
    """
    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return total, trainable
