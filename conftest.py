"""Repository-wide pytest hooks: where the suite's time goes, and how many checks its runs made,
printed at the end of every run.

CI must finish in 10 minutes on 2 cores; the table at the end of ``make test`` shows which test
files and notebooks (each notebook is one file of nbval cells) spend it. Every ``torchrun`` job
of the suite — the tests' and the notebooks' kernels' alike — appends its results' check counts
to one file (:data:`handbook_lib.core.protocol.RESULTS_LOG_ENV`), and the total closes the run:
the number of predictions the suite put beside a measurement.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from handbook_lib.core.protocol import RESULTS_LOG_ENV

_SECONDS: defaultdict[str, float] = defaultdict(float)
_OWN_LOG = "handbook_results_log"
"""The key under which the session that created the results log remembers it (to remove it)."""


def pytest_configure(config: pytest.Config) -> None:
    """Give every process of the session one results log: the first process (the controller
    under xdist) creates it; workers and notebook kernels inherit the variable. And start each
    notebook's kernel again if it dies before it answers (:func:`_retrying_kernel_start`)."""
    if not os.environ.get(RESULTS_LOG_ENV):
        fd, path = tempfile.mkstemp(prefix="handbook-results-", suffix=".jsonl")
        os.close(fd)
        os.environ[RESULTS_LOG_ENV] = path
        setattr(config, _OWN_LOG, path)
    try:
        import nbval.kernel
    except ImportError:  # the suite without nbval: no notebooks to run
        return
    if not getattr(nbval.kernel.start_new_kernel, "_retries", False):
        nbval.kernel.start_new_kernel = _retrying_kernel_start(nbval.kernel.start_new_kernel)


KERNEL_STARTS = 3
"""Tries to start a notebook's kernel before its cells fail."""


def _retrying_kernel_start(start: Callable[..., Any]) -> Callable[..., Any]:
    """nbval's ``start_new_kernel``, tried up to :data:`KERNEL_STARTS` times. Two workers start
    their first kernels at the same moment; jupyter_client picks each kernel's five ports by
    binding and releasing them, and a kernel that finds one taken by the other's dies before it
    answers ("Kernel died before replying to kernel_info"), which fails every cell of a notebook
    that never ran. A kernel that dies again is a real failure; the dead one's stderr (which
    nbval sends to /dev/null) is printed for it."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        for attempt in range(1, KERNEL_STARTS + 1):
            with tempfile.TemporaryFile(mode="w+") as err:
                try:
                    return start(*args, **{**kwargs, "stderr": err})
                except RuntimeError as failure:
                    err.seek(0)
                    print(f"notebook kernel start {attempt} of {KERNEL_STARTS} failed ({failure}); its stderr:\n"
                          f"{err.read()[-2000:]}", file=sys.stderr)
                    if attempt == KERNEL_STARTS:
                        raise
        raise AssertionError("unreachable")

    wrapped._retries = True  # type: ignore[attr-defined]
    return wrapped


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add each phase's duration (setup, call, teardown; seconds) to its file's total."""
    _SECONDS[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """Print seconds per file, slowest first, and their sum; then the checks of the suite's runs."""
    if _SECONDS:
        terminalreporter.section("seconds per file (setup + call + teardown)")
        for path, seconds in sorted(_SECONDS.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"{seconds:7.1f}  {path}")
        terminalreporter.write_line(f"{sum(_SECONDS.values()):7.1f}  total")
    own = getattr(config, _OWN_LOG, None)
    if own is None or not Path(own).exists():
        return
    rows = [json.loads(line) for line in Path(own).read_text().splitlines() if line.strip()]
    Path(own).unlink()
    if rows:
        checks = sum(r["checks"] for r in rows)
        failed = sum(r["failed"] for r in rows)
        terminalreporter.section("checks of the suite's runs")
        terminalreporter.write_line(f"{checks} checks in {len(rows)} run results ({failed} outside their "
                                    "tolerance, in the tests that provoke a failed check)")
