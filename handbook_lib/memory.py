"""The memory model: where a training job's bytes go, per rank.

Pure arithmetic: no ``torch.distributed``, no side effects.

Chapter 1 introduces the model state ("16 bytes per parameter") and FSDP's shards; chapter 2
builds the full per-rank model of this module and checks it against real runs:

- **model state at rest** — sharded parameters, gradients and optimizer states, exact to the byte
  (padding included) for the handbook's model;
- **transients** — unsharded parameters of the unit(s) being computed and FSDP's all-gather
  buffer, unsharded gradients, casts and reduce-scatter buffers, the loss's logits gradients;
- **activations** (see :mod:`handbook_lib.activations`), with or without checkpointing.

Peak memory is predicted as the largest of a few *phases* of a training step, each a sum of
components alive at the same moment (see :func:`estimate_memory`). The phases follow what FSDP2
does on every rank; chapter 2 shows each against a memory tracker's breakdown.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from math import prod

from handbook_lib.activations import (
    ActivationBytes,
    DecoderShape,
    estimate_activation_bytes,
    estimate_decoder_activation_bytes,
)
from handbook_lib.architecture import ModelConfig, param_count, param_shapes
from handbook_lib.config import PRECISIONS, lookup
from handbook_lib.sharding import (
    DTYPE_BYTES,
    ShardBytes,
    Unit,
    check_world,
    dtype_bytes,
    estimate_shard_bytes,
    fsdp_units,
    shard_rows,
)
from handbook_lib.strategies import STRATEGY_TABLE, get_strategy

__all__ = [
    "DTYPE_BYTES", "ShardBytes", "Unit", "dtype_bytes", "shard_rows", "estimate_shard_bytes",
    "fsdp_units", "OPTIMIZER_STATES", "optimizer_states", "optimizer_step_bytes", "COMPONENTS", "FSDP2_SPELLING",
    "ZERO_STAGES", "ModelStateBytes", "MemoryEstimate", "estimate_model_state_bytes",
    "estimate_zero_memory", "estimate_memory", "estimate_seed_model_state", "min_gpus_to_fit",
    "PHASE_WORDS", "SEED_STRATEGIES", "model_part_numels", "estimate_init_bytes",
    "estimate_accumulation_bytes", "RankState", "estimate_rank_state",
]

PHASE_WORDS: dict[str, tuple[str, str]] = {
    "forward_start": ("as forward starts",
                      "forward begins: the root and the first layer gathered, each with its "
                      "all-gather buffer"),
    "layer_forward": ("as a layer is gathered in forward",
                      "a layer's all-gather in forward: its parameters copied out of the all-gather "
                      "buffer, the previous unit's buffer still kept, the activations so far "
                      "(SHARD_GRAD_OP: every unit gathered before it)"),
    "loss_backward": ("in the loss's backward",
                      "the loss's backward, with every activation still saved"),
    "backward_start": ("as backward starts",
                       "backward begins: the logits' gradient alive, the root unit gathered again"),
    "layer_backward": ("in a layer's backward",
                       "a layer's backward: that layer and the root gathered, the next layer's "
                       "all-gather buffer, the previous layer's reduce-scatter input kept"),
    "layer_reduce": ("in a layer's reduce-scatter",
                     "a layer's reduce-scatter: its gradients copied into the reduce-scatter input, "
                     "then the input and its output (HSDP: the earlier layers' all-reduce buffers kept)"),
    "root_reduce": ("at the end of backward",
                    "end of backward: the root's gradients cast and reduce-scattered"),
    "layer_recompute": ("while a layer is recomputed",
                        "a layer's activations recomputed (activation checkpointing)"),
    "head_backward": ("in the output head's backward",
                      "the output head's backward: the logits' gradient, the head's weight gradients "
                      "and the hidden states' gradient alive together"),
    "optimizer_step": ("in the optimizer step",
                       "the optimizer step: Adam's temporaries of the largest tensor"),
}
"""Each phase of :func:`estimate_memory` in plain words: ``(when, what)`` — when it happens, to
end a sentence ("peak 34.0 GB per GPU in a layer's backward"), and what is alive then,
for a legend under a table."""

OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}
"""State tensors per parameter, each the parameter's shape: Adam's two moments, SGD's momentum.

(Adam also keeps one ``step`` scalar per parameter tensor; it is not sharded and is counted
apart, as ``optimizer_other``.)
"""

FSDP2_SPELLING: dict[str, str] = {s.name: s.fsdp2_spelling for s in STRATEGY_TABLE.values()
                                  if s.wrapper != "deepspeed"}
"""How each FSDP1 ``ShardingStrategy`` is written with FSDP2's ``fully_shard`` (from
:data:`handbook_lib.strategies.STRATEGY_TABLE`)."""

ZERO_STAGES: dict[int, str | None] = {
    stage: next((s.name for s in STRATEGY_TABLE.values()
                  if s.zero_stage == stage and not s.hybrid and s.wrapper != "deepspeed"), None)
    for stage in range(4)
}
"""DeepSpeed ZeRO stage → the first FSDP strategy with the same sharding (from the strategy
table): DDP, none, SHARD_GRAD_OP, FULL_SHARD. ZeRO-1 shards only the optimizer states; FSDP has
no such strategy. ZeRO-2 keeps parameters replicated at rest, while FSDP's SHARD_GRAD_OP shards
them between steps (both hold them unsharded from forward to backward)."""

COMPONENTS = ("params", "grads", "optimizer", "unsharded_params", "grad_buffers",
              "activations", "loss_buffers")
"""Names of the per-rank memory components, in the order the book stacks them."""


def optimizer_states(optimizer: str) -> int:
    """How many parameter-shaped state tensors ``optimizer`` keeps (see :data:`OPTIMIZER_STATES`).

    Raises:
        ValueError: for an unknown optimizer, listing the accepted ones.
    """
    return lookup(OPTIMIZER_STATES, optimizer, "optimizer")


def optimizer_step_bytes(model: ModelConfig, optimizer: str, units: Sequence[Unit] | None = None) -> int:
    """Bytes of Adam's per-tensor ``step`` counters (a 4-byte float each; 0 for SGD).

    They are not sharded: every rank holds one per parameter tensor it has a shard of. With
    FSDP1's flat parameters, pass the ``units``: the optimizer then sees one tensor per unit
    that has parameters.
    """
    optimizer_states(optimizer)  # validates the name
    tensors = len(param_shapes(model)) if units is None else sum(1 for u in units if u.numel)
    return 4 * tensors if optimizer in ("adam", "adamw") else 0


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model state: parameters, gradients and optimizer states."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        """Sum of the three components, bytes."""
        return self.params + self.grads + self.optimizer


def _count(model: int | ModelConfig | DecoderShape) -> int:
    if isinstance(model, ModelConfig):
        return param_count(model)
    if isinstance(model, DecoderShape):
        return model.num_params
    if isinstance(model, bool) or not isinstance(model, int) or model < 0:
        raise ValueError(f"model must be an int >= 0, a ModelConfig or a DecoderShape, got {model!r}")
    return model


def estimate_model_state_bytes(
    num_params: int | ModelConfig,
    *,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optimizer_bytes: int = 8,
) -> ModelStateBytes:
    """Model-state bytes of an unsharded model: the chapter-1 "16 bytes per parameter".

    The defaults are fp32 training with Adam: 4 B parameter + 4 B gradient + 8 B optimizer state
    (two fp32 moments) per parameter. Activations, temporary buffers and the Adam step counters
    are not included.
    """
    n = _count(num_params)
    for name, value in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes),
                        ("optimizer_bytes", optimizer_bytes)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    return ModelStateBytes(params=n * param_bytes, grads=n * grad_bytes, optimizer=n * optimizer_bytes)


def estimate_zero_memory(num_params: int, world_size: int, stage: int, *, k: int = 12) -> ModelStateBytes:
    """Per-GPU model state in the ZeRO paper's accounting (Rajbhandari et al., 2020, Figure 1).

    Mixed-precision Adam keeps fp16 parameters (2 B) and gradients (2 B), plus K = 12 bytes of
    fp32 optimizer state (a master copy of the weights, momentum and variance): 2 + 2 + 12 = 16
    bytes per parameter — the same total as fp32 Adam's 4 + 4 + 8, for different reasons.
    Stage 1 shards the K bytes, stage 2 also the gradients, stage 3 also the parameters.
    """
    n = _count(num_params)
    check_world(world_size)
    if stage not in ZERO_STAGES:
        raise ValueError(f"stage must be one of 0, 1, 2, 3, got {stage!r}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    shard = lambda b, from_stage: b * n / world_size if stage >= from_stage else b * n  # noqa: E731
    return ModelStateBytes(params=round(shard(2, 3)), grads=round(shard(2, 2)),
                           optimizer=round(shard(k, 1)))


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes on one rank's device, by component, at the step's peak."""

    components: dict[str, int]
    """Bytes alive at the peak phase, keyed by :data:`COMPONENTS`."""
    phases: dict[str, int]
    """Total device bytes of each phase of the step; the peak is the largest."""
    peak_phase: str
    forward_activations: int = 0
    """Bytes of activations alive at the end of the forward pass (all saved tensors)."""
    host: int = 0
    """Bytes kept in host memory instead (CPU offload)."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """What this estimate leaves out."""
    late_free_peak: int = 0
    """On gloo, with sharded parameters: the peak if a finished collective's buffers are freed
    late by gloo's worker thread (see :func:`estimate_memory`), bytes; 0 where that cannot raise
    the peak. A bound for a run under load, not a prediction for an idle one."""

    @property
    def peak(self) -> int:
        """Predicted peak device bytes: the largest phase."""
        return self.phases[self.peak_phase]

    @property
    def model_state(self) -> int:
        """Parameters, gradients and optimizer states on the device (at rest)."""
        return self.components["params"] + self.components["grads"] + self.components["optimizer"]

    def __getattr__(self, name: str) -> int:
        if name in COMPONENTS:
            return self.components[name]
        raise AttributeError(name)


def _units_and_activations(model, group, c_name, micro_batch, seq_len, ac, units=None, flat=False):
    """(units' padded numels: layers list + root, activations total/head-free parts, T·V)."""
    if isinstance(model, ModelConfig):  # units: resolved by estimate_memory, root first
        if not units or not units[0].root:
            raise ValueError("units must start with the root unit (see wrap_units)")
        numels = [u.flat_padded_numel(group) if flat else u.padded_numel(group) for u in units]
        acts = estimate_activation_bytes(model, micro_batch, seq_len, c_name,
                                         activation_checkpointing=ac) if micro_batch else None
        return numels[1:], numels[0], acts, model.vocab_size
    if isinstance(model, DecoderShape):
        c = dtype_bytes(c_name)
        layer = -(-model.layer_params // group) * group
        root = -(-model.root_params // group) * group
        acts = None
        if micro_batch:
            layers = estimate_decoder_activation_bytes(model, micro_batch, seq_len,
                                                       recompute="full" if ac else "none") * c // 2
            tokens = micro_batch * seq_len
            head = tokens * model.d_model * c + tokens * model.vocab_size * 4 + 16 * tokens
            per_layer = layers // model.num_layers
            acts = ActivationBytes(per_layer=per_layer, layers=layers, head=head,
                                   recompute=per_layer if ac else 0)
        return [layer] * model.num_layers, root, acts, model.vocab_size
    return [], 0, None, 0


def _d_model(model) -> int:
    """Width of the hidden states (0 when unknown)."""
    return model.d_model if isinstance(model, (ModelConfig, DecoderShape)) else 0


def _head_numel(model) -> int:
    """Elements of the output head (its gradients are computed first in backward)."""
    if isinstance(model, ModelConfig):
        return model.d_model * model.vocab_size + model.vocab_size
    if isinstance(model, DecoderShape):
        return model.d_model * model.vocab_size
    return 0


def estimate_memory(
    model: int | ModelConfig | DecoderShape,
    world_size: int,
    strategy: str = "FULL_SHARD",
    precision: str = "fp32",
    optimizer: str = "adamw",
    *,
    micro_batch: int = 0,
    seq_len: int = 0,
    shard_group_size: int | None = None,
    rank: int = 0,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    reduce_dtype: str | None = None,
    units: Sequence[Unit] | None = None,
    flat_params: bool = False,
    backend: str = "nccl",
    grad_accum_steps: int = 1,
) -> MemoryEstimate:
    """Predict one rank's device memory for a training step, by component and phase.

    Args:
        model: A :class:`ModelConfig` (exact shapes, units and activations), a
            :class:`DecoderShape` (a large GPT-style model: per-layer units, published activation
            formula) or a parameter count (model state only: no units, no activations).
        world_size: Ranks in the job.
        strategy: One of :data:`handbook_lib.config.STRATEGIES`.
        precision: ``fp32``, ``bf16-mixed`` or ``fp16-mixed`` (see :data:`handbook_lib.config.PRECISIONS`).
        optimizer: One of :data:`OPTIMIZER_STATES`.
        micro_batch: Sequences per rank per step (0: leave activations out).
        seq_len: Tokens per sequence.
        shard_group_size: Ranks that shard one copy of the model, for the HYBRID strategies
            (must divide ``world_size``); the others use ``world_size`` (or 1 for DDP/NO_SHARD).
        rank: Which rank (matters only for uneven shards).
        activation_checkpointing: Recompute each layer's activations in backward.
        cpu_offload: Keep sharded parameters, gradients and optimizer states in host memory
            (FSDP strategies only: refused with ``NONE`` and ``DDP``, as ``fsdp_train`` does).
        reduce_dtype: Gradient-reduction dtype, overriding the precision's (e.g. ``bf16``).
        units: The FSDP units, root first (default: one per layer, :func:`fsdp_units`; see
            :func:`handbook_lib.sharding.wrap_units` for the other wrapping policies). Only for
            a :class:`ModelConfig`.
        flat_params: FSDP1's flat parameters: each unit padded once (chapter 5).
        backend: The process group's backend, ``nccl`` or ``gloo``: gloo's reduce-scatter
            flattens its input into a temporary copy (one more reduce-dtype copy of the unit).
        grad_accum_steps: Micro-steps per optimizer step, gradients reduced in the last one
            only: a strategy that shards gradients then keeps every unsharded gradient until
            that last micro-step (:func:`estimate_accumulation_bytes`), in every phase but the
            end of backward.

    The phases of a sharding strategy (FSDP2; every fsdp_train run checks the peak they give):

    - ``forward_start``: the root gathered (its unsharded parameters, and its all-gather buffer,
      which FSDP2 keeps until the next unit's all-gather), the embedding's output, and the first
      layer gathered (2 copies): the peak of SHARD_GRAD_OP with checkpointing and few layers;
    - ``loss_backward``: all activations, plus the loss's two T·V fp32 gradients, plus whatever
      stays unsharded after forward (everything, for SHARD_GRAD_OP);
    - ``backward_start``: the log-softmax output is freed, the logits' gradient (compute dtype)
      is alive, and FULL_SHARD all-gathers the root unit again: its unsharded parameters and
      FSDP's all-gather buffer (2 copies in the compute dtype);
    - ``head_backward``: the output head's backward: the logits' gradient, the head's weight
      and bias gradients and the hidden states' gradient alive together;
    - ``layer_backward``: a layer's backward, the largest over the layers (last first): the
      root still unsharded, the head's gradients waiting for the root's reduce-scatter, the
      layer gathered and its gradients computed, the next layer's all-gather buffer
      (prefetched), and from the second layer on the previous layer's reduce-scatter input,
      which FSDP2 keeps until the next unit's post-backward; each layer done frees its saved
      activations. With HSDP (more than one replica) every reduced unit's all-reduce buffer
      (its reduce-scatter output, r bytes per element of the shard) stays alive to the end of
      backward, on top of the zeroed gradients;
    - ``layer_reduce``: a layer's post-backward, the layer resharded, the larger of two moments:
      its gradients copied into the reduce-scatter input (reduce dtype), then that input, its
      1/N output and, on gloo, gloo's flattened copy of the input (plus the unit's last
      gradient, which FSDP2's loop keeps);
    - ``root_reduce``: end of backward, the same two moments for the root, with the
      HSDP all-reduce buffers of every layer;
    - ``layer_recompute`` (with checkpointing): one layer's activations recomputed, its unit
      gathered, the root still unsharded, the head's gradients alive (the logits' gradient is
      freed by then), with the buffers ``layer_backward`` keeps.

    On gloo, a finished collective's buffers are dropped by gloo's worker thread a moment after
    the rank moves on; under load the root's all-gather buffer can meet the first layer's, or a
    unit's flattened reduce-scatter copy the next unit's start. That bound is reported in
    ``notes``, not counted in the peak (idle runs match the phases above).

    The replicating strategies (DDP, NO_SHARD, and NONE, one plain process) are one model: the
    full state at rest, the same activation phases, plus what each wrapper adds. DDP keeps its
    gradient buckets (``grad_bucket_copy`` in the strategy table: a second copy of every
    gradient, r·n, allocated when DDP wraps the model); FSDP1's NO_SHARD all-reduces each unit's
    flat gradient in place, which autograd concatenates from the parameters' gradients (both
    alive at the end of backward), and with mixed precision keeps a compute-dtype copy of the
    root's flat parameters through backward. Their ``optimizer_step`` phase holds Adam's two
    fp32 temporaries of the largest tensor (PyTorch's per-tensor Adam, the CPU default; CUDA's
    foreach Adam holds one temporary of every tensor, not modelled).
    """
    check_world(world_size, rank)
    row = get_strategy(strategy).torch_only("estimate_memory")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    row.check_cpu_offload(cpu_offload)
    k = optimizer_states(optimizer)
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if bool(micro_batch) != bool(seq_len):
        raise ValueError("micro_batch and seq_len must be given together (both > 0) or not at all")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be an int >= 1, got {grad_accum_steps!r}")
    group = row.shard_group(world_size, shard_group_size if row.hybrid else None)
    c_name, r_name = PRECISIONS[precision]
    c, r = dtype_bytes(c_name), dtype_bytes(reduce_dtype or r_name)
    n = _count(model)

    if isinstance(model, ModelConfig):
        shard = estimate_shard_bytes(model, group, rank % group).shard_bytes // 4
        steps = optimizer_step_bytes(model, optimizer, units if flat_params else None)
    else:
        shard, steps = -(-n // group), 0
    held = {flag: shard if flag else n for flag in (True, False)}  # elements: sharded or whole
    state = {"params": 4 * held[row.shards_params], "grads": 4 * held[row.shards_grads],
             "optimizer": 4 * k * held[row.shards_optimizer] + steps}
    host = 0
    if cpu_offload:
        host, state = sum(state.values()), {key: 0 for key in state}

    if units is not None and not isinstance(model, ModelConfig):
        raise ValueError("units can be given only with a ModelConfig")
    if isinstance(model, ModelConfig):  # the units, root first, resolved once for every phase
        units = list(units) if units is not None else fsdp_units(model)
    layers, root, acts, vocab = _units_and_activations(model, group, c_name, micro_batch, seq_len,
                                                       activation_checkpointing, units, flat_params)
    head = _head_numel(model)
    tv = micro_batch * seq_len * vocab
    hidden = micro_batch * seq_len * _d_model(model)
    act_total = acts.total if acts else 0
    logsoftmax = 4 * tv

    accumulated = (estimate_accumulation_bytes(model, strategy, precision, reduce_dtype=reduce_dtype)
                   if grad_accum_steps > 1 else 0)

    def phase(unsharded=0, grad_buffers=0, activations=0, loss=0, accumulating=True):
        return {**state, "unsharded_params": unsharded,
                "grad_buffers": grad_buffers + (accumulated if accumulating else 0),
                "activations": activations, "loss_buffers": loss}

    notes = []
    if not acts:
        notes.append("activations not included (no micro_batch/seq_len, or no model shape)")
    shape_known = bool(layers or root)
    if not shape_known and row.shards_params and not row.reshard_after_forward:
        notes.append(f"unit sizes unknown: {row.name} keeps every unit gathered from forward to "
                     "backward, counted as P x compute-dtype bytes (no padding); the gather buffers "
                     "of the unit in flight are not included (give a model shape)")
    elif not shape_known:
        notes.append("unit sizes unknown: transient unsharded parameters and buffers not included")
    phases: dict[str, dict[str, int]] = {}
    if row.shards_params:
        reshard = row.reshard_after_forward
        copies = 2 if group > 1 else 1  # all-gather output buffer + unsharded params (1 rank: a copy)
        # gathered once per step and kept: every unit (padded), or P elements for a bare count
        everything = c * (sum(layers) + root) if shape_known else c * n
        kept = 0 if reshard else everything
        if acts:
            first = layers[0] if layers else 0
            # the causal mask (bool, s x s), built before the first layer's all-gather
            mask = seq_len * seq_len if isinstance(model, ModelConfig) else 0
            phases["forward_start"] = phase(copies * c * (root + first), 0, c * hidden + mask, 0)
            if layers and group > 1:
                # each layer's all-gather copy-out in forward: FSDP2 keeps the previous unit's
                # all-gather buffer until this one's copy-out is done (``all_gather_state``);
                # SHARD_GRAD_OP also keeps every unit gathered so far
                per = acts.layers // len(layers) if len(layers) == getattr(model, "num_layers", 0) else 0
                forward = []
                for i, unit in enumerate(layers):
                    prev = layers[i - 1] if i else root
                    gathered = c * root + (0 if reshard else c * sum(layers[:i]))
                    forward.append(phase(gathered + c * prev + 2 * c * unit, 0,
                                         c * hidden + mask + i * per, 0))
                phases["layer_forward"] = max(forward, key=lambda p: sum(p.values()))
        phases["loss_backward"] = phase(kept, 0, act_total, 2 * logsoftmax)
        phases["backward_start"] = phase(copies * c * root if reshard else kept, 0,
                                         act_total - logsoftmax, c * tv)
        if acts:
            phases["head_backward"] = phase(c * root if reshard else kept, c * head + c * hidden,
                                            act_total - logsoftmax, c * tv)
        # Backward, unit by unit (last layer first). What a layer's backward finds alive besides
        # its own unit, and what stays alive after its reduce-scatter (FSDP2, torch 2.x):
        # - the root unsharded, and the head's gradients, reduced only at the end of backward;
        # - the next unit's all-gather buffer, prefetched as this unit's backward starts;
        # - the previous unit's reduce-scatter input (reduce dtype), which FSDP2 keeps until
        #   the next unit's post-backward (``reduce_scatter_states``, one buffer by default);
        # - with HSDP (replicas > 1), every reduced unit's all-reduce buffer, its reduce-scatter
        #   output (r per element of its shard), kept until the end of backward
        #   (``_all_reduce_state``): with gradients zeroed, not freed, they are extra memory.
        # (FSDP2's; FSDP1's flat parameters keep the first-layer phases, not these two buffers)
        replicas = world_size // group if row.hybrid and not flat_params else 1
        keeps_input = not flat_params
        gloo = backend == "gloo" and group > 1
        whole_layers = (isinstance(model, (ModelConfig, DecoderShape)) and layers
                        and len(layers) == model.num_layers)
        saved = acts.layers // len(layers) if acts and whole_layers else 0  # freed per layer done
        # the last parameter's gradient of a unit outlives the others in its reduce-scatter (a
        # loop variable in FSDP2's foreach_reduce keeps it; only with more than one shard)
        lasts = [0] * (len(layers) + 1)
        if isinstance(model, ModelConfig) and group > 1 and not flat_params:
            lasts = [c * prod(u.shapes[-1]) if u.shapes else 0 for u in units]
        # with gradient accumulation, each unit's accumulated unsharded gradient is gone once its
        # reduce-scatter has taken it: elements of each layer unit, unpadded
        plain = [0] * len(layers)
        if accumulated:
            if isinstance(model, ModelConfig):
                plain = [u.numel for u in units[1:]]
            elif isinstance(model, DecoderShape):
                plain = [model.layer_params] * len(layers)
        accumulated_done = 0
        biggest = [0] * len(layers)  # each layer unit's largest parameter (elements)
        if accumulated and isinstance(model, ModelConfig):
            biggest = [max((prod(shape) for shape in u.shapes), default=0) for u in units[1:]]
        order = list(range(len(layers)))[::-1]
        held_rs = held_ar = freed = 0
        backward, reduce, recompute, late = [], [], [], []
        for j, i in enumerate(order):
            unit = layers[i]
            following = layers[order[j + 1]] if j + 1 < len(order) else 0
            if reshard:  # the root, and the next unit's all-gather buffer (prefetched)
                others = c * root + (c * following if group > 1 else 0)
            else:  # everything gathered, less the units already resharded after their backward
                others = kept - freed - c * unit
            left = act_total - logsoftmax - j * saved
            # with accumulation the head's and this unit's new gradients are added in place to
            # the unsharded gradients held (``accumulated``): one parameter's at a time
            held = (0 if accumulated else c * head) + held_rs + held_ar
            grads = c * (biggest[i] if accumulated and biggest[i] else unit)
            if gloo and j:  # the previous unit's gloo copy, freed late, as this unit starts
                start = c * root + 2 * c * unit if reshard else others + c * unit
                late.append(sum(phase(start, held + held_rs, left, 0).values()))
            backward.append(phase(others + c * unit, held + grads - accumulated_done, left, 0))
            if activation_checkpointing and acts:
                recompute.append(phase(others + c * unit, held - accumulated_done, left + acts.recompute, 0))
            accumulated_done += plain[i] * r
            # its post-backward: the unit resharded, the previous input released; the gradients
            # copied into the reduce-scatter input, then the input, its 1/N output and gloo's copy
            copy_in = c * unit + r * unit
            scatter = r * unit + r * unit // group + (r * unit if gloo else 0) + lasts[i + 1]
            reduce.append(phase(others, held - held_rs + max(copy_in, scatter) - accumulated_done,
                                left - saved, 0))
            held_rs = r * unit if keeps_input else 0
            held_ar += r * unit // group if replicas > 1 else 0
            freed += c * unit
        if backward:
            phases["layer_backward"] = max(backward, key=lambda p: sum(p.values()))
            if not flat_params:
                phases["layer_reduce"] = max(reduce, key=lambda p: sum(p.values()))
        copy_in = c * root + r * root
        scatter = r * root + r * root // group + (r * root if gloo else 0) + lasts[0]
        phases["root_reduce"] = phase(0, held_ar + max(copy_in, scatter), 0, 0, accumulating=False)
        if recompute:
            phases["layer_recompute"] = max(recompute, key=lambda p: sum(p.values()))
    else:
        buckets = r * n if row.grad_bucket_copy else 0
        flat_copy = row.wrapper == "fsdp" and c != 4  # FSDP1's compute-dtype flat parameters
        root_copy = c * root if flat_copy else 0
        phases["loss_backward"] = phase(0, buckets, act_total, 2 * logsoftmax)
        phases["backward_start"] = phase(root_copy, buckets, act_total - logsoftmax, c * tv)
        if acts:
            phases["head_backward"] = phase(root_copy, buckets + c * head + c * hidden,
                                            act_total - logsoftmax, c * tv)
        if row.wrapper == "fsdp" and root:
            # end of backward: the root's parameters' gradients and the flat gradient autograd
            # concatenates from them; with mixed precision, the flat gradient's cast to the
            # reduce dtype beside it is larger
            phases["root_reduce"] = phase(root_copy, c * root + max(c * root, r * root if flat_copy else 0),
                                          0, 0)
        if k == 2:  # Adam: sqrt(v) / bias correction, two fp32 temporaries of the largest tensor
            if isinstance(model, ModelConfig) and not flat_params:
                largest = max(prod(shape) for _, shape in param_shapes(model))
            else:
                largest = max([*layers, root])
            phases["optimizer_step"] = phase(0, buckets + 2 * 4 * largest, 0, 0)
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    peak_phase = max(totals, key=totals.get)
    late_free = 0
    if row.shards_params and backend == "gloo" and group > 1 and layers and not flat_params:
        # gloo's worker thread drops a finished collective's buffers a moment after the rank
        # moves on: under load, the root's all-gather buffer can meet the first layer's, or a
        # unit's flattened reduce-scatter copy the next unit's start (not counted in the peak)
        if reshard:
            late.append(totals["backward_start"] + c * layers[-1])
        worst = max(late, default=0)
        if worst > totals[peak_phase]:
            late_free = worst
            notes.append(f"gloo: a collective's buffers freed late by gloo's worker thread (under "
                         f"load) can raise the peak to {worst:,} bytes "
                         f"(+{100 * (worst / totals[peak_phase] - 1):.1f} %)")
    return MemoryEstimate(components=phases[peak_phase], phases=totals, peak_phase=peak_phase,
                          forward_activations=act_total, host=host, notes=tuple(notes),
                          late_free_peak=late_free)


SEED_STRATEGIES = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")
"""The three strategies the seed's memory rule knows."""


def estimate_accumulation_bytes(
    model: int | ModelConfig | DecoderShape,
    strategy: str = "FULL_SHARD",
    precision: str = "fp32",
    *,
    reduce_dtype: str | None = None,
) -> int:
    """Bytes a rank holds between the micro-steps of gradient accumulation, beyond its state at
    rest: with gradient sync off (FSDP2's ``set_requires_gradient_sync(False)``), a strategy
    that shards gradients keeps every parameter's *unsharded* gradient, in the reduce dtype,
    until the last micro-step reduce-scatters it: P·r bytes, where FSDP held P·4/N. A
    replicating strategy (DDP, NO_SHARD) accumulates in the gradients it holds anyway: 0.
    """
    row = get_strategy(strategy).torch_only("estimate_accumulation_bytes")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if not row.shards_grads:
        return 0
    return _count(model) * dtype_bytes(reduce_dtype or PRECISIONS[precision].reduce)


def estimate_seed_model_state(num_params: int, world_size: int, strategy: str) -> int:
    """Per-GPU bytes by the simplified model this course started from (the "seed").

    Its assumptions: fp32 training with Adam, 16 bytes per parameter, model state only (no
    activations, no transient buffers, no padding), three strategies: ``NO_SHARD`` replicates
    everything (16P), ``SHARD_GRAD_OP`` shards gradients and optimizer states (4P + 12P/N),
    ``FULL_SHARD`` shards everything (16P/N). Chapter 2 reproduces it, then shows where it is
    wrong: SHARD_GRAD_OP's parameters are unsharded during forward and backward, and at long
    sequences activations, not model state, decide what fits.
    """
    n = _count(num_params)
    check_world(world_size)
    if strategy not in SEED_STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(SEED_STRATEGIES)} (the seed's three), "
                         f"got {strategy!r}")
    row = get_strategy(strategy)
    # bytes per parameter: 4 (fp32 weight) + 4 (gradient) + 8 (Adam's two moments); the seed
    # counts parameters as sharded only when they are freed after forward (FULL_SHARD)
    parts = ((4, row.reshard_after_forward), (4, row.shards_grads), (8, row.shards_optimizer))
    whole = sum(b for b, sharded in parts if not sharded)
    split = sum(b for b, sharded in parts if sharded)
    return whole * n + split * n // world_size


def model_part_numels(model: ModelConfig) -> dict[str, int]:
    """Elements of each top-level part of the handbook's model, in construction order:
    ``embedding``, ``layers.0`` … ``output`` (as :func:`handbook_lib.model.model_parts` builds them)."""
    parts: dict[str, int] = {}
    for name, shape in param_shapes(model):
        head = name.split(".")
        part = ".".join(head[:2]) if head[0] == "layers" else head[0]
        numel = 1
        for size in shape:
            numel *= size
        parts[part] = parts.get(part, 0) + numel
    return parts


def estimate_init_bytes(
    model: ModelConfig,
    world_size: int,
    strategy: str = "FULL_SHARD",
    init: str = "meta",
    *,
    rank: int = 0,
    shard_group_size: int | None = None,
    units: Sequence[Unit] | None = None,
) -> int:
    """Peak bytes a rank holds while :func:`handbook_lib.parallelize.parallelize` builds and
    wraps the model (fp32, FSDP2, DDP or one process), exact to the byte.

    ``meta``: the rank materialises only what it keeps — its padded parameter shards with a
    sharding strategy, the whole model otherwise — plus one top-level part
    (:func:`model_part_numels`) built on the CPU to copy its values in. ``full``: every rank
    first builds the whole seeded model (4 bytes per parameter); FSDP2 then shards unit by unit,
    deepest first, and the peak comes with the first unit's shards, while every original is
    still alive. FSDP's device mesh keeps one 4-byte rank id per rank. DDP allocates its
    gradient buckets (a copy of every gradient, the strategy table's ``grad_bucket_copy``) when
    it wraps, after the part is dropped: the peak is the larger of the two moments. FSDP1,
    which flattens as it materialises, is measured but not predicted.

    Args:
        units: The FSDP units, root first (default: one per layer, :func:`fsdp_units`).
    """
    row = get_strategy(strategy).torch_only("estimate_init_bytes")
    check_world(world_size, rank)
    if init not in ("meta", "full"):
        raise ValueError(f"init must be 'meta' or 'full', got {init!r}")
    n = param_count(model)
    group = row.shard_group(world_size, shard_group_size if row.hybrid else None)
    buckets = 4 * n if row.grad_bucket_copy else 0  # allocated by DDP's wrap, after the init
    mesh = 4 * world_size if row.wrapper == "fsdp" else 0
    if init == "full":
        first = 0
        if row.shards_params:
            units = list(units) if units is not None else fsdp_units(model)
            order = sorted((u for u in units if not u.root), key=lambda u: -u.name.count("."))
            unit = next((u for u in order if u.numel), units[0])
            first = 4 * unit.padded_numel(group) // group
        return 4 * n + max(first + mesh, buckets)
    held = 4 * n
    if row.shards_params:
        held = estimate_shard_bytes(model, group, rank % group).padded_bytes
    return held + max(4 * max(model_part_numels(model).values()) + mesh, buckets)


def min_gpus_to_fit(
    model: int | ModelConfig | DecoderShape,
    device_bytes: int,
    *,
    max_gpus: int = 4096,
    headroom: float = 0.0,
    **kwargs,
) -> int | None:
    """Smallest power-of-two GPU count whose predicted peak fits in ``device_bytes``.

    Args:
        model: As for :func:`estimate_memory`.
        device_bytes: Memory of one GPU, bytes.
        max_gpus: Give up above this many GPUs.
        headroom: Fraction of ``device_bytes`` kept free (e.g. 0.1 for fragmentation and the
            CUDA context).
        **kwargs: Passed to :func:`estimate_memory` (strategy, precision, micro_batch, ...).

    Returns:
        The GPU count, or ``None`` if even ``max_gpus`` do not suffice (e.g. activations alone
        exceed the budget: they do not shrink with more GPUs).
    """
    if device_bytes <= 0 or not 0 <= headroom < 1:
        raise ValueError(f"device_bytes must be > 0 and headroom in [0, 1), got {device_bytes}, {headroom}")
    budget = device_bytes * (1 - headroom)
    n = 1
    while n <= max_gpus:
        if estimate_memory(model, n, **kwargs).peak <= budget:
            return n
        n *= 2
    return None


@dataclass(frozen=True)
class RankState:
    """One rank's model state just before the optimizer step, bytes, in the same five parts for
    every row of the strategy table — PyTorch's (FSDP2, DDP, one process) and DeepSpeed's ZeRO —
    so that the two families compare part by part (chapter 7). Predictions
    (:func:`estimate_rank_state`) and measurements
    (:func:`handbook_lib.zero_engine.measure_zero_bytes`) share it."""

    params: int
    """Parameters held (FSDP2: the sharded fp32 parameters with their padding; DDP: all)."""
    master: int
    """A separate fp32 master copy (ZeRO only: PyTorch's optimizer updates the parameters)."""
    grads: int
    """Gradients held after backward."""
    optimizer: int
    """Optimizer state tensors (Adam's two moments)."""
    optimizer_step: int
    """Adam's step counters (one per tensor with PyTorch, one per flat group with ZeRO)."""

    @property
    def total(self) -> int:
        """All five parts, bytes."""
        return self.params + self.master + self.grads + self.optimizer + self.optimizer_step


def estimate_rank_state(
    model: ModelConfig, world_size: int, strategy: str, precision: str = "fp32", optimizer: str = "adamw",
    *, rank: int = 0, shard_group_size: int | None = None, persistence_threshold: int = 0,
    cpu_offload: bool = False,
) -> RankState:
    """Predict one rank's :class:`RankState` under any strategy row.

    A ZeRO row is DeepSpeed's layout (:func:`handbook_lib.zero.estimate_zero_rank_bytes`,
    which takes ``persistence_threshold`` and ``cpu_offload``). Any other row is FSDP2's, DDP's
    or one process's: fp32 parameters (sharded per tensor along dim 0, padded, where the row
    shards them), gradients and optimizer state sharded where the row says so, no master copy —
    whatever the precision, since mixed precision only changes the compute copies.

    Raises:
        ValueError: for an unknown strategy, precision or optimizer, or a bad world size or
            rank.
    """
    row = get_strategy(strategy)
    if row.wrapper == "deepspeed":
        from handbook_lib.zero import estimate_zero_rank_bytes  # zero builds on this module

        return estimate_zero_rank_bytes(model, world_size, strategy, precision, optimizer, rank=rank,
                                        persistence_threshold=persistence_threshold, cpu_offload=cpu_offload)
    check_world(world_size, rank)
    lookup(PRECISIONS, precision, "precision")
    row.check_cpu_offload(cpu_offload)
    group = row.shard_group(world_size, shard_group_size if row.hybrid else None)
    whole = 4 * param_count(model)
    shard = estimate_shard_bytes(model, group, rank % group) if row.sharded else ShardBytes(whole, 0)
    return RankState(
        params=shard.padded_bytes if row.shards_params else whole,
        master=0,
        grads=shard.shard_bytes if row.shards_grads else whole,
        optimizer=optimizer_states(optimizer) * (shard.shard_bytes if row.shards_optimizer else whole),
        optimizer_step=optimizer_step_bytes(model, optimizer),
    )
