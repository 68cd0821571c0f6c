"""Pipeline parallelism: the model cut into stages over ``pp_size`` ranks, run by a schedule; every byte sent checked.

Chapter 9 launches it. The ranks form the job's one mesh (:mod:`handbook_lib.runtime.mesh`),
``pp`` outermost: :func:`~handbook_lib.runtime.build.parallelize` cuts the book's split-attention
model (the seeded weights of :class:`~handbook_lib.runtime.model.SimpleTransformer`) at layer
boundaries into ``pp_size · pp_stages_per_rank`` stages (the embedding on the first, the head on
the last, :func:`~handbook_lib.models.pipeline.stage_layers`), splits each over ``tp_size``
tensor ranks if asked (Megatron's plan, ``sequence_parallel`` too), checkpoints it and shards it
with FSDP2 over its data-parallel ranks, and ``torch.distributed.pipelining`` runs them by
``schedule`` (GPipe, 1F1B, interleaved 1F1B) over ``pp_microbatches`` micro-batches; the
book's one loop (:func:`~handbook_lib.runtime.training.train`) steps it
(:func:`~handbook_lib.runtime.pipeline.pipeline_step`).

Checks, beside :mod:`handbook_lib.models.pipeline`: each rank's layers; its parameters, FSDP2's
padding, gradients and optimizer state (exact: the embedding and the head make the first and
last ranks heavier); every send and receive of the last step, tensor parallelism's collectives
inside each stage and FSDP2's over its data-parallel ranks (count, buffer bytes, each call
matched, bytes sent: exact); the
losses against one process training the book's model on the whole batch (1e-5 in fp32, 1e-3 in
bf16).

Launch::

    python -m handbook_lib run pipeline --nproc 4 --set schedule=1F1B   # pp_size 0: every rank
"""

from __future__ import annotations

import sys

from handbook_lib.core.config import get_precision
from handbook_lib.core.results import Check
from handbook_lib.models.pipeline import (
    bubble_fraction,
    estimate_pipeline_fsdp_calls,
    estimate_pipeline_p2p,
    estimate_pipeline_tp_calls,
    estimate_pipeline_state_bytes,
    rank_stages,
)
from handbook_lib.runs.axes_checks import LOSS_TOLERANCE, collective_checks, state_checks
from handbook_lib.runs.entry import RankReport, main, one_process_loss_checks
from handbook_lib.runs.specs.pipeline import CONFIG as CONFIG, PipelineConfig, validate
from handbook_lib.runtime.axes import axes_step
from handbook_lib.runtime.build import parallelize
from handbook_lib.runtime.collectives import collective_totals
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.mesh import build_layout_mesh
from handbook_lib.runtime.optimization import build_optimizer
from handbook_lib.runtime.training import train


def run(config: PipelineConfig, ctx: RankContext) -> RankReport:
    """Train ``config`` as a pipeline of ``pp_size`` ranks; check every byte held and sent, and the losses."""
    validate(config, ctx.world_size)
    config = config.on_world(ctx.world_size)  # pp_size 0: every rank
    mesh = build_layout_mesh(config.parallel_layout(ctx.world_size), ctx.device.type)
    model = parallelize(config, ctx, mesh=mesh)
    optimizer = build_optimizer(model.parameters(), config.optimizer, config.lr)
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
    sent = sum(k["sent_bytes"] for k in collective_totals(log.collectives).values())
    metrics = {"losses": log.losses, "step_time_s": log.step_time_s, "lr": log.lr,
               "pp_rank": mesh.pp_rank, "dp_rank": mesh.dp_rank, "pp_size": config.pp_size,
               "stages": [s.index for s in spans], "layers": layers, "embedding": spans[0].embedding,
               "head": spans[-1].head, "param_shard_bytes": params.shard_bytes,
               "bubble_fraction": bubble_fraction(config.pp_size, config.pp_microbatches, config.pp_stages_per_rank),
               "collectives": [vars(c) for c in log.collectives], "sent_bytes": sent}
    if ctx.is_main:
        compute, _ = get_precision(config.precision)
        metrics["reference_losses"], loss_checks = one_process_loss_checks(
            config, log.losses, LOSS_TOLERANCE[compute], str(ctx.device))  # the reference on the rank's device
        checks += loss_checks
    return RankReport(metrics=metrics, checks=checks, extra={"pp_size": config.pp_size})


if __name__ == "__main__":
    main(sys.modules[__name__])
