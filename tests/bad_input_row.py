"""The shape of one row in the table of bad inputs (tests/test_bad_inputs.py).

Both halves of issue 12 build rows of this shape: the planning-command rows
live in ``tests/test_bad_inputs.py``; the launcher/config/checkpoint rows live
in ``tests/bad_inputs_runs.py`` as a module-level ``ROWS: list[BadInputRow]``,
which the runner imports and parametrizes over together with its own rows.

A row is either a CLI call (``argv`` for ``handbook_lib.face.cli.main(argv)``, which
returns the exit code; expect ``exit_code``) or a Python API call (``call``, a
zero-argument callable; expect it to raise ``raises``). ``fragment`` must occur
in the CLI's stderr or in the exception message: it names the flag
(``"--params"``) or config key (``"steps"``) that is wrong.

Placeholders: an argv element equal to ``TMP`` is replaced by the row's fresh
temporary directory (the current directory while the row runs), so a row may
point ``--out`` inside it; a ``call`` may take the same directory as its single
argument if it is declared with one parameter.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

#: An argv element that the runner replaces by the row's tmp directory path.
TMP = "<TMP>"


@dataclass(frozen=True)
class BadInputRow:
    """One bad input and the clear refusal it must get.

    Attributes:
        id: Short unique test id, e.g. ``"memory-params-inf"``.
        argv: Arguments for ``handbook_lib.face.cli.main(argv)``, or None for an API row.
        call: Zero-argument callable (or one taking the tmp dir path) for an
            API row, or None for a CLI row.
        exit_code: Expected exit code of a CLI row (2 = bad arguments,
            1 = the run failed); None for an API row.
        raises: Expected exception type of an API row; None for a CLI row.
        fragment: Text that must occur in stderr / the exception message,
            naming the flag or config key at fault (case-sensitive).
        launches: True if the row may start a real torchrun job because the
            bad input is only detectable at run time (at most 3 such rows).
    """

    id: str
    argv: list[str] | None
    call: Callable[..., object] | None
    exit_code: int | None
    raises: type[BaseException] | None
    fragment: str
    launches: bool = False

    def __post_init__(self) -> None:
        """Check that the row is either a CLI row or an API row, not both."""
        if (self.argv is None) == (self.call is None):
            raise ValueError(f"row {self.id!r}: give exactly one of argv or call")
        if self.argv is not None and self.exit_code is None:
            raise ValueError(f"row {self.id!r}: a CLI row needs exit_code")
        if self.call is not None and self.raises is None:
            raise ValueError(f"row {self.id!r}: an API row needs raises")
        if not self.fragment:
            raise ValueError(f"row {self.id!r}: fragment must not be empty")


def cli(id: str, argv: list[str], fragment: str, exit_code: int = 2, launches: bool = False) -> BadInputRow:
    """A CLI row: ``main(argv)`` must return ``exit_code`` with ``fragment`` in stderr."""
    return BadInputRow(id, argv, None, exit_code, None, fragment, launches)


def api(id: str, call: Callable[..., object], fragment: str,
        raises: type[BaseException] = ValueError) -> BadInputRow:
    """An API row: ``call()`` (or ``call(folder)``) must raise ``raises`` with ``fragment``."""
    return BadInputRow(id, None, call, None, raises, fragment)


def later(module: str, name: str, *args: object, **kwargs: object) -> Callable[[], object]:
    """``module.name(*args, **kwargs)`` as a zero-argument call, the module imported only when
    the row runs; ``name`` may be dotted (``"RunConfig.from_mapping"``)."""
    def call() -> object:
        target: object = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
        return target(*args, **kwargs)  # type: ignore[operator]

    return call
