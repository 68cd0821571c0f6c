"""Stored notebook outputs and the CPU kernels they are replayed with (scripts/cpu_variant.py).

``make test`` re-executes the notebooks on other kernels than the ones that stored their outputs;
these tests check that the notebooks say which kernels stored them, and that the replay really
runs other kernels (torch reports another ATen capability under the replay's variables).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "cpu_variant.py"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _script(*args: str) -> str:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_every_notebook_records_the_kernels_that_stored_it():
    recorded = {json.loads(p.read_text())["metadata"]["handbook"]["cpu"]["aten"] for p in NOTEBOOKS}
    assert len(NOTEBOOKS) >= 6 and len(recorded) == 1
    assert _script("--stored") == recorded.pop()


def test_the_replay_runs_other_aten_kernels_than_the_stored_ones():
    stored = _script("--stored")
    env = dict(line.split("=", 1) for line in _script("--other").splitlines())
    assert set(env) == {"ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR"}
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    replayed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                              env={**os.environ, **env}).stdout.strip()
    assert replayed != stored and replayed.lower() == env["ATEN_CPU_CAPABILITY"].lower()
