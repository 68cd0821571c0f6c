"""Profile one FSDP2 training step and read FSDP2's own ranges from the trace.

The reference page "Measured on GPUs" launches it. Each rank trains ``steps - 1`` steps, then
the last under ``torch.profiler`` (:func:`handbook_lib.runtime.trace.profiled`), and reads from
its events the ranges FSDP2 names (:func:`handbook_lib.runtime.trace.fsdp_ranges`): each unit's
pre-forward and all-gather, the backward prefetches, each unit's reduce, with their start and
duration. The checks count the trace's all-gathers and reduce-scatters against the step the
communication model predicts (:func:`handbook_lib.models.traffic.estimate_step_traffic`, the
root kept gathered into backward, FSDP2's default), exactly: a trace read by the same rules as
a counter. The ranges go to each rank's metrics; the trace file itself stays with the
profiler (``export_chrome_trace``), where a learner's own job would write it.

Launch::

    python -m handbook_lib run trace_step --nproc 2 --set steps=3 --out runs/trace
"""

from __future__ import annotations

import sys
from dataclasses import asdict

from handbook_lib.core.config import RunConfig, get_precision
from handbook_lib.core.results import Check
from handbook_lib.models.layout import model_layout
from handbook_lib.models.traffic import estimate_step_traffic
from handbook_lib.runs.entry import RankReport, main
from handbook_lib.runs.specs.trace_step import CONFIG as CONFIG, validate  # the spec: one home
from handbook_lib.runtime.build import parallelize
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.optimization import build_optimizer
from handbook_lib.runtime.trace import fsdp_ranges, profiled
from handbook_lib.runtime.training import train

TRACED = {"all_gather": "all_gather", "post_backward_reduce": "reduce_scatter"}
"""FSDP2's range for each collective the checks count: one ``all_gather`` range per unit
gathered, one ``post_backward_reduce`` per unit reduced."""


def run(config: RunConfig, ctx: RankContext) -> RankReport:
    validate(config, ctx.world_size)
    model = parallelize(config, ctx)
    optimizer = build_optimizer(model.parameters(), config.optimizer, config.lr, config.optimizer_impl)
    train(model, optimizer, config.replace(steps=config.steps - 1), ctx, progress=False)
    with profiled(ctx.device) as prof:
        log = train(model, optimizer, config, ctx, start_step=config.steps - 1, progress=False)
    events = list(prof.events())
    ranges = fsdp_ranges(events)
    units = model_layout(config.model_config()).units(config.wrap, config.wrap_min_params)
    param_dtype, reduce_dtype = get_precision(config.precision)
    traffic = estimate_step_traffic(units, ctx.world_size, config.strategy, param_dtype=param_dtype,
                                    reduce_dtype=reduce_dtype)
    checks = [Check(f"traced_{kind}_count", ctx.rank, traffic.counts.get(kind, 0),
                    sum(r.kind == name for r in ranges), "collectives")
              for name, kind in TRACED.items()]
    span_ms = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / 1e3
    metrics = {"ranges": [asdict(r) for r in ranges], "losses": log.losses, "traced_ms": span_ms}
    return RankReport(metrics=metrics, checks=checks)


if __name__ == "__main__":
    main(sys.modules[__name__])
