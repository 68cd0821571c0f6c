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


# Files that take a minute or more, longest first (seconds on the 2-core CI machine, from the
# table above). With two xdist workers handing out files in collection order, starting the
# longest first keeps one worker from running chapter 5 alone at the end (longest processing
# time first: on 2 cores the suite then ends near half its summed time).
_SLOW_FIRST = (
    "notebooks/05_fsdp_in_practice.ipynb",            # ~230 s
    "tests/test_runs_fsdp_train.py",                  # ~115 s
    "notebooks/03_communication_model.ipynb",         # ~75 s
    "notebooks/07_accelerate_trainer_deepspeed.ipynb",  # ~73 s
    "notebooks/02_memory_model.ipynb",                # ~70 s
    "tests/test_launch.py",                           # ~57 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the slowest files first (a stable sort: the order within a file is kept)."""
    rank = {path: i for i, path in enumerate(_SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(_SLOW_FIRST)))
