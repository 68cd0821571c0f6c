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
    under xdist) creates it; workers and notebook kernels inherit the variable."""
    if not os.environ.get(RESULTS_LOG_ENV):
        fd, path = tempfile.mkstemp(prefix="handbook-results-", suffix=".jsonl")
        os.close(fd)
        os.environ[RESULTS_LOG_ENV] = path
        setattr(config, _OWN_LOG, path)


KERNEL_STARTS = 3
"""Tries to start the warm-up kernel of a process that runs notebooks."""


def pytest_sessionstart(session: pytest.Session) -> None:
    """In a process that runs notebooks (``--nbval``), start and stop one kernel before the first
    notebook's: twice a notebook lost every cell to "Kernel died before replying to
    kernel_info" when both workers started their first kernels at once, at the start of a
    run. The warm-up kernel takes that start, tried up to :data:`KERNEL_STARTS` times with what
    a dead one printed shown, so the notebooks' kernels start on a warm machine."""
    option = session.config.option
    notebooks = getattr(option, "nbval", False) or getattr(option, "nbval_lax", False)
    controller = getattr(option, "numprocesses", None) and not hasattr(session.config, "workerinput")
    if notebooks and not controller:  # each process that runs notebooks: xdist's workers, or this one
        warm_kernel(_start_kernel)


def warm_kernel(start: Callable[[Any], Any], tries: int = KERNEL_STARTS) -> int:
    """Call ``start(stderr)`` until it returns, up to ``tries`` times, printing the stderr of
    each start that raised ``RuntimeError``; return the tries it took. Raises the last error."""
    for attempt in range(1, tries + 1):
        with tempfile.TemporaryFile(mode="w+") as err:
            try:
                start(err)
                return attempt
            except RuntimeError as failure:
                err.seek(0)
                print(f"warm-up kernel start {attempt} of {tries} failed ({failure}); its stderr:\n"
                      f"{err.read()[-2000:]}", file=sys.stderr)
                if attempt == tries:
                    raise
    raise AssertionError("unreachable")


def _start_kernel(err: Any) -> int:
    """Start a ``python3`` kernel as nbval does (jupyter_client's manager and client), wait for
    its first answer, then shut it down; return its process id."""
    from jupyter_client import KernelManager

    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(stderr=err)
    pid = int(getattr(manager.provisioner, "pid", 0) or 0)  # the local provisioner's process
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return pid


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
