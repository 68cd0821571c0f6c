"""A pipeline's memory, stage by stage. Pure: no ``torch``.

What :mod:`handbook_lib.models.pipeline` leaves out of a stage's state: what its micro-batches
keep, priced two ways.

- :func:`estimate_pipeline_recv_buffers` and :func:`stage_activation_bytes`: one rank of the
  book's pipeline run, to the byte on CPU ranks (the run checks both): the receive buffers
  torch's stages keep, one per micro-batch each way, whatever the schedule
  (:func:`recv_buffers`), and what one micro-batch's forward leaves on a stage until its
  backward (times the micro-batches in flight: the stage's activations);
- :func:`pipeline_memory`: a decoder's pipeline at scale, the planner's worst stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from handbook_lib.core.checks import check_int
from handbook_lib.core.config import dtype_bytes, get_precision
from handbook_lib.core.parallel_config import ParallelConfig
from handbook_lib.core.parallel_layout import ParallelLayout
from handbook_lib.models.axes_run import estimate_axes_activation_bytes
from handbook_lib.models.layout import ModelLike, model_layout
from handbook_lib.models.memory import MemoryEstimate
from handbook_lib.models.pipeline import (
    SPLIT_BACKWARD,
    StageSpan,
    boundary_bytes,
    in_flight,
    interleaved_in_flight,
    rank_stages,
    stage_layers,
)
from handbook_lib.models.presets import DecoderShape
from handbook_lib.models.tensor_parallel import decoder_tp_units

__all__ = ["RecvBuffers", "recv_buffers", "estimate_pipeline_recv_buffers", "stage_activation_bytes",
           "pipeline_memory"]


@dataclass(frozen=True)
class RecvBuffers:
    """Bytes of the receive buffers one rank's ``PipelineStage`` objects keep from the first step
    on (torch 2.13's ``torch/distributed/pipelining/stage.py``)."""

    activations: int
    """One buffer per micro-batch for the activation each stage but the first receives
    (``_setup_forward_recv_info``: allocated once, reused every step; a V's local neighbour
    replaces them with its own outputs, ``set_local_fwd_input``, which they keep alive)."""
    activation_grads: int
    """Under a split backward (:data:`SPLIT_BACKWARD`), the input gradient each such buffer holds
    as ``.grad`` (``stage_backward_input``) until the next step's ``clear_runtime_states``: per
    micro-batch, on every stage whose previous stage is on another rank (a V's middle stage's is
    the buffer its neighbour already holds). A full backward drops it (``stage_backward``)."""
    grads: int
    """One buffer per micro-batch for the gradient each stage but the last receives back
    (``_setup_backward_recv_info``)."""

    @property
    def total(self) -> int:
        """All three, bytes."""
        return self.activations + self.activation_grads + self.grads


def recv_buffers(stages: list[int], num_stages: int, microbatches: int, buffer: int, *,
                 split_backward: bool = False) -> RecvBuffers:
    """:class:`RecvBuffers` of the rank holding ``stages`` (indices) of ``num_stages``, with
    ``microbatches`` micro-batches whose boundary activation is ``buffer`` bytes: ``m·B`` per
    stage but the first, ``m·B`` per stage but the last, and under a split backward ``m·B`` per
    stage fed from another rank."""
    check_int("microbatches", microbatches, 1)
    check_int("buffer", buffer, 0)
    fed = [s for s in stages if s > 0]
    remote = [s for s in fed if s - 1 not in stages] if split_backward else []
    per = microbatches * buffer
    return RecvBuffers(per * len(fed), per * len(remote), per * sum(1 for s in stages if s < num_stages - 1))


def estimate_pipeline_recv_buffers(config: ParallelConfig, world_size: int, pp_rank: int) -> RecvBuffers:
    """:func:`recv_buffers` of pipeline rank ``pp_rank`` in the run ``config`` describes
    (:func:`boundary_bytes` each). Measured to the byte on 2 and 4 CPU ranks: GPipe, 1F1B,
    interleaved 1F1B, the zero-bubble V, with TP and SP."""
    stages = [span.index for span in rank_stages(config, pp_rank)]
    return recv_buffers(stages, config.pp_stages, config.pp_microbatches, boundary_bytes(config, world_size),
                        split_backward=config.schedule in SPLIT_BACKWARD)


def stage_activation_bytes(config: ParallelConfig, world_size: int, span: StageSpan) -> int | None:
    """Bytes one micro-batch's forward leaves alive on stage ``span`` until its backward: what its
    layers save (:func:`~handbook_lib.models.axes_run.estimate_axes_activation_bytes`, ``b/m``
    sequences, under the run's checkpointing) less the first layer's input on a stage that
    receives it (the receive buffer, :func:`estimate_pipeline_recv_buffers`), plus its output,
    which the stage keeps for the backward (``fwd_cache``): the boundary activation, or on the
    last stage the logits (``T·V·c``), whose projection also saves its input (``T·d·c``). The
    loss's log-softmax comes after, outside the stage's forward. Token ids and targets are the
    batch's, not new.

    Exact on CPU ranks in fp32 with neither FSDP nor TP (measured for every schedule); ``None``
    for a run with either, in bf16, or with ``ac_every``/``ac_matmul_every`` > 1 or another
    ``ac_save``: FSDP2 frees gathered parameters by resizing their storage, which a count of new
    storages cannot follow, and TP's and bf16's kernels save other tensors (not measured here)."""
    layout = config.parallel_layout(world_size)
    if (layout.fsdp_size > 1 or config.tp_size > 1 or config.precision != "fp32" or config.ac_every != 1
            or config.ac_matmul_every != 1 or config.ac_save != "matmul+attention"):
        return None
    rows = config.batch_size // (layout.dp * config.pp_microbatches)
    layers = sum(estimate_axes_activation_bytes(config, rows).by_layer[span.first_layer:span.last_layer])
    boundary = boundary_bytes(config, world_size)
    held = layers - (0 if span.embedding else boundary)
    if not span.head:
        return held + boundary
    return held + rows * config.seq_len * (config.d_model + config.padded_vocab_size) * 4


def pipeline_memory(model: ModelLike, layout: ParallelLayout, micro_batch: int, seq_len: int, microbatches: int,
                    schedule: str, levers: dict[str, Any], *,
                    estimate: Callable[..., MemoryEstimate], stages_per_rank: int = 1) -> MemoryEstimate:
    """The pipeline's worst stage, first or last (:func:`~handbook_lib.models.pipeline.stage_layers`:
    the first holds one more layer when they do not divide evenly, and the embedding; the last the
    head, its logits and the loss). Each stage is priced as a decoder of its own layers, one
    vocabulary matrix and its final norm, on the other axes (:func:`estimate_job_memory` of the
    layout without ``pp``); then, as the CPU runs measure it, the schedule's three additions:

    - the layers' activations of every micro-batch in flight (:func:`in_flight`) beyond the one
      priced (the stage's layers as :meth:`~handbook_lib.models.layout.ModelLayout.activations`
      counts them under the run's checkpointing policy, 1/tp of them with sequence parallelism,
      at ``seq_len / sp`` tokens), and the receive buffers torch's stages keep for every
      micro-batch (:func:`recv_buffers`: a boundary activation of ``micro_batch·seq_len/sp·d``
      elements, 1/tp with sequence parallelism, each way), counted with the activations;
    - the stage's units stay gathered from the first micro-batch's backward to the last one's
      (compute dtype), and
    - their gradients stay unsharded until the last micro-batch reduces them (reduce dtype),
      beyond the one or two units the stage's own estimate holds gathered.

    The first stage is priced with its vocabulary matrix's logits and loss buffers, which only the
    last computes: an overestimate of one micro-batch's logits."""
    if not isinstance(model, DecoderShape):
        raise ValueError("a pipeline is priced for a decoder's shape (a preset or a config.json), not the "
                         "handbook's model or a parameter count")
    spans = stage_layers(model.num_layers, layout.pp)
    inner = dataclasses.replace(layout, pp=1)
    compute, reduce = get_precision(levers["precision"])
    best: MemoryEstimate | None = None
    for span in (spans[0], spans[-1]):
        stage = dataclasses.replace(model, num_layers=span.layers, tied_embeddings=True,
                                    max_positions=model.max_positions if span.embedding else 0)
        mem = estimate(stage, inner, micro_batch=micro_batch, seq_len=seq_len, **levers)
        units = decoder_tp_units(stage, layout.tp) if layout.tp > 1 else model_layout(stage).units()
        held = sum(u.numel for u in units) * (dtype_bytes(compute) + dtype_bytes(reduce))
        extra_units = max(0, held - mem.unsharded_params - mem.grad_buffers)
        acts = model_layout(stage).activations(micro_batch, seq_len // layout.sp, compute,
                                               activation_checkpointing=levers["activation_checkpointing"])
        layers = acts.layers if acts else 0
        if stages_per_rank > 1:  # its chunks, each 1/v of the rank's layers: in stage-equivalents
            chunks = interleaved_in_flight(layout.pp, microbatches, span.index, stages_per_rank)
            flying = -(-chunks // stages_per_rank)
            extra_acts = (chunks - stages_per_rank) * layers // (stages_per_rank * layout.tp)
        else:
            flying = in_flight(schedule, layout.pp, microbatches, span.index)
            extra_acts = (flying - 1) * layers // layout.tp
        ranks = [span.index + k * layout.pp for k in range(stages_per_rank)]  # the rank's stages
        width = micro_batch * (seq_len // layout.sp) * model.d_model * dtype_bytes(compute) // layout.tp
        extra_acts += recv_buffers(ranks, layout.pp * stages_per_rank, microbatches, width).total
        components = dict(mem.components)
        components["activations"] += extra_acts
        components["unsharded_params"] += extra_units
        phases = {k: v + extra_acts + extra_units for k, v in mem.phases.items()}
        flight = (f"{chunks} chunks of 1/{stages_per_rank} of its layers" if stages_per_rank > 1
                  else str(flying))
        note = (f"pipeline stage {span.index} of {layout.pp} ({span.layers} layers, {schedule}, "
                f"{microbatches} micro-batches): {flight} in "
                "flight; its units gathered and their gradients unsharded from the first backward to the last")
        priced = MemoryEstimate(components, phases, mem.peak_phase, forward_activations=mem.forward_activations
                                + extra_acts, notes=(*mem.notes, note))
        if best is None or priced.peak > best.peak:
            best = priced
    assert best is not None
    return best
