"""Views of single runs: the tables and lines a chapter shows for one kind of run's result.

Each reads the metrics its run writes (``fsdp_train``'s peaks and losses, ``step_time``'s
ratios, ``comm_bench``'s fits, ``deepspeed_zero``'s bytes beside its FSDP2 twin); the generic
pieces (:class:`~handbook_lib.face.display.Table`, the checks table) are in
:mod:`handbook_lib.face.display`. Chapters 2, 3, 5 and 7 use them, and the command line after a run.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from handbook_lib.core.results import (
    Check,
    RunResult,
    max_relative_difference,
    model_state_bytes,
)
from handbook_lib.face.display import Table, format_bytes, format_losses
from handbook_lib.models.axes_table import AxisOption
from handbook_lib.models.collectives import AlphaBeta

__all__ = ["summarize_runs", "run_summary", "compare_runs", "step_time_table", "step_time_summary", "fit_table",
           "zero_vs_fsdp_table", "gathered_table", "knob_traffic_table",
           "checks_by_run", "axes_table"]


def summarize_runs(results: Mapping[str, RunResult]) -> Table:
    """One row per run: how its checks came out, over all ranks.

    Columns: the exact checks that hold, of all exact checks (byte for byte; the checks table
    shows any byte error); the worst relative errors of the activation (act.) and peak checks,
    with the peaks predicted and measured. The note under the table says so.
    """
    rows = []
    for label, result in results.items():
        exact = [c for c in result.checks if c.tolerance == 0]
        def worst(quantity: str, checks: list[Check] = result.checks) -> Check:
            return max((c for c in checks if c.quantity == quantity),
                       key=lambda c: abs(c.relative_error))
        act = worst("activation_bytes")
        row = [label, result.world_size, f"{sum(c.exact for c in exact)}/{len(exact)}",
               f"{100 * act.relative_error:+.2f}%"]
        if any(c.quantity == "peak_bytes" for c in result.checks):
            peak = worst("peak_bytes")
            row += [format_bytes(peak.predicted), format_bytes(peak.measured),
                    f"{100 * peak.relative_error:+.2f}%"]
        else:  # e.g. FSDP1: the peak is measured but not predicted
            row += ["-", format_bytes(max(result.metric("peak_bytes"))), "-"]
        rows.append(row)
    return Table(["run", "ranks", "exact\nchecks", "act.\nerror", "peak\npredicted", "peak\nmeasured",
                  "peak\nerror"], rows,
                 "exact checks: byte-exact predictions that hold / all of them; act. (activations) and "
                 "peak error: the worst over ranks of (measured - predicted) / predicted")

def run_summary(result: RunResult) -> str:
    """Two lines on a training run: rank 0's per-step losses (:func:`format_losses`, which repeat
    on any CPU) and how many of its checks passed."""
    losses = format_losses(result.metric("losses")[0])
    failed = result.failed_checks()
    text = f"losses: {losses}\n{len(result.checks)} checks, {len(failed)} failed"
    return text + "".join(f"\n  failed: {c.quantity} rank {c.rank}: predicted {c.predicted}, measured {c.measured}"
                          for c in failed)

def compare_runs(results: Mapping[str, RunResult], baseline: str) -> Table:
    """One row per training run: what each rank holds, its peak, and its losses against
    ``baseline``'s (one of the keys, e.g. the one-process run).

    Columns: ranks; model state per rank (parameter shards + gradients + optimizer state, the
    largest over ranks); peak per rank (the largest); both as a fraction of the baseline's;
    the max relative difference of the per-step losses (rank 0's, which all ranks share).
    Timing is left out on purpose (it varies run to run): see :func:`step_time_table`.
    """
    def state(result: RunResult) -> int:
        return max(model_state_bytes(r) for r in result.ranks)

    base = results[baseline]
    base_state, base_peak = state(base), max(base.metric("peak_bytes"))
    rows = []
    for label, result in results.items():
        peak = max(result.metric("peak_bytes"))
        diff = max_relative_difference(result.metric("losses")[0], base.metric("losses")[0])
        rows.append([label, result.world_size, format_bytes(state(result)),
                     f"{state(result) / base_state:.2f}", format_bytes(peak), f"{peak / base_peak:.2f}",
                     f"{diff:.1e}"])
    return Table(["run", "ranks", "model state\nper rank", "ratio", "peak\nper rank", "ratio ",
                  "loss\ndiff."], rows,
                 note=f"ratio: to the {baseline!r} run; loss diff.: the largest relative difference "
                      "of the per-step losses from the baseline's")

def step_time_table(result: RunResult) -> Table:
    """Rank 0's step times of a ``step_time`` run: per strategy, the median over repeats of the
    mean step time (seconds) and of its ratio to DDP, with the smallest and largest ratio."""
    ranks = sorted(result.ranks, key=lambda r: r["rank"])[0]
    rows = []
    for name in result.extra["variants"]:
        ratios = ranks["ratio_to_ddp"][name]
        rows.append([name, f"{statistics.median(ranks['step_time_s'][name]):.3f}",
                     f"{statistics.median(ratios):.2f}", f"{min(ratios):.2f} - {max(ratios):.2f}",
                     len(ratios)])
    return Table(["strategy", "step time (s, median)", "ratio to DDP (median)", "ratio range",
                  "repeats"], rows)

def step_time_summary(result: RunResult) -> str:
    """One line on a ``step_time`` run: each FSDP variant's median step-time ratio to DDP,
    e.g. ``"FSDP/DDP step time (median of 5 repeats): FULL_SHARD 1.32x, SHARD_GRAD_OP 1.18x"``."""
    rank0 = sorted(result.ranks, key=lambda r: r["rank"])[0]
    baseline, *names = result.extra["variants"]  # the baseline (DDP) first
    parts = [f"{n} {statistics.median(rank0['ratio_to_ddp'][n]):.2f}x" for n in names]
    repeats = len(rank0["ratio_to_ddp"][baseline])
    return f"FSDP/DDP step time (median of {repeats} repeats): " + ", ".join(parts)

def fit_table(result: RunResult) -> Table:
    """The alpha-beta fit of a ``comm_bench`` run, one row per collective: latency alpha
    (microseconds per ring step) and bandwidth beta (GB/s a rank sends), and the time the fit
    predicts for the largest buffer measured beside the measured time. A collective without a
    fit (noise left no growth with size) shows ``-``."""
    rows = []
    for kind, fit in result.extra["fits"].items():
        points = [m for m in result.extra["measurements"] if m["kind"] == kind]
        top = max(points, key=lambda m: m["buffer_bytes"])
        if fit is None:
            rows.append([kind, "-", "-", format_bytes(top["buffer_bytes"], binary=True), "-",
                         f"{top['seconds'] * 1e3:.3f}"])
            continue
        model = AlphaBeta(kind, result.world_size, fit["alpha_s"], fit["beta_bytes_per_s"])
        rows.append([kind, f"{fit['alpha_s'] * 1e6:.1f}", f"{fit['beta_bytes_per_s'] / 1e9:.3f}",
                     format_bytes(top["buffer_bytes"], binary=True),
                     f"{model.predict_s(top['buffer_bytes']) * 1e3:.3f}", f"{top['seconds'] * 1e3:.3f}"])
    return Table(["collective", "alpha (us)", "beta (GB/s)", "largest buffer", "fit (ms)",
                  "measured (ms)"], rows)

def zero_vs_fsdp_table(results: Mapping[str, RunResult], what: str = "bytes", rank: int = 0) -> Table:
    """One rank of each ``deepspeed_zero`` run, DeepSpeed's row above its FSDP2 twin's (both
    measured in the same job, on the same batches) and, for ZeRO-1, PyTorch's own ZeRO-1
    (DDP + ``ZeroRedundancyOptimizer``, in the bytes table).

    ``what="bytes"``: the bytes of parameters, fp32 master copy, gradients (after backward),
    optimizer state (moments and step counters), and their total. ``what="collectives"``: the
    last step's all-gathers, reduce-scatters and all-reduces (counts), and the bytes one rank
    sent in them (ring model).

    Raises:
        ValueError: for another ``what``.
    """
    if what not in ("bytes", "collectives"):
        raise ValueError(f"what must be 'bytes' or 'collectives', got {what!r}")
    kinds = ("all_gather", "reduce_scatter", "all_reduce")
    rows = []
    for label, result in results.items():
        r = result.ranks[rank]
        twin = r["fsdp2"]
        sides = [(label, [r["params_bytes"], r["master_bytes"], r["grads_bytes"],
                          r["optimizer_bytes"] + r["optimizer_step_bytes"]], r["collectives"]),
                 (f"  FSDP2 {twin['strategy']}", [twin["params"], 0, twin["grads"],
                                                  twin["optimizer"] + twin["optimizer_step"]], twin["collectives"])]
        if "torch_zero1" in r and what == "bytes":  # PyTorch's ZeRO-1, bytes only (its collectives uncounted)
            own = r["torch_zero1"]
            sides.append(("  DDP + ZeroRedundancyOpt.", [own["params"], 0, own["grads"],
                                                        own["optimizer"] + own["optimizer_step"]], {}))
        for who, values, calls in sides:
            if what == "bytes":
                rows.append([who, *values, sum(values)])
            else:
                rows.append([who, *(calls.get(k, {}).get("count", 0) for k in kinds),
                             sum(c["sent_bytes"] for c in calls.values())])
    if what == "bytes":
        return Table(["who", "params", "master", "grads", "optimizer", "total"], rows)
    return Table(["who", "all-gathers", "reduce-scatters", "all-reduces", "sent bytes"], rows)


def _short_unit(name: str) -> str:
    return name.replace("layers.", "L")


def gathered_table(results: Mapping[str, RunResult], rank: int = 0) -> Table:
    """Which FSDP2 units each run held gathered while each unit computed (forward, then
    backward), as ``fsdp_train``'s probe saw them on ``rank`` (runs with ``count_gathered`` or a
    tuning knob; chapter 5): ``root L0 L1`` is the root and layers 0 and 1. The last row is the
    peak of gathered bytes, measured, with the traffic model's prediction beside it."""
    seen = {label: r.ranks[rank]["gathered"] for label, r in results.items()}
    first = next(iter(seen.values()))
    rows = [[{"forward": "fwd", "backward": "bwd"}[s["phase"]], _short_unit(s["unit"]),
             *(" ".join(_short_unit(n) for n in seen[label][i]["gathered"]) for label in seen)]
            for i, s in enumerate(first)]
    peaks = []
    for label, r in results.items():
        measured = max(s["gathered_bytes"] for s in seen[label])
        predicted = max(s["gathered_bytes"] for s in r.ranks[rank].get("predicted_gathered", seen[label]))
        peaks.append(f"{format_bytes(measured)} ({format_bytes(predicted)})")
    rows.append(["peak", "", *peaks])
    return Table(["phase", "unit", *seen], rows,
                 note="units gathered (all-gather issued, not yet freed) while that unit computes; "
                      "peak: bytes gathered at once, measured (predicted)")


def knob_traffic_table(results: Mapping[str, RunResult], rank: int = 0) -> Table:
    """One row per run: its all-gathers and reduce-scatters counted on ``rank``, the bytes it
    sent by the ring model (measured, and the communication model's prediction from the run's
    ``sent_bytes`` check), and the bytes held between micro-steps (measured; prediction)."""
    rows = []
    for label, r in results.items():
        calls = r.ranks[rank]["collectives"]
        sent = next(c for c in r.checks if c.quantity == "sent_bytes" and c.rank == rank)
        held = next((c for c in r.checks if c.quantity == "held_between_micro_steps" and c.rank == rank), None)
        ags = [c for c in calls if c["kind"] == "all_gather"]
        groups = "/".join(str(g) for g in sorted({c["group_size"] for c in ags}, reverse=True))
        rows.append([label, f"{len(ags)} in {groups}", sum(c["kind"] == "reduce_scatter" for c in calls),
                     f"{format_bytes(sent.measured)} ({format_bytes(sent.predicted)})",
                     f"{format_bytes(held.measured)} ({format_bytes(held.predicted)})" if held else "-"])
    return Table(["run", "all-gathers", "RS", "sent (model)", "held (model)"], rows,
                 note="all-gathers: count, in groups of that many ranks; RS: reduce-scatters; sent: "
                      "bytes one rank sends in the step; held: bytes held between micro-steps")


def checks_by_run(results: Mapping[str, RunResult], quantities: tuple[str, ...]) -> Table:
    """The checks of ``quantities`` for several runs, one row per run and quantity: rank 0's
    prediction and measurement, and how many ranks' checks passed (``2/2``)."""
    rows = []
    for label, r in results.items():
        for q in quantities:
            mine = [c for c in r.checks if c.quantity == q]
            if not mine:
                continue
            first = next(c for c in mine if c.rank == 0)
            value = (lambda v: format_bytes(v)) if first.unit == "bytes" else (lambda v: f"{v:,}")
            rows.append([label, q.removesuffix("_bytes"), value(first.predicted), value(first.measured),
                         f"{sum(c.ok for c in mine)}/{len(mine)}"])
    return Table(["run", "quantity", "predicted", "measured", "ok"], rows,
                 note="predicted and measured on rank 0; ok: checks within tolerance / ranks")


def axes_table(rows: list[AxisOption], *, compact: bool = False) -> Table:
    """Chapter 9's layouts of one job beside each other (``models.axes_table.compare_axes``):
    memory reserved per GPU and its margin (``batch`` where the layout fits but its step takes
    more tokens than the recipe's batch), the step's communication in seconds (all of it, and
    what compute does not hide), compute seconds, step seconds, and tokens per second per GPU;
    beside a pipeline, its bubble's seconds in the place of all communication's (and, compact,
    of the exposed communication's too: the book's column is 86 characters).
    ``compact`` leaves out the communication and compute totals (the book's column)."""
    def margin(r: AxisOption) -> str:
        if not r.within_batch and r.fits:
            return "batch"
        fraction = r.margin_bytes / r.budget_bytes
        return f"{100 * fraction:+.1f} %" if abs(fraction) < 1 else f"{100 * fraction:+.0f} %"

    headers = ["layout", "reserved", "margin", "comm s", "exposed s", "comp s", "bubble s", "step s", "tok/s/GPU"]
    table = [[r.name, format_bytes(r.peak_reserved_bytes), margin(r), round(r.comm_s, 3),
              round(r.exposed_s, 3), round(r.compute_s, 3), round(r.bubble_s, 3), round(r.step_s, 3),
              f"{r.tokens_per_s_per_gpu:,.0f}"] for r in rows]
    piped = any(r.pp_size > 1 for r in rows)  # the bubble's column only beside a pipeline
    # a pipeline's bubble takes the all-communication column's place (what is not hidden stays)
    keep = [i for i, h in enumerate(headers) if not (compact and h in ("comm s", "comp s"))
            and (h != "bubble s" if not piped else h != "comm s" and not (compact and h == "exposed s"))]
    if piped:  # the pipeline's names are long: two headers lose their unit (seconds) to fit 100 columns
        headers = [{"exposed s": "exposed", "bubble s": "bubble"}.get(h, h) for h in headers]
    return Table([headers[i] for i in keep], [[row[i] for i in keep] for row in table])
