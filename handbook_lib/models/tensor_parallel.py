"""Tensor parallelism beside FSDP: placements, bytes per rank, collectives, activations. Pure.

Chapter 9 teaches it. Tensor parallelism (TP; Shoeybi et al., 2019, "Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism") splits every layer's matrices
over a group of ``tp`` ranks: Q, K, V and the first feed-forward projection by output rows
("column parallel"), the attention's output projection and the second feed-forward projection
by input columns ("row parallel"), so a layer needs one reduction of its (tokens × d) output
after each of its two blocks in forward, and one of its input's gradient in backward. Sequence
parallelism (SP; Korthikanti et al., 2022, "Reducing Activation Recomputation in Large
Transformer Models") keeps the tensors between the blocks — the residual adds and the norms —
split by sequence: each all-reduce becomes a reduce-scatter and an all-gather of the same
buffer (the same bytes on the wire), and those tensors take 1/tp of the activation memory.
FSDP2 then shards each rank's TP-local tensors over the ``dp`` ranks.

Two levels, as elsewhere in the book:

- the exact model of chapter 9's run (:mod:`handbook_lib.runs.tensor_parallel`):
  :func:`tp_param_placements` (one home for which dimension of each parameter of
  :class:`~handbook_lib.runtime.parallel_model.ParallelTransformer` TP splits),
  :func:`estimate_tp_state_bytes`, :func:`estimate_tp_step_collectives`,
  :func:`estimate_tp_activation_bytes` — integer bytes, checked exactly;
- formulas for decoders at scale, for the planner: :func:`estimate_tp_layer_traffic` (bytes a
  rank sends per layer per step) and :func:`estimate_decoder_tp_memory` (per-GPU bytes of a
  :class:`~handbook_lib.models.presets.DecoderShape` under TP inside a node × FSDP across).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from handbook_lib.core.architecture import ModelConfig, param_shapes
from handbook_lib.core.checks import check_int
from handbook_lib.core.config import dtype_bytes
from handbook_lib.core.parallel_layout import ParallelLayout
from handbook_lib.models.activations import ActivationBytes, ModelSizes
from handbook_lib.models.collectives import CollectiveCost, estimate_collective
from handbook_lib.models.model_state import OPTIMIZER_RULES, optimizer_states
from handbook_lib.models.presets import DecoderShape
from handbook_lib.models.sharding import Unit, estimate_tensor_shards, policy_units
from handbook_lib.models.traffic import estimate_step_traffic

__all__ = [
    "DecoderTPMemory",
    "TPCollective",
    "TPLayerTraffic",
    "TPParam",
    "TPStateBytes",
    "state_from_shapes",
    "decoder_tp_units",
    "estimate_decoder_tp_activation_bytes",
    "estimate_decoder_tp_memory",
    "estimate_tp_activation_bytes",
    "estimate_tp_collectives",
    "estimate_tp_layer_traffic",
    "estimate_tp_state_bytes",
    "estimate_tp_step_collectives",
    "tp_local_shapes",
    "tp_padded",
    "tp_param_placements",
    "tp_units",
]

_COLUMN = ("q_proj", "k_proj", "v_proj", "linear1")
"""Column-parallel linears (``ColwiseParallel``): weight and bias split on dim 0 (output rows)."""
_ROW = ("out_proj", "linear2")
"""Row-parallel linears (``RowwiseParallel``): weight split on dim 1 (input columns), bias
replicated (added once, after the reduction)."""


@dataclass(frozen=True)
class TPParam:
    """One parameter of :class:`~handbook_lib.runtime.parallel_model.ParallelTransformer` and its
    placement on the tensor-parallel axis."""

    name: str
    """As ``named_parameters()`` names it, e.g. ``layers.0.self_attn.q_proj.weight``."""
    shape: tuple[int, ...]
    """Full shape, elements."""
    tp_dim: int | None
    """The dimension TP splits (0 or 1), or ``None``: replicated on every TP rank."""

    def local_shape(self, tp_size: int) -> tuple[int, ...]:
        """The shape one TP rank holds (the split dimension divided by ``tp_size``).

        Raises:
            ValueError: if ``tp_size`` does not divide the split dimension.
        """
        check_int("tp_size", tp_size, 1)
        if self.tp_dim is None:
            return self.shape
        size = self.shape[self.tp_dim]
        if size % tp_size:
            raise ValueError(f"tp_size={tp_size} must divide dim {self.tp_dim} of {self.name} ({size})")
        return tuple(s // tp_size if i == self.tp_dim else s for i, s in enumerate(self.shape))


def _placement(name: str) -> int | None:
    """TP dimension of a parameter from its name (the plan of
    :func:`handbook_lib.runtime.tensor_parallel.apply_tensor_parallel`)."""
    module, kind = name.rsplit(".", 2)[-2:]
    if module in ("embedding", "output") or module in _COLUMN:
        return 0  # vocabulary rows (embedding: RowwiseParallel on nn.Embedding; head: Colwise)
    if module in _ROW:
        return 1 if kind == "weight" else None
    return None  # the norms


def tp_param_placements(config: ModelConfig) -> list[TPParam]:
    """Every parameter of ``ParallelTransformer(config)`` in ``named_parameters()`` order, with
    its TP placement: the one home of the plan's layout.

    Derived from :func:`~handbook_lib.core.architecture.param_shapes`, with each layer's fused
    ``in_proj`` (3d, d) + (3d,) cut into Q, K, V projections of (d, d) + (d,) (as
    :func:`~handbook_lib.runtime.parallel_model.from_simple` cuts it). Split on dim 0: the
    embedding and the head (vocabulary), Q/K/V and ``linear1`` (weights and biases); on dim 1:
    the ``out_proj`` and ``linear2`` weights; replicated: their biases and the norms.
    """
    out: list[TPParam] = []
    for name, shape in param_shapes(config):
        if name.endswith("self_attn.in_proj_weight"):
            prefix = name[: -len("in_proj_weight")]
            d = shape[1]
            for proj in ("q_proj", "k_proj", "v_proj"):
                out += [TPParam(f"{prefix}{proj}.weight", (d, d), 0), TPParam(f"{prefix}{proj}.bias", (d,), 0)]
        elif name.endswith("self_attn.in_proj_bias"):
            continue
        else:
            out.append(TPParam(name, shape, _placement(name)))
    return out


def tp_padded(config: ModelConfig, tp_size: int) -> ModelConfig:
    """``config`` with its vocabulary padded for ``tp_size`` tensor-parallel ranks
    (:meth:`ParallelLayout.padded_vocab <handbook_lib.core.parallel_layout.ParallelLayout.padded_vocab>`):
    the model a TP run builds, whose embedding and head hold the padded rows."""
    padded = ParallelLayout(tp=tp_size).padded_vocab(config.vocab_size)
    return config if padded == config.vocab_size else replace(config, vocab_size=padded)


def tp_local_shapes(config: ModelConfig, tp_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of what one TP rank holds of every parameter, before FSDP shards it:
    the vocabulary padded first (:func:`tp_padded`), so the embedding and head rows split evenly."""
    return [(p.name, p.local_shape(tp_size)) for p in tp_param_placements(tp_padded(config, tp_size))]


def tp_units(config: ModelConfig, tp_size: int) -> list[Unit]:
    """The FSDP2 units over the ``dp`` axis (one per layer, the root with the embedding and the
    head), each holding its TP-local tensors: what ``fully_shard`` pads and gathers."""
    return policy_units(tp_local_shapes(config, tp_size), "layer")


@dataclass(frozen=True)
class TPStateBytes:
    """One rank's model state under TP × FSDP2, bytes (fp32 parameters and gradients)."""

    param_shard_bytes: int
    """Parameter values held (the dp shard of each TP-local tensor)."""
    param_padding_bytes: int
    """FSDP2's dim-0 padding of those shards."""
    grad_bytes: int
    """Gradients held: the same shards, unpadded."""
    optimizer_state_bytes: int
    """The optimizer's parameter-shaped states (Adam: two per parameter)."""
    optimizer_step_bytes: int
    """Adam's 4-byte ``step`` counter per parameter tensor (0 for SGD)."""

    @property
    def total(self) -> int:
        """All parts, padding included."""
        return (self.param_shard_bytes + self.param_padding_bytes + self.grad_bytes
                + self.optimizer_state_bytes + self.optimizer_step_bytes)


def estimate_tp_state_bytes(config: ModelConfig, tp_size: int, dp_size: int, dp_rank: int = 0,
                            optimizer: str = "adamw", dtype: str = "fp32") -> TPStateBytes:
    """Parameter, gradient and optimizer bytes of the rank at ``dp_rank`` of its data-parallel
    group (every TP rank of a group holds the same amount): each parameter's TP-local shape
    (:func:`tp_local_shapes`), then FSDP2's rule (:func:`~handbook_lib.models.sharding.estimate_tensor_shards`):
    rows ``ceil(n / dp)`` along dim 0, padded to equal size. ``dp_size`` 1: no FSDP, no padding.

    Raises:
        ValueError: for an unknown optimizer, a bad rank, or a ``tp_size`` that does not divide a split dim.
    """
    return state_from_shapes([shape for _, shape in tp_local_shapes(config, tp_size)], dp_size, dp_rank, optimizer,
                             dtype)


def state_from_shapes(shapes: list[tuple[int, ...]], group: int, rank: int, optimizer: str = "adamw",
                      dtype: str = "fp32") -> TPStateBytes:
    """What one rank holds of tensors of ``shapes`` sharded by FSDP2's dim-0 rule over ``group``
    ranks (:func:`~handbook_lib.models.sharding.estimate_tensor_shards`, padding included): the
    parameter shards, their gradients, the optimizer's parameter-shaped states and its ``step``
    counters (4 bytes per tensor), bytes."""
    shard = estimate_tensor_shards(shapes, group, rank, dtype)
    rule = OPTIMIZER_RULES.get(optimizer)
    return TPStateBytes(
        param_shard_bytes=shard.shard_bytes, param_padding_bytes=shard.padding_bytes, grad_bytes=shard.shard_bytes,
        optimizer_state_bytes=optimizer_states(optimizer) * shard.shard_bytes,
        optimizer_step_bytes=4 * len(shapes) if rule is not None and rule.step_counter else 0)


@dataclass(frozen=True)
class TPCollective(CollectiveCost):
    """One collective of a TP × FSDP2 step: its ring cost, and where and when it is issued."""

    axis: str
    """``tp`` (tensor parallelism's, over the TP group) or ``dp`` (FSDP2's, over the dp group)."""
    phase: str
    """``forward`` or ``backward``."""
    site: str
    """What issues it, e.g. ``layers.0.out_proj`` (TP) or the FSDP unit ``layers.0`` (dp)."""


def _tp(kind: str, buffer: int, tp: int, phase: str, site: str) -> TPCollective:
    cost = estimate_collective(kind, buffer, tp)
    return TPCollective(**vars(cost), axis="tp", phase=phase, site=site)


def estimate_tp_collectives(config: ModelConfig, tp_size: int, tokens: int, sequence_parallel: bool = False,
                            compute_dtype: str = "fp32") -> list[TPCollective]:
    """Tensor parallelism's collectives in one step of chapter 9's run, forward then backward.

    ``tokens`` T is what one TP group computes on (its dp share of the batch × ``seq_len``);
    every buffer is the (T, d) activation, B = T·d·c bytes, over ``tp_size`` ranks. With L layers:

    - without SP: forward, one all-reduce after the embedding (vocabulary-parallel rows) and
      after each ``out_proj`` and ``linear2`` (1 + 2L); backward, one all-reduce of the input
      gradient of each layer's attention (Q, K, V share one input) and ``linear1``, and of the
      head's (2L + 1);
    - with SP: forward, a reduce-scatter in place of each of those all-reduces (1 + 2L) and an
      all-gather before the attention, ``linear1`` and the head (2L + 1); backward, each turned
      round (an all-gather per forward reduce-scatter, a reduce-scatter per all-gather), plus an
      all-reduce of each norm's weight and bias gradient (4L, of d·c bytes: their gradients are
      partial sums over the sequence shards, in the dtype the norms compute in).

    ``loss_parallel``'s own reductions (the max, the sum of exponentials and the target logit
    over the vocabulary shards) run inside DTensor's dispatch, where the collective counter
    cannot see them: they are small (T values each) and not listed.
    """
    check_int("tp_size", tp_size, 2)
    check_int("tokens", tokens, 1)
    big = tokens * config.d_model * dtype_bytes(compute_dtype)
    layers = [f"layers.{i}" for i in range(config.num_layers)]
    fwd_reduced = ["embedding"] + [f"{x}.{m}" for x in layers for m in ("out_proj", "linear2")]
    fwd_gathered = [f"{x}.{m}" for x in layers for m in ("self_attn", "linear1")] + ["output"]
    bwd_reduced = ["output"] + [f"{x}.{m}" for x in reversed(layers) for m in ("linear1", "self_attn")]
    if not sequence_parallel:
        return ([_tp("all_reduce", big, tp_size, "forward", s) for s in fwd_reduced]
                + [_tp("all_reduce", big, tp_size, "backward", s) for s in bwd_reduced])
    norm = config.d_model * dtype_bytes(compute_dtype)  # the norms' gradients, in the compute dtype
    out = [_tp("reduce_scatter", big, tp_size, "forward", s) for s in fwd_reduced]
    out += [_tp("all_gather", big, tp_size, "forward", s) for s in fwd_gathered]
    out += [_tp("all_gather", big, tp_size, "backward", s) for s in fwd_reduced]
    out += [_tp("reduce_scatter", big, tp_size, "backward", s) for s in fwd_gathered]
    out += [_tp("all_reduce", norm, tp_size, "backward", f"{x}.{n}.{p}")
            for x in layers for n in ("norm1", "norm2") for p in ("weight", "bias")]
    return out


def estimate_tp_step_collectives(config: ModelConfig, tp_size: int, dp_size: int, micro_batch: int, seq_len: int,
                                 sequence_parallel: bool = False, compute_dtype: str = "fp32",
                                 ) -> list[TPCollective]:
    """Every collective one rank issues in a step of chapter 9's run: TP's
    (:func:`estimate_tp_collectives`, T = ``micro_batch · seq_len``, the rows of its dp group) and
    FSDP2's over the dp group — per unit (:func:`tp_units`: its TP-local tensors, padded along
    dim 0 to a multiple of dp) an all-gather in forward and again in backward (every unit but
    the root, which stays gathered into backward) and a reduce-scatter of its gradients, as
    :func:`~handbook_lib.models.traffic.estimate_step_traffic` lists them for FULL_SHARD over
    ``dp_size`` ranks (reused as it is: it takes any unit shapes). ``dp_size`` 1: no FSDP.
    """
    out = estimate_tp_collectives(config, tp_size, micro_batch * seq_len, sequence_parallel, compute_dtype)
    if dp_size > 1:
        fsdp = estimate_step_traffic(tp_units(config, tp_size), dp_size, "FULL_SHARD")
        out += [TPCollective(r.kind, r.buffer_bytes, r.group_size, r.sent_bytes, r.received_bytes, r.steps,
                             axis="dp", phase=r.phase, site=r.unit) for r in fsdp.records]
    return out


def estimate_tp_activation_bytes(config: ModelSizes, micro_batch: int, seq_len: int, tp_size: int,
                                 sequence_parallel: bool = False, compute_dtype: str = "fp32") -> ActivationBytes:
    """Bytes alive after the forward pass (what autograd saves) on one rank of chapter 9's run:
    ``ParallelTransformer`` with TP over ``tp_size`` >= 2 ranks, ``micro_batch`` rows per dp group.

    With T = micro_batch·seq_len, width d, feed-forward f, h heads, t = tp_size, c bytes, one layer
    saves (PyTorch 2.x CPU kernels, fp32: exact, checked by the run against the memory tracker):

    - ``T·d·c`` ×4, replicated: the layer input (shared by Q, K and V: under SP the all-gathered
      one), norm1's input, ``linear1``'s input (norm1's output; under SP all-gathered), norm2's input;
    - ``T·(d/t)·c`` ×4: Q, K, V and the attention output (the rank's heads);
    - ``T·(f/t)·c`` ×2: GELU's input and output; ``T·(h/t)·4``: the attention's log-sum-exp;
    - ``4·T·4``: the two norms' mean and reciprocal std.

    With ``sequence_parallel`` the norms' inputs and statistics are 1/t (the sequence shard):
    ``2·T·d·c`` and ``16·T`` become ``2·T·d·c/t`` and ``16·T/t``. (PyTorch saves the all-gathered
    inputs of the linears; Megatron-SP saves the shards and gathers again in backward, which is
    how Korthikanti et al. reach 1/t for every term.) Outside the layers: the rank's token ids
    and targets (int64, ``16·T``; :func:`~handbook_lib.runtime.tensor_parallel.dp_batch` gives
    each its own contiguous copy — a non-contiguous view of the global batch would keep that
    whole batch alive and make the embedding save a contiguous copy of the ids), the head's
    input ``T·d·c``, the vocabulary-parallel log-softmax ``T·(V/t)·4`` (``V`` padded to a multiple
    of ``t``, :func:`tp_padded`) and two fp32 scalars
    (8 bytes). Batch, sequence, vocabulary, width and depth were varied one at a time to fit
    the terms outside the layers; the run checks the total exactly.
    """
    check_int("tp_size", tp_size, 2)
    check_int("micro_batch", micro_batch, 1)
    check_int("seq_len", seq_len, 1)
    c, t = dtype_bytes(compute_dtype), tp_size
    d, f, h = config.d_model, config.dim_feedforward, config.nhead
    v = ParallelLayout(tp=t).padded_vocab(config.vocab_size)
    tokens = micro_batch * seq_len
    norms = 2 * tokens * d * c + 16 * tokens
    per_layer = tokens * (2 * d + 4 * d // t + 2 * f // t) * c + tokens * (h // t) * 4
    per_layer += norms // t if sequence_parallel else norms
    head = tokens * (2 * 8 + d * c + (v // t) * 4) + 8
    return ActivationBytes(per_layer=per_layer, layers=config.num_layers * per_layer, head=head, recompute=0)


@dataclass(frozen=True)
class TPLayerTraffic:
    """Tensor parallelism's collectives of one transformer layer in one training step."""

    collectives: tuple[CollectiveCost, ...]
    """Forward then backward."""

    @property
    def sent_bytes(self) -> int:
        """Bytes one rank sends for the layer in the step (forward and backward)."""
        return sum(c.sent_bytes for c in self.collectives)

    @property
    def counts(self) -> dict[str, int]:
        """Collectives of each kind."""
        out: dict[str, int] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0) + 1
        return out


def estimate_tp_layer_traffic(d_model: int, tokens: int, tp_size: int, dtype_bytes: int = 2,
                              sequence_parallel: bool = False) -> TPLayerTraffic:
    """TP's communication for one decoder layer of width ``d_model`` on ``tokens`` T (micro-batch ×
    sequence) per step, in ``dtype_bytes`` c per element (2: bf16), over ``tp_size`` t ranks.

    Megatron's layer (Shoeybi et al., 2019, §3): the attention and the MLP each end in a
    row-parallel projection, so forward all-reduces the (T, d) output twice and backward the
    input gradient twice: 4 all-reduces of B = T·d·c, each sending 2(t-1)/t·B on a ring.
    With sequence parallelism (Korthikanti et al., 2022, §4.2.2) each all-reduce is a
    reduce-scatter plus an all-gather of the same B, each sending (t-1)/t·B: 4 of each per
    layer and the same total, ``8·(t-1)/t·T·d·c`` bytes per layer per micro-batch either way —
    while the norm/residual activations shrink to 1/t. (SP's small all-reduce of the norms'
    gradients, ~d·c per norm, is left out.)
    """
    for key, value in (("d_model", d_model), ("tokens", tokens), ("tp_size", tp_size), ("dtype_bytes", dtype_bytes)):
        check_int(key, value, 1)
    big = tokens * d_model * dtype_bytes
    kinds = ("all_gather", "reduce_scatter") if sequence_parallel else ("all_reduce",)
    if sequence_parallel and big % tp_size:
        raise ValueError(f"tokens={tokens} × d_model × dtype_bytes must divide by tp_size={tp_size} under SP")
    one_way = [estimate_collective(k, big, tp_size) for k in kinds for _ in range(2)]
    return TPLayerTraffic(tuple(one_way + one_way))


def estimate_decoder_tp_activation_bytes(shape: ModelSizes, micro_batch: int, seq_len: int, tp_size: int,
                                         sequence_parallel: bool = False, *, recompute: str = "none",
                                         fused_attention: bool = True) -> int:
    """Activation bytes per GPU of a decoder's layers in 16-bit training under TP (Korthikanti et
    al., 2022, Table 2), with s = seq_len, b = micro_batch, h = d_model, a = heads, t = tp_size:

    - TP: ``s·b·h·(10 + 24/t)`` per layer (the norms, residuals and dropout masks, 10·sbh, are
      replicated), plus ``5·a·s²·b/t`` for an unfused attention's scores;
    - TP + SP: ``s·b·h·34/t`` (+ ``5·a·s²·b/t`` unfused);
    - ``attention`` (Korthikanti's selective recomputation of the attention core): the same
      without the scores;
    - ``full`` recomputation: ``2·s·b·h`` per layer (``2·s·b·h/t`` with SP).

    ``fused_attention`` (FlashAttention, SDPA) stores no s² scores. Rounded down to bytes.
    """
    check_int("tp_size", tp_size, 1)
    sbh = seq_len * micro_batch * shape.d_model
    scores = 0 if fused_attention else 5 * shape.nhead * seq_len**2 * micro_batch // tp_size
    if recompute == "full":
        per_layer = 2 * sbh // (tp_size if sequence_parallel else 1)
    elif recompute in ("none", "attention"):  # attention: Korthikanti's selective recomputation
        per_layer = (34 * sbh // tp_size if sequence_parallel else 10 * sbh + 24 * sbh // tp_size)
        per_layer += scores if recompute == "none" else 0
    else:
        raise ValueError(f"recompute must be one of none, attention, full, got {recompute!r}")
    return shape.num_layers * per_layer


@dataclass(frozen=True)
class DecoderTPMemory:
    """Per-GPU bytes of a decoder trained with TP inside a node and FSDP2 across nodes."""

    params_per_gpu: int
    """Parameter elements one GPU holds (its TP slice, then its FSDP shard)."""
    state_bytes: int
    """fp32 parameters, gradients and optimizer states of those elements."""
    activation_bytes: int
    """The layers' activations for one micro-batch (:func:`estimate_decoder_tp_activation_bytes`)."""
    gathered_bytes: int
    """FSDP2's gathered unit at the peak: one layer's TP slice in the compute dtype (×2: the
    next one prefetched)."""

    @property
    def total(self) -> int:
        """All of it, bytes (no allocator overhead)."""
        return self.state_bytes + self.activation_bytes + self.gathered_bytes


def _tp_layer_elements(shape: DecoderShape, tp: int) -> int:
    """Elements of one layer one TP rank holds: the projections split, the norms and the
    row-parallel biases (attention output, MLP output) replicated."""
    d = shape.d_model
    replicated = 2 * d * (2 if shape.bias else 1)
    replicated += d if shape.bias or shape.out_bias else 0
    replicated += d if shape.bias or shape.mlp_bias else 0
    return (shape.layer_params - replicated) // tp + replicated


def estimate_decoder_tp_memory(shape: DecoderShape, tp_size: int, dp_size: int, micro_batch: int, seq_len: int, *,
                               sequence_parallel: bool = True, optimizer: str = "adamw",
                               compute_bytes: int = 2, recompute: str = "none") -> DecoderTPMemory:
    """Per-GPU memory of ``shape`` under TP over ``tp_size`` GPUs (inside a node) × FSDP2 over
    ``dp_size`` (across nodes): what the planner prices against HSDP and FULL_SHARD.

    Each GPU holds 1/tp of every projection and of the (vocabulary-parallel) embedding and head,
    all of the norms, then 1/dp of that (FSDP2), at 4·(2 + k) bytes per element (fp32 parameter,
    gradient and k optimizer states, Adam k = 2; the step counters are negligible). Activations:
    :func:`estimate_decoder_tp_activation_bytes`; the gathered buffers: two layers' TP slices in
    ``compute_bytes``. Tensor parallelism needs ``tp_size`` to divide the heads, the KV heads and
    the feed-forward width.

    Raises:
        ValueError: for a ``tp_size`` that does not divide them, or bad sizes.
    """
    check_int("tp_size", tp_size, 1)
    check_int("dp_size", dp_size, 1)
    ParallelLayout(tp=tp_size).check_shape(nhead=shape.nhead, kv_heads=shape.kv_heads, ffn=shape.ffn)
    layer = _tp_layer_elements(shape, tp_size)
    d = shape.d_model
    vocab = shape.vocab_size * d * (1 if shape.tied_embeddings else 2)
    root = -(-vocab // tp_size) + shape.max_positions * d + d * (2 if shape.bias else 1)
    held = -(-(shape.num_layers * layer + root) // dp_size)
    state = 4 * (2 + optimizer_states(optimizer)) * held
    acts = estimate_decoder_tp_activation_bytes(shape, micro_batch, seq_len, tp_size, sequence_parallel,
                                                recompute=recompute)
    return DecoderTPMemory(params_per_gpu=held, state_bytes=state, activation_bytes=acts,
                           gathered_bytes=2 * layer * compute_bytes if dp_size > 1 else 0)


def decoder_tp_units(shape: DecoderShape, tp_size: int) -> list[Unit]:
    """FSDP2's units over the dp axis for a decoder under TP: the root (embedding and head split
    over the vocabulary, final norm replicated) and one unit per layer, each one TP rank's slice
    (:func:`estimate_decoder_tp_memory`'s split): the planner's FSDP traffic under TP."""
    layer = _tp_layer_elements(shape, tp_size)
    root = estimate_decoder_tp_memory(shape, tp_size, 1, 1, 1).params_per_gpu - shape.num_layers * layer
    return [Unit("root", ((root,),), root=True)] + [Unit(f"layers.{i}", ((layer,),)) for i in range(shape.num_layers)]
