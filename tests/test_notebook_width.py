"""Every notebook's code and every output it shows fit the book's column (86 characters).

At a 1400 px window the book's code column is 768 px; layout.css sets code and outputs at a size
where 86 monospace characters fit it (scripts/check_book.py measures that in Chromium). A longer
line scrolls sideways, and a reader who does not scroll misses its end.
"""

import json
from pathlib import Path

import pytest

from handbook_lib.core.text import BOOK_WIDTH

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def _shown_text(output: dict) -> str:
    """The text a reader sees of one output: a stream, or the plain text of a result that has
    no HTML form (an HTML table is checked in the browser by scripts/check_book.py)."""
    if output.get("output_type") == "stream":
        return "".join(output["text"])
    data = output.get("data", {})
    if "text/html" in data or "image/png" in data or "image/svg+xml" in data:
        return ""
    return "".join(data.get("text/plain", ""))


def _too_long(notebook: Path) -> list[str]:
    found = []
    for i, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        if cell["cell_type"] != "code":
            continue
        texts = [("code", "".join(cell["source"]))]
        texts += [("output", _shown_text(o)) for o in cell.get("outputs", [])]
        for where, text in texts:
            found += [f"cell {i} {where}: {len(line)} characters: {line[:40]!r}..."
                      for line in text.splitlines() if len(line) > BOOK_WIDTH]
    return found


def test_book_width_is_86():
    assert BOOK_WIDTH == 86


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_code_and_outputs_fit_the_column(notebook):
    assert not _too_long(notebook), "\n".join(_too_long(notebook))


def test_the_check_finds_a_long_line(tmp_path):
    cell = {"cell_type": "code", "source": ["x = 1\n", "y = '" + "a" * 90 + "'"],
            "outputs": [{"output_type": "stream", "text": ["b" * 87 + "\n"]}]}
    path = tmp_path / "n.ipynb"
    path.write_text(json.dumps({"cells": [cell]}))
    assert [line.split(":")[0] for line in _too_long(path)] == ["cell 0 code", "cell 0 output"]


def _shown_source_lines(notebook: Path) -> list[tuple[int, str]]:
    """``(cell, line)`` of the library code a chapter shows (``show_source``: Pygments' HTML),
    as the reader sees it in the book, where nothing folds it."""
    import html
    import re

    lines = []
    for i, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        for output in cell.get("outputs", []):
            page = "".join(output.get("data", {}).get("text/html", ""))
            if 'class="highlight"' not in page:
                continue
            text = html.unescape(re.sub(r"<[^>]+>", "", page))
            lines += [(i, line) for line in text.splitlines()]
    return lines


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_library_code_a_chapter_shows_fits_the_column(notebook):
    long = [f"cell {i}: {len(line)} characters: {line[:40]!r}"
            for i, line in _shown_source_lines(notebook) if len(line) > BOOK_WIDTH]
    assert not long, "\n".join(long)


def test_shown_source_is_found_in_the_html():
    from handbook_lib.face.display import show_source

    page = show_source(test_book_width_is_86)._repr_html_()
    assert 'class="highlight"' in page


def _figures_without_image(notebook: Path) -> list[int]:
    """Code cells whose result is a matplotlib figure shown only as its repr (``<Figure size
    ...>``): the notebook lacks ``%matplotlib inline``, and the page shows a line of text."""
    found = []
    for i, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        for output in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            data = output.get("data", {})
            if "".join(data.get("text/plain", "")).startswith("<Figure size") and "image/png" not in data:
                found.append(i)
    return found


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_figure_is_stored_as_an_image(notebook):
    assert _figures_without_image(notebook) == []


def test_the_check_finds_a_figure_without_its_image(tmp_path):
    shown = {"output_type": "execute_result", "data": {"text/plain": "<Figure size 720x340 with 2 Axes>",
                                                       "image/png": "iVBOR"}}
    bare = {"output_type": "execute_result", "data": {"text/plain": "<Figure size 720x340 with 2 Axes>"}}
    path = tmp_path / "n.ipynb"
    path.write_text(json.dumps({"cells": [{"cell_type": "code", "source": "f()", "outputs": [shown]},
                                          {"cell_type": "code", "source": "f()", "outputs": [bare]}]}))
    assert _figures_without_image(path) == [1]
