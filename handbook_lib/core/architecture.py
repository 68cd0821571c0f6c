"""The handbook model's shape and its parameter count, without building it. Pure arithmetic.

Chapter 1 introduces it. :class:`ModelConfig` describes :class:`~handbook_lib.runtime.model.SimpleTransformer`
(see :mod:`handbook_lib.runtime.model` for the module itself); :func:`param_shapes` lists every
parameter's shape from the config alone, so the memory and communication models never need
``torch`` (and the planning CLI answers without importing it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import ClassVar

from handbook_lib.core.checks import check_int, is_int

__all__ = ["ModelConfig", "MODEL_KEYS", "MAX_LAYERS", "param_shapes", "forward_modules", "param_count",
           "param_count_breakdown"]

MAX_LAYERS = 256
"""The most layers a model may have here (the deepest published dense decoders have about 130):
every estimate walks the layers, and at this bound the slowest command (``plan``) still answers
in well under a second."""


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

    MINIMUMS: ClassVar[Mapping[str, int]] = {
        "vocab_size": 1, "d_model": 1, "nhead": 1, "dim_feedforward": 1, "num_layers": 1}
    """Each key's least value (what ``--set num_layers=0`` says it takes)."""

    def __post_init__(self) -> None:
        for field in fields(self):
            check_int(f"ModelConfig.{field.name}", getattr(self, field.name), 1)
        check_int("ModelConfig.num_layers", self.num_layers, 1, below=MAX_LAYERS + 1)
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

    Raises:
        ValueError: in one line, for anything but a :class:`ModelConfig` (a decoder's shape is
            known by its sizes only: its layout has no tensor names).
    """
    _require_config("param_shapes", config)  # a DecoderShape is known by its sizes only
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
    """Parameter count by component, from the closed-form formulas of chapter 1 (a
    :class:`~handbook_lib.models.presets.DecoderShape` gives its own ``param_breakdown()``).

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
    if not isinstance(config, ModelConfig) and hasattr(config, "param_breakdown"):
        return dict(config.param_breakdown())  # a decoder's shape: its own components
    _require_config("param_count_breakdown", config, "a DecoderShape, ")
    v, d, f, n = config.vocab_size, config.d_model, config.dim_feedforward, config.num_layers
    return {
        "embedding": v * d,
        "attention": n * (4 * d * d + 4 * d),
        "feed_forward": n * (2 * d * f + f + d),
        "norms": n * 4 * d,
        "output": d * v + v,
    }


def forward_modules(num_layers: int) -> list[str]:
    """The modules ``SimpleTransformer.forward`` calls, by name, in the order it enters them: a
    block before the modules it calls, ``""`` the root. A layer runs its attention, ``norm1``,
    its two linear layers, then ``norm2``; the attention reads ``out_proj``'s tensors itself
    (``out_proj`` is never called). Hooks on every module see this order (the tests check it);
    DeepSpeed's ZeRO-3 records it to prefetch (:func:`handbook_lib.models.zero.zero3_gathers`)."""
    layer = ("self_attn", "norm1", "linear1", "linear2", "norm2")
    return ["", "embedding",
            *(name for i in range(num_layers) for name in (f"layers.{i}", *(f"layers.{i}.{m}" for m in layer))),
            "output"]


def param_count(model: object) -> int:
    """Total number of parameters of ``model``, computed without building it.

    ``model`` is any model form of the package that has a count:

    - :class:`ModelConfig` (the handbook's ``SimpleTransformer``): ``sum(param_count_breakdown(config).values())``,
      the product-sum of :func:`param_shapes`; the default config gives 9,868,560;
    - a :class:`~handbook_lib.models.presets.DecoderShape` (``get_shape("llama2-7b")``, a
      Transformers config read by ``read_hf_config``) or a
      :class:`~handbook_lib.models.layout.ModelLayout`: its ``num_params`` (Llama-2 7B: 6,738,415,616);
    - an int: a count, returned as it is.

    A preset's name or a Transformers config (dict or path) is refused in one line saying how
    to read it first: this layer knows no presets and reads no file
    (``handbook_lib.models.model_layout(name).num_params`` takes a name).

    Raises:
        ValueError: in one line, for anything else.
    """
    if isinstance(model, ModelConfig):
        return sum(param_count_breakdown(model).values())
    count = getattr(model, "num_params", None)
    if is_int(count) and not isinstance(model, type):
        return count  # a DecoderShape or a ModelLayout: the count it derives from its shape
    if is_int(model):
        return check_int("param_count's model (a count)", model, 0)
    _require_config("param_count", model, "a DecoderShape, a ModelLayout, an int count, ")
    raise AssertionError("unreachable")  # _require_config raised


def _require_config(function: str, model: object, also: str = "") -> None:
    """Refuse, in one line naming ``function`` and what it takes, anything but a :class:`ModelConfig`."""
    if isinstance(model, ModelConfig):
        return
    if isinstance(model, str):
        got = f"the name {model[:40]!r}: read a preset with handbook_lib.models.get_shape(name) first"
    elif isinstance(model, dict) or type(model).__name__.endswith("Path"):
        got = ("a Transformers config: read it with handbook_lib.models.decoder_shape_from_hf(dict) or "
               "read_hf_config(path) first")
    else:
        got = f"a {type(model).__name__}"
    raise ValueError(f"{function} takes {also + 'or ' if also else ''}a ModelConfig, not {got}")
