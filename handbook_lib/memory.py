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

from handbook_lib.activations import (
    ActivationBytes,
    DecoderShape,
    estimate_activation_bytes,
    estimate_decoder_activation_bytes,
)
from handbook_lib.architecture import ModelConfig, param_count, param_shapes
from handbook_lib.config import PRECISIONS, STRATEGIES
from handbook_lib.names import lookup
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

__all__ = [
    "DTYPE_BYTES", "ShardBytes", "Unit", "dtype_bytes", "shard_rows", "estimate_shard_bytes",
    "fsdp_units", "OPTIMIZER_STATES", "optimizer_states", "optimizer_step_bytes", "COMPONENTS", "PRECISION_DTYPES", "FSDP2_SPELLING",
    "ZERO_STAGES", "ModelStateBytes", "MemoryEstimate", "estimate_model_state_bytes",
    "estimate_zero_memory", "estimate_memory", "estimate_seed_model_state", "min_gpus_to_fit",
    "PHASE_WORDS",
]

PHASE_WORDS: dict[str, tuple[str, str]] = {
    "loss_backward": ("in the loss's backward",
                      "the loss's backward, with every activation still saved"),
    "backward_start": ("as backward starts",
                       "backward begins: the logits' gradient alive, the root unit gathered again"),
    "layer_backward": ("in the last layer's backward",
                       "the last layer's backward: that layer and the root gathered"),
    "root_reduce": ("at the end of backward",
                    "end of backward: the root's gradients cast and reduce-scattered"),
    "layer_recompute": ("while a layer is recomputed",
                        "a layer's activations recomputed (activation checkpointing)"),
}
"""Each phase of :func:`estimate_memory` in plain words: ``(when, what)`` — when it happens, to
end a sentence ("peak 33.8 GB per GPU in the last layer's backward"), and what is alive then,
for a legend under a table."""

OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}
"""State tensors per parameter, each the parameter's shape: Adam's two moments, SGD's momentum.

(Adam also keeps one ``step`` scalar per parameter tensor; it is not sharded and is counted
apart, as ``optimizer_other``.)
"""

PRECISION_DTYPES: dict[str, tuple[str, str]] = {
    "fp32": ("fp32", "fp32"),
    "bf16-mixed": ("bf16", "fp32"),
    "fp16-mixed": ("fp16", "fp32"),
}
"""Precision → (compute dtype of unsharded parameters, gradient-reduction dtype), as FSDP2's
``MixedPrecisionPolicy(param_dtype, reduce_dtype)``. The sharded parameters, the gradients
handed to the optimizer and the optimizer states stay fp32 in every case. fp16 also needs a
gradient scaler, whose state (a scale and a step counter) is a few bytes and is not counted."""

FSDP2_SPELLING: dict[str, str] = {
    "NONE": "the plain module, one process: no wrapper",
    "DDP": "DistributedDataParallel (or replicate()); not FSDP",
    "NO_SHARD": "none: FSDP2 has no NO_SHARD; use DDP",
    "SHARD_GRAD_OP": "fully_shard(m, reshard_after_forward=False)",
    "FULL_SHARD": "fully_shard(m, reshard_after_forward=True)",
    "HYBRID_SHARD": "fully_shard(m, mesh=<2-D (replicate, shard) mesh>, reshard_after_forward=True)",
    "HYBRID_SHARD_ZERO2": "fully_shard(m, mesh=<2-D (replicate, shard) mesh>, reshard_after_forward=False)",
}
"""How each FSDP1 ``ShardingStrategy`` is written with FSDP2's ``fully_shard``."""

ZERO_STAGES: dict[int, str | None] = {0: "DDP", 1: None, 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}
"""DeepSpeed ZeRO stage → the FSDP strategy with the same sharding. ZeRO-1 shards only the
optimizer states; FSDP has no such strategy. ZeRO-2 keeps parameters replicated at rest, while
FSDP's SHARD_GRAD_OP shards them between steps (both hold them unsharded from forward to
backward)."""

_SHARDED = ("SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
_RESHARD = ("FULL_SHARD", "HYBRID_SHARD")
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
    if isinstance(model, ModelConfig):
        units = list(units) if units is not None else fsdp_units(model)
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
) -> MemoryEstimate:
    """Predict one rank's device memory for a training step, by component and phase.

    Args:
        model: A :class:`ModelConfig` (exact shapes, units and activations), a
            :class:`DecoderShape` (a large GPT-style model: per-layer units, published activation
            formula) or a parameter count (model state only: no units, no activations).
        world_size: Ranks in the job.
        strategy: One of :data:`handbook_lib.config.STRATEGIES`.
        precision: ``fp32``, ``bf16-mixed`` or ``fp16-mixed`` (see :data:`PRECISION_DTYPES`).
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

    The phases (FSDP strategies; DDP, NO_SHARD and NONE — one plain process — keep the full
    state, and DDP adds its gradient
    buckets):

    - ``loss_backward``: all activations, plus the loss's two T·V fp32 gradients, plus whatever
      stays unsharded after forward (everything, for SHARD_GRAD_OP);
    - ``backward_start``: the log-softmax output is freed, the logits' gradient (compute dtype)
      is alive, and FULL_SHARD all-gathers the root unit again: its unsharded parameters and
      FSDP's all-gather buffer (2 copies in the compute dtype);
    - ``layer_backward``: the last layer's backward: the root still unsharded, the head's
      gradients waiting for the root's reduce-scatter, the layer gathered (2 copies);
    - ``root_reduce``: end of backward: the root's unsharded gradients, their cast to the reduce
      dtype, and the reduce-scatter input buffer;
    - ``layer_recompute`` (with checkpointing): one layer's activations recomputed, its unit
      gathered (2 copies), the root still unsharded.
    """
    check_world(world_size, rank)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if cpu_offload and strategy in ("NONE", "DDP"):
        raise ValueError(f"cpu_offload needs an FSDP strategy (NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, "
                         f"HYBRID_*): {strategy} keeps the whole model state on the device")
    k = optimizer_states(optimizer)
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if bool(micro_batch) != bool(seq_len):
        raise ValueError("micro_batch and seq_len must be given together (both > 0) or not at all")
    group = world_size if strategy in _SHARDED else 1
    if strategy.startswith("HYBRID"):
        group = shard_group_size or world_size
        if world_size % group:
            raise ValueError(f"shard_group_size={group} must divide world_size={world_size}")
    c_name, r_name = PRECISION_DTYPES[precision]
    c, r = dtype_bytes(c_name), dtype_bytes(reduce_dtype or r_name)
    n = _count(model)

    if isinstance(model, ModelConfig):
        shard = estimate_shard_bytes(model, group, rank % group).shard_bytes // 4
        steps = optimizer_step_bytes(model, optimizer, units if flat_params else None)
    else:
        shard, steps = -(-n // group), 0
    state = {"params": 4 * shard, "grads": 4 * shard, "optimizer": 4 * k * shard + steps}
    host = 0
    if cpu_offload:
        host, state = sum(state.values()), {key: 0 for key in state}

    if units is not None and not isinstance(model, ModelConfig):
        raise ValueError("units can be given only with a ModelConfig")
    layers, root, acts, vocab = _units_and_activations(model, group, c_name, micro_batch, seq_len,
                                                       activation_checkpointing, units, flat_params)
    head = _head_numel(model)
    tv = micro_batch * seq_len * vocab
    act_total = acts.total if acts else 0
    logsoftmax = 4 * tv

    def phase(unsharded=0, grad_buffers=0, activations=0, loss=0):
        return {**state, "unsharded_params": unsharded, "grad_buffers": grad_buffers,
                "activations": activations, "loss_buffers": loss}

    notes = []
    if not acts:
        notes.append("activations not included (no micro_batch/seq_len, or no model shape)")
    if not layers and not root:
        notes.append("unit sizes unknown: transient unsharded parameters and buffers not included")
    phases: dict[str, dict[str, int]] = {}
    if strategy in _SHARDED:
        reshard = strategy in _RESHARD
        copies = 2 if group > 1 else 1  # all-gather output buffer + unsharded params (1 rank: a copy)
        everything = c * (sum(layers) + root)
        biggest = max(layers, default=0)
        kept = 0 if reshard else everything
        cast = r * root if r != c else 0
        phases["loss_backward"] = phase(kept, 0, act_total, 2 * logsoftmax)
        phases["backward_start"] = phase(copies * c * root if reshard else kept, 0,
                                         act_total - logsoftmax, c * tv)
        # first layer backward: the root stays unsharded, its head's gradients wait for the
        # root's reduce-scatter, and the layer is gathered with its gradients being computed
        phases["layer_backward"] = phase(c * root + copies * c * biggest if reshard else kept,
                                         c * head + c * biggest, act_total - logsoftmax, 0)
        phases["root_reduce"] = phase(0, c * root + cast + r * root, 0, 0)
        if activation_checkpointing and acts:
            unsharded = (c * root + copies * c * biggest) if reshard else everything
            phases["layer_recompute"] = phase(unsharded, 0, act_total - logsoftmax + acts.recompute,
                                              c * tv)
    else:
        buckets = r * n if strategy == "DDP" else 0
        phases["loss_backward"] = phase(0, 0, act_total, 2 * logsoftmax)
        phases["backward_start"] = phase(0, buckets, act_total - logsoftmax, c * tv)
        if strategy == "NO_SHARD":
            notes.append("NO_SHARD: transients modelled from DDP's design, not measured")
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    peak_phase = max(totals, key=totals.get)
    return MemoryEstimate(components=phases[peak_phase], phases=totals, peak_phase=peak_phase,
                          forward_activations=act_total, host=host, notes=tuple(notes))


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
    formulas = {"NO_SHARD": 16 * n, "SHARD_GRAD_OP": 4 * n + 12 * n // world_size,
                "FULL_SHARD": 16 * n // world_size}
    if strategy not in formulas:
        raise ValueError(f"strategy must be one of {', '.join(formulas)} (the seed's three), got {strategy!r}")
    return formulas[strategy]


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
