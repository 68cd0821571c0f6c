"""Repository-wide pytest hooks: where the suite's time goes, printed at the end of every run.

CI must finish in 10 minutes on 2 cores; the table at the end of ``make test`` shows which test
files and notebooks (each notebook is one file of nbval cells) spend it.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

_SECONDS: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add each phase's duration (setup, call, teardown; seconds) to its file's total."""
    _SECONDS[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    """Print seconds per file, slowest first, and their sum."""
    if not _SECONDS:
        return
    terminalreporter.section("seconds per file (setup + call + teardown)")
    for path, seconds in sorted(_SECONDS.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:7.1f}  {path}")
    terminalreporter.write_line(f"{sum(_SECONDS.values()):7.1f}  total")

