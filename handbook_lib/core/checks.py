"""The one vocabulary of argument checks: a bad value gets a ``ValueError`` that names the
argument and says what is accepted. Pure: no ``torch``, no side effects.

Chapter 1 states the rule the whole library follows (an error names the flag or key and the
accepted values, in one line); every module checks its plain values through these functions,
so the same mistake reads the same everywhere:

- :func:`check_int`: ``"nproc must be an int >= 1, got 0"`` (a ``bool`` is not an int here);
- :func:`lookup`: ``"optimizer must be one of adamw, adam, sgd, sgd-momentum, got 'adagrad'"``;
- :func:`check_world`: ``"world_size must be an int >= 1, got 0"``, ``"rank must be in [0, 4), got 4"``.

``name`` is the caller's spelling of the argument (``"--gpus"`` for the CLI, ``"config key
'steps'"`` for a run config), so one function serves the library, the runs and the terminal.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

__all__ = ["is_int", "check_int", "lookup", "check_world"]

_T = TypeVar("_T")


def is_int(value: object) -> bool:
    """True for an ``int`` that is not a ``bool`` (``True`` is an int to Python, not to a config)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: object, minimum: int = 0, *, below: int | None = None,
              context: str = "", noun: str = "an int") -> int:
    """``value``, if it is an int >= ``minimum`` (and < ``below`` when given).

    Args:
        name: The argument as the caller spells it, e.g. ``"micro_batch"`` or ``"--gpus"``.
        value: What was given.
        minimum: The smallest value accepted.
        below: If given, the first value no longer accepted: the message then says
            ``"an int in [minimum, below)"``.
        context: Words appended to the accepted range, e.g. ``"for nnodes=2"``.
        noun: What is accepted, in the caller's words: ``"an int"``, or ``"a whole number"``
            for a command-line flag.

    Raises:
        ValueError: ``"<name> must be an int >= <minimum>, got <value>"`` (or ``in [a, b)``).
    """
    ok = is_int(value) and value >= minimum and (below is None or value < below)
    if not ok:
        accepted = f"{noun} >= {minimum}" if below is None else f"{noun} in [{minimum}, {below})"
        raise ValueError(f"{name} must be {accepted}{f' {context}' if context else ''}, got {value!r}")
    return value  # type: ignore[return-value]


def lookup(table: Mapping[str, _T], name: object, what: str) -> _T:
    """``table[name]``: a preset or a vocabulary value by name.

    Raises:
        ValueError: ``"<what> must be one of <names>, got <name>"`` for an unknown name.
    """
    try:
        return table[name]  # type: ignore[index]
    except (KeyError, TypeError):
        raise ValueError(f"{what} must be one of {', '.join(table)}, got {name!r}") from None


def check_world(world_size: object, rank: object = None) -> None:
    """Refuse a world size that is not an int >= 1, or a ``rank`` outside ``[0, world_size)``.

    Raises:
        ValueError: ``"world_size must be an int >= 1, got 0"`` or ``"rank must be in [0, 4), got 4"``.
    """
    check_int("world_size", world_size, 1)
    if rank is not None and not (is_int(rank) and 0 <= rank < world_size):  # type: ignore[operator]
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
