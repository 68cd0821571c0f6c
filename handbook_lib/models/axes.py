"""When FSDP stops being the answer: the axes beyond it, and why. Pure arithmetic: no ``torch``.

Chapter 9 teaches it. FSDP shards the model state over every GPU; two things it cannot shard, and
one thing it cannot hide, call for another axis:

(a) **one sequence's activations.** With full activation checkpointing a layer keeps only its
    input, ``2·s·d`` bytes per layer in 16-bit, and FSDP does not divide it: past some length one
    sequence no longer fits a GPU. Splitting the sequence over ``sp`` ranks divides every
    per-token activation by ``sp`` (:func:`~handbook_lib.models.sequence_parallel.sequence_activation_bytes`);
    :func:`estimate_axes` finds the smallest ``sp`` that fits, per method (Ulysses needs the
    heads, and the key/value heads, divisible by ``sp``; the ring needs only the sequence);
(b) **the global batch.** Every GPU of a pure FSDP job is a data-parallel replica, so the batch
    grows with the GPUs (:func:`~handbook_lib.models.batch.global_batch_tokens`). Past the batch
    a job can use (:func:`~handbook_lib.models.batch.max_data_parallel`), the GPUs must share
    sequences: tensor parallelism inside a node (or the sequence split) shrinks the
    data-parallel degree by its size;
(c) **a ring that no longer hides.** A ring's block transfer hides behind the block's attention
    only when the block is long enough for the link
    (:func:`~handbook_lib.models.sequence_parallel.ring_overlap`): a ring across nodes, on one
    network port per GPU, needs blocks ~8x longer than on NVLink. Then the sequence split stays
    inside a node, or uses Ulysses' all-to-alls.

:func:`estimate_axes` returns the verdict with its reasons (:class:`AxesVerdict`);
:func:`compare_axes` prices tensor parallelism inside a node x FSDP across nodes beside
FULL_SHARD and HYBRID_SHARD (:class:`AxisOption`, the planner's options for those two).
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.core.checks import check_int
from handbook_lib.core.config import checkpointing_mode, dtype_bytes, get_precision
from handbook_lib.core.parallel_layout import ParallelLayout
from handbook_lib.core.strategies import get_strategy
from handbook_lib.models.hardware import (
    Accelerator,
    Link,
    Node,
    get_accelerator,
    node_preset,
)
from handbook_lib.models.budget import memory_budget
from handbook_lib.models.nccl_buffers import nccl_buffer_bytes
from handbook_lib.models.layout import ModelLike, model_layout
from handbook_lib.models.memory import MemoryEstimate, estimate_memory
from handbook_lib.models.model_state import optimizer_states
from handbook_lib.models.batch import max_data_parallel
from handbook_lib.models.planner import check_whole_nodes
from handbook_lib.models.presets import DecoderShape, get_shape
from handbook_lib.models.sequence_parallel import (
    SP_METHODS,
    ring_layer_bytes,
    ring_overlap,
    sequence_activation_bytes,
    ulysses_layer_bytes,
)
from handbook_lib.models.stage_memory import pipeline_memory
from handbook_lib.models.tensor_parallel import estimate_decoder_tp_memory

__all__ = ["AxesVerdict", "SpChoice", "estimate_axes", "estimate_job_memory", "estimate_sp_memory",
           "estimate_tp_fsdp_memory", "sp_candidates"]


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


@dataclass(frozen=True)
class SpChoice:
    """The smallest sequence split of one method that fits a GPU."""

    method: str
    """``ulysses`` or ``ring``."""
    sp_size: int | None
    """Ranks one sequence is split over; ``None``: no split this method allows fits."""
    peak_reserved_bytes: int = 0
    """Reserved peak per GPU at that split (FULL_SHARD over every GPU, full checkpointing)."""
    layer_sent_bytes: int = 0
    """Bytes one rank sends per layer per step for the split (forward and backward)."""
    crosses_nodes: bool = False
    """The split spans more GPUs than one node holds."""
    ring_hides: bool | None = None
    """``ring`` only: whether each ring step's transfer hides behind its block's attention on
    the link it crosses (:func:`~handbook_lib.models.sequence_parallel.ring_overlap`)."""


@dataclass(frozen=True)
class AxesVerdict:
    """The planner's answer to "is FSDP enough?", with the figures behind it."""

    model: str
    gpu: str
    gpus: int
    gpus_per_node: int
    seq_len: int
    micro_batch: int
    budget_bytes: int
    """Bytes of a GPU an option may reserve (the usable memory less the headroom)."""
    fsdp_peak_reserved_bytes: int
    """FULL_SHARD over every GPU with full activation checkpointing, reserved peak per GPU."""
    sequence_bytes: int
    """Activations of one micro-batch on one GPU under full checkpointing, unsplit, bytes."""
    sp: tuple[SpChoice, ...]
    """The smallest split per method, when one sequence does not fit (empty when it does)."""
    max_dp: int | None
    """Most data-parallel replicas the global batch allows (``None``: no batch given)."""
    tp_size: int
    """Tensor-parallel ranks recommended, inside a node (1: none)."""
    sp_size: int
    """Sequence-parallel ranks recommended (1: none)."""
    sp_method: str
    """The split's method (``""`` without one)."""
    reasons: tuple[str, ...]
    peak_reserved_bytes: int = 0
    """Reserved peak per GPU with the recommended axes, bytes."""

    @property
    def fsdp_enough(self) -> bool:
        """FULL_SHARD alone fits and the batch allows every GPU as a replica."""
        return self.tp_size == 1 and self.sp_size == 1 and self.fsdp_peak_reserved_bytes <= self.budget_bytes

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas with the recommended axes."""
        return self.gpus // (self.tp_size * self.sp_size)

    @property
    def axes(self) -> str:
        """The recommendation in a few words: ``"FSDP 64"``, ``"TP 8 x FSDP 8"``,
        ``"SP 8 (ulysses) x FSDP 8"``."""
        parts = [f"TP {self.tp_size}"] if self.tp_size > 1 else []
        if self.sp_size > 1:
            parts.append(f"SP {self.sp_size} ({self.sp_method})")
        return " x ".join([*parts, f"FSDP {self.dp_size}"])


_GPUS = {"world": "the GPUs ({})"}
"""How this module's refusals name the world: its GPUs."""


def estimate_job_memory(model: ModelLike, layout: ParallelLayout, *, micro_batch: int, seq_len: int,
                        strategy: str = "FULL_SHARD", precision: str = "bf16-mixed", optimizer: str = "adamw",
                        activation_checkpointing: bool | str = "full", cpu_offload: bool = False,
                        grad_accum_steps: int = 1, sync_every_micro_step: bool = False,
                        pp_microbatches: int = 1, pp_schedule: str = "1F1B",
                        pp_stages_per_rank: int = 1) -> MemoryEstimate:
    """One GPU's memory, by component, for a job laid out as ``layout`` (its degrees: data
    parallel, tensor, sequence, pipeline): the one memory entry point for any combination of the
    axes.

    - **A pipeline** (``pp``, a :class:`~handbook_lib.models.presets.DecoderShape`): the worst of
      its first and last stages (:func:`~handbook_lib.models.stage_memory.pipeline_memory`), each
      priced as a model of its own
      layers on the other axes, with ``pp_microbatches`` micro-batches of ``micro_batch``
      sequences in flight as ``pp_schedule`` keeps them.

    - **The sequence split** (``sp``): each GPU keeps the activations, logits and loss buffers of
      ``micro_batch`` sequences of ``seq_len / sp`` tokens; with a fused attention every term of
      the activation model is per token (the
      :func:`~handbook_lib.models.sequence_parallel.sequence_activation_bytes` rule), so the
      GPU is priced at the shorter length. Its ranks hold the same parameters, so FSDP shards
      over them too (torchtitan's ``dp_shard_cp``). Ulysses' and the ring's in-flight buffers (a
      few ``T·d`` of one layer) are left out.
    - **Without tensor parallelism**: :func:`~handbook_lib.models.memory.estimate_memory` of
      ``strategy`` over every GPU (a hybrid one in groups of ``dp_shard · sp``), with its levers.
    - **With tensor parallelism** (``tp``, a :class:`~handbook_lib.models.presets.DecoderShape`):
      the model state is the TP slice's FSDP shard over the other ``world / tp`` GPUs
      (:func:`~handbook_lib.models.tensor_parallel.estimate_decoder_tp_memory`: projections,
      embedding and head split, norms replicated), 4 bytes per element each for the parameters,
      the gradients and every optimizer state. Everything else is FULL_SHARD's on all GPUs
      (phase by phase) divided by ``tp``: with sequence parallelism on the norms (Korthikanti et
      al.'s ``34·s·b·h/t``; with full checkpointing ``2·s·b·h/t``), a loss-parallel head and
      gathered units of one TP slice, every activation, logit and gathered byte of a GPU is 1/t
      of FULL_SHARD's for the same tokens, but for the two inputs PyTorch's TP all-gathers in
      each layer (the attention's, shared by Q, K and V, and the feed-forward's): their
      colwise-parallel projections save them whole, ``2·T·d·c`` a layer, as the CPU runs
      measure (:func:`~handbook_lib.models.axes_run.estimate_axes_activation_bytes`), where
      Korthikanti's Megatron keeps the shard and gathers again in backward. They are alive for
      every layer through backward without checkpointing, for the layer being recomputed with
      it. TP's in-flight buffers (one (T, d) all-gather output at a time) are left out.
      ``micro_batch`` is per TP group.

    Raises:
        ValueError: for a shape the layout cannot split (:meth:`ParallelLayout.check_shape`); with
            ``tp`` > 1, a strategy other than FULL_SHARD, offload or accumulation (not priced
            with tensor parallelism); what ``estimate_memory`` refuses.
    """
    check_int("seq_len", seq_len, 1)
    check_int("micro_batch", micro_batch, 1)
    levers = {"strategy": strategy, "precision": precision, "optimizer": optimizer,
              "activation_checkpointing": activation_checkpointing}
    if layout.pp > 1:
        if cpu_offload or grad_accum_steps > 1:
            raise ValueError(f"a pipeline (pp {layout.pp}) is priced without offload or accumulation: its "
                             "micro-batches are the accumulation (pp_microbatches)")
        return pipeline_memory(model, layout, micro_batch, seq_len, pp_microbatches, pp_schedule, levers,
                               estimate=estimate_job_memory, stages_per_rank=pp_stages_per_rank)
    sizes = model_layout(model) if not isinstance(model, DecoderShape) else model
    kv = sizes.kv_heads if isinstance(sizes, DecoderShape) else None
    layout.check_shape(nhead=sizes.nhead, kv_heads=kv, seq_len=seq_len, names=_GPUS)
    world, local = layout.world_size, seq_len // layout.sp
    if layout.tp == 1:
        group = layout.fsdp_size if layout.hybrid else None
        return estimate_memory(model, world, strategy, precision, optimizer, micro_batch=micro_batch, seq_len=local,
                               shard_group_size=group, activation_checkpointing=activation_checkpointing,
                               cpu_offload=cpu_offload, grad_accum_steps=grad_accum_steps,
                               sync_every_micro_step=sync_every_micro_step)
    row = get_strategy(strategy)
    if not row.fully_sharded or row.hybrid or cpu_offload or layout.hybrid or grad_accum_steps > 1:
        raise ValueError(f"tensor parallelism (tp {layout.tp}) is priced beside FSDP's FULL_SHARD on the device, "
                         "one micro-step a step: give FULL_SHARD without offload, shard groups or accumulation")
    if not isinstance(model, DecoderShape):
        raise ValueError("tensor parallelism is priced for a decoder's shape (a preset or a config.json), "
                         "not the handbook's model or a parameter count")
    layout.check_shape(ffn=model.ffn, names=_GPUS)
    tp_state = estimate_decoder_tp_memory(model, layout.tp, world // layout.tp, micro_batch, local,
                                          optimizer=optimizer)
    fsdp = estimate_memory(model, world, "FULL_SHARD", precision, optimizer, micro_batch=micro_batch,
                           seq_len=local, activation_checkpointing=activation_checkpointing)
    held = tp_state.params_per_gpu
    state = {"params": 4 * held, "grads": 4 * held, "optimizer": 4 * optimizer_states(optimizer) * held}
    components = {k: state[k] if k in state else v // layout.tp for k, v in fsdp.components.items()}
    gathered = _gathered_inputs(model, micro_batch * local, precision, layout.tp)
    phases = {k: sum(state.values()) + (v - fsdp.model_state) // layout.tp
              + gathered * _layers_holding(k, activation_checkpointing, model.num_layers)
              for k, v in fsdp.phases.items()}
    components["activations"] += gathered * _layers_holding(fsdp.peak_phase, activation_checkpointing,
                                                            model.num_layers)
    phases[fsdp.peak_phase] = sum(components.values())
    split = f" x SP {layout.sp}" if layout.sp > 1 else ""
    note = (f"TP {layout.tp}{split} x FSDP {world // (layout.tp * layout.sp)}: activations, logits and gathered "
            f"units are FULL_SHARD's / {layout.tp} (sequence parallel, loss parallel); TP's in-flight buffers "
            "left out")
    return MemoryEstimate(components, phases, fsdp.peak_phase,
                          forward_activations=fsdp.forward_activations // layout.tp, notes=(note,))


def _gathered_inputs(shape: DecoderShape, tokens: int, precision: str, tp: int) -> int:
    """What a layer's two all-gathered inputs hold beyond the 1/tp share FULL_SHARD's count
    gives them, bytes: ``2·T·d·c·(1 - 1/tp)``."""
    c = dtype_bytes(get_precision(precision)[0])
    return 2 * tokens * shape.d_model * c * (tp - 1) // tp


def _layers_holding(phase: str, checkpointing: bool | str, layers: int) -> int:
    """Layers whose gathered inputs are alive in ``phase``: every layer from the last forward to
    the first backward without checkpointing; the one recomputed with it."""
    if checkpointing_mode(checkpointing) == "none":
        return layers if phase in ("layer_forward", "forward_end", "loss_backward", "backward_start", "head_backward",
                                   "layer_backward", "layer_reduce") else 0
    return 1 if phase in ("layer_recompute", "layer_backward", "layer_reduce") else 0


def estimate_sp_memory(model: ModelLike, world_size: int, seq_len: int, sp_size: int, *, micro_batch: int = 1,
                       precision: str = "bf16-mixed", optimizer: str = "adamw",
                       activation_checkpointing: bool | str = "full") -> MemoryEstimate:
    """One GPU's memory with each sequence split over ``sp_size`` ranks, FULL_SHARD over all
    ``world_size`` GPUs: :func:`estimate_job_memory` of that layout (either method: the memory
    does not depend on it).

    Raises:
        ValueError: for a ``seq_len`` that ``sp_size`` does not divide, ``sp_size`` not dividing
            ``world_size``, or what :func:`~handbook_lib.models.memory.estimate_memory` refuses.
    """
    check_int("seq_len", seq_len, 1)
    layout = ParallelLayout.for_world(world_size, sp=sp_size, sp_method="ring", seq_len=seq_len, names=_GPUS)
    return estimate_job_memory(model, layout, micro_batch=micro_batch, seq_len=seq_len, precision=precision,
                               optimizer=optimizer, activation_checkpointing=activation_checkpointing)


def estimate_tp_fsdp_memory(shape: DecoderShape | str, world_size: int, tp_size: int, *, micro_batch: int,
                            seq_len: int, precision: str = "bf16-mixed", optimizer: str = "adamw",
                            activation_checkpointing: bool | str = "full") -> MemoryEstimate:
    """One GPU's memory under tensor parallelism over ``tp_size`` GPUs inside a node x FSDP2 over
    the ``world_size / tp_size`` TP groups: :func:`estimate_job_memory` of that layout;
    ``micro_batch`` sequences per TP group.

    Raises:
        ValueError: for ``tp_size`` not dividing ``world_size``, or the heads, KV heads or
            feed-forward width; for what ``estimate_memory`` refuses.
    """
    shape = get_shape(shape) if isinstance(shape, str) else shape
    layout = ParallelLayout.for_world(world_size, tp=tp_size, nhead=shape.nhead, kv_heads=shape.kv_heads,
                                      ffn=shape.ffn, names=_GPUS)
    return estimate_job_memory(shape, layout, micro_batch=micro_batch, seq_len=seq_len, precision=precision,
                               optimizer=optimizer, activation_checkpointing=activation_checkpointing)


def sp_candidates(model: ModelLike, gpus: int, seq_len: int, method: str) -> list[int]:
    """Sequence splits ``sp > 1`` a method allows on ``gpus`` GPUs, ascending: ``sp`` divides
    the GPUs and the sequence; Ulysses also needs the heads and the key/value heads divisible
    by ``sp`` (each rank attends with ``heads/sp`` of them over the whole sequence)."""
    if method not in SP_METHODS:
        raise ValueError(f"sp_method must be one of {', '.join(SP_METHODS)}, got {method!r}")
    layout = model_layout(model)
    heads = layout.nhead
    q = layout.q_width or layout.d_model
    kv = heads * (layout.kv_width or q) // q if heads else 0
    if method == "ulysses" and not heads:
        return []
    return [sp for sp in range(2, gpus + 1)
            if ParallelLayout.allows(gpus, sp=sp, sp_method=method, seq_len=seq_len, nhead=heads, kv_heads=kv)]


@dataclass(frozen=True)
class _Job:
    model: ModelLike
    acc: Accelerator
    gpus: int
    gpus_per_node: int
    seq_len: int
    micro_batch: int
    precision: str
    headroom: float
    node: Node

    @property
    def inter_link(self) -> Link:
        return self.node.inter_link

    @property
    def intra_link(self) -> Link:
        return self.node.intra_link

    def budget(self, sp: int = 1, tp: int = 1, method: str = "ulysses") -> int:
        """What the layout may reserve per GPU: the usable memory less its NCCL buffers and the headroom."""
        layout = ParallelLayout.for_world(self.gpus, tp=tp, sp=sp, sp_method=method)
        return memory_budget(self.acc, self.headroom, nccl_buffer_bytes(layout, self.node)).budget_bytes


def _peak(job: _Job, sp: int, tp: int = 1) -> int:
    """Reserved peak per GPU of the job with its sequences split over ``sp`` ranks, and each
    layer over ``tp`` (TP x FSDP at ``seq_len / sp`` tokens: every term is per token), bytes."""
    if tp == 1:
        return estimate_sp_memory(job.model, job.gpus, job.seq_len, sp, micro_batch=job.micro_batch,
                                  precision=job.precision).peak_reserved
    return estimate_tp_fsdp_memory(_shape(job.model), job.gpus, tp, micro_batch=job.micro_batch,
                                   seq_len=job.seq_len // sp, precision=job.precision).peak_reserved


def _shape(model: ModelLike) -> DecoderShape:
    shape = get_shape(model) if isinstance(model, str) else model
    if not isinstance(shape, DecoderShape):
        name = model_layout(model).name  # a ValueError, as every refusal of the book's models
        raise ValueError(f"tensor parallelism is priced for a decoder's shape, not {name}")  # noqa: TRY004
    return shape


def _smallest_split(job: _Job, method: str, tp: int) -> SpChoice:
    for sp in sp_candidates(job.model, job.gpus // tp, job.seq_len, method):
        peak = _peak(job, sp, tp)
        if peak > job.budget(sp, tp, method):
            continue
        per_layer = (ulysses_layer_bytes if method == "ulysses" else ring_layer_bytes)(
            job.model, job.seq_len, sp, micro_batch=job.micro_batch)
        crosses = sp * tp > job.gpus_per_node
        hides = None
        if method == "ring":
            link = job.inter_link if crosses else job.intra_link
            hides = ring_overlap(job.model, job.seq_len, sp, link, job.acc, micro_batch=job.micro_batch).hides
        return SpChoice(method, sp, peak, per_layer.sent, crosses, hides)
    return SpChoice(method, None)


def _pick_split(choices: tuple[SpChoice, ...]) -> SpChoice | None:
    """Inside a node first; then the one that sends less; a ring that does not hide last."""
    usable = [c for c in choices if c.sp_size is not None]
    if not usable:
        return None
    return min(usable, key=lambda c: (c.crosses_nodes, c.ring_hides is False, c.sp_size, c.layer_sent_bytes))


def estimate_axes(model: ModelLike, gpu: Accelerator | str, gpus: int, *, seq_len: int, micro_batch: int = 1,
                  batch_tokens: int | None = None, gpus_per_node: int | None = None,
                  inter_link: str = "ib-ndr400", precision: str = "bf16-mixed",
                  headroom: float = 0.0) -> AxesVerdict:
    """Is FSDP enough for ``model`` on ``gpus`` GPUs at ``seq_len``, and if not, which axis?

    Args:
        model: A decoder shape or preset name (anything with an activation model).
        gpu: An accelerator or preset name.
        gpus: GPUs in the job (whole nodes beyond one).
        seq_len: Tokens per sequence.
        micro_batch: Sequences per data-parallel replica per step.
        batch_tokens: The global batch the training recipe wants, tokens per optimizer step
            (``None``: no limit from the batch).
        gpus_per_node: GPUs per node (default: the accelerator preset's node).
        inter_link: One network port between nodes (a ring across nodes crosses it).
        precision: As for :func:`~handbook_lib.models.memory.estimate_memory`.
        headroom: Fraction of usable memory kept free.

    Returns:
        The verdict: (a) the smallest sequence split per method when one sequence does not fit
        even with full checkpointing; (b) tensor parallelism inside a node when the batch allows
        fewer replicas than GPUs; (c) the ring's overlap on the link it would cross.

    Raises:
        ValueError: for a bad count, a headroom outside [0, 1), or a batch smaller than one
            micro-batch.
    """
    acc = get_accelerator(gpu) if isinstance(gpu, str) else gpu
    check_int("gpus", gpus, 1)
    check_int("seq_len", seq_len, 1)
    check_int("micro_batch", micro_batch, 1)
    per_node = node_preset(acc).gpus_per_node if gpus_per_node is None else gpus_per_node
    check_whole_nodes(gpus, per_node)
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    node = node_preset(acc, inter_link=inter_link, gpus_per_node=per_node)
    job = _Job(model, acc, gpus, per_node, seq_len, micro_batch, precision, headroom, node)
    layout = model_layout(model)
    fsdp_peak = _peak(job, 1)
    seq_bytes = sequence_activation_bytes(model, seq_len, micro_batch=micro_batch, recompute="full")
    reasons: list[str] = []
    tp, max_dp = _batch_axis(job, batch_tokens, reasons)
    peak = _peak(job, 1, tp)
    choices: tuple[SpChoice, ...] = ()
    sp, method = 1, ""
    budget = job.budget(1, tp)
    if peak > budget:
        choices = tuple(_smallest_split(job, m, tp) for m in SP_METHODS)
        reasons.append(_sequence_reason(layout.name, job, peak, seq_bytes, tp, budget))
        pick = _pick_split(choices)
        reasons += [_split_reason(c, job) for c in choices]
        if pick is not None:
            sp, method, peak = pick.sp_size or 1, pick.method, pick.peak_reserved_bytes
            budget = job.budget(sp, tp, method)
            reasons.append(_pick_reason(pick, choices, job))
    else:
        where = f"TP {tp} x FSDP {gpus // tp}" if tp > 1 else f"FULL_SHARD on {gpus} GPUs"
        reasons.append(f"One sequence fits: {where} with full checkpointing reserves {_gb(peak)} per GPU "
                       f"of {_gb(budget)}; no sequence split needed.")
    if sp == 1 and tp == 1:
        reasons.append(f"FSDP is enough to fit: FSDP {gpus}.")
    return AxesVerdict(layout.name, acc.name, gpus, per_node, seq_len, micro_batch, budget, fsdp_peak,
                       seq_bytes, choices, max_dp, tp, sp, method, tuple(reasons), peak)


def _sequence_reason(name: str, job: _Job, peak: int, seq_bytes: int, tp: int, budget: int) -> str:
    where = f"TP {tp} x FSDP {job.gpus // tp}" if tp > 1 else f"FULL_SHARD on {job.gpus} GPUs"
    return (f"One sequence does not fit: {job.micro_batch} x {job.seq_len:,} tokens of {name} keep "
            f"{_gb(seq_bytes)} of activations and logits per GPU even with full checkpointing; {where} "
            f"reserves {_gb(peak)} against {_gb(budget)}. FSDP divides the model state, not one "
            "sequence: split the sequence.")


def _split_reason(c: SpChoice, job: _Job) -> str:
    if c.sp_size is None:
        why = "the heads allow no split that fits" if c.method == "ulysses" else "no split up to every GPU fits"
        return f"{c.method}: {why}."
    where = "across nodes" if c.crosses_nodes else "inside a node"
    text = (f"{c.method}: sp={c.sp_size} fits ({_gb(c.peak_reserved_bytes)} reserved per GPU), {where}, "
            f"{_gb(c.layer_sent_bytes)} sent per layer per step")
    if c.ring_hides is not None:
        link = job.inter_link if c.crosses_nodes else job.intra_link
        text += f"; its transfers {'hide' if c.ring_hides else 'do not hide'} behind the block attention on {link.name}"
    return text + "."


def _pick_reason(pick: SpChoice, choices: tuple[SpChoice, ...], job: _Job) -> str:
    ring = next(c for c in choices if c.method == "ring")
    if not pick.crosses_nodes:
        return (f"Split with {pick.method}, sp={pick.sp_size}, inside a node of {job.gpus_per_node} GPUs "
                f"({job.intra_link.name}): the smallest split that fits (a tie: the fewer bytes sent).")
    if pick.method == "ulysses" and ring.ring_hides is False:
        return (f"Split with ulysses, sp={pick.sp_size}, across nodes: a ring there would not hide its "
                f"transfers behind its blocks of {job.seq_len // (ring.sp_size or 1):,} tokens on "
                f"{job.inter_link.name}.")
    return f"Split with {pick.method}, sp={pick.sp_size}, across nodes: no split inside a node fits."


def _batch_axis(job: _Job, batch_tokens: int | None, reasons: list[str]) -> tuple[int, int | None]:
    """(b): the smallest tensor-parallel degree inside a node that brings the replicas within the
    batch; TP needs it to divide the heads, the KV heads and the feed-forward width. A pipeline is
    no answer here: with ``m >= p`` micro-batches (1F1B) its ``gpus / (tp · p)`` replicas take at
    least ``gpus / tp`` sequences a step, as many as TP alone."""
    if batch_tokens is None:
        return 1, None
    max_dp = max_data_parallel(batch_tokens, job.micro_batch, job.seq_len)
    words = (f"The batch of {batch_tokens:,} tokens allows {max_dp:,} replicas of {job.micro_batch} x "
             f"{job.seq_len:,} tokens")
    if job.gpus <= max_dp:
        reasons.append(f"{words}; {job.gpus:,} are used.")
        return 1, max_dp
    shape = _shape(job.model)
    fits = [tp for tp in range(2, job.gpus_per_node + 1)
            if ParallelLayout.allows(job.gpus, tp=tp, gpus_per_node=job.gpus_per_node, nhead=shape.nhead,
                                     kv_heads=shape.kv_heads, ffn=shape.ffn)]
    for tp in fits:
        if job.gpus // tp <= max_dp:
            reasons.append(f"{words}, not {job.gpus:,}: TP {tp} inside a node makes {job.gpus // tp:,} "
                           "replicas, each sequence shared by its TP group.")
            return tp, max_dp
    tp = fits[-1] if fits else 1
    reasons.append(f"{words}, fewer than the {job.gpus // tp:,} TP {tp} inside a node leaves. A pipeline does "
                   "not lower it: 1F1B runs at least one micro-batch per stage on every replica, so its "
                   f"step still takes {job.gpus // tp:,} sequences or more. Split each sequence too, or grow "
                   "the batch.")
    return tp, max_dp
