"""How a run fails, as exceptions a notebook cell or the terminal shows in a few lines.

Chapter 1 shows each: :class:`RunFailed` names the rank that caused the failure (found by
:mod:`handbook_lib.launch.diagnose`) with its traceback; :class:`RunTimeout` shows where every
rank was; :class:`RunInterrupted` is Ctrl-C; :class:`ChecksFailed` is a run that finished but
whose model disagrees with its measurement (a failure too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from handbook_lib.core.results import RunResult

__all__ = ["RunFailed", "RunTimeout", "RunPreempted", "RunInterrupted", "ChecksFailed", "describe_failed_checks",
           "killed_lines"]


class RunFailed(RuntimeError):
    """A run ended without a result. ``str(err)`` says which rank failed and why.

    Attributes:
        run: The run's name.
        rank: The rank found to have caused the failure, or ``None`` if none could be named.
        rank_traceback: That rank's Python traceback (``""`` if it died without one).
        out_dir: The run's directory (logs under ``logs/``, rank states under ``ranks/``), or
            ``None`` when it was a temporary one (no ``out`` given): removed once the run ended.
        returncode: torchrun's exit status (``None`` if it was killed).
        log_tail: The last lines of output (all ranks and torchrun itself).
    """

    def __init__(self, message: str, *, run: str, rank: int | None, rank_traceback: str,
                 out_dir: Path | None, returncode: int | None, log_tail: list[str]) -> None:
        super().__init__(message)
        self.run = run
        self.rank = rank
        self.rank_traceback = rank_traceback
        self.out_dir = out_dir
        self.returncode = returncode
        self.log_tail = log_tail

class RunTimeout(RunFailed):
    """A run did not finish within its timeout; all its processes were killed."""

class RunPreempted(RunFailed):
    """A run stopped on a preemption signal (SIGTERM, SIGUSR1) after every rank saved.

    ``str(err)`` is one line, e.g. ``run 'checkpoint_resume' preempted by SIGTERM at step 3; saved
    step_000003 in /ck``: the same run with ``resume=true`` continues from there. The CLI exits
    with :data:`~handbook_lib.core.protocol.PREEMPTED_EXIT` and says how to resume.

    Attributes:
        step: The optimizer step every rank saved at.
    """

    def __init__(self, message: str, *, step: int, **kwargs: Any) -> None:
        super().__init__(message, rank=None, rank_traceback="", **kwargs)
        self.step = step


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C (SIGINT in the launching process); torchrun and its ranks were killed.

    A :class:`KeyboardInterrupt` (so ``except Exception`` does not swallow a user's Ctrl-C), whose
    message is one line, e.g. ``run 'fsdp_train' interrupted; torchrun and 2 ranks stopped``.
    IPython and Jupyter show only that line (``_render_traceback_``), not the launcher's frames.

    Attributes:
        run: The run's name.
        out_dir: The run's directory (whatever the ranks wrote before they were stopped), or
            ``None`` when it was a temporary one, removed.
    """

    def __init__(self, message: str, *, run: str, out_dir: Path | None) -> None:
        super().__init__(message)
        self.run = run
        self.out_dir = out_dir

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]

class ChecksFailed(RunFailed):
    """A run finished and wrote its result, but at least one check is outside its tolerance.

    Attributes:
        result: The parsed ``result.json`` (every check, passed or not); in a batch, the first
            config's with a failed check.
        failed: The checks of ``result`` outside their tolerance.
        results: Every config's result, by label (a single run's label is ``""``).
    """

    def __init__(self, message: str, *, result: RunResult, results: dict[str, RunResult] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(message, rank=None, rank_traceback="", **kwargs)
        self.result = result
        self.failed = result.failed_checks()
        self.results = results if results is not None else {"": result}


def describe_failed_checks(result: RunResult, limit: int = 10) -> str:
    """One line per failed check (the first ``limit``): quantity, rank, prediction, measurement,
    relative error and the tolerance it broke; ``""`` when every check passed."""
    failed = result.failed_checks()
    lines = []
    for c in failed[:limit]:
        allowed = "exact" if c.tolerance == 0 else f"within {c.tolerance:.0%}"
        rel = "" if c.predicted == 0 else f", {c.relative_error:+.2%}"
        lines.append(f"  {c.quantity} (rank {c.rank}): predicted {c.predicted:,}, measured "
                     f"{c.measured:,} {c.unit}{rel}; the check is {allowed}")
    if len(failed) > limit:
        lines.append(f"  ... and {len(failed) - limit} more")
    return "\n".join(lines)


def killed_lines(err: RunFailed, word: str = "SIGKILL") -> list[str]:
    """The lines of ``err.log_tail`` in which a rank said ``word`` (by default, the line a rank
    prints as it sends itself ``SIGKILL``: its last words, which chapter 6 shows)."""
    return [line for line in err.log_tail if line.startswith("[rank") and word in line]
