"""How wide a line a person reads may be, and the one way text is wrapped to it. Pure.

Chapter 1's outputs follow it: every line a notebook stores fits :data:`BOOK_WIDTH`, the
rendered book's code column; every line the command line prints fits :data:`TERMINAL_WIDTH`.
"""

from __future__ import annotations

import textwrap

__all__ = ["BOOK_WIDTH", "TERMINAL_WIDTH", "wrap"]

BOOK_WIDTH = 86
"""Characters of output a line may take in the book: its code column holds about 88."""
TERMINAL_WIDTH = 100
"""Columns every line the command line prints fits in (tables, notes, reasons, legends)."""


def wrap(text: str, width: int = BOOK_WIDTH, indent: str = "  ", *, break_long_words: bool = True) -> str:
    """``text`` filled to ``width`` columns, continuation lines indented by ``indent``; hyphens
    never break a line (flags and strategy names keep theirs)."""
    return textwrap.fill(text, width, subsequent_indent=indent, break_long_words=break_long_words,
                         break_on_hyphens=False)
