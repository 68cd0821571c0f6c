"""The envelope page (``notebooks/envelope.ipynb``): every section's hand figures are asserted
by a hidden cell (nbval runs it), the page is in the book, and the chapters that derive each
formula link to it."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "notebooks" / "envelope.ipynb"


def _cells() -> list[dict]:
    return json.loads(PAGE.read_text())["cells"]


def test_every_section_ends_with_a_hidden_cell_that_asserts_its_figures():
    cells = _cells()
    starts = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
              and re.search(r"^## ", "".join(c["source"]), re.M)]
    assert len(starts) >= 8
    for begin, end in zip(starts, [*starts[1:], len(cells)]):
        title = re.search(r"^## (.*)$", "".join(cells[begin]["source"]), re.M).group(1)
        if title == "Where each is checked":
            continue
        hidden = [c for c in cells[begin:end] if c["cell_type"] == "code"
                  and "hide-cell" in c["metadata"].get("tags", [])]
        assert hidden and all("assert " in "".join(c["source"]) for c in hidden), title
        figures = re.findall(r"\*\*([\d,.]+) (?:GB|s|TFLOP|tokens|%)\*\*", "".join(cells[begin]["source"]))
        assert figures, title  # each section works its formula by hand


def test_the_page_is_in_the_book_and_the_chapters_link_to_it():
    assert "notebooks/envelope" in (ROOT / "_toc.yml").read_text()
    labels = set(re.findall(r"^\((envelope[-a-z]*)\)=", "\n".join(
        "".join(c["source"]) for c in _cells() if c["cell_type"] == "markdown"), re.M))
    for chapter, label in (("02_memory_model", "envelope-peak"), ("03_communication_model", "envelope-time"),
                           ("06_checkpointing", "envelope-checkpoint"),
                           ("09_tensor_sequence_context_parallelism", "envelope-axes")):
        assert label in labels
        assert f"{{ref}}`{label}`" in (ROOT / "notebooks" / f"{chapter}.ipynb").read_text(), chapter
