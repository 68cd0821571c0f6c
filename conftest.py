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
import tempfile
from collections import defaultdict
from pathlib import Path

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
