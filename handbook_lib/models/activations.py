"""Activation memory: what the forward pass keeps for the backward pass. Pure arithmetic.

Chapter 2 teaches it, with two models:

- :func:`estimate_activation_bytes` counts, tensor by tensor, what autograd saves for the
  handbook's own :class:`~handbook_lib.runtime.model.SimpleTransformer` (PyTorch's CPU kernels; the
  chapter-2 runs check it against a memory tracker);
- :func:`gated_decoder_tensors` counts, tensor by tensor, what a Llama-family layer (RMSNorm,
  grouped-query attention with RoPE, SwiGLU) saves as Transformers writes it, on PyTorch's fused
  attention; :class:`~handbook_lib.runtime.decoder.Decoder` is that layer as a module the tests
  build from a Transformers config and measure;
- :func:`estimate_decoder_activation_bytes` is the published per-layer formula for GPT-style
  decoders (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
  2022), for the GPT-shaped models of the chapter's scenarios.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from handbook_lib.core.checks import check_int
from handbook_lib.core.config import AC_SAVE_POLICIES, checkpointing_mode, dtype_bytes

__all__ = [
    "SELECTIVE_SAVE",
    "MATRIX_PRODUCTS",
    "ATTENTION_OPS",
    "saved_families",
    "ModelSizes",
    "ActivationBytes",
    "estimate_activation_bytes",
    "estimate_decoder_activation_bytes",
    "checkpointed",
    "kept_products",
    "GatedDecoderTensors",
    "gated_decoder_tensors",
]

_INDEX_BYTES = 8  # int64 token ids and targets

MATRIX_PRODUCTS = ("mm", "addmm", "bmm")
"""The ``aten`` matrix products a selective policy counts when it keeps every n-th one only
(``ac_matmul_every``)."""

ATTENTION_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
"""The ``aten`` fused attentions, whose outputs (the attention's output and its fp32
log-sum-exp) a selective policy that keeps ``attention`` saves."""

SELECTIVE_SAVE = (*MATRIX_PRODUCTS, *ATTENTION_OPS)
"""The ``aten`` operators whose outputs selective activation checkpointing keeps by default (the
matrix products and the fused attentions); every other operator of a layer is recomputed in
backward. The runtime's policy (``handbook_lib.runtime.recompute``) and the memory model read
these lists (:func:`saved_families`)."""


def saved_families(ac_save: str = "matmul+attention") -> tuple[bool, bool]:
    """Whether a selective policy ``ac_save`` keeps the matrix products' outputs and the fused
    attention's: ``(matmul, attention)``.

    Raises:
        ValueError: for a policy outside :data:`~handbook_lib.core.config.AC_SAVE_POLICIES`.
    """
    if ac_save not in AC_SAVE_POLICIES:
        raise ValueError(f"ac_save must be one of {', '.join(AC_SAVE_POLICIES)}, got {ac_save!r}")
    families = ac_save.split("+")
    return "matmul" in families, "attention" in families


class ModelSizes(Protocol):
    """What the activation formulas read of a model: a
    :class:`~handbook_lib.core.architecture.ModelConfig`, a
    :class:`~handbook_lib.models.presets.DecoderShape` or a
    :class:`~handbook_lib.models.layout.ModelLayout` (counts, not bytes)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def nhead(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def dim_feedforward(self) -> int: ...


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes of activations one rank keeps for backward, for one micro-batch."""

    per_layer: int
    """Saved by one transformer layer."""
    layers: int
    """Saved by all layers (``per_layer * num_layers``, or the layer inputs only with AC)."""
    head: int
    """Saved outside the layers: token ids, the head's input, log-softmax output, targets; with
    checkpointing, also what every checkpointed layer takes as input besides its hidden state
    (the handbook model's boolean causal mask)."""
    recompute: int
    """Extra bytes alive while one checkpointed layer is recomputed in backward (0 without AC)."""
    by_layer: tuple[int, ...] = ()
    """What each layer saves, in forward order (summing to :attr:`layers`): ``per_layer`` for a
    layer that keeps everything, its input and what the policy keeps for a checkpointed one."""
    checkpointed_layers: tuple[bool, ...] = ()
    """Which layers are checkpointed (recomputed in backward), in forward order."""

    @property
    def total(self) -> int:
        """Bytes held at the end of the forward pass: ``layers + head``."""
        return self.layers + self.head


def estimate_activation_bytes(
    config: ModelSizes,
    micro_batch: int,
    seq_len: int,
    compute_dtype: str = "fp32",
    *,
    activation_checkpointing: bool | str = False,
    every: int = 1,
    matmul_every: int = 1,
    ac_save: str = "matmul+attention",
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
    loss, always fp32 (``T·V·4``), and the loss's 4-byte weight total.

    ``activation_checkpointing`` (``none``, ``selective`` or ``full``; ``True`` is ``full``):
    with ``full`` each layer keeps only its input (``T·d·c``) and recomputes the rest, one layer
    at a time, in backward. With ``selective`` it keeps its input and the outputs of its matrix
    products and attention, which the book's policy saves (:data:`SELECTIVE_SAVE`): Q/K/V
    (``T·3d·c``), the attention's output and log-sum-exp (``T·d·c + h·T·4``), the output
    projection, linear1 and linear2 (``T·(2d + f)·c``): ``T·(6d + f)·c + 4hT`` more per layer;
    what the recomputation holds is the rest of the layer's tensors. Either way the boolean
    causal mask (``s²`` bytes, one per micro-batch) stays alive: every checkpointed layer takes it
    as an input, and checkpointing keeps a layer's inputs for its recomputation. ``every`` k
    checkpoints layers 0, k, 2k, ... only (:func:`checkpointed`). ``matmul_every`` n keeps only
    the 1st, (n+1)-th, ... of a selective layer's matrix products (:func:`kept_products`: Q/K/V,
    the output projection, linear1, linear2 in forward order; torchtitan's policy is n = 2, which
    keeps Q/K/V and linear1), the attention's output always. ``ac_save`` ``matmul`` keeps the
    products only (the attention is recomputed), ``attention`` the attention's output and
    log-sum-exp only (:func:`saved_families`).

    The count is exact for fp32 on PyTorch 2.x's CPU kernels (the tests compare it with the
    tensors autograd saves); in bf16 and on GPUs the kernels save slightly different tensors
    (the chapter-2 runs report the difference).
    """
    check_int("micro_batch", micro_batch, 1)
    check_int("seq_len", seq_len, 1)
    c = dtype_bytes(compute_dtype)
    d, f, h, v = config.d_model, config.dim_feedforward, config.nhead, config.vocab_size
    tokens = micro_batch * seq_len
    per_layer = tokens * (8 * d + 2 * f) * c + tokens * (16 + 4 * h) + seq_len**2 * c
    head = 2 * tokens * _INDEX_BYTES + tokens * d * c + tokens * v * 4 + 4
    products = kept_products((3 * d, d, f, d), matmul_every, activation_checkpointing, ac_save)
    attention = (tokens * d * c + 4 * h * tokens) * saved_families(ac_save)[1]
    kept = {"selective": tokens * products * c + attention, "full": 0}
    if checkpointing_mode(activation_checkpointing) != "none":
        head += seq_len**2  # the bool mask, an input of every checkpointed layer
    return checkpointed(per_layer, tokens * d * c, kept, config.num_layers, head, activation_checkpointing, every)


def kept_products(widths: tuple[int, ...], every: int = 1, activation_checkpointing: bool | str = "selective",
                  ac_save: str = "matmul+attention") -> int:
    """The output widths a selective policy that keeps every ``every``-th matrix product saves:
    the products' ``widths`` (per token, in forward order) at positions 0, ``every``,
    ``2·every``, ... (1 keeps them all); 0 where the policy ``ac_save`` keeps no product.

    Raises:
        ValueError: for ``every`` below 1, or above 1 with a checkpointing mode other than
            ``selective`` or a policy that keeps no product (there is nothing to thin).
    """
    check_int("matmul_every", every, 1)
    mode = checkpointing_mode(activation_checkpointing)
    if every > 1 and mode != "selective":
        raise ValueError(f"matmul_every={every} keeps every n-th matrix product of the selective policy: it "
                         f"needs activation checkpointing 'selective', got {mode!r}")
    matmul, _ = saved_families(ac_save)
    if every > 1 and not matmul:
        raise ValueError(f"matmul_every={every} thins the kept matrix products, and ac_save={ac_save!r} keeps "
                         "none")
    return sum(widths[::every]) if matmul else 0


def checkpointed(per_layer: int, layer_input: int, kept: dict[str, int], num_layers: int, head: int,
                  activation_checkpointing: bool | str, every: int = 1, *,
                  shared: dict[str, int] | None = None) -> ActivationBytes:
    """The activations of ``num_layers`` layers of ``per_layer`` bytes each under a checkpointing
    mode: all of them (``none``); each checkpointed layer's input and what the mode keeps
    besides, ``kept[mode]`` (``selective``: the tensors its policy saves; ``full``: 0). With
    ``every`` k > 1 only layers 0, k, 2k, ... are checkpointed (torchtitan's "selective layer"
    checkpointing), the others keep all ``per_layer``. A layer being recomputed in backward
    holds the rest of its share, ``per_layer - kept[mode]``, or, where only ``shared[mode]``
    bytes of what the mode keeps are among the layer's saved tensors (a kept product that its
    next operator does not save), ``per_layer - shared[mode]``.

    Raises:
        ValueError: for ``every`` below 1, or above 1 without checkpointing.
    """
    check_int("every", every, 1)
    mode = checkpointing_mode(activation_checkpointing)
    if mode == "none":
        if every != 1:
            raise ValueError(f"every={every} checkpoints every k-th layer: it needs activation "
                             "checkpointing (full or selective), got none")
        return ActivationBytes(per_layer=per_layer, layers=num_layers * per_layer, head=head, recompute=0,
                               by_layer=(per_layer,) * num_layers, checkpointed_layers=(False,) * num_layers)
    marks = tuple(i % every == 0 for i in range(num_layers))
    by_layer = tuple(layer_input + kept[mode] if mark else per_layer for mark in marks)
    held = (shared or kept).get(mode, kept[mode])
    return ActivationBytes(per_layer=per_layer, layers=sum(by_layer), head=head,
                           recompute=per_layer - held, by_layer=by_layer, checkpointed_layers=marks)


@dataclass(frozen=True)
class GatedDecoderTensors:
    """What a gated decoder saves for backward in one micro-batch, tensor by tensor, bytes."""

    layer: tuple[tuple[str, int], ...]
    """One layer's saved tensors, in forward order: (what it is, bytes)."""
    head: tuple[tuple[str, int], ...]
    """What the model saves outside its layers: token ids, RoPE's tables, the final norm, the
    loss's log-softmax and targets."""
    products: tuple[int, ...]
    """Per token, the output widths of the layer's seven matrix products in forward order (Q, K,
    V, output, gate, up, down): what op-level selective checkpointing keeps."""
    shared_products: tuple[bool, ...]
    """Which of those products' outputs are also among :attr:`layer`'s tensors (V, the gate and
    the up projection: their next operators save them)."""

    @property
    def per_layer(self) -> int:
        """Bytes one layer saves."""
        return sum(b for _, b in self.layer)

    @property
    def outside(self) -> int:
        """Bytes saved outside the layers."""
        return sum(b for _, b in self.head)


def gated_decoder_tensors(sizes: ModelSizes, micro_batch: int, seq_len: int, compute_dtype: str = "bf16", *,
                          q_width: int = 0, kv_width: int = 0) -> GatedDecoderTensors:
    """The tensors a Llama-family decoder (Llama, Mistral, Qwen2: RMSNorm, grouped-query attention
    with rotary embeddings, a SwiGLU feed-forward) saves for backward, counted operator by
    operator as Transformers writes the layer and PyTorch's fused attention runs it.

    With T = micro_batch·seq_len tokens, width d, query width q, key/value width k (grouped-query:
    ``k = q·kv_heads/heads``), feed-forward width f, a heads of width h_d and c bytes per element of
    the compute dtype, one layer saves:

    - each of its two RMSNorms (computed in fp32 whatever the compute dtype): the input cast to
      fp32 (``T·d·4``: the input itself in fp32), the fp32 reciprocal RMS (``T·4``), the normalised
      input cast back (``T·d·c``, for the weight's product) and the output (``T·d·c``, the next
      projections' input);
    - attention: Q and K after RoPE (``T·q·c``, ``T·k·c``: RoPE's products save only its cos and
      sin tables), V (``T·k·c``), the output (``T·q·c``, also the output projection's input) and
      the fp32 log-sum-exp (``4·a·T``); keys and values are not repeated for the query heads
      (``enable_gqa``), and no ``s²`` scores are stored;
    - the SwiGLU feed-forward: the gate projection's output (SiLU's input), SiLU's output, the up
      projection's output and their product (the down projection's input), ``4·T·f·c``.

    That is ``T·(d·(8 + 4c) + c·(2q + 2k + 4f) + 8 + 4a)`` bytes a layer; biases (``attention_bias``,
    ``mlp_bias``, Qwen2's Q/K/V biases) save nothing more. Outside the layers: the int64 token ids
    and targets (``16·T``), RoPE's cos and sin (``2·s·h_d·c``, shared by the batch and every layer),
    the final norm (as above), the fp32 log-softmax of the loss (``T·V·4``) and its 4-byte weight
    total. For Llama 3 8B in bf16 a layer is ``49·s·b·h`` bytes (Korthikanti's GPT count, which
    :func:`estimate_decoder_activation_bytes` gives, is ``34``).

    ``q_width`` and ``kv_width`` default to the widths ``sizes`` states (a layout's ``q_width``
    and ``kv_width``, a :class:`~handbook_lib.models.presets.DecoderShape`'s heads), else to
    ``d_model`` and ``q_width``. Exact, to the byte, for
    the tensors autograd saves on PyTorch's CPU kernels in fp32 and bf16 (the tests measure
    Transformers' own Llama and :class:`~handbook_lib.runtime.decoder.Decoder`); CUDA's flash
    attention saves the same tensors and two 8-byte random-number words.
    """
    check_int("micro_batch", micro_batch, 1)
    check_int("seq_len", seq_len, 1)
    c = dtype_bytes(compute_dtype)
    tokens = micro_batch * seq_len
    d, f, a, v = sizes.d_model, sizes.dim_feedforward, sizes.nhead, sizes.vocab_size
    q = q_width or getattr(sizes, "q_width", 0) or getattr(sizes, "attention_width", 0) or d
    shape_kv = getattr(sizes, "kv_heads", 0) * getattr(sizes, "head_width", 0)  # a DecoderShape's
    k = kv_width or getattr(sizes, "kv_width", 0) or shape_kv or q

    def norm(where: str) -> tuple[tuple[str, int], ...]:
        return ((f"{where} norm: input in fp32", tokens * d * 4), (f"{where} norm: 1/RMS (fp32)", tokens * 4),
                (f"{where} norm: normalised", tokens * d * c), (f"{where} norm: output", tokens * d * c))

    layer = (*norm("attention"), ("Q after RoPE", tokens * q * c), ("K after RoPE", tokens * k * c),
             ("V", tokens * k * c), ("attention output", tokens * q * c), ("log-sum-exp (fp32)", 4 * a * tokens),
             *norm("feed-forward"), ("gate projection", tokens * f * c), ("SiLU", tokens * f * c),
             ("up projection", tokens * f * c), ("gate x up", tokens * f * c))
    head = (("token ids (int64)", _INDEX_BYTES * tokens), ("RoPE cos and sin", 2 * seq_len * (q // a) * c),
            *norm("final"), ("log-softmax (fp32)", tokens * v * 4), ("targets (int64)", _INDEX_BYTES * tokens),
            ("loss weight", 4))
    return GatedDecoderTensors(layer, head, products=(q, k, k, d, f, f, d),
                               shared_products=(False, False, True, False, True, True, False))


def estimate_decoder_activation_bytes(
    shape: ModelSizes,
    micro_batch: int,
    seq_len: int,
    *,
    recompute: str = "none",
    fused_attention: bool = True,
) -> int:
    """Activation bytes of a decoder in 16-bit training (Korthikanti et al., 2022).

    The formula was derived for GPT-style layers (a 4d feed-forward, LayerNorm in 16 bits,
    dropout masks); a Llama layer keeps 34-43 % more (:func:`gated_decoder_tensors`, which the
    layouts use for the Llama family).

    Per layer, with s = seq_len, b = micro_batch, h = d_model, a = heads:

    - ``none``: ``34·s·b·h`` bytes, plus ``5·a·s²·b`` for the attention scores, their softmax
      and dropout that an unfused ("eager") attention stores; a fused kernel (FlashAttention,
      PyTorch's SDPA) stores none of them, which is why ``fused_attention`` defaults to True;
    - ``attention``: Korthikanti et al.'s *selective recomputation* (Megatron's
      ``--recompute-granularity selective``), which recomputes the attention core (scores,
      softmax, dropout) and keeps every linear layer's output: ``34·s·b·h`` with the scores'
      term gone. It is the opposite split of the runs' op-level ``selective`` policy
      (``activation_checkpointing="selective"``), which keeps the matrix products' outputs and
      recomputes the cheap operators;
    - ``full`` (checkpoint every layer): ``2·s·b·h``, the layer input.

    Returns:
        Bytes for all layers (the embedding and loss terms are small at this scale and omitted).
    """
    check_int("micro_batch", micro_batch, 1)
    check_int("seq_len", seq_len, 1)
    sbh = seq_len * micro_batch * shape.d_model
    per_layer = {
        "none": sbh * 34 + (0 if fused_attention else 5 * shape.nhead * seq_len**2 * micro_batch),
        "attention": 34 * sbh,
        "full": 2 * sbh,
    }
    if recompute not in per_layer:
        raise ValueError(f"recompute must be one of {', '.join(per_layer)}, got {recompute!r}")
    return shape.num_layers * per_layer[recompute]
