"""A clinic case's broken and fixed lines, read from the case's own source, as a diff.

Each case of chapter 10 is one function that runs the user's code twice, broken then fixed
(:mod:`handbook_lib.runs.clinic`). The lines that make the difference carry a marker comment:

- ``# clinic: broken`` or ``# clinic: fixed``: a statement only that half runs, shown as written;
- ``# clinic: both``: a statement inside the ``for broken in (True, False)`` loop, shown once with
  ``broken`` set to True and once to False: ``A if broken else B`` becomes ``A`` or ``B``, an
  ``if broken:`` block becomes its body or its ``else``, ``not broken`` and ``broken`` become
  ``True``/``False``. A statement the same in both halves is shown once, as context.

The marker is a comment on any line of the statement (on an ``if``, its first line). Nothing is
copied: the lines are read from the function when the page is built or the notebook runs, so the
page cannot drift from the code that ran.
"""

from __future__ import annotations

import ast
import html
import inspect
import io
import re
import textwrap
import tokenize
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["CaseDiff", "case_diff", "show_case", "specialise"]

Marker = Literal["broken", "fixed", "both"]
MARKER = re.compile(r"\s*#\s*clinic:\s*(broken|fixed|both)\s*$")
"""The marker comment at the end of a line of a case's source."""


@dataclass(frozen=True)
class CaseDiff:
    """A case's differing lines in order: ``("-", line)`` broken only, ``("+", line)`` fixed
    only, ``(" ", line)`` the same in both (context). Shown as a diff: plain text, or
    highlighted (removed lines red, added green) in HTML."""

    name: str
    lines: tuple[tuple[str, str], ...]

    @property
    def broken(self) -> list[str]:
        """The lines the broken half runs, context included."""
        return [text for sign, text in self.lines if sign in "- "]

    @property
    def fixed(self) -> list[str]:
        """The lines the fixed half runs, context included."""
        return [text for sign, text in self.lines if sign in "+ "]

    def __repr__(self) -> str:
        return "\n".join(f"{sign} {text}".rstrip() for sign, text in self.lines)

    def _repr_html_(self) -> str:
        try:
            from pygments import highlight
            from pygments.formatters import HtmlFormatter
            from pygments.lexers import DiffLexer
        except ImportError:  # pragma: no cover - Pygments comes with IPython
            return f"<pre>{html.escape(repr(self))}</pre>"
        return highlight(repr(self), DiffLexer(), HtmlFormatter(noclasses=True, nobackground=True))


def _is_broken_test(node: ast.expr) -> bool | None:
    """True for the test ``broken``, False for ``not broken``, None for anything else."""
    if isinstance(node, ast.Name) and node.id == "broken":
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return False if _is_broken_test(node.operand) else None
    return None


def _offset(lines: list[str], line: int, col: int) -> int:
    """The character index in ``"".join(lines)`` of ``ast``'s (1-based line, UTF-8 byte column)."""
    return sum(len(x) for x in lines[:line - 1]) + len(lines[line - 1].encode()[:col].decode())


def _rewrite_once(text: str, broken: bool) -> str | None:
    """``text`` with its outermost use of ``broken`` resolved, or None when none is left."""
    lines = text.splitlines(keepends=True)
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.If) and (sense := _is_broken_test(node.test)) is not None:
            kept = node.body if sense == broken else node.orelse
            start, end = node.lineno - 1, node.end_lineno or node.lineno
            body = textwrap.dedent("".join(lines[kept[0].lineno - 1:kept[-1].end_lineno])) if kept else ""
            indent = re.match(r"\s*", lines[start]).group()  # type: ignore[union-attr]  # always matches
            return "".join(lines[:start]) + textwrap.indent(body, indent) + "".join(lines[end:])
        if isinstance(node, ast.IfExp) and (sense := _is_broken_test(node.test)) is not None:
            branch = node.body if sense == broken else node.orelse
            new = ast.get_source_segment(text, branch) or ""
        elif isinstance(node, ast.UnaryOp | ast.Name) and (sense := _is_broken_test(node)) is not None:
            new = str(sense == broken)
        else:
            continue
        flat = "".join(lines)
        start = _offset(lines, node.lineno, node.col_offset)
        end = _offset(lines, node.end_lineno or node.lineno, node.end_col_offset or 0)
        return flat[:start] + new + flat[end:]
    return None


def specialise(text: str, broken: bool) -> str:
    """The statements ``text`` as the half ``broken`` runs them, every use of the name
    ``broken`` resolved (see the module's docstring)."""
    while (rewritten := _rewrite_once(text, broken)) is not None:
        text = rewritten
    return text


def _marked_statements(source: str) -> list[tuple[Marker, str]]:
    """Each statement of ``source`` carrying a marker, in order, with its marker and its text
    (dedented, marker comments removed)."""
    marks: dict[int, Marker] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and (m := MARKER.search(token.string)):
            marks[token.start[0]] = m.group(1)  # type: ignore[assignment]  # the pattern's three words
    statements = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.stmt)]
    lines = source.splitlines(keepends=True)
    found: dict[int, tuple[Marker, str]] = {}
    for line, marker in marks.items():
        holders = [s for s in statements if s.lineno == line or (
            not hasattr(s, "body") and s.lineno <= line <= (s.end_lineno or s.lineno))]
        if not holders:
            raise ValueError(f"line {line} of the case: a '# clinic: {marker}' marker goes on a simple "
                             "statement's line or a block's first line, not on a comment alone")
        stmt = min(holders, key=lambda s: ((s.end_lineno or s.lineno) - s.lineno, -s.col_offset))
        text = "".join(MARKER.sub("", x.rstrip("\n")) + "\n" for x in lines[stmt.lineno - 1:stmt.end_lineno])
        found[stmt.lineno] = (marker, textwrap.dedent(text))
    return [found[k] for k in sorted(found)]


def case_diff(fn: Callable[..., Any], name: str | None = None) -> CaseDiff:
    """The broken and fixed lines of the case function ``fn``, read from its source.

    Raises:
        ValueError: if no marked statement of ``fn`` differs between the halves.
    """
    source = textwrap.dedent(inspect.getsource(fn))
    rows: list[tuple[str, str]] = []
    for marker, text in _marked_statements(source):
        if marker == "both":
            halves = {True: specialise(text, True), False: specialise(text, False)}
        else:  # one half's statement, as written
            halves = {True: text if marker == "broken" else "", False: text if marker == "fixed" else ""}
        if marker == "both" and halves[True] == halves[False]:
            rows += [(" ", x) for x in halves[True].splitlines()]
            continue
        rows += [("-", x) for x in halves[True].splitlines()] + [("+", x) for x in halves[False].splitlines()]
    label = name or fn.__name__
    if all(sign == " " for sign, _ in rows):
        raise ValueError(f"case {label}: mark the lines its halves differ by with '# clinic: broken', "
                         "'# clinic: fixed' or '# clinic: both' (none differ)")
    return CaseDiff(label, tuple(rows))


def show_case(name: str) -> CaseDiff:
    """Clinic case ``name``'s broken lines (``-``) and fixed lines (``+``), read from the source
    of the function the clinic runs (:func:`handbook_lib.runs.clinic.case_function`).

    Raises:
        ValueError: for a name that is not a case, naming the accepted ones.
    """
    from handbook_lib.runs.clinic import case_function

    return case_diff(case_function(name), name)
