"""The linter and the type checker, as tests: ``make test`` runs them with the rest.

- **ruff** (``[tool.ruff]`` in ``pyproject.toml``): pyflakes, pycodestyle, bugbear and pylint's
  errors over the package, the tests, the scripts and the hub's files, at 120 columns;
- **mypy** (``[tool.mypy]``): the package, default mode, torch and the frameworks not followed
  (their names are ``Any``), unused ``# type: ignore`` comments reported. Its cache lives in
  ``.mypy_cache`` (ignored by git and by the book build), so a second run takes about a second.

Each skips, saying why, only when its tool is not installed (the ``test`` extra installs both).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 120
"""A generous bound on each tool's time: ruff takes well under a second, mypy about 6 s cold."""


def _run(tool: str, *args: str) -> None:
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (pip install -e '.[test]' installs it)")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=BUDGET_S)
    seconds = time.perf_counter() - start
    assert done.returncode == 0, f"{tool} found problems ({seconds:.1f} s):\n{done.stdout}{done.stderr}"


def test_ruff_finds_nothing():
    _run("ruff", "check", "--no-cache", "--quiet", ".")


def test_mypy_finds_nothing():
    _run("mypy")  # files, options and cache directory: [tool.mypy] in pyproject.toml
