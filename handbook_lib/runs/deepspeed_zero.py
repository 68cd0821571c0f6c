"""Train the handbook's model with DeepSpeed ZeRO and with FSDP2 side by side; check DeepSpeed's bytes and collectives.

Chapter 7 launches it. Each rank first trains the FSDP2 twin of the config (the FSDP strategy
with ZeRO's sharding at rest: SHARD_GRAD_OP for ZeRO-2, FULL_SHARD for ZeRO-3 and ZeRO-1, which
FSDP has no form of) and then the same seeded model under a DeepSpeed engine, on the same
batches, in the same loop (:func:`handbook_lib.runtime.training.train`). The last step of each runs
under a collective counter. It then measures where DeepSpeed keeps each byte — parameters, the
fp32 master partition, gradients, optimizer state — and checks each, and the FSDP2 twin's, against
:func:`handbook_lib.models.memory.estimate_rank_state` (exact: ZeRO and FSDP are two rows of one model),
the collectives against
:func:`handbook_lib.models.zero.estimate_zero_step_traffic` (exact bytes), and DeepSpeed's losses
against FSDP2's (:data:`LOSS_TOLERANCE`). DeepSpeed's own memory estimators are reported beside
them (rank 0).

Launch::

    python -m handbook_lib run deepspeed_zero --nproc 2 --set strategy=ZERO2 --out runs/zero2
"""

from __future__ import annotations

import sys
from typing import Any

from handbook_lib.core.architecture import param_count
from handbook_lib.core.config import RunConfig, optimizer_impl_on
from handbook_lib.core.results import Check
from handbook_lib.core.strategies import get_strategy
from handbook_lib.models.memory import estimate_rank_state
from handbook_lib.models.zero import (
    ZERO_STAGES,
    estimate_zero_redundancy_rank_bytes,
    estimate_zero_step_traffic,
    gather_units,
)
from handbook_lib.models.zero_peak import estimate_zero_peak
from handbook_lib.runs.entry import RankReport, main
from handbook_lib.runs.specs.deepspeed_zero import CONFIG as CONFIG, LOSS_TOLERANCE, ZeroRunConfig, validate
from handbook_lib.runtime.build import parallelize
from handbook_lib.runtime.data import local_batch
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.collectives import collective_totals
from handbook_lib.runtime.measure import (
    measure_grad_bytes,
    measure_optimizer_bytes,
    measure_param_bytes,
)
from handbook_lib.runtime.optimization import build_optimizer, build_zero_redundancy_optimizer
from handbook_lib.runtime.training import train


STEP_TOLERANCE = 2e-4
"""Relative tolerance of the optimizer step's bytes: DeepSpeed's scalars (its overflow flag,
step count, the norm's sum: 8 to 28 B, 1e-4 of the smallest step measured) sit beside the
priced tensors."""

BUCKET_MOMENT_TOLERANCE = 1e-3
"""Relative tolerance of ZeRO-1/2's backward peak, the moment the gradient bucket (98 % of it on
the book's models) is full: up to one gradient tensor more is alive there (8 kB to 423 kB
measured, by rank and run), a reduction's buffer that gloo frees a moment late or, under ZeRO-1,
a tensor still alive when its bucket is allocated; not priced."""


def fsdp_twin(strategy: str) -> str:
    """The FSDP strategy the run compares a ZeRO row with: the same sharding at rest where FSDP
    has one (ZeRO-2 → SHARD_GRAD_OP, ZeRO-3 → FULL_SHARD), else FULL_SHARD."""
    stage = get_strategy(strategy).zero_stage
    return (ZERO_STAGES.get(stage) if stage is not None else None) or "FULL_SHARD"


def _book_config(config: ZeroRunConfig) -> RunConfig:
    """The run config of ``config`` without ZeRO's own keys: what the twins train."""
    return RunConfig.from_mapping({k: v for k, v in config.to_dict().items() if k in RunConfig.keys()})


def _train_fsdp2(config: ZeroRunConfig, ctx: RankContext) -> dict:
    """The FSDP2 twin's losses, bytes and collectives (its own checks are fsdp_train's)."""
    twin = _book_config(config)
    twin = twin.replace(strategy=fsdp_twin(config.strategy), api="fsdp2", init="meta")
    model = parallelize(twin, ctx)
    optimizer = build_optimizer(model.parameters(), twin.optimizer, twin.lr, twin.optimizer_impl)
    log = train(model, optimizer, twin, ctx, count_collectives=True, progress=False)
    assert log.collectives is not None  # counted on the last step
    params = measure_param_bytes(model)
    sharded, other = measure_optimizer_bytes(optimizer)
    return {"strategy": twin.strategy, "losses": log.losses,
            "params": params.storage_bytes, "grads": measure_grad_bytes(model),
            "optimizer": sharded, "optimizer_step": other, "collectives": collective_totals(log.collectives)}


def _train_torch_zero1(config: ZeroRunConfig, ctx: RankContext) -> dict:
    """PyTorch's own ZeRO-1 on the same seeded model and batches: DDP replicas, the optimizer
    state split by ``ZeroRedundancyOptimizer`` (whole tensors per rank); its losses and bytes."""
    twin = _book_config(config)
    twin = twin.replace(strategy="DDP", init="full")
    model = parallelize(twin, ctx)
    optimizer = build_zero_redundancy_optimizer(model.parameters(), twin.optimizer, twin.lr, twin.optimizer_impl)
    log = train(model, optimizer, twin, ctx, progress=False)
    sharded, other = measure_optimizer_bytes(optimizer.optim)  # its local optimizer
    return {"strategy": "DDP + ZeroRedundancyOptimizer", "losses": log.losses,
            "params": measure_param_bytes(model).storage_bytes, "grads": measure_grad_bytes(model),
            "optimizer": sharded, "optimizer_step": other, "tensors": len(optimizer.optim.state)}


def _peak_checks(config: ZeroRunConfig, ctx: RankContext, measured: dict[str, int]) -> tuple[list[Check], dict]:
    """One more step's bytes beyond the state it starts from, against
    :func:`~handbook_lib.models.zero_peak.estimate_zero_peak`, as ``(checks, readings)``:
    DeepSpeed's buckets held at rest, ZeRO-1/2's backward peak (the bucket moment) and the
    optimizer step's, each priced from DeepSpeed's own allocations (:data:`BUCKET_MOMENT_TOLERANCE`,
    :data:`STEP_TOLERANCE`).
    ZeRO-3's forward and backward, which the model approximates, are reported beside the
    prediction, not checked; so is ZeRO-3's step with persistent tensors, whose regathered
    copies the measurement counts without their freed originals. Nothing with ``cpu_offload``,
    which the peak model does not price."""
    if config.cpu_offload:
        return [], {}
    knobs = config.zero3_knobs()
    zero = estimate_zero_peak(config.model_config(), ctx.world_size, config.strategy, config.precision,
                              config.optimizer, micro_batch=config.batch_size // ctx.world_size,
                              seq_len=config.seq_len, backend=ctx.backend, knobs=knobs, rank=ctx.rank,
                              optimizer_impl=optimizer_impl_on(config.optimizer_impl, ctx.device.type))
    stage3 = get_strategy(config.strategy).zero_stage == 3
    predicted = {"buckets_at_rest": zero.buckets if stage3 else 0,
                 "backward": max(v for k, v in zero.phases.items() if k != "optimizer_step") - zero.at_rest,
                 "optimizer_step": zero.phases["optimizer_step"] - zero.at_rest}
    checked = ["buckets_at_rest"] + ([] if stage3 else ["backward"]) + \
        ([] if stage3 and knobs.persistence_threshold else ["optimizer_step"])
    tolerance = {"buckets_at_rest": 0.0, "backward": BUCKET_MOMENT_TOLERANCE, "optimizer_step": STEP_TOLERANCE}
    checks = [Check(f"{name}_peak_bytes" if name != "buckets_at_rest" else "buckets_at_rest_bytes", ctx.rank,
                    predicted[name], measured[name], "bytes", tolerance[name]) for name in checked]
    return checks, {name: {"predicted": predicted[name], "measured": measured[name]} for name in predicted}


def run(config: ZeroRunConfig, ctx: RankContext) -> RankReport:
    validate(config, ctx.world_size)
    from handbook_lib.integrations.zero_engine import (
        build_engine,
        deepspeed_estimates,
        measure_zero_bytes,
        measure_zero_step,
    )

    fsdp = _train_fsdp2(config, ctx)
    knobs = config.zero3_knobs()
    engine, optimizer, ds_config = build_engine(config, ctx, knobs)
    log = train(engine, optimizer, config, ctx, count_collectives=True)
    assert log.collectives is not None  # counted on the last step
    held = measure_zero_bytes(engine, optimizer.grad_bytes)
    model = config.model_config()
    kwargs: dict[str, Any] = {"persistence_threshold": knobs.persistence_threshold, "cpu_offload": config.cpu_offload}
    parts = ("params", "master", "grads", "optimizer", "optimizer_step")
    predicted = estimate_rank_state(model, ctx.world_size, config.strategy, config.precision, config.optimizer,
                                    rank=ctx.rank, **kwargs)
    checks = [Check(f"{name}_bytes", ctx.rank, getattr(predicted, name), getattr(held, name), "bytes")
              for name in parts]
    twin = estimate_rank_state(model, ctx.world_size, fsdp["strategy"], config.precision, config.optimizer,
                               rank=ctx.rank)  # the same model's other row: FSDP2
    checks += [Check(f"fsdp2_{name}_bytes", ctx.rank, getattr(twin, name), fsdp.get(name, 0), "bytes")
               for name in parts]
    torch_zero1 = _train_torch_zero1(config, ctx) if get_strategy(config.strategy).zero_stage == 1 else None
    if torch_zero1 is not None:  # PyTorch's ZeRO-1 beside DeepSpeed's
        mine = estimate_zero_redundancy_rank_bytes(model, ctx.world_size, config.precision, config.optimizer,
                                                   rank=ctx.rank)
        checks += [Check(f"torch_zero1_{name}_bytes", ctx.rank, getattr(mine, name), torch_zero1[name], "bytes")
                   for name in ("params", "grads", "optimizer", "optimizer_step")]
    peak_checks, step_bytes = _peak_checks(config, ctx, measure_zero_step(engine, optimizer,
                                                                          *local_batch(config, config.steps, ctx)))
    checks += peak_checks
    tolerance = LOSS_TOLERANCE[config.precision]
    checks += [Check(f"loss_step{i + 1}_vs_fsdp2", ctx.rank, a, b, "nats", tolerance)
               for i, (a, b) in enumerate(zip(fsdp["losses"], log.losses))]
    if torch_zero1 is not None:
        checks += [Check(f"loss_step{i + 1}_torch_zero1_vs_deepspeed", ctx.rank, a, b, "nats", tolerance)
                   for i, (a, b) in enumerate(zip(log.losses, torch_zero1["losses"]))]
    traffic = estimate_zero_step_traffic(model, ctx.world_size, config.strategy, config.precision, **kwargs,
                                         prefetch_bucket_size=knobs.prefetch_bucket_size,
                                         max_reuse_distance=knobs.max_reuse_distance)
    counted = collective_totals(log.collectives)
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        records = [r for r in traffic.records if r.kind == kind]
        if not records and kind not in counted:
            continue
        measured = counted.get(kind, {"count": 0, "buffer_bytes": 0})
        checks.append(Check(f"{kind}_buffer_bytes", ctx.rank, sum(r.buffer_bytes for r in records),
                            measured["buffer_bytes"], "bytes"))
        if kind == "all_gather":  # reductions are bucketed: only their bytes are the model's
            checks.append(Check("all_gather_count", ctx.rank, len(records), measured["count"], "collectives"))
    checks.append(Check("sent_bytes", ctx.rank, traffic.sent_bytes,
                        sum(k["sent_bytes"] for k in counted.values()), "bytes"))
    metrics = {
        "losses": log.losses,
        "step_time_s": log.step_time_s,
        **{f"{name}_bytes": getattr(held, name) for name in parts},
        "collectives": counted,
        "step_bytes": step_bytes,
        "fsdp2": fsdp,
        **({"torch_zero1": torch_zero1} if torch_zero1 is not None else {}),
    }
    extra = {"num_params": param_count(model), "deepspeed_config": ds_config,
             "gather_units": len(gather_units(model)),
             "deepspeed_estimates": deepspeed_estimates(model, ctx.world_size) if ctx.is_main else None}
    engine.destroy()
    return RankReport(metrics=metrics, checks=checks, extra=extra)


if __name__ == "__main__":
    main(sys.modules[__name__])
