"""The command line's argument types: each parses one flag's text or says, in one line, what
it accepts. Used by :mod:`handbook_lib.face.cli`."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from handbook_lib.core.checks import BadText, parse_count, parse_float, parse_int

__all__ = ["MAX_PARAMS", "MAX_PORT", "endpoint", "fraction", "param_count", "seconds", "whole"]

MAX_PARAMS = 10**15
"""Largest ``--params`` accepted: a quadrillion parameters, beyond any model trained so far."""
MAX_PORT = 65535
"""The largest TCP port (``--rdzv-endpoint``, ``slurm --port``)."""


def whole(minimum: int, below: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in ``[minimum, below)``, written as digits."""
    def parse(text: str) -> int:
        try:
            return parse_int(text, minimum, below)
        except BadText as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return parse


def param_count(text: str) -> int:
    """An argparse type for ``--params``: a whole number of parameters in [1, MAX_PARAMS]."""
    try:
        return parse_count(text, 1, MAX_PARAMS, noun="a whole number of parameters")
    except BadText as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1)."""
    try:
        return parse_float(text, 0.0, below=1.0)
    except BadText as err:
        raise argparse.ArgumentTypeError(f"{err} (a fraction, e.g. 0.1)") from None


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        return parse_float(text, above=0.0)
    except BadText as err:
        raise argparse.ArgumentTypeError(f"{err} (seconds)") from None


def endpoint(text: str) -> str:
    """An argparse type for ``--rdzv-endpoint``: ``HOST:PORT`` with a TCP port in [1, 65535]."""
    host, sep, port = text.rpartition(":")
    try:
        if not sep or not host:
            raise BadText(text, "HOST:PORT")
        parse_int(port, 1, MAX_PORT + 1)
    except BadText:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT with a TCP port from 1 to {MAX_PORT}, "
                                         f"got {text!r}") from None
    return text
