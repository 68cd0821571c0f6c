"""Well-known decoder models by shape, with parameter counts derived from the shape.

Chapter 2 uses their sizes for its scenarios, chapter 4 plans for them. A shape is enough for
the memory and communication models: the parameters per layer (FSDP's unit), the embedding and
head (the root unit), and the activations. Pure arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.core.architecture import MAX_LAYERS, ModelConfig
from handbook_lib.core.checks import check_int, lookup

__all__ = ["DecoderShape", "DECODER_SHAPES", "get_shape", "describe_shape"]

_FLAGS = ("gated_mlp", "tied_embeddings", "bias", "qkv_bias", "out_bias", "mlp_bias")


@dataclass(frozen=True)
class DecoderShape:
    """Shape of a decoder-only transformer. Counts are elements (parameters), not bytes."""

    name: str
    num_layers: int
    d_model: int
    nhead: int
    vocab_size: int = 50_257
    dim_feedforward: int = 0
    """Hidden width of the feed-forward block (0: 4·d_model, GPT-style)."""
    num_kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0: as many as ``nhead``."""
    gated_mlp: bool = False
    """SwiGLU-style feed-forward with three projections (Llama) instead of two (GPT)."""
    tied_embeddings: bool = True
    """Output head shares the token embedding's weights."""
    bias: bool = False
    """Linear layers and layer norms have biases (GPT) or not (Llama, RMSNorm)."""
    qkv_bias: bool = False
    """Query, key and value projections have biases even when :attr:`bias` is False (Qwen2;
    Llama with ``attention_bias``)."""
    out_bias: bool = False
    """The attention's output projection has a bias even when :attr:`bias` is False (Llama with
    ``attention_bias``)."""
    mlp_bias: bool = False
    """The feed-forward projections have biases even when :attr:`bias` is False (Llama with
    ``mlp_bias``)."""
    head_dim: int = 0
    """Width of one attention head (0: ``d_model // nhead``); the query projection is
    ``nhead · head_dim`` wide, keys and values ``num_kv_heads · head_dim``."""
    max_positions: int = 0
    """Learned position embeddings (GPT); 0 for rotary embeddings (Llama)."""
    published_params: int = 0
    """The parameter count the model's paper states (0 if none)."""
    source: str = ""
    """Where the shape comes from."""

    def __post_init__(self) -> None:
        for key in ("num_layers", "d_model", "nhead", "vocab_size"):
            check_int(f"DecoderShape.{key}", getattr(self, key), 1)
        check_int("DecoderShape.num_layers", self.num_layers, 1, below=MAX_LAYERS + 1)
        for key in ("head_dim", "dim_feedforward", "num_kv_heads", "max_positions", "published_params"):
            check_int(f"DecoderShape.{key}", getattr(self, key), 0)
        for key in _FLAGS:
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"DecoderShape.{key} must be True or False, got {getattr(self, key)!r}")
        if (not self.head_dim and self.d_model % self.nhead) or self.nhead % self.kv_heads:
            raise ValueError("nhead must divide d_model (unless head_dim is given), and num_kv_heads must "
                             "divide nhead")

    @property
    def ffn(self) -> int:
        """The feed-forward width in use."""
        return self.dim_feedforward or 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        """The key/value heads in use."""
        return self.num_kv_heads or self.nhead

    @property
    def head_width(self) -> int:
        """The width of one attention head in use."""
        return self.head_dim or self.d_model // self.nhead

    @property
    def attention_width(self) -> int:
        """Width of a layer's queries, ``nhead · head_width``: what attention's FLOPs scale with."""
        return self.nhead * self.head_width

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer layer (one FSDP unit).

        With d = d_model, q = nhead · head_width, k = kv_heads · head_width, f = the feed-forward
        width: attention ``2·d·q + 2·d·k`` (Q, K, V, output) plus ``q + 2k`` (Q, K, V biases) and
        ``d`` (output bias); feed-forward ``3·d·f`` gated or ``2·d·f`` plus ``2f + d`` or ``f + d``
        of biases; two norms of ``d`` each (``2d`` with a bias)."""
        d, f = self.d_model, self.ffn
        q, k = self.nhead * self.head_width, self.kv_heads * self.head_width
        attention = 2 * d * q + 2 * d * k
        attention += (q + 2 * k if self.bias or self.qkv_bias else 0) + (d if self.bias or self.out_bias else 0)
        mlp = (3 if self.gated_mlp else 2) * d * f
        mlp += ((2 * f if self.gated_mlp else f) + d) if self.bias or self.mlp_bias else 0
        norms = 2 * d * (2 if self.bias else 1)
        return attention + mlp + norms

    @property
    def root_params(self) -> int:
        """Embedding, position embedding, untied head and final norm: FSDP's root unit."""
        d = self.d_model
        head = 0 if self.tied_embeddings else self.vocab_size * d
        final_norm = d * (2 if self.bias else 1)
        return self.vocab_size * d + self.max_positions * d + head + final_norm

    @property
    def num_params(self) -> int:
        """All parameters: ``num_layers · layer_params + root_params``."""
        return self.num_layers * self.layer_params + self.root_params

    def param_breakdown(self) -> dict[str, int]:
        """Parameters (elements) by component, summing to :attr:`num_params`: ``embedding``,
        ``position_embedding`` (learned positions only), ``layers`` (all of them), ``head``
        (an untied output head only) and ``final_norm``."""
        d = self.d_model
        parts = {"embedding": self.vocab_size * d}
        if self.max_positions:
            parts["position_embedding"] = self.max_positions * d
        parts["layers"] = self.num_layers * self.layer_params
        if not self.tied_embeddings:
            parts["head"] = self.vocab_size * d
        parts["final_norm"] = d * (2 if self.bias else 1)
        return parts


_LLAMA2 = "Touvron et al. 2023, Llama 2 paper, Table 1 and the released configs"
DECODER_SHAPES: dict[str, DecoderShape] = {
    "llama2-7b": DecoderShape("Llama-2 7B", 32, 4096, 32, 32_000, dim_feedforward=11_008, gated_mlp=True,
                              tied_embeddings=False, published_params=6_738_415_616, source=_LLAMA2),
    "llama2-13b": DecoderShape("Llama-2 13B", 40, 5120, 40, 32_000, dim_feedforward=13_824, gated_mlp=True,
                               tied_embeddings=False, published_params=13_015_864_320, source=_LLAMA2),
    "llama2-70b": DecoderShape("Llama-2 70B", 80, 8192, 64, 32_000, dim_feedforward=28_672, num_kv_heads=8,
                               gated_mlp=True, tied_embeddings=False, published_params=68_976_648_192,
                               source=_LLAMA2),
    "llama3-405b": DecoderShape("Llama-3.1 405B", 126, 16_384, 128, 128_256, dim_feedforward=53_248,
                                num_kv_heads=8, gated_mlp=True, tied_embeddings=False,
                                published_params=405_000_000_000,
                                source="Llama Team 2024, The Llama 3 Herd of Models, Table 3 and the released "
                                       "config"),
    "gpt3-175b": DecoderShape("GPT-3 175B", 96, 12_288, 96, 50_257, bias=True, max_positions=2048,
                              published_params=175_000_000_000,
                              source="Brown et al. 2020, GPT-3 paper, Table 2.1"),
}
"""Presets: parameter counts from the shapes are within 1 % of the published ones (tested)."""
DECODER_SHAPES.update({"7b": DECODER_SHAPES["llama2-7b"], "13b": DECODER_SHAPES["llama2-13b"],
                       "70b": DECODER_SHAPES["llama2-70b"], "175b": DECODER_SHAPES["gpt3-175b"],
                       "405b": DECODER_SHAPES["llama3-405b"]})


def get_shape(name: str) -> DecoderShape:
    """The preset called ``name``. Raises ValueError listing the presets for an unknown name."""
    return lookup(DECODER_SHAPES, name, "model")


def describe_shape(model: DecoderShape | ModelConfig) -> str:
    """The shape in one line, as every planning command echoes what it read: layers, hidden
    width, heads and key/value heads (and their width), feed-forward width, vocabulary, biases,
    and whether the output head is tied to the embedding. Counts, no units.

    For Llama-2 70B: ``shape: 80 layers, hidden 8,192, 64 heads and 8 KV heads of 128, FFN 28,672
    (gated), vocabulary 32,000, no biases, head untied``.
    """
    if isinstance(model, ModelConfig):  # the handbook's model: PyTorch's layer, all biases, its own head
        return (f"shape: {model.num_layers} layers, hidden {model.d_model:,}, {model.nhead} heads of "
                f"{model.d_model // model.nhead}, FFN {model.dim_feedforward:,}, vocabulary "
                f"{model.vocab_size:,}, biases everywhere, head untied")
    ffn = f"FFN {model.ffn:,}{' (gated)' if model.gated_mlp else ''}"
    biased = [part for part, on in (("Q/K/V", model.qkv_bias), ("output", model.out_bias),
                                    ("FFN", model.mlp_bias)) if on or model.bias]
    biases = ("biases everywhere" if model.bias else f"biases on {', '.join(biased)}" if biased
              else "no biases")
    positions = f", {model.max_positions:,} learned positions" if model.max_positions else ""
    return (f"shape: {model.num_layers} layers, hidden {model.d_model:,}, {model.nhead} heads and "
            f"{model.kv_heads} KV heads of {model.head_width}, {ffn}, vocabulary {model.vocab_size:,}"
            f"{positions}, {biases}, head {'tied' if model.tied_embeddings else 'untied'}")
