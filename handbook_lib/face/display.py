"""Formatting for people: byte sizes and small tables that read well in a terminal and a book.

Chapter 1 introduces it. Everything else in the library works in plain numbers (bytes,
seconds); only this module turns them into text. A :class:`Table` shows as aligned text
(``repr``, which nbval compares) and as HTML in Jupyter and the rendered book. Every shown line
fits :data:`BOOK_WIDTH` (86) characters, the book's code column: text too long for a table column is
shown as :func:`definitions`; an exception as :func:`show_exception`; library code, in a notebook,
with :func:`show_source`; a run, as one :class:`~handbook_lib.launch.show.RunReport` line with its log folded under it.
"""

from __future__ import annotations

import html
import inspect
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from handbook_lib.core.results import Check, RunResult
from handbook_lib.core.text import BOOK_WIDTH, wrap

__all__ = ["format_bytes", "format_loss", "format_losses", "format_bound", "LOSS_DECIMALS", "Table", "checks_table",
           "checks_summary", "checks_halves", "checks_bound", "checks_verdict", "checks_legend", "format_tolerance",
           "ranks_table", "Definitions", "definitions", "ErrorText", "show_exception", "SourceCode", "show_source"]

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
    assert above is not None  # exactly one of the two, checked above
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
    (wrapped at :data:`BOOK_WIDTH`), e.g. to explain a shortened header.
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
            lines += textwrap.wrap(self.note, BOOK_WIDTH, break_on_hyphens=False)
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
    :data:`BOOK_WIDTH` columns for the book's runs.
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


def checks_summary(checks: RunResult | Iterable[Check], *, only: tuple[str, ...] = (),
                   leave_out: tuple[str, ...] = ()) -> Table:
    """Predictions beside measurements: one row per quantity, with how many ranks agree.

    The ranks of a run usually measure the same thing (each holds an equal shard, counts the
    same collectives): :func:`checks_table` then repeats one block per rank. Here the checks
    that share a quantity, a prediction, a measurement and a verdict make one row, whose
    ``ranks`` column says how many ranks it stands for: ``2/2`` when every rank of a
    :class:`~handbook_lib.core.results.RunResult` agrees, ``3/4`` and ``1/4`` on two rows when
    one rank differs, ``all`` for a quantity of the whole job (a check with no rank). Rows keep
    the order in which their quantity first appears. The other columns are those of
    :func:`checks_table`. ``only`` keeps the quantities that begin with one of its prefixes,
    ``leave_out`` drops those that do (a chapter shows a check's noise digits as a bound, with
    :func:`checks_bound`, rather than in the table).
    """
    items = checks.checks if isinstance(checks, RunResult) else list(checks)
    world = checks.world_size if isinstance(checks, RunResult) else None
    items = [c for c in items if (not only or c.quantity.startswith(only))
             and not (leave_out and c.quantity.startswith(leave_out))]
    groups: dict[tuple[Any, ...], list[Check]] = {}
    order: dict[str, int] = {}
    for c in items:
        order.setdefault(c.quantity, len(order))
        key = (c.quantity, c.rank is None, c.predicted, c.measured, c.unit, c.tolerance, c.ok)
        groups.setdefault(key, []).append(c)

    def ranks(group: list[Check]) -> str:
        if group[0].rank is None:
            return "all"
        n = len({c.rank for c in group})
        return f"{n}/{world}" if world else str(n)

    keys = sorted(groups, key=lambda k: order[k[0]])
    table = checks_table([groups[k][0] for k in keys])
    rows = [[row[0], ranks(groups[k]), *row[2:]] for row, k in zip(table.rows, keys)]
    return Table(["quantity", "ranks", *table.columns[2:]], rows, table.note)


def checks_halves(checks: RunResult | Iterable[Check], halves: tuple[str, ...] = ("broken", "fixed")) -> Table:
    """A run's checks named ``half.quantity`` (the clinic's ``broken.units``, ``fixed.units``),
    one row per quantity (its ``_bytes`` suffix dropped, as :func:`checks_table` does) and a
    column per half, each ``model / run``; where a half's ranks
    measure different values, each pair once, in rank order, joined by ``;``. Rows keep the
    order in which their quantity first appears; a job-wide check (no rank: the clinic's
    ``broken.symptom`` and ``fixed.symptom``) has no row, the same in every case. The note says
    how many checks passed, those included, and their tolerance (``exact`` when every one is
    0), or which failed."""
    items = checks.checks if isinstance(checks, RunResult) else list(checks)
    pairs: dict[str, dict[str, list[str]]] = {}
    units: dict[str, str] = {}
    for c in items:
        half, _, quantity = c.quantity.partition(".")
        quantity = quantity.removesuffix("_bytes") if c.unit == "bytes" else quantity
        if half in halves and c.rank is not None:
            said = pairs.setdefault(quantity, {}).setdefault(half, [])
            pair = f"{_cell(c.predicted)} / {_cell(c.measured)}"
            said.extend([pair] if pair not in said else [])
            units.setdefault(quantity, _UNIT_SHORT.get(c.unit, c.unit))
    rows = [[q, *("; ".join(by.get(h, ["-"])) for h in halves), units[q]] for q, by in pairs.items()]
    failed, exact = sorted({c.quantity for c in items if not c.ok}), all(c.tolerance == 0 for c in items)
    note = (f"model / run; {len(items)} checks, every one within its tolerance{' (all exact)' * exact}"
            if not failed else f"model / run; outside their tolerance: {', '.join(failed)}")
    return Table(["quantity", *halves, "unit"], rows, note)


def checks_bound(checks: RunResult | Iterable[Check], prefixes: tuple[str, ...], *, below: float) -> str:
    """The largest relative error of the checks whose quantity begins with one of ``prefixes``,
    as the bound it meets (:func:`format_bound`): e.g. ``"< 1e-05"`` for fp32 losses against one
    process, whose digits change from CPU to CPU.

    Raises:
        ValueError: if no check matches, or the largest error does not meet the bound.
    """
    items = checks.checks if isinstance(checks, RunResult) else list(checks)
    errors = [abs(c.relative_error) for c in items if c.quantity.startswith(prefixes)]
    if not errors:
        raise ValueError(f"no check's quantity begins with {', '.join(prefixes)}")
    return format_bound(max(errors), below=below)


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


@dataclass(frozen=True)
class Definitions:
    """Named entries with long text, shown as a list rather than a table too wide to read.

    Text: each name on its line, then each field as ``  field: text``, wrapped at
    :data:`BOOK_WIDTH`; HTML: a definition list. A field named ``""`` shows its text alone.
    """

    entries: Sequence[tuple[str, Sequence[tuple[str, str]]]]

    def text(self) -> str:
        lines: list[str] = []
        for name, fields in self.entries:
            lines.append(name)
            for label, value in fields:
                lines.append(textwrap.fill(f"{label}: {value}" if label else value, BOOK_WIDTH, initial_indent="  ",
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
    """An exception for a reader: ``Type: message`` wrapped at :data:`BOOK_WIDTH` (text and HTML),
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
    """``err`` as ``Type: message`` (the message's first line) wrapped at :data:`BOOK_WIDTH`.

    Args:
        err: The exception.
        replace: Text to replace in the message first, e.g. ``{str(root): "<root>"}`` for a
            temporary path that would change from run to run.
    """
    message = str(err)
    for old, new in (replace or {}).items():
        message = message.replace(old, new)
    first, _, rest = message.partition("\n")
    return ErrorText(wrap(f"{type(err).__name__}: {first}".rstrip(": ")), rest.strip("\n"))


@dataclass(frozen=True)
class SourceCode:
    """Python source: highlighted in HTML (Pygments when installed) as written; in plain text,
    a line longer than :data:`BOOK_WIDTH` continues on the next, indented 4 more (display only)."""

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
    """A line of code cut into pieces of at most :data:`BOOK_WIDTH` characters, at spaces where it can."""
    indent = " " * (len(line) - len(line.lstrip()) + 4)
    pieces = []
    while len(line) > BOOK_WIDTH:
        cut = line.rfind(" ", len(indent), BOOK_WIDTH)
        cut = cut if cut > len(indent) else BOOK_WIDTH
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




COLLECTIVE_QUANTITIES = ("fsdp_unit_count", "all_gather_", "reduce_scatter_", "all_reduce_",
                         "sent_bytes")
"""How the quantities of a run's collective checks begin (:func:`collective_checks`)."""


def collective_checks(checks: RunResult | Iterable[Check], *, rank: int | None = None) -> list[Check]:
    """The checks of a run that count its collectives: FSDP units, every kind's count and
    buffer bytes, and the bytes each rank sends (quantities beginning with one of
    :data:`COLLECTIVE_QUANTITIES`), not its memory or its loss; only ``rank``'s when given."""
    items = checks.checks if isinstance(checks, RunResult) else list(checks)
    return [c for c in items if c.quantity.startswith(COLLECTIVE_QUANTITIES)
            and (rank is None or c.rank == rank)]
