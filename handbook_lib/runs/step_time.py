"""Time DDP and FSDP steps side by side in one job: the price of sharding in step time.

Chapter 5 launches it. Timing separate jobs one after another on a shared machine compares the
machine's moods as much as the strategies; here every rank builds one model per strategy in
``variants`` (same seed, same data), and then, ``repeats`` times, runs ``steps`` timed steps of
each — in a rotated order every repeat, so a slow moment does not always hit the same
strategy. Each repeat gives one ratio per strategy (its mean step time over DDP's); the chapter
reports their median and spread. Because every variant trains on the same batches, their fp32
losses must agree too: the ``checks`` compare each variant's last loss with DDP's.

Launch::

    python -m handbook_lib run step_time --nproc 2 --set repeats=5
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from handbook_lib.core.results import Check
from handbook_lib.runs.entry import RankReport, main
from handbook_lib.runs.specs.step_time import BASELINE, CONFIG as CONFIG, StepTimeConfig, validate
from handbook_lib.runtime.build import parallelize
from handbook_lib.runtime.data import local_batch
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.optimization import build_optimizer
from handbook_lib.runtime.training import train_step

LOSS_TOLERANCE = 1e-5
"""Relative tolerance between a variant's fp32 loss and DDP's on the same batches."""


def run(config: StepTimeConfig, ctx: RankContext) -> RankReport:
    validate(config, ctx.world_size)
    names = config.variant_list()
    if ctx.is_main:  # progress on rank 0: building and warming up takes a while on a CPU
        print(f"step_time: building {', '.join(names)}; then {config.warmup} warm-up step(s) each and "
              f"{config.repeats} repeats of {config.steps} timed step(s)", flush=True)
    models, optimizers, step = {}, {}, {}
    for name in names:
        variant = config.replace(strategy=name)
        models[name] = parallelize(variant, ctx)
        optimizers[name] = build_optimizer(models[name].parameters(), config.optimizer, config.lr,
                                           config.optimizer_impl)
        step[name] = 0

    def advance(name: str) -> float:
        """One training step of variant ``name`` on its next batch; returns its loss."""
        inputs, targets = local_batch(config, step[name], ctx)
        step[name] += 1
        return float(train_step(models[name], optimizers[name], inputs, targets, step=step[name]))

    for name in names:
        for _ in range(config.warmup):
            advance(name)
        if ctx.is_main and config.warmup:
            print(f"warm-up done: {name}", flush=True)
    times: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(config.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(config.steps):
                losses[name].append(advance(name))
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            times[name].append((time.perf_counter() - start) / config.steps)
        if ctx.is_main:
            print(f"repeat {rep + 1}/{config.repeats}: " + ", ".join(
                f"{n} {times[n][-1]:.3f} s" for n in names), flush=True)
    ratios = {n: [t / d for t, d in zip(times[n], times[BASELINE])] for n in names}
    checks = [Check(f"loss_{n}_vs_{BASELINE}", ctx.rank, losses[BASELINE][-1], losses[n][-1], "nats",
                    LOSS_TOLERANCE) for n in names[1:]]
    return RankReport(
        metrics={
            "step_time_s": times,
            "ratio_to_ddp": ratios,
            "median_ratio_to_ddp": {n: statistics.median(r) for n, r in ratios.items()},
            "local_losses": losses,
        },
        checks=checks,
        extra={"variants": names},
    )


if __name__ == "__main__":
    main(sys.modules[__name__])
