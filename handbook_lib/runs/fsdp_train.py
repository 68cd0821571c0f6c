"""Train the handbook's model on N ranks and measure every byte the memory model predicts.

Chapter 1 launches it for the shards; chapter 2 for the whole memory model; chapter 5 for every
strategy: one plain process (``NONE``), DDP, FSDP2 and FSDP1, each wrapping policy, fp32 /
bf16 / fp16 (with or without a gradient scaler), activation checkpointing and CPU offload. Each
rank builds the same seeded model, wraps it as asked (FSDP2: ``fully_shard`` every unit of the
wrapping policy and then the root, on a 2-D mesh for the HYBRID strategies), trains ``steps``
steps on its slice of the synthetic global batch — the last one under a memory tracker and a
collective counter — and measures what it holds: parameter shards and their padding, gradient
shards, optimizer state, its FSDP units, activations and the step's peak. The memory and
communication models predict the same quantities for the same config; both go into ``checks``
(exact for the model state, the units and the collectives; within a stated tolerance for
activations and the peak; FSDP1's peak is reported but not predicted).

Launch::

    python -m handbook_lib run fsdp_train --nproc 2 --set steps=3 --out runs/first
    # or, by hand:
    torchrun --nproc-per-node 2 -m handbook_lib.runs.fsdp_train --set steps=3 --out runs/first
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from handbook_lib.core.config import RunConfig, dtype_bytes, get_precision, optimizer_impl_on, state_dtype
from handbook_lib.core.results import Check
from handbook_lib.core.strategies import STRATEGY_TABLE
from handbook_lib.models.allocator import reserved_bytes
from handbook_lib.models.init_bytes import estimate_init_bytes
from handbook_lib.models.layout import ModelLayout, model_layout
from handbook_lib.models.memory import MemoryEstimate, estimate_memory, local_numels
from handbook_lib.models.model_state import (
    optimizer_temporary_bytes,
    estimate_accumulation_bytes,
    optimizer_states,
    optimizer_step_bytes,
)
from handbook_lib.models.sharding import Unit, estimate_flat_shard_bytes, post_forward_shard_bytes
from handbook_lib.models.traffic import (
    StepTraffic,
    estimate_gathered_units,
    estimate_held_between_micro_steps,
    estimate_step_traffic,
)
from handbook_lib.runs.entry import RankReport, main
from handbook_lib.runs.specs.fsdp_train import CONFIG as CONFIG, validate
from handbook_lib.runtime.build import check_runnable, measure_init_bytes, shard_group
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.collectives import CollectiveCall, collective_totals
from handbook_lib.runtime.measure import (
    StepMemory,
    measure_fsdp_units,
    measure_grad_bytes,
    measure_optimizer_bytes,
    measure_param_bytes,
)
from handbook_lib.runtime.optimization import build_grad_scaler, build_optimizer
from handbook_lib.runtime.probe import GatheredProbe, GatheredSnapshot
from handbook_lib.runtime.training import train


ACTIVATION_TOLERANCE = 0.05
"""Relative tolerance of the activation check (the per-tensor count is exact on CPU; GPU
attention kernels save slightly different tensors)."""
PEAK_TOLERANCE = 0.10
"""Relative tolerance of the peak-memory check. On gloo with sharded parameters the model's
late-free headroom (:attr:`handbook_lib.models.memory.MemoryEstimate.late_free_peak`) is added: a
collective that finishes late under load keeps its buffers into the next phase (measured: up to
+10.7 % on the tests' 3.6 MB peaks with two jobs sharing 2 cores, 0.04 % idle)."""
NORM_TOLERANCE = 1e-6
"""Relative tolerance of the gradient-norm check: the norms of the shards combined across ranks,
against one process's norm of the whole gradient (both summed in float64; measured 1e-14)."""


def run(config: RunConfig, ctx: RankContext) -> RankReport:
    """Train ``config`` on this rank, measure what it holds, and check each byte the models predict."""
    validate(config, ctx.world_size)
    row = check_runnable(config, ctx.world_size)
    group = shard_group(config, ctx.world_size)
    flat = config.api == "fsdp1" and row.wrapper == "fsdp"
    model, init_bytes = measure_init_bytes(config, ctx, config.init)
    optimizer = build_optimizer(model.parameters(), config.optimizer, config.lr, config.optimizer_impl)
    layout = model_layout(config.model_config())
    units = layout.units(config.wrap, config.wrap_min_params)
    probe = _probe(model, units) if config.tunes_fsdp2 and row.wrapper == "fsdp" and not flat \
        and row.shards_params else None
    log = train(model, optimizer, config, ctx, track_memory=True, count_collectives=True,
                scaler=build_grad_scaler(config, ctx))
    predicted = estimate_memory(
        layout, ctx.world_size, config.strategy, config.precision, config.optimizer,
        micro_batch=config.batch_size // (ctx.world_size * config.grad_accum_steps), seq_len=config.seq_len,
        shard_group_size=group if row.hybrid else None, rank=ctx.rank, cpu_offload=config.cpu_offload,
        activation_checkpointing=config.activation_checkpointing, units=units, flat_params=flat,
        backend=ctx.backend, grad_accum_steps=config.grad_accum_steps,
        sync_every_micro_step=config.sync_every_micro_step, optimizer_impl=config.optimizer_impl,
        ac_every=config.ac_every, ac_matmul_every=config.ac_matmul_every, ac_save=config.ac_save,
        loss_chunks=config.loss_chunks, set_to_none=config.set_to_none,
    )
    state, checks = _state(config, ctx, layout, units, group, flat, model, optimizer, init_bytes)
    metrics = {
        "losses": log.losses, "step_time_s": log.step_time_s, **state,
        "grad_zero_fraction": log.grad_zero_fraction, "grad_scale": log.grad_scale,
        "skipped_steps": log.skipped_steps, "init_bytes": init_bytes, "grad_norm": log.grad_norm,
        "predicted_peak_phase": predicted.peak_phase, "predicted_components": predicted.components,
    }
    if log.grad_norm_full is not None:  # clipping: the sharded norm against one process's
        checks.append(Check("grad_norm", ctx.rank, log.grad_norm_full, log.grad_norm[0], "norm",
                            NORM_TOLERANCE))
    if log.memory is not None:
        checks += _memory_checks(config, ctx, layout, units, group, predicted, log.memory, flat, metrics)
    if probe is not None and probe.available and probe.passes:
        probe.close()
        checks += _gathered_checks(config, ctx, group, units, probe.passes[-1], metrics)
    if log.collectives is not None and probe is not None:
        checks += _order_checks(config, ctx, units, log.collectives, metrics)
    if log.collectives is not None:
        # the ring model applied to what was counted (kinds, buffers, group sizes)
        sent = sum(kind["sent_bytes"] for kind in collective_totals(log.collectives).values())
        checks += _collective_checks(config, ctx, units, flat, log.collectives, sent)
        metrics["collectives"] = [vars(c) for c in log.collectives]
        metrics["sent_bytes"] = sent
    return RankReport(metrics=metrics, checks=checks,
                      extra={"num_params": layout.num_params, "model_bytes": 4 * layout.num_params})


def _bytes(ctx: RankContext, quantity: str, expected: int, measured: int, tolerance: float = 0.0) -> Check:
    """A check of ``quantity`` on this rank, in bytes."""
    return Check(quantity, ctx.rank, expected, measured, "bytes", tolerance)


def _state(config: RunConfig, ctx: RankContext, layout: ModelLayout, units: list[Unit], group: int, flat: bool,
           model: nn.Module, optimizer: torch.optim.Optimizer, init_bytes: int) -> tuple[dict, list[Check]]:
    """What this rank holds at rest (parameter shards and padding, gradients, optimizer state,
    its FSDP units, and its peak while the model was built), measured beside the prediction.

    Returns:
        ``(metrics, checks)``; the metrics do not repeat ``init_bytes``.
    """
    params = measure_param_bytes(model)
    grads = measure_grad_bytes(model)
    opt_sharded, opt_other = measure_optimizer_bytes(optimizer)
    row = STRATEGY_TABLE[config.strategy]
    if flat:  # FSDP1: one padded FlatParameter per unit; grads and states are as padded
        shard = estimate_flat_shard_bytes(units, group, ctx.rank % group)
        state = shard.padded_bytes
    else:
        shard = layout.shard_bytes(group, ctx.rank % group, state_dtype(config.precision))
        state = shard.shard_bytes
    checks = [
        _bytes(ctx, "param_shard_bytes", shard.shard_bytes, params.shard_bytes),
        _bytes(ctx, "param_padding_bytes", shard.padding_bytes, params.padding_bytes),
        _bytes(ctx, "grad_shard_bytes", 0 if config.set_to_none else state, grads),  # freed: none at rest
        _bytes(ctx, "optimizer_state_bytes", optimizer_states(config.optimizer) * state, opt_sharded),
        _bytes(ctx, "optimizer_step_bytes", optimizer_step_bytes(layout, config.optimizer, units if flat else None),
               opt_other),
    ]
    if not flat:  # FSDP1 flattens while it materialises: its init is reported, not predicted
        # on CUDA the tracker reads the GPU only: offloaded shards live on the host, none there
        gpu = ctx.device.type == "cuda"
        checks.append(_bytes(ctx, "init_bytes", 0 if gpu and config.cpu_offload else estimate_init_bytes(
            layout, ctx.world_size, config.strategy, config.init, rank=ctx.rank,
            shard_group_size=group if row.hybrid else None, units=units,
            device="cuda" if gpu else "cpu", dtype=state_dtype(config.precision)), init_bytes))
    wrapped = measure_fsdp_units(model)
    if row.wrapper == "fsdp":
        checks.append(Check("fsdp_unit_count", ctx.rank, sum(1 for u in units if u.numel), len(wrapped), "units"))
    metrics = {
        "param_shard_bytes": params.shard_bytes, "param_padding_bytes": params.padding_bytes,
        "grad_shard_bytes": grads, "optimizer_state_bytes": opt_sharded, "optimizer_other_bytes": opt_other,
        "param_device": str(next(model.parameters()).device), "shard_group_size": group,
        "units": [u.name for u in units if u.numel], "measured_units": wrapped,
    }
    return metrics, checks


def _memory_checks(config: RunConfig, ctx: RankContext, layout: ModelLayout, units: list[Unit], group: int,
                   predicted: MemoryEstimate, mem: StepMemory, flat: bool, metrics: dict) -> list[Check]:
    """The tracked step's activations, peak and (with accumulation) the gradients held between
    micro-steps, beside the memory model's; their metrics are added to ``metrics``. ``units``
    and ``group`` are the run's FSDP units and shard group, as :func:`run` derived them."""
    row = STRATEGY_TABLE[config.strategy]
    # On a CPU-only machine "device" and host are the same memory: offloaded state counts too.
    peak = predicted.peak + (predicted.host if ctx.device.type == "cpu" else 0)
    kept = _post_forward_shard_bytes(config, units, group)
    checks = [_bytes(ctx, "activation_bytes", predicted.forward_activations + kept, mem.activation_bytes,
                     ACTIVATION_TOLERANCE)]
    metrics["post_forward_shard_bytes"] = kept
    if config.reshard_after_forward_size or not config.reshard_after_backward:
        pass  # the memory model holds no post-forward shards and no units kept between micro-steps
    elif not flat or not row.shards_params:  # FSDP1 sharding its flat parameters: reported only
        headroom = max(0, predicted.late_free_peak - predicted.peak) / peak
        checks.append(_bytes(ctx, "peak_bytes", peak, mem.peak_bytes, PEAK_TOLERANCE + headroom))
    if config.grad_accum_steps > 1:
        if config.sync_every_micro_step or not config.reshard_after_backward:
            param_dtype, reduce_dtype = get_precision(config.precision)
            held = estimate_held_between_micro_steps(
                units, ctx.world_size, config.strategy,
                param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                sync_every_micro_step=config.sync_every_micro_step,
                reshard_after_backward=config.reshard_after_backward,
                shard_group_size=group if row.hybrid else None,
                device="cuda" if ctx.device.type == "cuda" else "cpu")
        else:
            held = estimate_accumulation_bytes(layout, config.strategy, config.precision,
                                               device="cuda" if ctx.device.type == "cuda" else "cpu")
        assert mem.held_between_micro_steps is not None  # marked between micro-steps
        checks.append(_bytes(ctx, "held_between_micro_steps", held, mem.held_between_micro_steps))
    if mem.optimizer_temporary_bytes is not None:  # the step ran (a scaler may skip it)
        impl = optimizer_impl_on(config.optimizer_impl, "cuda" if ctx.device.type == "cuda" else "cpu")
        shards = local_numels(layout, row, group, ctx.rank % group, units, flat)
        temp = optimizer_temporary_bytes(shards, config.optimizer, impl, dtype_bytes(state_dtype(config.precision)))
        checks.append(_bytes(ctx, "optimizer_temporary_bytes", temp, mem.optimizer_temporary_bytes))
    metrics.update(optimizer_temporary_bytes=mem.optimizer_temporary_bytes)
    metrics.update(predicted_peak_bytes=peak, peak_bytes=mem.peak_bytes, activation_bytes=mem.activation_bytes,
                   peak_breakdown=mem.peak_breakdown, allocator_peak_bytes=mem.allocator_peak_bytes,
                   held_between_micro_steps=mem.held_between_micro_steps)
    metrics.update(mem.allocator_metrics())  # CUDA: the allocator's readings (none on the CPU)
    if mem.allocator_reserved_bytes is not None:  # CUDA: the allocator's segments beside the model's
        metrics.update(predicted_peak_reserved_bytes=reserved_bytes(peak))
    return checks


def _post_forward_shard_bytes(config: RunConfig, units: list[Unit], group: int) -> int:
    """With ``reshard_after_forward_size``: :func:`~handbook_lib.models.sharding.post_forward_shard_bytes`
    of the run's units in its parameter dtype; 0 otherwise."""
    param_dtype, _ = get_precision(config.precision)
    return post_forward_shard_bytes(units, group, config.reshard_after_forward_size, param_dtype)


def _scaler_group(config: RunConfig, world_size: int) -> int | None:
    """Ranks the fp16 gradient scaler all-reduces its inf flag over, as counted (``None``: none).

    FSDP1's ``ShardedGradScaler`` calls ``all_reduce`` over the world, which the counter sees.
    With FSDP2, DTensor reduces the flag inside its own dispatch, where a dispatch mode cannot
    see it: not counted, so not predicted either.
    """
    if config.precision != "fp16-mixed" or not config.grad_scaler or config.api != "fsdp1":
        return None
    return world_size


def step_traffic(config: RunConfig, world_size: int, units: list[Unit], *, flat: bool = False,
                 issue_order: int | None = None) -> StepTraffic:
    """The collectives of one step of a run of ``config`` on ``world_size`` ranks, as the
    communication model lists them (:func:`~handbook_lib.models.traffic.estimate_step_traffic`):
    its units, dtypes, shard group, accumulation and resharding knobs, the root kept gathered
    from forward into backward as :func:`~handbook_lib.runtime.build.apply_fsdp2` wraps it
    (FSDP2's default; FSDP1's too, ``flat``, which pads each unit's flat parameter once).
    ``issue_order``: in the order FSDP2 issues them (``None``: unit by unit)."""
    row = STRATEGY_TABLE[config.strategy]
    param_dtype, reduce_dtype = get_precision(config.precision)
    return estimate_step_traffic(
        units, world_size, config.strategy,
        param_dtype=param_dtype, reduce_dtype=reduce_dtype,
        shard_group_size=shard_group(config, world_size) if row.hybrid else None, flat_params=flat,
        grad_accum_steps=config.grad_accum_steps, sync_every_micro_step=config.sync_every_micro_step,
        grad_scaler_group=_scaler_group(config, world_size),
        reshard_after_forward_size=config.reshard_after_forward_size or None,
        reshard_after_backward=config.reshard_after_backward, issue_order=issue_order,
    )


def _collective_checks(config: RunConfig, ctx: RankContext, units: list[Unit], flat: bool,
                       calls: list[CollectiveCall], sent: int) -> list[Check]:
    """Counted collectives of the step beside the communication model's schedule
    (:func:`step_traffic`).

    FSDP2 and FSDP1 both keep the root unsharded between forward and backward (FULL_SHARD
    gathers it once a step); FSDP1 pads each unit's flat parameter once.
    DDP's bucket count depends on its 25 MB bucketing, so only its bytes are checked. One plain
    process (``NONE``) must issue no collective at all.
    """
    row = STRATEGY_TABLE[config.strategy]
    if not row.distributed:
        return [Check("collective_count", ctx.rank, 0, len(calls), "collectives")]
    traffic = step_traffic(config, ctx.world_size, units, flat=flat)
    checks = []
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        predicted = [r for r in traffic.records if r.kind == kind]
        measured = [c for c in calls if c.kind == kind]
        if not predicted and not measured:
            continue
        if row.wrapper != "ddp":  # DDP's bucket count follows its 25 MB bucketing
            checks.append(Check(f"{kind}_count", ctx.rank, len(predicted), len(measured), "collectives"))
        checks.append(_bytes(ctx, f"{kind}_buffer_bytes", sum(r.buffer_bytes for r in predicted),
                             sum(c.buffer_bytes for c in measured)))
        if kind == "all_gather" and config.reshard_after_forward_size:  # the backward's smaller groups
            size = config.reshard_after_forward_size
            checks.append(Check("small_group_all_gathers", ctx.rank,
                                sum(r.group_size == size for r in predicted),
                                sum(c.group_size == size for c in measured), "collectives"))
    if calls or traffic.records:
        # DDP's buckets round each all-reduce's chunks separately: a few bytes off one
        # all-reduce of everything
        checks.append(_bytes(ctx, "sent_bytes", traffic.sent_bytes, sent, 1e-6 if row.wrapper == "ddp" else 0.0))
    return checks


def _probe(model: nn.Module, units: list[Unit]) -> GatheredProbe:
    """A :class:`GatheredProbe` on the run's FSDP2 units (the root is the model itself)."""
    modules = {u.name: model if u.root else model.get_submodule(u.name) for u in units if u.numel}
    return GatheredProbe(model, modules)


def _gathered_checks(config: RunConfig, ctx: RankContext, group: int, units: list[Unit],
                     seen: list[GatheredSnapshot], metrics: dict) -> list[Check]:
    """The units gathered at each unit's compute in the measured micro-step (the last), beside
    :func:`handbook_lib.models.traffic.estimate_gathered_units`: the peak count and bytes in
    forward and in backward. Not predicted with an int ``reshard_after_forward_size`` (a unit
    kept on the smaller mesh is neither sharded nor gathered) or with units kept between
    micro-steps."""
    metrics["gathered"] = [vars(s) for s in seen]
    if config.reshard_after_forward_size or not config.reshard_after_backward:
        return []
    param_dtype, _ = get_precision(config.precision)
    row = STRATEGY_TABLE[config.strategy]
    predicted = estimate_gathered_units(units, ctx.world_size, config.strategy,
                                        explicit_prefetch=config.explicit_prefetch, param_dtype=param_dtype,
                                        shard_group_size=group if row.hybrid else None)
    metrics["predicted_gathered"] = [vars(s) for s in predicted]
    checks = []
    for phase in ("forward", "backward"):
        want = [s for s in predicted if s.phase == phase]
        got = [s for s in seen if s.phase == phase]
        short = "fwd" if phase == "forward" else "bwd"
        checks.append(Check(f"gathered_units_{short}", ctx.rank, max(len(s.gathered) for s in want),
                            max((len(s.gathered) for s in got), default=0), "units"))
        checks.append(_bytes(ctx, f"gathered_peak_{short}_bytes", max(s.gathered_bytes for s in want),
                             max((s.gathered_bytes for s in got), default=0)))
    return checks


def _order_checks(config: RunConfig, ctx: RankContext, units: list[Unit],
                  calls: list[CollectiveCall], metrics: dict) -> list[Check]:
    """The order in which the last micro-step's collectives were issued, beside FSDP2's
    schedule (:func:`estimate_step_traffic` with ``issue_order``): how many of them are in the
    predicted place (exact: all of them)."""
    traffic = step_traffic(config, ctx.world_size, units, issue_order=config.explicit_prefetch)
    predicted = [(r.kind, r.unit, r.phase) for r in traffic.records]
    # the counter names a phase after the first backward "optimizer": an all-gather there is
    # the next micro-step's forward (FSDP gathers nothing in the optimizer step)
    measured = [(c.kind, c.unit, "forward" if (c.kind, c.phase) == ("all_gather", "optimizer") else c.phase)
                for c in calls if c.unit is not None]
    metrics["predicted_order"] = [list(p) for p in predicted]
    return [Check("issue_order", ctx.rank, len(predicted),
                  sum(p == m for p, m in zip(predicted, measured)) if len(measured) == len(predicted) else -1,
                  "in place")]


if __name__ == "__main__":
    main(sys.modules[__name__])
