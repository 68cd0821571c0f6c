"""The handbook model's shape and its parameter count, without building it. Pure arithmetic.

Chapter 1 introduces it. :class:`ModelConfig` describes :class:`~handbook_lib.runtime.model.SimpleTransformer`
(see :mod:`handbook_lib.runtime.model` for the module itself); :func:`param_shapes` lists every
parameter's shape from the config alone, so the memory and communication models never need
``torch`` (and the planning CLI answers without importing it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from handbook_lib.core.checks import check_int

__all__ = ["ModelConfig", "MODEL_KEYS", "param_shapes", "param_count", "param_count_breakdown"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of :class:`~handbook_lib.runtime.model.SimpleTransformer`. All fields are counts (no units).

    The defaults are the book's running example: 9,868,560 parameters.
    """

    vocab_size: int = 10_000
    """Number of distinct tokens: rows of the embedding, outputs of the head."""
    d_model: int = 256
    """Width of the residual stream (embedding size)."""
    nhead: int = 4
    """Attention heads; must divide ``d_model``."""
    dim_feedforward: int = 1024
    """Hidden width of each layer's feed-forward block."""
    num_layers: int = 6
    """Number of :class:`~handbook_lib.runtime.model.TransformerLayer` blocks."""

    def __post_init__(self) -> None:
        for field in fields(self):
            check_int(f"ModelConfig.{field.name}", getattr(self, field.name), 1)
        if self.d_model % self.nhead:
            raise ValueError(
                f"ModelConfig.nhead={self.nhead} must divide d_model={self.d_model}"
            )

    def to_dict(self) -> dict[str, int]:
        """The config as a plain dict (the keys of the run-config vocabulary)."""
        return asdict(self)


MODEL_KEYS: tuple[str, ...] = tuple(f.name for f in fields(ModelConfig))
"""The model's shape keys (``vocab_size``, ``d_model``, ``nhead``, ``dim_feedforward``,
``num_layers``): the first keys of every run config, and the ``--set`` keys of ``params`` and
``memory``."""


def param_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter's name and shape, in ``named_parameters()`` order, from the config alone.

    This is the analytic twin of ``SimpleTransformer(config).named_parameters()``; the tests
    check that the two agree for many configs. FSDP shards each of these tensors along its
    first dimension, so the memory model (chapter 2) starts from this list.
    """
    v, d, f = config.vocab_size, config.d_model, config.dim_feedforward
    layer = [
        ("self_attn.in_proj_weight", (3 * d, d)),
        ("self_attn.in_proj_bias", (3 * d,)),
        ("self_attn.out_proj.weight", (d, d)),
        ("self_attn.out_proj.bias", (d,)),
        ("linear1.weight", (f, d)),
        ("linear1.bias", (f,)),
        ("linear2.weight", (d, f)),
        ("linear2.bias", (d,)),
        ("norm1.weight", (d,)),
        ("norm1.bias", (d,)),
        ("norm2.weight", (d,)),
        ("norm2.bias", (d,)),
    ]
    shapes: list[tuple[str, tuple[int, ...]]] = [("embedding.weight", (v, d))]
    for i in range(config.num_layers):
        shapes.extend((f"layers.{i}.{name}", shape) for name, shape in layer)
    shapes.extend([("output.weight", (v, d)), ("output.bias", (v,))])
    return shapes


def param_count_breakdown(config: ModelConfig) -> dict[str, int]:
    """Parameter count by component, from the closed-form formulas of chapter 1.

    With V = vocab_size, d = d_model, f = dim_feedforward, L = num_layers:

    - embedding: V·d
    - attention, per layer: 4d² + 4d (Q, K, V and output projections with biases)
    - feed-forward, per layer: 2·d·f + f + d
    - layer norms, per layer: 4d (two norms, weight and bias each)
    - output head: d·V + V

    Returns:
        Counts (elements) keyed ``embedding``, ``attention``, ``feed_forward``, ``norms`` (the
        three per-layer items summed over all L layers) and ``output``.
    """
    v, d, f, n = config.vocab_size, config.d_model, config.dim_feedforward, config.num_layers
    return {
        "embedding": v * d,
        "attention": n * (4 * d * d + 4 * d),
        "feed_forward": n * (2 * d * f + f + d),
        "norms": n * 4 * d,
        "output": d * v + v,
    }


def param_count(config: ModelConfig) -> int:
    """Total number of parameters of ``SimpleTransformer(config)``, computed without building it.

    Equals ``sum(param_count_breakdown(config).values())`` and the product-sum of
    :func:`param_shapes`; the default config gives 9,868,560.
    """
    return sum(param_count_breakdown(config).values())
