"""Formatting for people: byte sizes and small tables that read well in a terminal and a book.

Chapter 1 introduces it. Everything else in the library works in plain numbers (bytes,
seconds); only this module turns them into text. A :class:`Table` shows as aligned text
(``repr``, which nbval compares) and as HTML in Jupyter and the rendered book. Every shown line
fits :data:`WIDTH` (86) characters, the book's code column: text too long for a table column is
shown as :func:`definitions`; an exception as :func:`show_exception`; library code, in a notebook,
with :func:`show_source`; a run, as one :class:`RunReport` line with its log folded under it.
"""

from __future__ import annotations

import html
import inspect
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from handbook_lib.results import Check, RunResult, max_relative_difference, model_state_bytes

__all__ = ["format_bytes", "format_loss", "format_losses", "format_bound", "LOSS_DECIMALS", "Table",
           "checks_table", "checks_verdict", "checks_legend", "format_tolerance", "ranks_table",
           "summarize_runs", "compare_runs", "step_time_table", "step_time_summary", "fit_table",
           "run_summary", "WIDTH", "Definitions", "definitions", "ErrorText", "show_exception", "SourceCode",
           "show_source", "RunReport", "describe_run"]

WIDTH = 86
"""Characters of output a line may take: the rendered book's code column holds about 88."""

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
    """Rows under named columns; ints print with thousands separators, floats with 4 digits.

    A column name may hold ``"\n"``: the header then takes several lines (bottom-aligned), which
    keeps a column as narrow as its values. ``note`` is a legend printed under the table
    (wrapped at :data:`WIDTH`), e.g. to explain a shortened header.
    """

    columns: Sequence[str]
    rows: Sequence[Sequence[Any]]
    note: str = ""

    def text(self) -> str:
        """The table as aligned plain text."""
        heads = [c.split("\n") for c in self.columns]
        depth = max((len(h) for h in heads), default=1)
        heads = [[""] * (depth - len(h)) + h for h in heads]
        body = [[_cell(v) for v in row] for row in self.rows]
        widths = [max(len(x) for x in [*heads[i], *(r[i] for r in body)]) for i in range(len(self.columns))]
        lines = ["  ".join(h[k].rjust(w) for h, w in zip(heads, widths)) for k in range(depth)]
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in body]
        if self.note:
            lines += textwrap.wrap(self.note, WIDTH, break_on_hyphens=False)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        pad = "padding:2px 12px;"
        head = "".join(f'<th style="{pad}text-align:right">{html.escape(c).replace(chr(10), "<br>")}</th>'
                       for c in self.columns)
        body = "".join(
            "<tr>" + "".join(
                f'<td style="{pad}text-align:{"right" if isinstance(v, (int, float)) else "left"}">'
                f"{html.escape(_cell(v))}</td>" for v in row) + "</tr>"
            for row in self.rows
        )
        note = f'<p style="font-size:90%">{html.escape(self.note)}</p>' if self.note else ""
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{note}"


def _stack(words: str, width: int = 0) -> str:
    """A header of several words stacked to stay narrow (``width``, at least its longest word):
    ``"optimizer state"`` -> ``"optimizer\nstate"``."""
    return "\n".join(textwrap.wrap(words, max(width, *(len(w) for w in words.split())), break_on_hyphens=False))


def format_tolerance(tolerance: float) -> str:
    """A check's tolerance in words: ``"exact"`` for 0, else the relative error allowed,
    e.g. ``"±10%"`` for 0.1 and ``"±0.001%"`` for 1e-5."""
    return "exact" if tolerance == 0 else f"±{tolerance * 100:.3g}%"


_UNIT_SHORT = {"collectives": "calls"}
"""Units shown shorter in a checks table (the legend, :func:`checks_legend`, says what they mean)."""


def checks_table(checks: RunResult | Iterable[Check]) -> Table:
    """Predictions beside measurements: one row per check.

    Columns: quantity (its ``_bytes`` suffix dropped when the unit says bytes); rank (``all``
    for a quantity of the whole job); predicted and measured; error (measured - predicted, in
    the check's unit); unit (``calls`` for collectives); tolerance (``exact``, or the relative
    error allowed, e.g. ``±10%``); ok (``yes`` within the tolerance, ``NO`` outside). Fits
    :data:`WIDTH` columns for the book's runs.
    """
    items = checks.checks if isinstance(checks, RunResult) else list(checks)

    def name(c: Check) -> str:
        return c.quantity.removesuffix("_bytes") if c.unit == "bytes" and c.quantity != "bytes" else c.quantity

    return Table(
        ["quantity", "rank", "predicted", "measured", "error", "unit", "tolerance", "ok"],
        [[name(c), "all" if c.rank is None else c.rank, c.predicted, c.measured, c.error,
          _UNIT_SHORT.get(c.unit, c.unit), format_tolerance(c.tolerance), "yes" if c.ok else "NO"]
         for c in items],
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
    "collectives": "calls = collectives called: all-gathers, reduce-scatters, all-reduces",
}


def checks_legend(checks: RunResult | Iterable[Check]) -> str:
    """A legend line for the jargon of a checks table: the units it uses that are not plain
    (``nats``, ``units``, ``collectives``); ``""`` if there are none."""
    items = checks.checks if isinstance(checks, RunResult) else list(checks)
    used = sorted({c.unit for c in items} & set(_UNIT_WORDS))
    return "; ".join(_UNIT_WORDS[u] for u in used)


def ranks_table(result: RunResult, keys: Sequence[str]) -> Table:
    """One row per rank with the chosen per-rank metrics.

    Headers are the metric names with ``_`` as spaces, stacked on lines to stay narrow; a
    ``_bytes`` suffix is dropped and said once in the note under the table.
    """
    rows = sorted(result.ranks, key=lambda r: r["rank"])
    heads = [_stack(k.removesuffix("_bytes").replace("_", " ")) for k in keys]
    in_bytes = [k.removesuffix("_bytes").replace("_", " ") for k in keys if k.endswith("_bytes")]
    note = ""
    if in_bytes:
        note = ("all in bytes" if len(in_bytes) == len(keys) else "in bytes: " + ", ".join(in_bytes)) \
            + " (metric names without _bytes)"
    return Table(["rank", *heads], [[r["rank"], *(r[k] for k in keys)] for r in rows], note)


def summarize_runs(results: Mapping[str, RunResult]) -> Table:
    """One row per run: how its checks came out, over all ranks.

    Columns: the exact checks that hold, of all exact checks (byte for byte; the checks table
    shows any byte error); the worst relative errors of the activation (act.) and peak checks,
    with the peaks predicted and measured. The note under the table says so.
    """
    rows = []
    for label, result in results.items():
        exact = [c for c in result.checks if c.tolerance == 0]
        def worst(quantity: str) -> Check:
            return max((c for c in result.checks if c.quantity == quantity),
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
                      "of the per-step losses from its")


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


def _wrapped(text: str, indent: str = "  ") -> str:
    """``text`` wrapped at :data:`WIDTH`, continuation lines indented."""
    return textwrap.fill(text, WIDTH, subsequent_indent=indent, break_long_words=True, break_on_hyphens=False)


@dataclass(frozen=True)
class Definitions:
    """Named entries with long text, shown as a list rather than a table too wide to read.

    Text: each name on its line, then each field as ``  field: text``, wrapped at
    :data:`WIDTH`; HTML: a definition list. A field named ``""`` shows its text alone.
    """

    entries: Sequence[tuple[str, Sequence[tuple[str, str]]]]

    def text(self) -> str:
        lines: list[str] = []
        for name, fields in self.entries:
            lines.append(name)
            for label, value in fields:
                lines.append(textwrap.fill(f"{label}: {value}" if label else value, WIDTH, initial_indent="  ",
                                           subsequent_indent="    ", break_on_hyphens=False))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        items = "".join(
            f"<dt><code>{html.escape(name)}</code></dt>" + "".join(
                f"<dd>{f'<em>{html.escape(label)}</em>: ' if label else ''}{html.escape(value)}</dd>"
                for label, value in fields)
            for name, fields in self.entries)
        return f"<dl>{items}</dl>"


def definitions(items: Mapping[str, str | Mapping[str, str] | Sequence[str]],
                fields: Sequence[str] = ()) -> Definitions:
    """:class:`Definitions` from a mapping: name -> text, name -> {field: text}, or name -> a
    sequence of texts named by ``fields`` (e.g. the rows of a wide table, its headers as
    ``fields``).

    Raises:
        ValueError: if a sequence does not have one text per name in ``fields``.
    """
    entries = []
    for name, value in items.items():
        if isinstance(value, str):
            pairs = [("", value)]
        elif isinstance(value, Mapping):
            pairs = [(str(k), str(v)) for k, v in value.items()]
        else:
            if len(value) != len(fields):
                raise ValueError(f"fields must name each of the {len(value)} texts of {name!r}, got {list(fields)}")
            pairs = [(f, str(v)) for f, v in zip(fields, value)]
        entries.append((str(name), pairs))
    return Definitions(entries)


@dataclass(frozen=True)
class ErrorText:
    """An exception for a reader: ``Type: message`` wrapped at :data:`WIDTH` (text and HTML),
    any further lines of the message (a traceback) folded away in HTML only."""

    line: str
    rest: str = ""

    def __repr__(self) -> str:
        return self.line

    def _repr_html_(self) -> str:
        more = (f"<details><summary>{len(self.rest.splitlines())} more lines</summary>"
                f"<pre>{html.escape(self.rest)}</pre></details>") if self.rest else ""
        return f"<pre>{html.escape(self.line)}</pre>{more}"


def show_exception(err: BaseException, replace: Mapping[str, str] | None = None) -> ErrorText:
    """``err`` as ``Type: message`` (the message's first line) wrapped at :data:`WIDTH`.

    Args:
        err: The exception.
        replace: Text to replace in the message first, e.g. ``{str(root): "<root>"}`` for a
            temporary path that would change from run to run.
    """
    message = str(err)
    for old, new in (replace or {}).items():
        message = message.replace(old, new)
    first, _, rest = message.partition("\n")
    return ErrorText(_wrapped(f"{type(err).__name__}: {first}".rstrip(": ")), rest.strip("\n"))


@dataclass(frozen=True)
class SourceCode:
    """Python source: highlighted in HTML (Pygments when installed) as written; in plain text,
    a line longer than :data:`WIDTH` continues on the next, indented 4 more (display only)."""

    source: str

    def __repr__(self) -> str:
        return "\n".join(_fold_code(line) for line in self.source.rstrip("\n").splitlines())

    def _repr_html_(self) -> str:
        try:
            from pygments import highlight
            from pygments.formatters import HtmlFormatter
            from pygments.lexers import PythonLexer
        except ImportError:  # pragma: no cover - Pygments comes with IPython
            return f"<pre>{html.escape(self.source)}</pre>"
        return highlight(self.source, PythonLexer(), HtmlFormatter(noclasses=True, nobackground=True))


def _fold_code(line: str) -> str:
    """A line of code cut into pieces of at most :data:`WIDTH` characters, at spaces where it can."""
    indent = " " * (len(line) - len(line.lstrip()) + 4)
    pieces = []
    while len(line) > WIDTH:
        cut = line.rfind(" ", len(indent), WIDTH)
        cut = cut if cut > len(indent) else WIDTH
        pieces.append(line[:cut].rstrip())
        line = indent + line[cut:].lstrip()
    return "\n".join([*pieces, line])


def show_source(obj: Any) -> SourceCode:
    """The source of a function, class or module (``inspect.getsource``), to show library code
    in a notebook: highlighted in JupyterLab and the book, plain in text outputs.

    Raises:
        ValueError: if ``obj`` has no Python source (a builtin, or code typed at a prompt).
    """
    try:
        return SourceCode(textwrap.dedent(inspect.getsource(obj)))
    except (TypeError, OSError) as err:
        raise ValueError(f"show_source needs a function, class or module defined in a file, got {obj!r}: "
                         f"{err}") from None


@dataclass(frozen=True)
class RunReport:
    """What a notebook shows for one run: one line that repeats on any machine (text/plain),
    and, in HTML only, the full run log (every rank's output) folded under it.

    Attributes:
        line: What ran and how it ended (:func:`describe_run`): no timings, paths or PIDs.
        log: The ranks' output lines, ``[rankR]``-prefixed.
        detail: Shown only beside the folded log (wall time, where the result is).
    """

    line: str
    log: tuple[str, ...] = ()
    detail: str = ""

    def __repr__(self) -> str:
        return self.line

    def _repr_html_(self) -> str:
        n = len(self.log)
        summary = f"run log: {n} line{'s' * (n != 1)}" + (f"; {self.detail}" if self.detail else "")
        return (f'<pre style="margin-bottom:0">{html.escape(self.line)}</pre>'
                f"<details><summary>{html.escape(summary)}</summary>"
                f'<pre style="font-size:85%">{html.escape(chr(10).join(self.log))}</pre></details>')


_QUIET_KEYS = frozenset({"vocab_size", "d_model", "nhead", "dim_feedforward", "num_layers", "batch_size",
                         "seq_len", "steps", "seed", "strategy", "api", "shard_group_size"})
"""Config keys :func:`describe_run` does not list as changes (the model's shape, the data, and
the keys it already shows)."""


def describe_run(run: str, nproc: int, config: Mapping[str, Any], defaults: Mapping[str, Any] | None = None,
                 result: RunResult | None = None, outcome: str = "", nnodes: int = 1) -> str:
    """One line on a run, the same on any machine: its name, ranks (with backend and device once
    known), steps, strategy, the config keys changed from ``defaults`` (not the model's shape,
    and no paths), and how it ended: its checks, or ``outcome`` (e.g. ``"running"``,
    ``"failed: rank 1"``). Wrapped at :data:`WIDTH`.

    ``describe_run("fsdp_train", 2, cfg, defaults, result)`` ->
    ``"fsdp_train on 2 ranks (gloo, cpu), 5 steps, FULL_SHARD: 26/26 checks passed"``; over
    several nodes (``nnodes``, ``nproc`` per node), ``"fsdp_train on 2 nodes x 2 ranks ..."``.
    """
    where = f"{run} on {nproc} rank{'s' * (nproc != 1)}"
    if nnodes > 1:  # nproc per node
        where = f"{run} on {nnodes} nodes x {nproc} rank{'s' * (nproc != 1)}"
    if result is not None:
        where += f" ({result.backend}, {result.device})"
    head = [where]
    if "steps" in config:
        head.append(f"{config['steps']} step{'s' * (config['steps'] != 1)}")
    what = []
    if config.get("strategy"):
        strategy = str(config["strategy"])
        if config.get("api") == "fsdp1":
            strategy = f"FSDP1 {strategy}"
        if config.get("shard_group_size"):
            strategy += f" (groups of {config['shard_group_size']})"
        what.append(strategy)
    for key, value in config.items():
        if key in _QUIET_KEYS or defaults is None or key not in defaults or value == defaults[key]:
            continue
        if isinstance(value, str) and "/" in value:
            continue  # a path: it changes from machine to machine
        what.append(f"{key}={value}")
    if what:
        head.append(" ".join(what))
    if result is not None and not outcome:
        failed = len(result.failed_checks())
        n = len(result.checks)
        outcome = ("no checks" if n == 0 else f"{n}/{n} checks passed" if not failed
                   else f"{failed} of {n} checks FAILED")
    return _wrapped(", ".join(head) + (f": {outcome}" if outcome else ""))
