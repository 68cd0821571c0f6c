"""Pipeline parallelism: the model cut into stages over ``pp_size`` ranks, run by a schedule; every byte sent checked.

Chapter 9 launches it. The ranks form the job's one mesh (:mod:`handbook_lib.runtime.mesh`),
``pp`` outermost: :func:`~handbook_lib.runtime.build.parallelize` cuts the book's split-attention
model (the seeded weights of :class:`~handbook_lib.runtime.model.SimpleTransformer`) at layer
boundaries into ``pp_size · pp_stages_per_rank`` stages (the embedding on the first, the head on
the last, :func:`~handbook_lib.models.pipeline.stage_layers`), splits each over ``tp_size``
tensor ranks if asked (Megatron's plan, ``sequence_parallel`` too), checkpoints it and shards it
with FSDP2 over its data-parallel ranks, and ``torch.distributed.pipelining`` runs them by
``schedule`` (GPipe, 1F1B, interleaved 1F1B, the zero-bubble V) over ``pp_microbatches``
micro-batches; the book's one loop (:func:`~handbook_lib.runtime.training.train`) steps it
(:func:`~handbook_lib.runtime.pipeline.pipeline_step`).

Checks, beside :mod:`handbook_lib.models.pipeline`: each rank's layers; its parameters, FSDP2's
padding, gradients and optimizer state (exact: the embedding and the head make the first and
last ranks heavier); every send and receive of the last step, tensor parallelism's collectives
inside each stage and FSDP2's over its data-parallel ranks (count, buffer bytes, each call
matched, bytes sent: exact); the receive buffers torch's stages keep between steps, one per
micro-batch each way (exact); the schedule (each rank's order of work, the micro-batches each
stage held at once, the bubble of the ranks' orders on a grid of unit times: exact); the
losses against one process training the book's model on the whole batch (1e-5 in fp32, 1e-3 in
bf16).

Launch::

    python -m handbook_lib run pipeline --nproc 4 --set schedule=1F1B   # pp_size 0: every rank
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from handbook_lib.core.config import get_precision
from handbook_lib.core.results import Check
from handbook_lib.models.pipeline import (
    bubble_fraction,
    estimate_pipeline_fsdp_calls,
    estimate_pipeline_p2p,
    estimate_pipeline_state_bytes,
    estimate_pipeline_tp_calls,
    idle_fraction,
    in_flight,
    most_in_flight,
    rank_stages,
    schedule_actions,
    simulate_schedule,
    SPLIT_BACKWARD,
    StageSpan,
)
from handbook_lib.models.stage_memory import estimate_pipeline_recv_buffers, stage_activation_bytes
from handbook_lib.runs.axes_checks import LOSS_TOLERANCE, collective_checks, state_checks
from handbook_lib.runs.entry import RankReport, main, one_process_loss_checks
from handbook_lib.runs.specs.pipeline import CONFIG as CONFIG, PipelineConfig, validate
from handbook_lib.runtime.axes import axes_step
from handbook_lib.runtime.build import parallelize
from handbook_lib.runtime.collectives import collective_totals
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.mesh import build_layout_mesh
from handbook_lib.runtime.optimization import build_optimizer
from handbook_lib.runtime.pipeline import PipelinedModel
from handbook_lib.runtime.training import train


def run(config: PipelineConfig, ctx: RankContext) -> RankReport:
    """Train ``config`` as a pipeline of ``pp_size`` ranks; check every byte held and sent, and the losses."""
    validate(config, ctx.world_size)
    config = config.on_world(ctx.world_size)  # pp_size 0: every rank
    mesh = build_layout_mesh(config.parallel_layout(ctx.world_size), ctx.device.type)
    model = parallelize(config, ctx, mesh=mesh)
    optimizer = build_optimizer(model.parameters(), config.optimizer, config.lr, config.optimizer_impl)
    log = train(model, optimizer, config, ctx, **axes_step(mesh), count_collectives=True)
    assert log.collectives is not None  # counted on the last step
    spans = rank_stages(config, mesh.pp_rank)
    layers = sum(len(stage.layers) for stage in model.stages)
    checks = [Check("stage_layers", ctx.rank, sum(s.layers for s in spans), layers, "layers")]
    state, params = state_checks(ctx, estimate_pipeline_state_bytes(config, ctx.world_size, mesh.pp_rank,
                                                                    mesh.fsdp_rank), model, optimizer)
    checks += state
    predicted = [*estimate_pipeline_p2p(config, ctx.world_size, mesh.pp_rank),
                 *estimate_pipeline_fsdp_calls(config, ctx.world_size, mesh.pp_rank),
                 *estimate_pipeline_tp_calls(config, ctx.world_size, mesh.pp_rank)]
    checks += collective_checks(ctx, predicted, log.collectives)
    assert isinstance(model, PipelinedModel)
    schedule, timeline = schedule_checks(config, ctx, model, mesh.pp_group)
    checks += schedule
    buffers, expected = model.recv_buffer_bytes(), estimate_pipeline_recv_buffers(config, ctx.world_size, mesh.pp_rank)
    checks += [Check(f"recv_buffers_{kind}", ctx.rank, getattr(expected, kind), buffers[kind], "bytes")
               for kind in buffers]
    checks += activation_checks(config, ctx, model, spans)
    sent = sum(k["sent_bytes"] for k in collective_totals(log.collectives).values())
    metrics = {"losses": log.losses, "step_time_s": log.step_time_s, "lr": log.lr,
               "pp_rank": mesh.pp_rank, "dp_rank": mesh.dp_rank, "pp_size": config.pp_size,
               "stages": [s.index for s in spans], "layers": layers, "embedding": spans[0].embedding,
               "head": spans[-1].head, "param_shard_bytes": params.shard_bytes,
               "collectives": [vars(c) for c in log.collectives], "sent_bytes": sent, **timeline,
               "recv_buffers": buffers, "held": model.held}
    if ctx.is_main:
        compute, _ = get_precision(config.precision)
        metrics["reference_losses"], loss_checks = one_process_loss_checks(
            config, log.losses, LOSS_TOLERANCE[compute], str(ctx.device))  # the reference on the rank's device
        checks += loss_checks
    return RankReport(metrics=metrics, checks=checks, extra={"pp_size": config.pp_size})


def activation_checks(config: PipelineConfig, ctx: RankContext, model: PipelinedModel,
                      spans: list[StageSpan]) -> list[Check]:
    """For each stage of this rank, in the last step (:attr:`PipelinedModel.held`): the bytes one
    micro-batch's forward left alive (the first forward's) against
    :func:`~handbook_lib.models.stage_memory.stage_activation_bytes`, and the most the stage held at
    once, the measured bytes of the micro-batches it had in flight at each moment of its measured
    order, against that times :func:`~handbook_lib.models.pipeline.in_flight` (an interleaved
    schedule: its list's). None where the model is not exact (a GPU, FSDP, TP, bf16)."""
    if ctx.device.type != "cpu":  # a GPU's kernels save other tensors (unmeasured)
        return []
    checks: list[Check] = []
    planned = most_in_flight(model.schedule_order()) if config.pp_stages_per_rank > 1 else {}
    for span in spans:
        per = stage_activation_bytes(config, ctx.world_size, span)
        if per is None:
            continue
        forwards = {mb: after - before for kind, stage, mb, before, after in model.held
                    if kind == "F" and stage == span.index}
        flying, most = 0, 0
        for kind, stage, mb, _, _ in model.held:
            if stage == span.index and kind != "I":  # a split backward frees it with its weights' half
                flying += forwards[mb] if kind == "F" else -forwards[mb]
                most = max(most, flying)
        count = (planned[span.index] if config.pp_stages_per_rank > 1
                 else in_flight(config.schedule, config.pp_size, config.pp_microbatches, span.index))
        checks += [Check(f"activations_per_microbatch_stage_{span.index}", ctx.rank, per, forwards[0], "bytes"),
                   Check(f"activations_held_stage_{span.index}", ctx.rank, count * per, most, "bytes")]
    return checks


def schedule_checks(config: PipelineConfig, ctx: RankContext, model: PipelinedModel,
                    group: dist.ProcessGroup) -> tuple[list[Check], dict]:
    """The last step's order of work on this rank against :func:`~handbook_lib.models.pipeline.schedule_actions`
    (an interleaved schedule: against the schedule's own list, which its executor runs); the most
    micro-batches each of its stages held at once against :func:`~handbook_lib.models.pipeline.in_flight`
    (an interleaved schedule: against its list's); and the bubble of the pipeline's measured orders
    on a grid of unit times (:data:`~handbook_lib.models.pipeline.UNIT_COST`) against
    ``(p − 1)/(v·m + p − 1)`` (a zero-bubble schedule: against its own list's on the grid). Returns the
    checks and the metrics: the timeline (seconds from the pipeline's first start), the orders'
    bubble and the model's (the metrics' ``bubble_fraction``), and the measured one (noisy on a
    shared CPU: reported, not checked)."""
    reference = ([a for span in rank_stages(config, dist.get_rank(group))
                  for a in schedule_actions(config.schedule, config.pp_size, config.pp_microbatches, span.index)]
                 if config.pp_stages_per_rank == 1 else model.schedule_order())
    measured = [(kind, stage, mb) for kind, stage, mb, _, _ in model.timeline]
    same = next((i for i, (a, b) in enumerate(zip(reference, measured)) if a != b), min(len(reference), len(measured)))
    checks = [Check("schedule_order", ctx.rank, len(reference), same if len(measured) == len(reference) else -1,
                    "actions")]
    held, planned = most_in_flight(measured), most_in_flight(reference)
    for stage in sorted(held):
        expected = (planned[stage] if config.pp_stages_per_rank > 1
                    else in_flight(config.schedule, config.pp_size, config.pp_microbatches, stage))
        checks.append(Check(f"in_flight_stage_{stage}", ctx.rank, expected, held[stage], "micro-batches"))
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, model.timeline, group=group)
    orders = {r: [(k, st, mb) for k, st, mb, _, _ in line] for r, line in enumerate(everyone)}
    grid = simulate_schedule(orders, config.pp_stages)
    span = max(end for line in grid.values() for _, _, end in line)
    here = dist.get_rank(group)
    if config.schedule in SPLIT_BACKWARD:  # zero-bubble: no closed form, its own orders on the grid
        planned_grid = simulate_schedule({r: model.schedule_order(r) for r in orders}, config.pp_stages)
        bubble = idle_fraction(planned_grid[here], max(end for line in planned_grid.values() for _, _, end in line))
    else:
        bubble = bubble_fraction(config.pp_size, config.pp_microbatches, config.pp_stages_per_rank)
    simulated = idle_fraction(grid[here], span)
    checks.append(Check("bubble_fraction", ctx.rank, bubble, simulated, "fraction"))
    origin = min(start for line in everyone for _, _, _, start, _ in line)
    last = max(end for line in everyone for _, _, _, _, end in line)
    timeline = [(k, st, mb, start - origin, end - origin) for k, st, mb, start, end in model.timeline]
    return checks, {"timeline": timeline, "simulated_bubble": simulated, "bubble_fraction": bubble,
                    "measured_bubble": idle_fraction([((k, st, mb), a, b) for k, st, mb, a, b in timeline],
                                                     last - origin)}


if __name__ == "__main__":
    main(sys.modules[__name__])
