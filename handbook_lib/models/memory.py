"""The memory model: where a training job's bytes go, per rank, at the peak of a step.

Pure arithmetic: no ``torch.distributed``, no side effects.

Chapter 2 builds it and checks it against real runs:

- **model state at rest** (:func:`estimate_state_at_rest`, :mod:`handbook_lib.models.model_state`)
  — sharded parameters, gradients and optimizer states, exact to the byte (padding included)
  for the handbook's model;
- **transients** — unsharded parameters of the unit(s) being computed and FSDP's all-gather
  buffer, unsharded gradients, casts and reduce-scatter buffers, the loss's logits gradients;
- **activations** (see :mod:`handbook_lib.models.activations`), with or without checkpointing.

Peak memory is predicted as the largest of a few *phases* of a training step, each a sum of
components alive at the same moment: one function per phase in :mod:`handbook_lib.models.phases`,
all reading one :class:`~handbook_lib.models.phases.StepShape` that :func:`estimate_memory`
resolves once from the model's layout. The phases follow what FSDP2 does on every rank;
chapter 2 shows each against a memory tracker's breakdown.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from handbook_lib.core.checks import check_int, check_world, lookup
from handbook_lib.core.config import checkpointing_mode, dtype_bytes, get_precision, optimizer_impl_on, state_dtype
from handbook_lib.core.strategies import Strategy, get_strategy
from handbook_lib.models.allocator import reserved_bytes
from handbook_lib.models.layout import ModelLayout, ModelLike, model_layout
from handbook_lib.models.offload import estimate_offload_gather_bytes
from handbook_lib.models.model_state import (
    RankState,
    estimate_accumulation_bytes,
    optimizer_states,
    optimizer_step_bytes,
    optimizer_temporary_bytes,
)
from handbook_lib.models.phase_words import PHASE_WORDS
from handbook_lib.models.phases import PHASES, StepShape, late_free_bound
from handbook_lib.models.sharding import ShardBytes, Unit, shard_rows
from handbook_lib.models.zero import estimate_zero_rank_bytes

__all__ = ["COMPONENTS", "PHASE_WORDS", "MemoryEstimate", "estimate_state_at_rest", "estimate_memory",
           "min_gpus_to_fit", "estimate_rank_state", "local_numels"]


COMPONENTS = ("params", "grads", "optimizer", "unsharded_params", "grad_buffers",
              "activations", "loss_buffers")
"""Names of the per-rank memory components, in the order the book stacks them."""


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
    by_phase: dict[str, dict[str, int]] = field(default_factory=dict)
    """Each phase's components, as :attr:`components` holds the peak's (bytes)."""
    kept_grads_peak: int = 0
    """With the gradients freed after each step (``set_to_none``): the peak had they been kept,
    bytes (0 otherwise). The caching allocator keeps a freed block reserved until a tensor that
    fits in it comes, and a step's activations and logits are larger than a layer's gradients:
    :attr:`peak_reserved` prices this peak (torchtitan's published peaks at 8 and 128 GPUs differ
    by the whole state's 16 bytes a parameter over N, gradients included)."""

    @property
    def peak(self) -> int:
        """Predicted peak device bytes: the largest phase (what tensors hold, as
        ``torch.cuda.max_memory_allocated`` reports it)."""
        return self.phases[self.peak_phase]

    @property
    def peak_reserved(self) -> int:
        """The peak as PyTorch's CUDA caching allocator reserves it, bytes
        (``torch.cuda.max_memory_reserved``: :func:`~handbook_lib.models.allocator.reserved_bytes`;
        freed gradients' blocks still reserved, :attr:`kept_grads_peak`)."""
        return reserved_bytes(max(self.peak, self.kept_grads_peak))

    @property
    def model_state(self) -> int:
        """Parameters, gradients and optimizer states on the device (at rest)."""
        return self.components["params"] + self.components["grads"] + self.components["optimizer"]

    @property
    def params(self) -> int:
        """Parameter bytes on the device at the peak (sharded, at rest)."""
        return self.components["params"]

    @property
    def grads(self) -> int:
        """Gradient bytes on the device at the peak (at rest)."""
        return self.components["grads"]

    @property
    def optimizer(self) -> int:
        """Optimizer-state bytes on the device at the peak (moments and step counters)."""
        return self.components["optimizer"]

    @property
    def unsharded_params(self) -> int:
        """Bytes of gathered (unsharded) parameters and all-gather buffers at the peak."""
        return self.components["unsharded_params"]

    @property
    def grad_buffers(self) -> int:
        """Bytes of unsharded gradients, casts and reduce buffers at the peak."""
        return self.components["grad_buffers"]

    @property
    def activations(self) -> int:
        """Bytes of activations saved for backward at the peak."""
        return self.components["activations"]

    @property
    def loss_buffers(self) -> int:
        """Bytes of the loss's logits and their gradients at the peak."""
        return self.components["loss_buffers"]


def estimate_state_at_rest(layout: ModelLayout, row: Strategy, group: int, rank: int, optimizer: str, *,
                           units: Sequence[Unit] | None = None, flat_params: bool = False,
                           cpu_offload: bool = False, element_bytes: int = 4) -> tuple[dict[str, int], int]:
    """One rank's model state between steps, on the device and in host memory, bytes.

    Parameters, gradients and each of the optimizer's k parameter-shaped states hold
    ``e·P/N`` bytes (``element_bytes`` e: 4 in fp32, 2 in pure bf16) where the row shards them
    (the shard of :meth:`ModelLayout.state_shard_elements`: N the shard group) and ``e·P``
    where it does not; Adam adds its 4-byte ``step`` counters
    (one per tensor, one per unit with FSDP1's flat parameters). With ``cpu_offload`` all of it
    is in host memory instead.

    Returns:
        ``({"params", "grads", "optimizer"}, host bytes)``.
    """
    k = optimizer_states(optimizer)
    shard, whole = layout.state_shard_elements(group, rank % group), layout.num_params
    held = {True: shard, False: whole}  # elements: sharded or whole
    steps = optimizer_step_bytes(layout, optimizer, units if flat_params else None)
    e = element_bytes
    state = {"params": e * held[row.shards_params], "grads": e * held[row.shards_grads],
             "optimizer": e * k * held[row.shards_optimizer] + steps}
    if cpu_offload:
        return {key: 0 for key in state}, sum(state.values())
    return state, 0


def estimate_memory(
    model: ModelLike,
    world_size: int,
    strategy: str = "FULL_SHARD",
    precision: str = "fp32",
    optimizer: str = "adamw",
    *,
    micro_batch: int = 0,
    seq_len: int = 0,
    shard_group_size: int | None = None,
    rank: int = 0,
    activation_checkpointing: bool | str = False,
    cpu_offload: bool = False,
    reduce_dtype: str | None = None,
    units: Sequence[Unit] | None = None,
    flat_params: bool = False,
    backend: str = "nccl",
    grad_accum_steps: int = 1,
    sync_every_micro_step: bool = False,
    optimizer_impl: str = "default",
    ac_every: int = 1,
    ac_matmul_every: int = 1,
    ac_save: str = "matmul+attention",
    loss_chunks: int = 1,
    set_to_none: bool = False,
    float8_all_gather: bool = False,
    root_reshard_after_forward: bool = False,
) -> MemoryEstimate:
    """Predict one rank's device memory for a training step, by component and phase.

    Args:
        model: Anything :func:`~handbook_lib.models.layout.model_layout` accepts: the handbook's
            :class:`~handbook_lib.core.architecture.ModelConfig` (exact tensors, units and
            activations), a :class:`~handbook_lib.models.presets.DecoderShape` or a preset's name
            (a large decoder: per-layer units, the published activation formula), a parameter
            count (model state only), or a layout built once.
        world_size: Ranks in the job.
        strategy: One of :data:`handbook_lib.core.strategies.STRATEGIES`.
        precision: ``fp32``, ``bf16-mixed`` or ``fp16-mixed`` (see :data:`handbook_lib.core.config.PRECISIONS`).
            The default is ``fp32``, what the runs train in, so a prediction compares with a run
            as it is. The ``memory`` command defaults to ``bf16-mixed`` (a large model's usual
            training): it prints the precision in its assumptions, then a line saying that this
            function's default is ``fp32`` (``plan``, command and function, defaults to
            ``bf16-mixed`` too).
        optimizer: One of :data:`~handbook_lib.models.model_state.OPTIMIZER_STATES`.
        micro_batch: Sequences per rank per step (0: leave activations out).
        seq_len: Tokens per sequence.
        shard_group_size: Ranks that shard one copy of the model, for the HYBRID strategies
            (must divide ``world_size``); the others use ``world_size`` (or 1 for DDP/NO_SHARD).
        rank: Which rank (matters only for uneven shards).
        activation_checkpointing: ``none``, ``selective`` or ``full`` (``True``: ``full``): what
            each layer keeps for backward (:func:`~handbook_lib.models.activations.checkpointed`).
        ac_every: With checkpointing, checkpoint layers 0, k, 2k, ... only (k = ``ac_every``; 1:
            every layer); the others keep all their activations. The runs check it: the
            activations as closely as with every layer checkpointed; the peak within 4,092 B on
            the book's 6-layer model, but 116,356 B (3.9 %) low on a 2-layer one, whose peak
            comes early in the plain last layer's backward with the logits' gradient still
            alive, a moment that is not one of the phases.
        ac_matmul_every: With selective checkpointing, keep the output of every n-th matrix
            product of a layer only (n = ``ac_matmul_every``; torchtitan's op policy is 2), the
            attention's always (:func:`~handbook_lib.models.activations.kept_products`).
        ac_save: With selective checkpointing, what the policy keeps: ``matmul+attention``,
            ``matmul`` (the attention recomputed) or ``attention`` (the products recomputed).
        cpu_offload: Keep sharded parameters, gradients and optimizer states in host memory
            (FSDP strategies only: refused with ``NONE`` and ``DDP``, as ``fsdp_train`` does).
        reduce_dtype: Gradient-reduction dtype, overriding the precision's (e.g. ``bf16``).
        units: The FSDP units, root first (default: the layout's, one per layer; see
            :func:`~handbook_lib.models.layout.wrap_units` for the other wrapping policies). Only
            for a layout with exact tensors.
        flat_params: FSDP1's flat parameters: each unit padded once (chapter 5).
        backend: The process group's backend, ``nccl`` or ``gloo``; in this project ``nccl``
            means CUDA ranks and ``gloo`` CPU ranks (``runtime.distributed.pick_device``), so it
            also says which device the rank computes on. gloo's reduce-scatter flattens its input
            into a temporary copy (one more reduce-dtype copy of the unit); on ``nccl`` CPU
            offload copies each unit's shards to the device before its all-gather (the
            ``offload_gather`` phase) and runs the optimizer step on the host.
        grad_accum_steps: Micro-steps per optimizer step, gradients reduced in the last one
            only: a strategy that shards gradients then keeps every unsharded gradient until
            that last micro-step
            (:func:`~handbook_lib.models.model_state.estimate_accumulation_bytes`), in every
            phase but the end of backward.
        sync_every_micro_step: With ``grad_accum_steps`` > 1, reduce(-scatter) the gradients in
            every micro-step instead: they stay sharded, and memory is one micro-step's.
        optimizer_impl: How the optimizer's step runs (``for-loop``, ``foreach``, ``fused``, or
            ``default``: torch's choice on the ``backend``'s device, foreach on CUDA and for-loop
            on the CPU): its temporaries in the ``optimizer_step`` phase
            (:func:`~handbook_lib.models.model_state.optimizer_temporary_bytes`).
        loss_chunks: The cross-entropy in k chunks of the sequence (must divide ``seq_len``): its
            backward holds one chunk's fp32 gradients (:func:`~handbook_lib.models.phases.loss_backward`).
        set_to_none: The gradients are freed after each step (``zero_grad(set_to_none=True)``,
            PyTorch's default; the book's loop zeroes them in place): with one micro-step a step,
            the phases before backward makes a gradient (forward, the loss's and the head's
            backward) hold none, and a layer's backward those of the layers reduced before it;
            with accumulation every phase keeps them.
        float8_all_gather: torchao's Float8 training with FSDP2's float8 all-gather: every
            layer unit's gathered weights and all-gather buffer in 1 B an element (the root's in
            the compute dtype). A 16-bit compute dtype and a sharding strategy without CPU
            offload only. Read from torchao's design, unverified on CPU ranks (no float8
            matmuls there); the float8 casts of activations are not priced.
        root_reshard_after_forward: The root unit resharded after forward too
            (``fully_shard(model, reshard_after_forward=True)``) and gathered again in backward.
            Default ``False``: FSDP2's default (and FSDP1's) keeps it gathered into backward.

    The peak is the largest of the step's phases (:data:`PHASE_WORDS`), each a function of
    :mod:`handbook_lib.models.phases` whose docstring gives its formula; the state at rest is
    :func:`estimate_state_at_rest`. Sharding strategies follow FSDP2 (every ``fsdp_train`` run
    checks the peak they give); the replicating ones (DDP, NO_SHARD, NONE) keep the whole state,
    plus DDP's gradient buckets and FSDP1's flat gradients.

    On gloo, a finished collective's buffers are dropped by gloo's worker thread a moment after
    the rank moves on; under load they can meet the next phase's
    (:func:`handbook_lib.models.phases.late_free_bound`). That bound is reported in ``notes`` and
    :attr:`MemoryEstimate.late_free_peak`, not counted in the peak (idle runs match the phases).
    """
    check_world(world_size, rank)
    row = get_strategy(strategy).torch_only("estimate_memory")
    compute, reduce = get_precision(precision)
    row.check_cpu_offload(cpu_offload)
    check_int("micro_batch", micro_batch, 0)
    check_int("seq_len", seq_len, 0)
    if bool(micro_batch) != bool(seq_len):
        raise ValueError("micro_batch and seq_len must be given together (both > 0) or not at all")
    lookup(dict.fromkeys(("nccl", "gloo")), backend, "backend")
    check_int("grad_accum_steps", grad_accum_steps, 1)
    if seq_len % check_int("loss_chunks", loss_chunks, 1):
        raise ValueError(f"loss_chunks={loss_chunks} must divide seq_len={seq_len}")
    impl = optimizer_impl_on(optimizer_impl, "cuda" if backend == "nccl" else "cpu")
    if float8_all_gather and (compute == "fp32" or not row.shards_params or cpu_offload):
        raise ValueError("float8_all_gather gathers float8 weights for bf16 compute: it needs a sharding strategy, "
                         f"a 16-bit precision and no CPU offload, got {strategy}, {precision}, "
                         f"cpu_offload={cpu_offload}")
    element = dtype_bytes(state_dtype(precision))
    layout = model_layout(model)
    group = row.shard_group(world_size, shard_group_size if row.hybrid else None)
    if units is not None and not layout.exact:
        raise ValueError(f"units can be given only with the model's tensors (a ModelConfig), not {layout.name}")
    state, host = estimate_state_at_rest(layout, row, group, rank, optimizer, units=units,
                                         flat_params=flat_params, cpu_offload=cpu_offload, element_bytes=element)
    accumulated = (estimate_accumulation_bytes(layout, strategy, precision, reduce_dtype=reduce_dtype)
                   if grad_accum_steps > 1 and not sync_every_micro_step else 0)
    shape = _step_shape(layout, row, state, dtype_bytes(compute), dtype_bytes(reduce_dtype or reduce),
                        world_size, group, units, flat_params, backend, accumulated, optimizer,
                        micro_batch, seq_len, compute, (activation_checkpointing, ac_every, ac_matmul_every, ac_save))
    shape = replace(shape, loss_chunks=(loss_chunks, micro_batch),
                    grads_freed=bool(set_to_none) and grad_accum_steps == 1, float8_gather=float8_all_gather,
                    root_resharded=root_reshard_after_forward)
    if not (cpu_offload and backend == "nccl") and (layout.exact or impl != "for-loop"):
        # not on a GPU's host (offloaded), nor one tensor at a time over unknown tensors
        locals_ = local_numels(layout, row, group, rank % group, units, flat_params)
        shape = replace(shape, step_temp=optimizer_temporary_bytes(locals_, optimizer, impl, element))
    if backend == "nccl":
        shape = _on_gpu(shape, layout, units, cpu_offload)
    phases = {fn.__name__: parts for fn in PHASES if (parts := fn(shape)) is not None}
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    kept = shape.grads_freed and max(sum(p.values()) for fn in PHASES if (p := fn(replace(shape, grads_freed=False))))
    peak_phase = max(totals, key=totals.__getitem__)
    late_free = late_free_bound(shape, totals[peak_phase], totals.get("backward_start", 0))
    notes = _notes(shape, row, totals[peak_phase], late_free)
    if impl == "for-loop" and not layout.exact and optimizer_states(optimizer) == 2:
        notes.append("the for-loop optimizer step's temporaries (two of one tensor) not included: "
                     "the tensors are unknown")
    return MemoryEstimate(components=phases[peak_phase], phases=totals, peak_phase=peak_phase,
                          forward_activations=shape.act_total, host=host, notes=tuple(notes),
                          late_free_peak=late_free, kept_grads_peak=int(kept), by_phase=phases)


def _step_shape(layout: ModelLayout, row: Strategy, state: dict[str, int], c: int, r: int, world_size: int,
                group: int, units: Sequence[Unit] | None, flat: bool, backend: str, accumulated: int,
                optimizer: str, micro_batch: int, seq_len: int, compute: str,
                checkpointing: tuple[bool | str, int, int, str]) -> StepShape:
    """The :class:`~handbook_lib.models.phases.StepShape` every phase reads, from the layout
    (``checkpointing``: the mode, ``ac_every``, ``ac_matmul_every`` and ``ac_save``)."""
    units = list(units) if units is not None else layout.units()
    if layout.exact and (not units or not units[0].root):
        raise ValueError("units must start with the root unit (see wrap_units)")
    numels = ([u.flat_padded_numel(group) if flat else u.padded_numel(group) for u in units]
              if layout.units_known else [0])
    layers, root = tuple(numels[1:]), numels[0]
    mode, every, matmul_every, ac_save = checkpointing
    acts = layout.activations(micro_batch, seq_len, compute, activation_checkpointing=mode, every=every,
                              matmul_every=matmul_every, ac_save=ac_save)
    whole_layers = bool(layers) and len(layers) == layout.num_layers
    saved = acts.by_layer if acts and whole_layers else (0,) * len(layers)
    exact = layout.exact
    lasts = tuple(c * _numel(u.shapes[-1]) if u.shapes else 0 for u in units) \
        if exact and group > 1 and not flat else (0,) * (len(layers) + 1)
    plain = tuple(u.numel for u in units[1:]) if accumulated else (0,) * len(layers)
    biggest = tuple(max((_numel(s) for s in u.shapes), default=0) for u in units[1:]) \
        if accumulated and exact else (0,) * len(layers)
    tokens = micro_batch * seq_len
    return StepShape(
        row=row, state=state, c=c, r=r, group=group,
        replicas=world_size // group if row.hybrid and not flat else 1, layers=layers, root=root,
        known=layout.units_known, params=layout.num_params, acts=acts, head=layout.head_numel,
        hidden=tokens * layout.d_model, logits=tokens * layout.vocab_size,
        mask=layout.causal_mask_bytes(seq_len) if acts else 0, saved=saved, lasts=lasts, plain=plain,
        biggest=biggest, optimizer_states=optimizer_states(optimizer), accumulated=accumulated,
        gloo=backend == "gloo" and group > 1, flat=flat, checkpointing=checkpointing_mode(mode) != "none",
    )


def local_numels(layout: ModelLayout, row: Strategy, group: int, rank: int,
                 units: Sequence[Unit] | None = None, flat: bool = False) -> tuple[int, ...]:
    """Elements of each parameter tensor the optimizer steps on ``rank``, in its order: FSDP2's
    dim-0 shard of every tensor (rows without padding) where ``row`` shards the optimizer state,
    else whole tensors; FSDP1's padded flat shard of every unit (``flat``; root first); for a
    layout without tensors, each unit's block taken as one tensor (right for foreach's sum, not
    for a step one tensor at a time, which :func:`estimate_memory` then leaves out)."""
    if flat:
        blocks = [u.flat_padded_numel(group) // group if row.shards_optimizer else u.numel
                  for u in (list(units) if units is not None else layout.units()) if u.numel]
        return tuple(blocks)
    if not layout.exact:  # one block per unit, taken as one tensor
        return tuple(-(-_numel(shape) // group) if row.shards_optimizer else _numel(shape)
                     for _, shape in layout.tensors)
    if not row.shards_optimizer:
        return tuple(_numel(shape) for _, shape in layout.tensors)
    return tuple(shard_rows(shape[0], group, rank)[0] * _numel(shape[1:]) if shape else 1
                 for _, shape in layout.tensors)


def _on_gpu(s: StepShape, layout: ModelLayout, units: Sequence[Unit] | None, cpu_offload: bool) -> StepShape:
    """``s`` with the term CUDA ranks add with CPU offload (:mod:`handbook_lib.models.phases`):
    each unit's all-gather with its shards copied in
    (:func:`~handbook_lib.models.offload.estimate_offload_gather_bytes`; FSDP2 only; a layout
    without tensors counts each unit as one tensor, an upper bound on one rank)."""
    gathers: tuple[int, ...] = ()
    if cpu_offload and s.row.shards_params and s.known and not s.flat:
        gathers = tuple(estimate_offload_gather_bytes(
            tuple(-(-shape[0] // s.group) * _numel(shape[1:]) for shape in u.shapes), s.c, s.group)
            for u in (list(units) if units is not None else layout.units()))
    return replace(s, gathers=gathers)


def _numel(shape: tuple[int, ...]) -> int:
    size = 1
    for d in shape:
        size *= d
    return size


def _notes(s: StepShape, row: Strategy, peak: int, late_free: int) -> list[str]:
    """What an estimate leaves out, in words."""
    notes = []
    if not s.acts:
        notes.append("activations not included (no micro_batch/seq_len, or no model shape)")
    if not s.known and row.shards_params and not row.reshard_after_forward:
        notes.append(f"unit sizes unknown: {row.name} keeps every unit gathered from forward to "
                     "backward, counted as P x compute-dtype bytes (no padding); the gather buffers "
                     "of the unit in flight are not included (give a model shape)")
    elif not s.known:
        notes.append("unit sizes unknown: transient unsharded parameters and buffers not included")
    if late_free:
        notes.append(f"gloo: a collective's buffers freed late by gloo's worker thread (under "
                     f"load) can raise the peak to {late_free:,} bytes "
                     f"(+{100 * (late_free / peak - 1):.1f} %)")
    return notes


def min_gpus_to_fit(
    model: ModelLike,
    device_bytes: int,
    *,
    max_gpus: int = 4096,
    headroom: float = 0.0,
    reserve_fraction: float | None = None,
    **kwargs,
) -> int | None:
    """Smallest power-of-two GPU count whose predicted peak fits in ``device_bytes``.

    Args:
        model: As for :func:`estimate_memory`.
        device_bytes: Memory of one GPU, bytes.
        max_gpus: Give up above this many GPUs.
        headroom: Fraction of ``device_bytes`` kept free (e.g. 0.1 for fragmentation and the
            CUDA context).
        reserve_fraction: Compare the peak as the allocator reserves it with this fraction on
            top (:func:`~handbook_lib.models.allocator.reserved_bytes`) instead of the tensors'
            peak (``None``).
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
        peak = estimate_memory(model, n, **kwargs).peak
        if peak <= budget if reserve_fraction is None else reserved_bytes(peak, fraction=reserve_fraction) <= budget:
            return n
        n *= 2
    return None


def estimate_rank_state(
    model: ModelLike, world_size: int, strategy: str, precision: str = "fp32", optimizer: str = "adamw",
    *, rank: int = 0, shard_group_size: int | None = None, persistence_threshold: int = 0,
    cpu_offload: bool = False,
) -> RankState:
    """Predict one rank's :class:`RankState` under any strategy row.

    A ZeRO row is DeepSpeed's layout (:func:`handbook_lib.models.zero.estimate_zero_rank_bytes`,
    which takes ``persistence_threshold`` and ``cpu_offload``). Any other row is FSDP2's, DDP's
    or one process's: parameters in the precision's state dtype (fp32, or bf16 in pure ``bf16``;
    sharded per tensor along dim 0, padded, where the row shards them), gradients and optimizer
    state sharded where the row says so, no master copy: mixed precision only changes the
    compute copies.

    Raises:
        ValueError: for an unknown strategy, precision or optimizer, or a bad world size or
            rank.
    """
    row = get_strategy(strategy)
    if row.wrapper == "deepspeed":
        return estimate_zero_rank_bytes(model, world_size, strategy, precision, optimizer, rank=rank,
                                        persistence_threshold=persistence_threshold, cpu_offload=cpu_offload)
    check_world(world_size, rank)
    dtype = state_dtype(precision)
    row.check_cpu_offload(cpu_offload)
    layout = model_layout(model)
    group = row.shard_group(world_size, shard_group_size if row.hybrid else None)
    whole = dtype_bytes(dtype) * layout.num_params
    shard = layout.shard_bytes(group, rank % group, dtype) if row.sharded else ShardBytes(whole, 0)
    return RankState(
        params=shard.padded_bytes if row.shards_params else whole,
        master=0,
        grads=shard.shard_bytes if row.shards_grads else whole,
        optimizer=optimizer_states(optimizer) * (shard.shard_bytes if row.shards_optimizer else whole),
        optimizer_step=optimizer_step_bytes(layout, optimizer),
    )
