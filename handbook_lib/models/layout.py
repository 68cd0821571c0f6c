"""A model's layout, derived once: its parameter tensors, its FSDP units, one rank's shards, and
the activations a forward pass keeps. Pure arithmetic: no ``torch``.

Chapter 1 introduces it. Every model in the pure layer (memory, communication, ZeRO, the
checkpoint count, the planner, the command line) reads a model through one :class:`ModelLayout`,
built by :func:`model_layout` from what the reader has:

- a :class:`~handbook_lib.core.architecture.ModelConfig`, the handbook's model: every parameter
  tensor by name and shape (:func:`~handbook_lib.core.architecture.param_shapes`), the wrapping
  policies over those names, the per-tensor shard rule, and activations counted tensor by tensor
  on PyTorch's CPU kernels (:func:`~handbook_lib.models.activations.estimate_activation_bytes`);
- a :class:`~handbook_lib.models.presets.DecoderShape` (or a preset's name, ``"llama2-7b"``): a
  large decoder known by its sizes, one flat block per layer and one for the root (embeddings,
  head, final norm), and its activations counted operator by operator for the Llama family
  (:func:`~handbook_lib.models.activations.gated_decoder_tensors`), by the published formula for
  GPT's (:func:`~handbook_lib.models.activations.estimate_decoder_activation_bytes`);
- a parameter count ``P``: the model as one flat block, model state only (no units, no
  activations).

That choice is made here and nowhere else: the estimators never ask which kind of model they
were given, they ask the layout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from math import prod
from typing import Literal, Union

from handbook_lib.core.architecture import (
    ModelConfig,
    param_count_breakdown,
    param_shapes,
)
from handbook_lib.core.checks import check_int, check_world
from handbook_lib.core.config import dtype_bytes
from handbook_lib.models.activations import (
    ActivationBytes,
    checkpointed,
    kept_products,
    saved_families,
    estimate_activation_bytes,
    estimate_decoder_activation_bytes,
    gated_decoder_tensors,
)
from handbook_lib.models.presets import DecoderShape, get_shape
from handbook_lib.models.sharding import (
    ShardBytes,
    Unit,
    estimate_tensor_shards,
    policy_units,
    shard_rows,
)

__all__ = ["ModelLayout", "ModelLike", "model_layout", "wrap_units", "estimate_shard_bytes"]

Tensors = tuple[tuple[str, tuple[int, ...]], ...]
ActivationModel = Literal["handbook", "decoder", "none"]


@dataclass(frozen=True)
class ModelLayout:
    """Everything the pure models read about a model, derived once (see :func:`model_layout`).

    Counts are elements (parameters), not bytes.
    """

    name: str
    """How the model is named in a sentence: ``"the handbook's model"``, ``"Llama-2 7B"``."""
    num_params: int
    """P: all parameters."""
    tensors: Tensors
    """The parameter tensors, ``(name, shape)`` in ``named_parameters()`` order when
    :attr:`exact`; else one flat block per FSDP unit (``root``, ``layers.0`` ...) or, for a bare
    count, one block ``model``."""
    exact: bool
    """:attr:`tensors` are the model's real tensors: units, shards and padding are exact."""
    units_known: bool
    """The FSDP units' sizes are known (a bare count knows none: no transient buffers)."""
    activation_model: ActivationModel = "none"
    """How activations are counted: ``handbook`` (tensor by tensor, the CPU kernels of
    :class:`~handbook_lib.runtime.model.SimpleTransformer`), ``decoder`` (Korthikanti et al.'s
    per-layer formula for 16-bit training), ``none`` (unknown)."""
    d_model: int = 0
    """Width of the hidden state (elements per token); 0 when unknown."""
    vocab_size: int = 0
    """Tokens of the vocabulary: the logits' width; 0 when unknown."""
    num_layers: int = 0
    """Transformer layers; 0 when unknown."""
    nhead: int = 0
    """Attention heads per layer; 0 when unknown."""
    dim_feedforward: int = 0
    """Feed-forward width; 0 when unknown."""
    q_width: int = 0
    """Width of a layer's queries (``nhead`` heads of their width; 0: ``d_model``), decoders."""
    kv_width: int = 0
    """Width of its keys, and of its values (fewer heads with grouped-query attention; 0:
    ``q_width``), decoders."""
    gated_mlp: bool = False
    """A gated feed-forward (Llama's gate and up projections, both ``dim_feedforward`` wide)."""
    head_numel: int = 0
    """Elements of the output head, whose gradients backward computes first."""
    containers: tuple[str, ...] = ("layers",)
    """Module paths holding the transformer layers (each child one FSDP unit with ``wrap="layer"``)."""
    breakdown: tuple[tuple[str, int], ...] = ()
    """Parameters by component (``embedding``, ``attention`` ...), summing to :attr:`num_params`."""

    @property
    def attention_width(self) -> int:
        """Width of a layer's queries (:attr:`q_width`, else :attr:`d_model`; 0 when unknown):
        what attention's FLOPs scale with."""
        return self.q_width or self.d_model

    def units(self, wrap: str = "layer", min_params: int = 100_000) -> list[Unit]:
        """The FSDP units of a wrapping policy, root first, in forward order
        (:func:`~handbook_lib.models.sharding.policy_units`; see :data:`~handbook_lib.core.config.WRAPS`).

        A layout that is not :attr:`exact` has one policy: its blocks, a root and one unit per
        layer (for a bare count, one unit ``model``).

        Raises:
            ValueError: for an unknown ``wrap``, a ``min_params`` below 1, or a policy other than
                ``layer`` on a layout that knows only per-layer counts.
        """
        if self.exact:
            return policy_units(self.tensors, wrap, min_params, containers=self.containers)
        if wrap != "layer":
            raise ValueError(f"wrap={wrap!r} needs the model's tensors; {self.name} is known by its "
                             "sizes only: one unit per layer (wrap='layer')")
        if not self.units_known:
            return [Unit(self.tensors[0][0], (self.tensors[0][1],))]
        root, *layers = self.tensors
        return [Unit("root", (root[1],), root=True), *(Unit(name, (shape,)) for name, shape in layers)]

    def shard_bytes(self, world_size: int, rank: int, dtype: str = "fp32") -> ShardBytes:
        """One rank's bytes of FSDP's shards of every parameter (chapter 1's shard rule): per
        tensor along dim 0 when :attr:`exact`, else of the flat model (``ceil(P / N)`` elements
        per rank, the last ranks possibly fewer, padded to it).

        Raises:
            ValueError: for a bad world size or rank, or an unknown dtype.
        """
        if self.exact:
            return estimate_tensor_shards((shape for _, shape in self.tensors), world_size, rank, dtype)
        rows, chunk = shard_rows(self.num_params, world_size, rank)
        size = dtype_bytes(dtype)
        return ShardBytes(rows * size, (chunk - rows) * size)

    def state_shard_elements(self, world_size: int, rank: int) -> int:
        """Elements of one rank's shard of each parameter-shaped state (parameters, gradients,
        optimizer moments) as the memory model counts them: the real rows of every tensor when
        :attr:`exact` (the padding is counted apart, by the checks), else an even 1/N of the flat
        model rounded up, ``ceil(P / N)``."""
        if self.exact:
            return self.shard_bytes(world_size, rank).shard_bytes // 4
        check_world(world_size, rank)
        return -(-self.num_params // world_size)

    @property
    def step_tensors(self) -> int:
        """Parameter tensors, each with an Adam ``step`` counter: 0 when not :attr:`exact`
        (counters of unknown tensors are a few bytes and are not counted)."""
        return len(self.tensors) if self.exact else 0

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest parameter tensor (0 when not :attr:`exact`)."""
        return max((prod(shape) for _, shape in self.tensors), default=0) if self.exact else 0

    def part_numels(self) -> dict[str, int]:
        """Elements of each top-level part, in construction order (``embedding``, ``layers.0`` …
        ``output`` for the handbook's model), as :func:`handbook_lib.runtime.model.model_parts`
        builds them.

        Raises:
            ValueError: for a layout that is not :attr:`exact`.
        """
        self.require_exact("part_numels")
        parts: dict[str, int] = {}
        for name, shape in self.tensors:
            head = name.split(".")
            owner = next((c for c in self.containers if name.startswith(c + ".")), None)
            part = f"{owner}.{name[len(owner) + 1:].split('.', 1)[0]}" if owner else head[0]
            parts[part] = parts.get(part, 0) + prod(shape)
        return parts

    def activations(self, micro_batch: int, seq_len: int, compute_dtype: str = "fp32", *,
                    activation_checkpointing: bool | str = False, every: int = 1,
                    matmul_every: int = 1, ac_save: str = "matmul+attention") -> ActivationBytes | None:
        """Bytes of activations one rank keeps for one micro-batch of ``micro_batch`` ×
        ``seq_len`` tokens, in the compute dtype (``None`` when the layout has no activation
        model, or no tokens are given).

        ``handbook``: counted tensor by tensor. ``decoder``, gated (the Llama family): counted
        operator by operator as well
        (:func:`~handbook_lib.models.activations.gated_decoder_tensors`), the layer being recomputed
        holding its saved tensors less those the policy kept. Other decoders (GPT's): Korthikanti et
        al.'s per-layer ``34·s·b·h`` (``2·s·b·h``, the input, with full checkpointing), scaled from
        16-bit to the compute dtype, plus the head's input (``T·d·c``), the fp32 log-softmax
        (``T·V·4``) and the int64 token ids and targets (``16·T``); the layer being recomputed holds
        the rest of its share. Selective checkpointing keeps, besides the input, what the policy
        saves: the outputs of the Q, K and V projections (``T·(q + 2k)·c``), of the attention
        (``T·q·c`` and its fp32 log-sum-exp, ``4·a·T``), of the output projection (``T·d·c``), of
        the feed-forward's up (and gate) projections (``T·f·c``, twice when gated) and of its down
        projection (``T·d·c``); for GPT-3's shape that is ``22·s·b·h`` of the ``34``. ``every`` k
        checkpoints layers 0, k, 2k, ... only
        (:func:`~handbook_lib.models.activations.checkpointed`). ``matmul_every`` n keeps every n-th
        matrix product only (:func:`~handbook_lib.models.activations.kept_products`), in forward
        order: a gated decoder's separate Q, K, V, output, gate, up and down projections
        (torchtitan's Llama, whose n = 2 keeps Q, V, gate and down), a GPT's fused QKV, output, up
        and down. ``ac_save`` keeps the products and the attention's outputs (``matmul+attention``),
        the products only (``matmul``) or the attention's only (``attention``).
        """
        if not micro_batch or self.activation_model == "none":
            return None
        if self.activation_model == "handbook":
            return estimate_activation_bytes(self, micro_batch, seq_len, compute_dtype,
                                             activation_checkpointing=activation_checkpointing, every=every,
                                             matmul_every=matmul_every, ac_save=ac_save)
        c = dtype_bytes(compute_dtype)
        tokens = micro_batch * seq_len
        d, f = self.d_model, self.dim_feedforward
        q = self.q_width or d
        k = self.kv_width or q
        if self.gated_mlp:
            saved = gated_decoder_tensors(self, micro_batch, seq_len, compute_dtype, q_width=q, kv_width=k)
            products = kept_products(saved.products, matmul_every, activation_checkpointing, ac_save)
            shared = kept_products(tuple(w * s for w, s in zip(saved.products, saved.shared_products)),
                                   matmul_every, activation_checkpointing, ac_save)
            attention = (tokens * q * c + 4 * self.nhead * tokens) * saved_families(ac_save)[1]
            kept = tokens * products * c + attention
            return checkpointed(saved.per_layer, tokens * d * c, {"selective": kept, "full": 0}, self.num_layers,
                                saved.outside, activation_checkpointing, every,
                                shared={"selective": tokens * shared * c + attention, "full": 0})
        per_layer = estimate_decoder_activation_bytes(self, micro_batch, seq_len) * c // 2 // self.num_layers
        head = tokens * self.d_model * c + tokens * self.vocab_size * 4 + 16 * tokens
        products = kept_products((q + 2 * k, d, f, d), matmul_every, activation_checkpointing, ac_save)
        kept = tokens * products * c + (tokens * q * c + 4 * self.nhead * tokens) * saved_families(ac_save)[1]
        return checkpointed(per_layer, tokens * d * c, {"selective": kept, "full": 0}, self.num_layers,
                            head, activation_checkpointing, every)

    def causal_mask_bytes(self, seq_len: int) -> int:
        """Bytes of the boolean (s × s) causal mask the handbook's model builds before its first
        layer (0 for other models: theirs is not counted)."""
        return seq_len * seq_len if self.activation_model == "handbook" else 0

    @property
    def runnable(self) -> bool:
        """The book's runs can train this model (it is the handbook's :class:`ModelConfig`)."""
        return self.activation_model == "handbook"

    def require_exact(self, what: str) -> None:
        """Refuse a layout that is not :attr:`exact` for ``what``, which needs real tensors.

        Raises:
            ValueError: naming ``what`` and the model.
        """
        if not self.exact:
            raise ValueError(f"{what} needs the model's tensors (a ModelConfig); {self.name} is known by "
                             "its sizes only")


ModelLike = Union[ModelLayout, ModelConfig, DecoderShape, str, int]
"""What every estimator accepts as a model: a layout, the handbook's config, a decoder's shape,
a preset's name or a parameter count."""


def model_layout(model: ModelLike) -> ModelLayout:
    """The layout of ``model``: the one place a model's kind is looked at (see the module docstring).

    A :class:`ModelLayout` is returned as is; layouts of configs, shapes and counts are built
    once and kept (they are immutable).

    Raises:
        ValueError: for an unknown preset name, or a count that is not an int >= 0.
    """
    if isinstance(model, ModelLayout):
        return model
    if isinstance(model, str):
        model = get_shape(model)
    if not isinstance(model, (ModelConfig, DecoderShape)):
        if isinstance(model, (bool, float)) or not isinstance(model, int) or model < 0:
            raise ValueError(f"model must be a ModelConfig, a DecoderShape, a preset name or an int >= 0, "
                             f"got {model!r}")
    return _build(model)


@functools.lru_cache(maxsize=64)
def _build(model: ModelConfig | DecoderShape | int) -> ModelLayout:
    if isinstance(model, ModelConfig):
        tensors = tuple(param_shapes(model))
        return ModelLayout("the handbook's model", sum(prod(s) for _, s in tensors), tensors, exact=True,
                           units_known=True, activation_model="handbook", d_model=model.d_model,
                           vocab_size=model.vocab_size, num_layers=model.num_layers, nhead=model.nhead,
                           dim_feedforward=model.dim_feedforward,
                           head_numel=model.d_model * model.vocab_size + model.vocab_size,
                           breakdown=tuple(param_count_breakdown(model).items()))
    if isinstance(model, DecoderShape):
        layer = model.layer_params
        blocks = (("root", (model.root_params,)), *((f"layers.{i}", (layer,)) for i in range(model.num_layers)))
        return ModelLayout(model.name, model.num_params, blocks, exact=False, units_known=True,
                           activation_model="decoder", d_model=model.d_model, vocab_size=model.vocab_size,
                           num_layers=model.num_layers, nhead=model.nhead, dim_feedforward=model.ffn,
                           q_width=model.nhead * model.head_width,
                           kv_width=model.kv_heads * model.head_width, gated_mlp=model.gated_mlp,
                           head_numel=model.d_model * model.vocab_size,
                           breakdown=tuple(model.param_breakdown().items()))
    check_int("model", model, 0)
    return ModelLayout(f"a model of {model:,} parameters", model, (("model", (model,)),), exact=False,
                       units_known=False, breakdown=(("parameters", model),))


def wrap_units(model: ModelLike, wrap: str = "layer", min_params: int = 100_000) -> list[Unit]:
    """The FSDP units a wrapping policy makes of ``model``: ``model_layout(model).units(wrap, min_params)``."""
    return model_layout(model).units(wrap, min_params)


def estimate_shard_bytes(model: ModelLike, world_size: int, rank: int, dtype: str = "fp32") -> ShardBytes:
    """Predict one rank's parameter-shard bytes under FSDP: ``model_layout(model).shard_bytes(...)``.

    For the handbook's model every parameter is sharded separately along dim 0 (see
    :func:`~handbook_lib.models.sharding.shard_rows`); over all ranks the ``shard_bytes`` sum to
    the whole model's bytes, and the padding is extra.

    Args:
        model: Anything :func:`model_layout` accepts.
        world_size: Ranks sharing the parameters (the shard group).
        rank: The rank to predict for (its index within the shard group).
        dtype: Element type of the sharded copy (``fp32`` for FSDP's sharded parameters).
    """
    return model_layout(model).shard_bytes(world_size, rank, dtype)
