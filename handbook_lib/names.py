"""Looking up a preset or a vocabulary value by name, with an error that lists the choices."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

__all__ = ["lookup"]

_T = TypeVar("_T")


def lookup(table: Mapping[str, _T], name: str, what: str) -> _T:
    """``table[name]``.

    Raises:
        ValueError: ``"<what> must be one of <names>, got <name>"`` for an unknown name.
    """
    try:
        return table[name]
    except (KeyError, TypeError):
        raise ValueError(f"{what} must be one of {', '.join(table)}, got {name!r}") from None
