"""The published throughputs beside the compute model, summarised for the book: a table by
source and GPU, a table by sequence length, and a figure of every row's error.

:func:`~handbook_lib.models.published.throughput_rows` gives some two hundred rows, too many to
print; these views say what they show (the median error of each group, the spread) and draw the
rest. Errors are the model's tokens per second over the published, minus one.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from matplotlib.figure import Figure

from handbook_lib.face.display import Table
from handbook_lib.models.published import ThroughputRow

__all__ = ["throughput_summary_table", "throughput_by_length_table", "plot_throughput_errors", "source_name"]

_GPU = {"a100-40gb": "A100 40GB", "a100-80gb": "A100 80GB", "h100-80gb": "H100"}


def source_name(source: str) -> str:
    """A short name for a row's source: its first words up to the first comma or colon."""
    for who in ("MosaicML", "torchtitan", "IBM", "Llama 3"):
        if who in source:
            return {"Llama 3": "Meta (Llama 3)", "IBM": "PyTorch and IBM"}.get(who, who)
    return source.split(",")[0].split(":")[0]


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _groups(rows: Sequence[ThroughputRow], key: Callable[[ThroughputRow], Any]) -> dict[Any, list[ThroughputRow]]:
    out: dict[Any, list[ThroughputRow]] = {}
    for r in rows:
        out.setdefault(key(r), []).append(r)
    return out


def _summary(label: list[Any], rows: list[ThroughputRow]) -> list[Any]:
    counted = [r for r in rows if not r.published.calibration]
    errors = [r.error for r in counted]
    if not errors:
        return [*label, 0, len(rows), "-", "-", "-"]
    return [*label, len(counted), len(rows) - len(counted), f"{100 * statistics.median(map(abs, errors)):.1f}%",
            _pct(statistics.median(errors)), _pct(max(errors, key=abs))]


def throughput_summary_table(rows: Sequence[ThroughputRow]) -> Table:
    """One line per source and GPU, then per GPU and overall: rows counted, calibration rows
    (shown, not counted), the median |error|, the median signed error and the largest miss."""
    lines = [_summary([source, _GPU[gpu]], group) for (source, gpu), group in
             sorted(_groups(rows, lambda r: (source_name(r.published.source), r.published.gpu)).items())]
    lines += [_summary(["every source", _GPU[gpu]], group)
              for gpu, group in sorted(_groups(rows, lambda r: r.published.gpu).items())]
    lines.append(_summary(["every source", "every GPU"], list(rows)))
    return Table(["source", "GPU", "rows", "calib.", "median\n|error|", "median\nerror", "largest\nmiss"], lines,
                 "error: the model's tokens/s per GPU over the published, minus one; calib.: rows the "
                 "utilization was fitted on, shown in the figure and not counted")


def throughput_by_length_table(rows: Sequence[ThroughputRow]) -> Table:
    """The rows not calibrated on, by sequence length and checkpointing: how many, and the
    median error (signed): where attention's FLOPs or the recomputation would show a trend."""
    counted = [r for r in rows if not r.published.calibration]
    lines = []
    for seq, group in sorted(_groups(counted, lambda r: r.published.seq_len).items()):
        by_ac = _groups(group, lambda r: r.published.activation_checkpointing)
        cells = []
        for ac in (False, True):
            errs = [r.error for r in by_ac.get(ac, [])]
            cells += [len(errs), _pct(statistics.median(errs)) if errs else "-"]
        lines.append([f"{seq:,}", *cells])
    return Table(["sequence\n(tokens)", "rows\nno AC", "median\nerror", "rows\nAC", "median\nerror"], lines,
                 "AC: activation checkpointing (the model adds the recomputed forward); rows not "
                 "calibrated on only")


def plot_throughput_errors(rows: Sequence[ThroughputRow]) -> Figure:
    """Every row's error against its sequence length (log scale), one colour per GPU, hollow
    markers for the calibration rows, crosses for the sources other than the largest."""
    colours = {"a100-40gb": "tab:blue", "a100-80gb": "tab:green", "h100-80gb": "tab:red"}
    fig = Figure(figsize=(7.2, 3.8), layout="constrained")
    ax = fig.add_subplot()
    largest = max(_groups(rows, lambda r: r.published.source).items(), key=lambda kv: len(kv[1]))[0]
    for gpu, colour in colours.items():
        for calibration in (False, True):
            picked = [r for r in rows if r.published.gpu == gpu and r.published.calibration == calibration]
            main = [r for r in picked if r.published.source == largest]
            other = [r for r in picked if r.published.source != largest]
            label = f"{_GPU[gpu]}" + (" (calibration)" if calibration else "")
            ax.scatter([r.published.seq_len for r in main], [100 * r.error for r in main], s=16,
                       facecolors="none" if calibration else colour, edgecolors=colour, label=label)
            if other:
                ax.scatter([r.published.seq_len for r in other], [100 * r.error for r in other], s=40,
                           marker="x", color=colour)
    ax.axhline(0, color="black", linewidth=0.8)
    for edge in (-15, 15):
        ax.axhline(edge, color="gray", linewidth=0.6, linestyle=":")
    ax.set_xscale("log", base=2)
    lengths = sorted({r.published.seq_len for r in rows})
    ax.set_xticks(lengths, [f"{s // 1024}k" if s >= 1024 else str(s) for s in lengths])
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("model over published - 1 (%)")
    ax.set_title(f"Every published throughput against the compute model ({source_name(largest)}: dots; "
                 "others: crosses)", fontsize=9)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, ncols=3, loc="outside lower center")
    return fig
