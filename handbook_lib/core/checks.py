"""The one vocabulary of argument checks: a bad value gets a ``ValueError`` that names the
argument and says what is accepted. Pure: no ``torch``, no side effects.

Chapter 1 states the rule the whole library follows (an error names the flag or key and the
accepted values, in one line); every module checks its plain values through these functions,
so the same mistake reads the same everywhere:

- :func:`check_int`: ``"nproc must be an int >= 1, got 0"`` (a ``bool`` is not an int here);
- :func:`lookup`: ``"optimizer must be one of adamw, adam, sgd, sgd-momentum, got 'adagrad'"``;
- :func:`check_world`: ``"world_size must be an int >= 1, got 0"``, ``"rank must be in [0, 4), got 4"``.

Numbers typed as text (a ``--set key=value``, a command-line flag) are read by one function per
type, which refuses what the type does not accept with the accepted range, never with Python's
own ``int()``/``float()`` message: :func:`parse_int` (digits only: ``3.0``, ``1e1`` and an empty
value are not whole numbers), :func:`parse_float`, :func:`parse_bool` and :func:`parse_count` (a
size or count that may be written ``7e9``). Each raises :class:`BadText`, a ``ValueError`` that
keeps the accepted range apart (:attr:`BadText.accepted`) so that a caller can phrase it its way:
``"argument --nproc: must be a whole number >= 1, got '3.0'"``, ``"--set steps=3.0: steps takes a
whole number >= 1"``.

``name`` is the caller's spelling of the argument (``"--gpus"`` for the CLI, ``"config key
'steps'"`` for a run config), so one function serves the library, the runs and the terminal.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TypeGuard, TypeVar

__all__ = ["is_int", "check_int", "lookup", "check_world", "BadText", "int_range", "float_range", "parse_int",
           "parse_float", "parse_bool", "parse_count"]

_T = TypeVar("_T")


def is_int(value: object) -> TypeGuard[int]:
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
    if not (is_int(value) and value >= minimum and (below is None or value < below)):
        accepted = f"{noun} >= {minimum}" if below is None else f"{noun} in [{minimum}, {below})"
        raise ValueError(f"{name} must be {accepted}{f' {context}' if context else ''}, got {value!r}")
    return value


def lookup(table: Mapping[str, _T], name: object, what: str) -> _T:
    """``table[name]``: a preset or a vocabulary value by name.

    Raises:
        ValueError: ``"<what> must be one of <names>, got <name>"`` for an unknown name.
    """
    if isinstance(name, str) and name in table:
        return table[name]
    raise ValueError(f"{what} must be one of {', '.join(table)}, got {name!r}")


def check_world(world_size: object, rank: object = None) -> None:
    """Refuse a world size that is not an int >= 1, or a ``rank`` outside ``[0, world_size)``.

    Raises:
        ValueError: ``"world_size must be an int >= 1, got 0"`` or ``"rank must be in [0, 4), got 4"``.
    """
    world = check_int("world_size", world_size, 1)
    if rank is not None and not (is_int(rank) and 0 <= rank < world):
        raise ValueError(f"rank must be in [0, {world}), got {rank!r}")


class BadText(ValueError):
    """A number or switch typed as text that its type does not accept.

    Its message is ``"must be <accepted>, got <text>"``; :attr:`accepted` is the accepted range
    alone (``"a whole number >= 1"``), for a caller that names the key its own way."""

    def __init__(self, text: str, accepted: str, shown: str | None = None) -> None:
        super().__init__(f"must be {accepted}, got {shown if shown is not None else repr(text)}")
        self.text = text
        self.accepted = accepted


_WHOLE = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*")
"""A whole number as digits (Python's grouping underscores allowed): no point, no exponent."""


def int_range(minimum: int | None = None, below: int | None = None, noun: str = "a whole number") -> str:
    """The words for the ints in ``[minimum, below)``: ``"a whole number >= 1"``,
    ``"a whole number in [1, 513)"`` or ``"a whole number"`` (no bound)."""
    if minimum is not None and below is not None:
        return f"{noun} in [{minimum}, {below})"
    if minimum is not None:
        return f"{noun} >= {minimum}"
    if below is not None:
        return f"{noun} < {below}"
    return noun


def parse_int(text: str, minimum: int | None = None, below: int | None = None, *,
              noun: str = "a whole number") -> int:
    """``text`` as an int in ``[minimum, below)`` (a bound ``None`` is open), written as digits.

    Raises:
        BadText: ``"must be a whole number >= 1, got '3.0'"`` for ``3.0``, ``1e1``, ``''``,
            ``1e-3x``, or ``"... got 0"`` for a whole number outside the range.
    """
    accepted = int_range(minimum, below, noun)
    stripped = text.strip() if isinstance(text, str) else ""
    if not _WHOLE.fullmatch(stripped):
        raise BadText(text, accepted)
    value = int(stripped)
    if (minimum is not None and value < minimum) or (below is not None and value >= below):
        raise BadText(text, accepted, shown=str(value))
    return value


def float_range(minimum: float | None = None, *, above: float | None = None, below: float | None = None) -> str:
    """The words for the finite numbers ``>= minimum`` (or ``> above``) and ``< below``."""
    low = f">= {minimum:g}" if minimum is not None else f"> {above:g}" if above is not None else ""
    if below is not None and low:
        left = "[" if minimum is not None else "("
        return f"a number in {left}{minimum if minimum is not None else above:g}, {below:g})"
    if below is not None:
        return f"a finite number < {below:g}"
    return f"a finite number {low}".rstrip()


def parse_float(text: str, minimum: float | None = None, *, above: float | None = None,
                below: float | None = None) -> float:
    """``text`` as a finite float ``>= minimum`` (or ``> above``) and ``< below`` when given;
    ``nan``, ``inf`` and numbers that overflow (``1e400``) are refused.

    Raises:
        BadText: ``"must be a finite number > 0, got 'x'"``.
    """
    accepted = float_range(minimum, above=above, below=below)
    try:
        value = float(text.strip()) if isinstance(text, str) and text.strip() else math.nan
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (minimum is None or value >= minimum) and (above is None or value > above)
            and (below is None or value < below)):
        raise BadText(text, accepted)
    return value


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
BOOL_WORDS = "a boolean, true or false (also 1/0, yes/no, on/off)"
"""What :func:`parse_bool` accepts, in words."""


def parse_bool(text: str) -> bool:
    """``text`` as a bool: ``true``/``false`` and their usual spellings, any case.

    Raises:
        BadText: ``"must be a boolean, true or false (also 1/0, yes/no, on/off), got 'maybe'"``.
    """
    lowered = text.strip().lower() if isinstance(text, str) else ""
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise BadText(text, BOOL_WORDS)


def parse_count(text: str, minimum: int = 1, maximum: int | None = None, *, noun: str = "a whole number",
                example: str = "7e9") -> int:
    """``text`` as a whole count or size in ``[minimum, maximum]``, in digits or in scientific
    notation when that is whole (``7e9``, ``1.5e3``; not ``7.5``).

    Raises:
        BadText: ``"must be a whole number from 1 to 1e15 (e.g. 7e9), got '7.5'"``.
    """
    top = "" if maximum is None else (f" to 1e{round(math.log10(maximum))}"
                                      if maximum >= 10**6 and 10 ** round(math.log10(maximum)) == maximum
                                      else f" to {maximum}")
    accepted = (f"{noun} from {minimum}{top} (e.g. {example})" if top
                else f"{noun} >= {minimum} (e.g. {example})")
    stripped = text.strip() if isinstance(text, str) else ""
    if _WHOLE.fullmatch(stripped):
        value = int(stripped)
    else:
        try:
            number = float(stripped) if stripped else math.nan
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and number == int(number)):
            raise BadText(text, accepted)
        value = int(number)
    if value < minimum or (maximum is not None and value > maximum):
        raise BadText(text, accepted)
    return value
