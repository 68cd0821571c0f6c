"""Execute notebooks in place and store their outputs (run by ``make notebooks``).

Outputs stored in the notebooks are what the book shows and what nbval compares, so they must
come from a real execution. The CPU kernels they were made with are recorded in the notebook's
metadata (``handbook.cpu``), so that ``make test`` can replay them with other kernels
(``scripts/cpu_variant.py``). nbclient is used directly (not ``jupyter execute``) so that no
timing metadata is written and git diffs stay small.

    python scripts/execute_notebooks.py                 # every notebooks/*.ipynb
    python scripts/execute_notebooks.py notebooks/01_*.ipynb
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_variant import kernels  # noqa: E402 - a sibling script, not a package

ROOT = Path(__file__).resolve().parent.parent


def execute(path: Path, cpu: dict[str, str], timeout_s: int = 1200) -> float:
    """Execute one notebook in its own folder, record ``cpu`` (the kernels it ran with) in its
    metadata and write it back; return seconds taken."""
    nb = nbformat.read(path, as_version=4)
    start = time.monotonic()
    NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nb.metadata.setdefault("handbook", {})["cpu"] = cpu
    nbformat.write(nb, path)
    return time.monotonic() - start


def main(argv: list[str]) -> int:
    paths = [Path(p) for p in argv] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    cpu = kernels()
    print(f"CPU kernels: {cpu}", flush=True)
    for path in paths:
        print(f"executing {path} ...", flush=True)
        print(f"  done in {execute(path, cpu):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
