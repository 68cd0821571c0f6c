"""The code a chapter shows is the library's code as it stands: every ``show_source(NAME)`` cell's
stored output is ``NAME``'s source today, and every ``show_case("NAME")`` cell's the clinic case's
broken and fixed lines read from its source today, so a page and the code it shows cannot drift
(nbval re-executes the cells; this test also holds between two executions). Each chapter that
teaches distributed code shows the functions its runs execute for that idea, and the clinic
shows every case's lines."""

from __future__ import annotations

import functools
import html
import importlib
import inspect
import json
import pkgutil
import re
import textwrap
from functools import cache
from pathlib import Path

import pytest

import handbook_lib

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

SHOWN = {
    "01_model_and_parameters": {"apply_fsdp2"},
    "05_fsdp_in_practice": {"_apply_fsdp", "build_mp_policy"},
    "06_checkpointing": {"save_checkpoint", "export_full_state_dict", "save_safetensors", "load_safetensors"},
    "07_accelerate_trainer_deepspeed": {"train_with_accelerate"},
    "08_many_nodes_and_the_gpu_hub": {"Nodes.commands"},
    "09_tensor_sequence_context_parallelism": {"apply_tensor_parallel", "apply_axes", "apply_pipeline",
                                               "ulysses_core"},
}
"""The functions each chapter must show: what its runs execute for the idea it teaches."""

CALL = re.compile(r"^show_source\(([\w.]+)\)\s*$", re.MULTILINE)
CASE_CALL = re.compile(r'^show_case\("(\w+)"\)\s*$', re.MULTILINE)
CLINIC = NOTEBOOKS / "10_the_fsdp_clinic.ipynb"


@cache
def library_objects() -> dict[str, list[object]]:
    """Every function and class defined in ``handbook_lib``, by name."""
    found: dict[str, list[object]] = {}
    for info in pkgutil.walk_packages(handbook_lib.__path__, "handbook_lib."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == info.name:
                found.setdefault(name, []).append(obj)
    return found


def shown(notebook: Path) -> list[tuple[str, str]]:
    """``(name, text)`` for each ``show_source(name)`` cell: the source as the book prints it
    (the highlighted HTML, its tags removed)."""
    out = []
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        names = CALL.findall("".join(cell["source"]))
        if not names:
            continue
        pages = ["".join(o.get("data", {}).get("text/html", "")) for o in cell.get("outputs", [])]
        pages = [p for p in pages if 'class="highlight"' in p]
        assert len(names) == len(pages), f"{notebook.name}: show_source({', '.join(names)}) without its output"
        out += [(name, html.unescape(re.sub(r"<[^>]+>", "", page))) for name, page in zip(names, pages)]
    return out


def test_the_reader_recovers_a_shown_function_exactly():
    from handbook_lib.face.display import show_source

    page = show_source(library_objects.__wrapped__)._repr_html_()
    text = html.unescape(re.sub(r"<[^>]+>", "", page))
    assert text.rstrip("\n") == textwrap.dedent(inspect.getsource(library_objects.__wrapped__)).rstrip("\n")


@pytest.mark.parametrize("notebook", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_each_shown_function_is_its_source_today(notebook):
    for name, text in shown(notebook):
        top, *attributes = name.split(".")  # a function, a class or a class's method
        objects = [functools.reduce(getattr, attributes, obj) for obj in library_objects().get(top, [])]
        assert len(objects) == 1, f"{notebook.name}: show_source({name}) names {len(objects)} library objects"
        source = textwrap.dedent(inspect.getsource(objects[0]))
        assert text.rstrip("\n") == source.rstrip("\n"), (
            f"{notebook.name}: the stored show_source({name}) differs from its source; re-execute the notebook")


@pytest.mark.parametrize("chapter", sorted(SHOWN))
def test_each_chapter_shows_the_code_its_runs_execute(chapter):
    names = {name for name, _ in shown(NOTEBOOKS / f"{chapter}.ipynb")}
    assert SHOWN[chapter] <= names, f"{chapter} does not show {sorted(SHOWN[chapter] - names)}"


def shown_cases(notebook: Path) -> list[tuple[str, str]]:
    """``(name, text)`` for each ``show_case("name")`` cell: its stored plain-text output."""
    out = []
    for cell in json.loads(notebook.read_text())["cells"]:
        names = CASE_CALL.findall("".join(cell["source"])) if cell["cell_type"] == "code" else []
        texts = ["".join(o["data"]["text/plain"]) for o in cell.get("outputs", []) if "text/plain" in o.get("data", {})]
        assert len(names) == len(texts) or not names, f"{notebook.name}: show_case({', '.join(names)}) without its output"
        out += list(zip(names, texts))
    return out


@pytest.mark.parametrize("notebook", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_each_shown_case_is_its_source_today(notebook):
    from handbook_lib.face.case_diff import show_case

    for name, text in shown_cases(notebook):
        assert text == repr(show_case(name)), (
            f"{notebook.name}: the stored show_case({name!r}) differs from the case's source; re-execute the notebook")


def test_the_clinic_shows_every_case_as_its_broken_and_fixed_lines():
    from handbook_lib.models.clinic_cases import CLINIC_CASES

    names = [name for name, _ in shown_cases(CLINIC)]
    assert sorted(names) == sorted(CLINIC_CASES), f"the clinic shows {names}, not each of {list(CLINIC_CASES)} once"


def test_the_case_reader_sees_a_stale_output(tmp_path):
    page = {"cells": [{"cell_type": "code", "source": ['show_case("forward_skips_hooks")'],
                       "outputs": [{"output_type": "execute_result", "data": {"text/plain": ["- call = model"]}}]}]}
    path = tmp_path / "p.ipynb"
    path.write_text(json.dumps(page))
    assert shown_cases(path) == [("forward_skips_hooks", "- call = model")]
    with pytest.raises(AssertionError, match="differs from the case's source"):
        test_each_shown_case_is_its_source_today(path)
