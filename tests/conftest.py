"""Shared fixtures: find processes a run may have left behind."""

from __future__ import annotations

import psutil
import pytest


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Live processes whose command line contains ``text`` (zombies excluded)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and text in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture
def no_leftovers(tmp_path):
    """An output directory; after the test, no process may still mention it."""
    yield tmp_path
    left = processes_mentioning(str(tmp_path))
    for proc in left:
        proc.kill()
    assert not left, f"processes left behind: {[p.pid for p in left]}"
