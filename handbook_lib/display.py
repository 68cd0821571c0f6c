"""Formatting for people: byte sizes and small tables that read well in a terminal and a book.

Chapter 1 introduces it. Everything else in the library works in plain numbers (bytes,
seconds); only this module turns them into text. A :class:`Table` shows as aligned text
(``repr``, which nbval compares) and as HTML in Jupyter and the rendered book.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from handbook_lib.results import Check, RunResult, max_relative_difference, model_state_bytes

__all__ = ["format_bytes", "format_loss", "format_losses", "format_bound", "LOSS_DECIMALS", "Table",
           "checks_table", "checks_verdict", "checks_legend", "format_tolerance", "ranks_table",
           "summarize_runs", "compare_runs", "step_time_table", "step_time_summary", "fit_table",
           "run_summary"]

_DECIMAL = [("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)]
_BINARY = [("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)]


def format_bytes(n: float, *, binary: bool = False, digits: int = 2) -> str:
    """A byte count in human units: ``format_bytes(39_474_240) == '39.47 MB'``.

    Args:
        n: Bytes.
        binary: Use powers of 1024 (MiB, GiB) instead of 1000 (MB, GB).
        digits: Decimals shown.
    """
    for unit, size in _BINARY if binary else _DECIMAL:
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{int(n)} B" if float(n).is_integer() else f"{n:.{digits}f} B"


LOSS_DECIMALS = 2
"""Decimals a loss is shown with wherever an output is stored and compared (the notebooks).

The last digits of a loss depend on the CPU's kernels: ATen's vector unit
(``ATEN_CPU_CAPABILITY``), oneDNN's ISA and MKL's code branch. Measured on one machine, the same
2-rank ``FULL_SHARD`` run (7,263,040 parameters, 6 steps) replayed with AVX-512, AVX2 and scalar
kernels gave losses near 9 that spread by up to 2e-6 in fp32, 5e-5 in fp16-mixed and 4e-4 in
bf16-mixed. A window of 2e-6 holds a rounding boundary for 2 % of fp32 losses at 4 decimals (they
then print differently on another CPU), for 0.02 % at 2 decimals. bf16's 4e-4 still holds one
for 4 % at 2 decimals: compared cells show bf16 losses only as a bound (:func:`format_bound`).
Show more digits only in outputs that are not compared (nbval-ignored cells)."""


def format_loss(x: float, decimals: int = LOSS_DECIMALS) -> str:
    """One loss, at a precision the cross-CPU spread cannot reach (see :data:`LOSS_DECIMALS`)."""
    return f"{x:.{decimals}f}"


def format_losses(losses: Iterable[float], decimals: int = LOSS_DECIMALS) -> str:
    """Per-step losses, space-separated, each as :func:`format_loss` shows it."""
    return " ".join(format_loss(x, decimals) for x in losses)


def format_bound(value: float, *, below: float | None = None, above: float | None = None) -> str:
    """A quantity that is only noise, shown as the bound it meets, not as its noise digits.

    ``format_bound(1.1e-07, below=1e-06) == "< 1e-06"``: the digits of a rounding difference
    change from CPU to CPU; the statement that it is below a bound does not.

    Args:
        value: The quantity (e.g. a max relative difference of losses).
        below: Show ``< below``; the value must be strictly smaller.
        above: Show ``> above``; the value must be strictly larger.

    Raises:
        ValueError: if not exactly one bound is given, or the value does not meet it (the
            stored output would then be a false statement).
    """
    if (below is None) == (above is None):
        raise ValueError("format_bound needs exactly one of below= or above=")
    if below is not None:
        if not value < below:
            raise ValueError(f"{value!r} is not below {below:.0e}")
        return f"< {below:.0e}"
    if not value > above:
        raise ValueError(f"{value!r} is not above {above:.0e}")
    return f"> {above:.0e}"


def _cell(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return str(value)


@dataclass(frozen=True)
class Table:
    """Rows under named columns; ints print with thousands separators, floats with 4 digits."""

    columns: Sequence[str]
    rows: Sequence[Sequence[Any]]

    def text(self) -> str:
        """The table as aligned plain text."""
        cells = [list(self.columns)] + [[_cell(v) for v in row] for row in self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.columns))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        pad = "padding:2px 12px;"
        head = "".join(f'<th style="{pad}text-align:right">{html.escape(c)}</th>' for c in self.columns)
        body = "".join(
            "<tr>" + "".join(
                f'<td style="{pad}text-align:{"right" if isinstance(v, (int, float)) else "left"}">'
                f"{html.escape(_cell(v))}</td>" for v in row) + "</tr>"
            for row in self.rows
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def format_tolerance(tolerance: float) -> str:
    """A check's tolerance in words: ``"exact"`` for 0, else the relative error allowed,
    e.g. ``"±10%"`` for 0.1 and ``"±0.001%"`` for 1e-5."""
    return "exact" if tolerance == 0 else f"±{tolerance * 100:.3g}%"


def checks_table(checks: RunResult | Iterable[Check]) -> Table:
    """Predictions beside measurements: one row per check.

    Columns: quantity; rank (``all`` for a quantity of the whole job); predicted and measured;
    error (measured - predicted, in the check's unit); unit; tolerance (``exact``, or the
    relative error allowed, e.g. ``±10%``); ok (``yes`` within the tolerance, ``NO`` outside).
    """
    items = checks.checks if isinstance(checks, RunResult) else list(checks)
    return Table(
        ["quantity", "rank", "predicted", "measured", "error", "unit", "tolerance", "ok"],
        [[c.quantity, "all" if c.rank is None else c.rank, c.predicted, c.measured, c.error, c.unit,
          format_tolerance(c.tolerance), "yes" if c.ok else "NO"] for c in items],
    )


def checks_verdict(checks: RunResult | Iterable[Check]) -> str:
    """One line under a checks table, e.g. ``"26 checks: 26 within tolerance"`` or
    ``"26 checks: 24 within tolerance, 2 outside (ok = NO)"``."""
    items = checks.checks if isinstance(checks, RunResult) else list(checks)
    bad = sum(not c.ok for c in items)
    return (f"{len(items)} checks: {len(items) - bad} within tolerance"
            + (f", {bad} outside (ok = NO)" if bad else ""))


_UNIT_WORDS = {
    "nats": "nats = loss in natural-log units (cross-entropy)",
    "units": "units = FSDP units (groups of parameters gathered together)",
    "collectives": "collectives = calls of all-gather, reduce-scatter, all-reduce",
}


def checks_legend(checks: RunResult | Iterable[Check]) -> str:
    """A legend line for the jargon of a checks table: the units it uses that are not plain
    (``nats``, ``units``, ``collectives``); ``""`` if there are none."""
    items = checks.checks if isinstance(checks, RunResult) else list(checks)
    used = sorted({c.unit for c in items} & set(_UNIT_WORDS))
    return "; ".join(_UNIT_WORDS[u] for u in used)


def ranks_table(result: RunResult, keys: Sequence[str]) -> Table:
    """One row per rank with the chosen per-rank metrics."""
    rows = sorted(result.ranks, key=lambda r: r["rank"])
    return Table(["rank", *keys], [[r["rank"], *(r[k] for k in keys)] for r in rows])


def summarize_runs(results: Mapping[str, RunResult]) -> Table:
    """One row per run: how its checks came out, over all ranks.

    Columns: the exact checks and the largest byte error among them (0 when the model is exact),
    and the worst relative errors of the activation and peak checks (percent), with the peaks.
    """
    rows = []
    for label, result in results.items():
        exact = [c for c in result.checks if c.tolerance == 0]
        def worst(quantity: str) -> Check:
            return max((c for c in result.checks if c.quantity == quantity),
                       key=lambda c: abs(c.relative_error))
        act = worst("activation_bytes")
        row = [label, result.world_size, len(exact), max(abs(c.error) for c in exact),
               f"{100 * act.relative_error:+.2f} %"]
        if any(c.quantity == "peak_bytes" for c in result.checks):
            peak = worst("peak_bytes")
            row += [format_bytes(peak.predicted), format_bytes(peak.measured),
                    f"{100 * peak.relative_error:+.2f} %"]
        else:  # e.g. FSDP1: the peak is measured but not predicted
            row += ["-", format_bytes(max(result.metric("peak_bytes"))), "-"]
        rows.append(row)
    return Table(["run", "ranks", "exact checks", "max byte error", "activations error",
                  "peak predicted", "peak measured", "peak error"], rows)


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
    return Table(["run", "ranks", "model state / rank", f"vs {baseline}", "peak / rank",
                  f"vs {baseline} ", "max loss difference"], rows)


def step_time_table(result: RunResult) -> Table:
    """Rank 0's step times of a ``step_time`` run: per strategy, the median over repeats of the
    mean step time (seconds) and of its ratio to DDP, with the smallest and largest ratio."""
    import statistics

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
    import statistics

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
    from handbook_lib.comm import AlphaBeta

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
    measured in the same job, on the same batches).

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
        sides = ((label, [r["params_bytes"], r["master_bytes"], r["grads_bytes"],
                          r["optimizer_bytes"] + r["optimizer_step_bytes"]], r["collectives"]),
                 (f"  FSDP2 {twin['strategy']}", [twin["params"], 0, twin["grads"],
                                                  twin["optimizer"] + twin["optimizer_step"]], twin["collectives"]))
        for who, values, calls in sides:
            if what == "bytes":
                rows.append([who, *values, sum(values)])
            else:
                rows.append([who, *(calls.get(k, {}).get("count", 0) for k in kinds),
                             sum(c["sent_bytes"] for c in calls.values())])
    if what == "bytes":
        return Table(["who", "params", "master", "grads", "optimizer", "total"], rows)
    return Table(["who", "all-gathers", "reduce-scatters", "all-reduces", "sent bytes"], rows)
