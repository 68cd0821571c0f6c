"""A Llama-family decoder as a ``torch`` module, built from its shape: what the memory model's
operator-by-operator count of a gated decoder is checked against.

Chapter 2 measures it. :class:`Decoder` is Transformers' ``LlamaForCausalLM`` written out with
the same modules, names and operators (RMSNorm computed in fp32, rotary embeddings by
``rotate_half``, PyTorch's fused attention with grouped-query heads, a SwiGLU feed-forward), so
a checkpoint's state dict loads into it (less the ``model.`` prefix) and its forward gives the
same logits; the tests check both. It is built from a
:class:`~handbook_lib.models.presets.DecoderShape`, which
:func:`~handbook_lib.models.hf_config.decoder_shape_from_hf` reads from a ``config.json``:
nothing is downloaded. Its layers sit in ``model.layers``, as the book's model's do, so
:func:`~handbook_lib.runtime.recompute.apply_activation_checkpointing` wraps them with any policy.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from handbook_lib.core.config import checkpointing_mode
from handbook_lib.models.presets import DecoderShape

__all__ = ["RMSNorm", "DecoderLayer", "Decoder", "ROPE_THETA", "measure_activation_bytes"]

ROPE_THETA = 10_000.0
"""The rotary embedding's base (Llama 2's; it changes no byte the model saves)."""


class RMSNorm(nn.Module):
    """Root-mean-square normalisation as Transformers' ``LlamaRMSNorm``: computed in fp32, the
    weight applied in the input's dtype (``eps`` is a number, no unit)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` over its last dimension."""
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Grouped-query self-attention with rotary embeddings (Transformers' ``LlamaAttention``)."""

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        d, hd = shape.d_model, shape.head_width
        qkv_bias = shape.bias or shape.qkv_bias
        self.heads, self.kv_heads, self.head_dim = shape.nhead, shape.kv_heads, hd
        self.q_proj = nn.Linear(d, shape.nhead * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(d, shape.kv_heads * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(d, shape.kv_heads * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(shape.nhead * hd, d, bias=shape.bias or shape.out_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attend causally over ``x`` (batch, seq, d_model) with RoPE tables ``cos``, ``sin``."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """The SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        bias = shape.bias or shape.mlp_bias
        self.gate_proj = nn.Linear(shape.d_model, shape.ffn, bias=bias)
        self.up_proj = nn.Linear(shape.d_model, shape.ffn, bias=bias)
        self.down_proj = nn.Linear(shape.ffn, shape.d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` (batch, seq, d_model)."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm layer: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.d_model)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.d_model)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Apply the layer to ``x`` (batch, seq, d_model)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.d_model)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.d_model)


class Decoder(nn.Module):
    """A Llama-family causal language model of ``shape`` (gated feed-forward; GPT's shapes are
    refused): ``forward(tokens)`` takes int64 ids (batch, seq) and returns logits (batch, seq,
    vocab_size) in the parameters' dtype.

    Raises:
        ValueError: for a shape without a gated feed-forward, or with learned positions.
    """

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        if not shape.gated_mlp or shape.max_positions:
            raise ValueError(f"Decoder builds the Llama family (a gated feed-forward, rotary positions); "
                             f"{shape.name} has a {'gated' if shape.gated_mlp else 'two-projection'} "
                             f"feed-forward and {shape.max_positions} learned positions")
        self.shape = shape
        self.model = _Body(shape)
        self.lm_head = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        if shape.tied_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rope(self, seq_len: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin tables for positions 0..seq_len-1, shape (1, 1, seq, head_dim)."""
        hd = self.shape.head_width
        inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd)
        freqs = torch.arange(seq_len, device=device).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[None, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for ``tokens`` (batch, seq)."""
        x = self.model.embed_tokens(tokens)
        cos, sin = self.rope(tokens.shape[1], x.dtype, x.device)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers (what FSDP wraps and checkpointing recomputes)."""
        return self.model.layers


def measure_activation_bytes(shape: DecoderShape, micro_batch: int, seq_len: int, compute_dtype: str = "bf16", *,
                             activation_checkpointing: bool | str = "none", every: int = 1, matmul_every: int = 1,
                             ac_save: str = "matmul+attention", seed: int = 0) -> int:
    """Build :class:`Decoder` of ``shape`` in ``compute_dtype`` (``fp32`` or ``bf16``) on the
    CPU, checkpoint it with the given policy (``ac_save``: what a selective one keeps), and
    measure the bytes its forward pass and loss leave alive for backward, token ids and targets
    included (made inside the measurement) and the 4-byte loss value excluded: what
    :meth:`~handbook_lib.models.layout.ModelLayout.activations` predicts as ``total``. Measured
    with :class:`~handbook_lib.runtime.measure.NewBytesPeak` (storages created by the operators
    and not yet freed), independently of the model."""
    from handbook_lib.runtime.measure import NewBytesPeak
    from handbook_lib.runtime.recompute import apply_activation_checkpointing

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[compute_dtype]
    torch.manual_seed(seed)
    model = Decoder(shape).to(dtype)
    apply_activation_checkpointing(model, checkpointing_mode(activation_checkpointing), every, matmul_every, ac_save)
    gen = torch.Generator().manual_seed(seed)
    with NewBytesPeak() as made:
        tokens, targets = (torch.randint(0, shape.vocab_size, (micro_batch, seq_len), generator=gen)
                           for _ in range(2))
        loss = F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
        alive = made.live - loss.nbytes
    loss.backward()
    return alive
