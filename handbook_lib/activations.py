"""Activation memory: what the forward pass keeps for the backward pass. Pure arithmetic.

Chapter 2 teaches it, with two models:

- :func:`estimate_activation_bytes` counts, tensor by tensor, what autograd saves for the
  handbook's own :class:`~handbook_lib.model.SimpleTransformer` (PyTorch's CPU kernels; the
  chapter-2 runs check it against a memory tracker);
- :func:`estimate_decoder_activation_bytes` is the published per-layer formula for GPT-style
  decoders (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
  2022), for the large models of the chapter's scenarios, which we cannot run here.
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.sharding import dtype_bytes
from handbook_lib.model import ModelConfig

__all__ = [
    "ActivationBytes",
    "DecoderShape",
    "DECODER_SHAPES",
    "estimate_activation_bytes",
    "estimate_decoder_activation_bytes",
]

_INDEX_BYTES = 8  # int64 token ids and targets


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes of activations one rank keeps for backward, for one micro-batch."""

    per_layer: int
    """Saved by one transformer layer."""
    layers: int
    """Saved by all layers (``per_layer * num_layers``, or the layer inputs only with AC)."""
    head: int
    """Saved outside the layers: token ids, the head's input, log-softmax output, targets."""
    recompute: int
    """Extra bytes alive while one checkpointed layer is recomputed in backward (0 without AC)."""

    @property
    def total(self) -> int:
        """Bytes held at the end of the forward pass: ``layers + head``."""
        return self.layers + self.head


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def estimate_activation_bytes(
    config: ModelConfig,
    micro_batch: int,
    seq_len: int,
    compute_dtype: str = "fp32",
    *,
    activation_checkpointing: bool = False,
) -> ActivationBytes:
    """Bytes that autograd saves in one forward pass of ``SimpleTransformer(config)``.

    With T = micro_batch·seq_len tokens, width d, feed-forward width f, h heads and c bytes per
    element of the compute dtype, one layer saves (counted from the kernels' saved tensors):

    - ``T·d·c`` ×5: the layer input (for the Q/K/V projection), the attention output (for the
      output projection), and the inputs of norm1, linear1 and norm2;
    - ``T·3d·c``: Q, K and V (one tensor from the fused input projection);
    - ``T·f·c`` ×2: GELU's input and output (the inputs of GELU and of linear2);
    - ``4·T·4`` bytes: each LayerNorm's mean and reciprocal std (fp32, two norms);
    - ``h·T·4`` bytes: the attention's log-sum-exp (fp32, fused CPU attention kernel);
    - ``s²·c`` bytes: the boolean causal mask, converted by the attention into an additive
      (1, 1, s, s) float mask in the compute dtype.

    That is ``T·(8d + 2f)·c + T·(16 + 4h) + s²·c`` bytes. Outside the layers the model saves the
    token ids and targets (int64), the head's input (``T·d·c``), the log-softmax output of the
    loss, always fp32 (``T·V·4``), and the loss's 4-byte weight total. With activation checkpointing each layer keeps only its input
    (``T·d·c``) and recomputes the rest, one layer at a time, in backward.

    The count is exact for fp32 on PyTorch 2.x's CPU kernels (the tests compare it with the
    tensors autograd saves); in bf16 and on GPUs the kernels save slightly different tensors
    (the chapter-2 runs report the difference).
    """
    _check_positive(micro_batch=micro_batch, seq_len=seq_len)
    c = dtype_bytes(compute_dtype)
    d, f, h, v = config.d_model, config.dim_feedforward, config.nhead, config.vocab_size
    tokens = micro_batch * seq_len
    per_layer = tokens * (8 * d + 2 * f) * c + tokens * (16 + 4 * h) + seq_len**2 * c
    head = 2 * tokens * _INDEX_BYTES + tokens * d * c + tokens * v * 4 + 4
    if activation_checkpointing:
        layers = config.num_layers * tokens * d * c
        recompute = per_layer
    else:
        layers = config.num_layers * per_layer
        recompute = 0
    return ActivationBytes(per_layer=per_layer, layers=layers, head=head, recompute=recompute)


@dataclass(frozen=True)
class DecoderShape:
    """Shape of a GPT-style decoder (4d feed-forward), enough to estimate its memory."""

    name: str
    num_layers: int
    d_model: int
    num_heads: int
    vocab_size: int = 50_257

    @property
    def num_params(self) -> int:
        """Approximate parameter count: ``12·L·d² + V·d`` (layers plus tied embedding)."""
        return 12 * self.num_layers * self.d_model**2 + self.vocab_size * self.d_model


DECODER_SHAPES: dict[str, DecoderShape] = {
    # Depth, width and heads of well-known decoders (Llama 2 paper, Touvron et al. 2023, for the
    # 7B/13B/70B sizes; GPT-3 paper, Brown et al. 2020, Table 2.1, for 175B), approximated as
    # GPT-style blocks with a 4d feed-forward: the counts land within ~10 % of the names.
    "7b": DecoderShape("7B", num_layers=32, d_model=4096, num_heads=32, vocab_size=32_000),
    "13b": DecoderShape("13B", num_layers=40, d_model=5120, num_heads=40, vocab_size=32_000),
    "70b": DecoderShape("70B", num_layers=80, d_model=8192, num_heads=64, vocab_size=32_000),
    "175b": DecoderShape("175B", num_layers=96, d_model=12288, num_heads=96, vocab_size=50_257),
}
"""Shapes for the chapter-2 scenarios, by nominal size (chapter 4 adds exact presets)."""


def estimate_decoder_activation_bytes(
    shape: DecoderShape,
    micro_batch: int,
    seq_len: int,
    *,
    recompute: str = "none",
    fused_attention: bool = True,
) -> int:
    """Activation bytes of a GPT-style decoder in 16-bit training (Korthikanti et al., 2022).

    Per layer, with s = seq_len, b = micro_batch, h = d_model, a = heads:

    - ``none``: ``34·s·b·h`` bytes, plus ``5·a·s²·b`` for the attention scores, their softmax
      and dropout that an unfused ("eager") attention stores; a fused kernel (FlashAttention,
      PyTorch's SDPA) stores none of them, which is why ``fused_attention`` defaults to True;
    - ``selective`` (recompute attention only): ``34·s·b·h``;
    - ``full`` (checkpoint every layer): ``2·s·b·h``, the layer input.

    Returns:
        Bytes for all layers (the embedding and loss terms are small at this scale and omitted).
    """
    _check_positive(micro_batch=micro_batch, seq_len=seq_len)
    sbh = seq_len * micro_batch * shape.d_model
    per_layer = {
        "none": sbh * 34 + (0 if fused_attention else 5 * shape.num_heads * seq_len**2 * micro_batch),
        "selective": 34 * sbh,
        "full": 2 * sbh,
    }
    if recompute not in per_layer:
        raise ValueError(f"recompute must be one of {', '.join(per_layer)}, got {recompute!r}")
    return shape.num_layers * per_layer[recompute]
