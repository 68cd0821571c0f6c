"""Train the book's model on any layout of chapter 9's axes and check every byte against the models.

The ``tensor_parallel`` and ``sequence_parallel`` runs are this one function, :func:`run_axes`,
behind their own validation: :func:`~handbook_lib.runtime.build.parallelize` lays the model out
(:func:`~handbook_lib.runtime.build.apply_axes`: tensor-parallel plan, sequence core, activation
checkpointing, FSDP2) on the job's one mesh, the book's one loop
trains it (:func:`~handbook_lib.runtime.training.train`), its last step under a memory tracker and
a collective counter. Checks, beside :mod:`handbook_lib.models.axes_run`:

- with ``tp_size`` > 1: the vocabulary's padding rows;
- with ``sp_size`` > 1: the distributed attention against full causal attention, once before
  training (output and gradients, 1e-6 relative);
- parameter shards and FSDP2's padding, gradients and optimizer state per rank (exact);
- activations alive after the first micro-batch's forward (exact on CPU; 5 % on CUDA, whose
  attention kernels save other tensors);
- every collective and transfer of the step, each axis's, by kind and group (count and buffer
  bytes), each call matched in kind, buffer bytes and group, and the bytes this rank sent (exact:
  :func:`collective_checks`, the pipeline run's too);
- with clipping: the gradient norm the shards give against the whole gradient's (1e-6);
- the losses against one process training the book's model on the whole batch in fp32
  (:data:`LOSS_TOLERANCE`: 1e-5 in fp32, wider in mixed precision).
"""

from __future__ import annotations

from collections import Counter

import torch

from handbook_lib.core.config import get_precision
from handbook_lib.core.parallel_config import ParallelConfig
from handbook_lib.core.results import Check
from handbook_lib.models.axes_run import (
    AxesCall,
    axes_micro_batch,
    axes_units,
    estimate_axes_activation_bytes,
    estimate_axes_collectives,
    estimate_axes_state_bytes,
)
from handbook_lib.models.sharding import post_forward_shard_bytes
from handbook_lib.models.tensor_parallel import TPStateBytes
from handbook_lib.runs.entry import RankReport, one_process_loss_checks
from handbook_lib.runtime.axes import axes_step
from handbook_lib.runtime.build import CoreFactory, parallelize
from handbook_lib.runtime.collectives import CollectiveCall, collective_totals
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.measure import (
    ParamBytes,
    measure_grad_bytes,
    measure_optimizer_bytes,
    measure_param_bytes,
)
from handbook_lib.runtime.mesh import build_layout_mesh
from handbook_lib.runtime.optimization import build_grad_scaler, build_optimizer
from handbook_lib.runtime.ring_attention import ring_core
from handbook_lib.runtime.sequence_parallel import measure_attention_error
from handbook_lib.runtime.training import train

__all__ = ["LOSS_TOLERANCE", "ATTENTION_TOLERANCE", "GPU_ACTIVATION_TOLERANCE", "NORM_TOLERANCE",
           "run_axes", "sp_core_factory", "tracked_extra_bytes", "collective_checks", "state_checks"]

LOSS_TOLERANCE: dict[str, float] = {"fp32": 1e-5, "bf16": 1e-3, "fp16": 1e-4}
"""Relative tolerance of each loss against one process's fp32 loss on the same global batch, by
the compute dtype. fp32: the same arithmetic in another order. bf16 and fp16 compute every layer
from rounded weights and activations (8 and 11 bits of significand); the loss itself is computed
in fp32. 1e-3 is a quarter of bf16's 2**-8 spacing (measured: 1.5e-4 on chapter 9's shapes)."""
ATTENTION_TOLERANCE = 1e-6
"""The distributed attention's largest difference from full causal attention, relative to the
reference's largest magnitude (fp32; measured about 1e-7)."""
GPU_ACTIVATION_TOLERANCE = 0.05
"""Relative tolerance of the activation check on CUDA, whose attention kernels save other
tensors than the CPU's (on CPU the check is exact)."""
NORM_TOLERANCE = 1e-6
"""The clipped norm from the shards against the whole gradient's, both summed in float64."""


def sp_core_factory(config: ParallelConfig) -> CoreFactory:
    """The attention of ``config.sp_method``: DeepSpeed's Ulysses (``ulysses``) or the book's
    ring (``ring``), each over the sequence-parallel group it is given."""
    if config.sp_method == "ulysses":
        from handbook_lib.integrations.ulysses import ulysses_core

        return ulysses_core
    return ring_core


def run_axes(config: ParallelConfig, ctx: RankContext) -> RankReport:
    """Train ``config`` on its layout over this job's ranks and check every byte and loss."""
    mesh = build_layout_mesh(config.parallel_layout(ctx.world_size), ctx.device.type)
    model = parallelize(config, ctx, mesh=mesh, sp_core=sp_core_factory(config))
    checks: list[Check] = []
    metrics: dict = {}
    if mesh.layout.sp_enabled:
        error = measure_attention_error(model.core, config, mesh, ctx.device)
        checks += [Check("attention_output", ctx.rank, error.out_scale, error.out_scale + error.out_diff,
                         "max |value|", ATTENTION_TOLERANCE),
                   Check("attention_grads", ctx.rank, error.grad_scale, error.grad_scale + error.grad_diff,
                         "max |value|", ATTENTION_TOLERANCE)]
        metrics["attention_error"] = vars(error)
    optimizer = build_optimizer(model.parameters(), config.optimizer, config.lr, config.optimizer_impl)
    log = train(model, optimizer, config, ctx, **axes_step(mesh), track_memory=True, count_collectives=True,
                scaler=build_grad_scaler(config, ctx))
    memory, calls = log.memory, log.collectives
    assert memory is not None and calls is not None  # tracked on the last step
    if mesh.layout.tp > 1:
        rows = int(model.embedding.weight.shape[0])  # the global rows of the (TP x FSDP) DTensor
        checks.append(Check("vocab_padding_rows", ctx.rank, config.padded_vocab_size - config.vocab_size,
                            rows - config.vocab_size, "rows"))
        metrics.update(vocab_size=config.vocab_size, padded_vocab_size=rows)
    state, params = state_checks(ctx, estimate_axes_state_bytes(config, ctx.world_size, mesh.fsdp_rank), model,
                                 optimizer)
    checks += state
    metrics.update(param_shard_bytes=params.shard_bytes, param_padding_bytes=params.padding_bytes)
    acts = estimate_axes_activation_bytes(config, axes_micro_batch(config, ctx.world_size), mesh.sp_rank)
    tracked = acts.total + tracked_extra_bytes(config, ctx.world_size)
    checks.append(Check("activation_bytes", ctx.rank, tracked, memory.activation_bytes, "bytes",
                        0.0 if ctx.device.type == "cpu" else GPU_ACTIVATION_TOLERANCE))
    checks += collective_checks(ctx, estimate_axes_collectives(config, ctx.world_size), calls)
    if log.grad_norm_full is not None:  # clipping: the sharded norm against the whole gradient's
        checks.append(Check("grad_norm", ctx.rank, log.grad_norm_full, log.grad_norm[0], "norm", NORM_TOLERANCE))
    lay = mesh.layout
    metrics.update({
        "losses": log.losses, "step_time_s": log.step_time_s, "lr": log.lr, "grad_norm": log.grad_norm,
        "dp_size": lay.dp, "tp_size": lay.tp, "sp_size": lay.sp, "fsdp_size": lay.fsdp_size,
        "dp_rank": mesh.dp_rank, "tp_rank": mesh.tp_rank, "sp_rank": mesh.sp_rank,
        "sequence_parallel": config.sequence_parallel,
        "activation_bytes": memory.activation_bytes, "predicted_activation_bytes": tracked,
        "activation_per_layer": acts.per_layer, "peak_bytes": memory.peak_bytes,
        "collectives": [vars(c) for c in calls],
        "sent_bytes": sum(k["sent_bytes"] for k in collective_totals(calls).values())})
    if ctx.is_main:
        compute, _ = get_precision(config.precision)
        metrics["reference_losses"], loss_checks = one_process_loss_checks(
            config, log.losses, LOSS_TOLERANCE[compute], str(ctx.device))  # the reference on the rank's device
        checks += loss_checks
    return RankReport(metrics=metrics, checks=checks, extra={"dp_size": lay.dp, "tp_size": lay.tp})


def tracked_extra_bytes(config: ParallelConfig, world_size: int) -> int:
    """What the memory tracker files with the first micro-batch's activations besides autograd's
    tensors:

    - with ``reshard_after_forward_size``: the post-forward parameter shards FSDP2 keeps
      (:func:`~handbook_lib.models.sharding.post_forward_shard_bytes` of the run's units of
      tensor-parallel shapes);
    - with gradient accumulation: the loop cuts the rank's rows into micro-batches with
      ``chunk()``, views made under the tracker, which files the storage they view — the arranged
      batch of token ids and targets (int64, ``world · b/dp`` rows of ``seq_len / sp`` positions
      each) — with them; and with tensor parallelism the divided loss, 4 bytes, kept beside the
      reported one (a view of the undivided loss). Measured on 4 ranks with TP 2 and SP 2.
    """
    layout = config.parallel_layout(world_size)
    param_dtype, _ = get_precision(config.precision)
    extra = post_forward_shard_bytes(axes_units(config, layout.tp), layout.fsdp_size,
                                     config.reshard_after_forward_size, param_dtype)
    if config.grad_accum_steps > 1:
        rows = world_size * config.batch_size // layout.dp
        extra += 2 * 8 * rows * (config.seq_len // layout.sp) + (4 if layout.tp > 1 else 0)
    return extra


def state_checks(ctx: RankContext, state: TPStateBytes, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 ) -> tuple[list[Check], ParamBytes]:
    """This rank's parameter shards and padding, gradients and optimizer state against ``state``
    (the axes' :func:`estimate_axes_state_bytes`, the pipeline's
    :func:`~handbook_lib.models.pipeline.estimate_pipeline_state_bytes`); with the measured
    parameter bytes."""
    params = measure_param_bytes(model)
    sharded, other = measure_optimizer_bytes(optimizer)
    return [Check("param_shard_bytes", ctx.rank, state.param_shard_bytes, params.shard_bytes, "bytes"),
            Check("param_padding_bytes", ctx.rank, state.param_padding_bytes, params.padding_bytes, "bytes"),
            Check("grad_shard_bytes", ctx.rank, state.grad_bytes, measure_grad_bytes(model), "bytes"),
            Check("optimizer_state_bytes", ctx.rank, state.optimizer_state_bytes, sharded, "bytes"),
            Check("optimizer_step_bytes", ctx.rank, state.optimizer_step_bytes, other, "bytes")], params


def collective_checks(ctx: RankContext, predicted: list[AxesCall], calls: list[CollectiveCall]) -> list[Check]:
    """A step's ``calls`` against the ``predicted`` ones: per (kind, group size) count and buffer
    bytes; how many calls match a predicted one in kind, buffer bytes and group size (all of them,
    and as many as predicted); the bytes this rank sent. Phases are not compared: the counter
    names everything after the first backward ``optimizer``, which with gradient accumulation (or
    a pipeline's micro-batches) includes the next forward passes."""
    want = Counter((c.kind, c.buffer_bytes, c.group_size) for c in predicted)
    got = Counter((c.kind, c.buffer_bytes, c.group_size) for c in calls)
    checks = []
    for kind, group in sorted({(k, g) for k, _, g in want} | {(k, g) for k, _, g in got}):
        wanted = [(n, b) for (k, b, g), n in want.items() if (k, g) == (kind, group)]
        seen = [(n, b) for (k, b, g), n in got.items() if (k, g) == (kind, group)]
        name = f"{kind}_{group}ranks"
        checks += [Check(f"{name}_count", ctx.rank, sum(n for n, _ in wanted), sum(n for n, _ in seen), "collectives"),
                   Check(f"{name}_buffer_bytes", ctx.rank, sum(n * b for n, b in wanted),
                         sum(n * b for n, b in seen), "bytes")]
    matched = sum((want & got).values())
    checks.append(Check("collectives_matched", ctx.rank, sum(want.values()),
                        matched if sum(got.values()) == sum(want.values()) else -1, "collectives"))
    sent = sum(k["sent_bytes"] for k in collective_totals(calls).values())
    checks.append(Check("sent_bytes", ctx.rank, sum(c.sent_bytes for c in predicted), sent, "bytes"))
    return checks
