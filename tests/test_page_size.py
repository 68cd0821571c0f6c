"""Every page of the book stays readable in one sitting: at most 40 KB of text, code and
plain-text output (each cell's source and what it prints as text, the way a reader scrolls
through it; figures and a table's HTML twin are not counted). Hidden cells count: a learner
reads them in JupyterLab."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
LIMIT = 40_000
"""Bytes of text, code and plain-text output a page may hold."""

def page_bytes(path: Path) -> int:
    """UTF-8 bytes of a notebook's cell sources and of the text its cells print (streams and the
    ``text/plain`` of displayed values)."""
    total = 0
    for cell in json.loads(path.read_text())["cells"]:
        total += len("".join(cell["source"]).encode())
        for out in cell.get("outputs", []):
            text = out.get("text") or out.get("data", {}).get("text/plain", "")
            total += len("".join(text).encode())
    return total


def test_the_measure_counts_sources_and_printed_text(tmp_path):
    page = {"cells": [{"cell_type": "markdown", "source": ["# é\n", "ab"]},
                      {"cell_type": "code", "source": ["print(1)"],
                       "outputs": [{"output_type": "stream", "text": ["1\n"]},
                                   {"output_type": "display_data",
                                    "data": {"text/plain": ["x"], "text/html": ["<b>x</b>"]}}]}]}
    path = tmp_path / "p.ipynb"
    path.write_text(json.dumps(page))
    assert page_bytes(path) == len("# é\nab".encode()) + len("print(1)") + len("1\n") + len("x") == 18


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_each_page_is_at_most_40_kb(path):
    size = page_bytes(path)
    assert size <= LIMIT, f"{path.name}: {size:,} B, over the {LIMIT:,} B a page may hold"
