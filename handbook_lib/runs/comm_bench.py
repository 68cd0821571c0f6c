"""Micro-benchmark: time all-gather, reduce-scatter and all-reduce over message sizes, fit alpha/beta.

Chapter 3 launches it to measure the reader's own machine (gloo over loopback on a CPU, NCCL
over NVLink or PCIe on GPUs). For each collective and each buffer size (geometric, from
``min_bytes`` to ``max_bytes``) every rank runs ``warmup`` untimed and ``repeats`` timed calls;
the time of a call is the slowest rank's, and the median over repeats is kept. Rank 0 then fits
the alpha-beta model of :func:`handbook_lib.models.collectives.fit_alpha_beta` to each collective (``None``,
with a note, where noise leaves no growth with size to fit).

Launch::

    python -m handbook_lib run comm_bench --nproc 2 --set max_bytes=16777216
"""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from handbook_lib.models.collectives import fit_alpha_beta
from handbook_lib.runs.entry import RankReport, main
from handbook_lib.runs.specs.comm_bench import (
    CONFIG as CONFIG,
    BenchConfig,
    buffer_sizes,
    host_bytes as host_bytes,
    validate,
)
from handbook_lib.runtime.distributed import RankContext

KINDS = ("all_gather", "reduce_scatter", "all_reduce")

# torch 2.13 renamed the single-tensor collectives (``all_gather_into_tensor`` ->
# ``all_gather_single``, ``reduce_scatter_tensor`` -> ``reduce_scatter_single``) and warns once per
# rank and name on the old ones (a 220-column FutureWarning). Use the new names where they exist,
# the old ones on older torch: the collective is the same.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _time_call(fn, ctx: RankContext) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank does
    return float(elapsed.item())


def run(config: BenchConfig, ctx: RankContext) -> RankReport:
    validate(config, ctx.world_size)
    n = ctx.world_size
    measurements: list[dict[str, Any]] = []
    for size in buffer_sizes(config, n):
        full = torch.ones(size // 4, device=ctx.device)
        shard = torch.ones(size // 4 // n, device=ctx.device)
        calls = {
            "all_gather": partial(_all_gather, full, shard),
            "reduce_scatter": partial(_reduce_scatter, shard, full),
            "all_reduce": partial(dist.all_reduce, full),
        }
        for kind in KINDS:
            for _ in range(config.warmup):
                calls[kind]()
            times = [_time_call(calls[kind], ctx) for _ in range(config.repeats)]
            measurements.append({"kind": kind, "buffer_bytes": size, "seconds": statistics.median(times)})
    fits: dict[str, dict[str, float] | None] = {}
    notes = []
    for kind in KINDS:
        points = [m for m in measurements if m["kind"] == kind]
        try:
            fit = fit_alpha_beta(kind, n, [m["buffer_bytes"] for m in points], [m["seconds"] for m in points])
        except ValueError as err:  # noise can swamp a narrow range of small messages
            fits[kind] = None
            notes.append(f"{kind}: no fit ({err}); widen min_bytes..max_bytes or add repeats")
            continue
        fits[kind] = {"alpha_s": fit.alpha_s, "beta_bytes_per_s": fit.beta_bytes_per_s}
    return RankReport(metrics={}, extra={"measurements": measurements, "fits": fits, "notes": notes})


if __name__ == "__main__":
    main(sys.modules[__name__])
