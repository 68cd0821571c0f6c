"""The book's planner widget (book/_static/planner.js, on book/planner.md and in chapter 4): its
choices are the package's presets, and what the
build packs for the browser runs on its own, without torch. (Chromium drives the page itself in
``make check-book``: scripts/check_planner.py.)"""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

from handbook_lib.models.hardware import ACCELERATORS, LINKS
from handbook_lib.models.presets import DECODER_SHAPES

ROOT = Path(__file__).resolve().parents[1]
FORM = (ROOT / "book" / "_static" / "planner.js").read_text()  # the widget's markup lives there


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _options(select):
    block = re.search(rf'<select name="{select}">(.*?)</select>', FORM, re.S).group(1)
    return [value or text for value, text in re.findall(r'<option(?: value="([^"]*)")?[^>]*>([^<]*)</option>', block)]


def test_the_page_offers_the_package_s_presets():
    assert set(_options("model")) <= set(DECODER_SHAPES) and "llama3-405b" in _options("model")
    assert set(_options("gpu")) == {name for name in ACCELERATORS if name != "cpu"}
    assert set(_options("inter_link")) <= set(LINKS)
    from handbook_lib.core.config import OPTIMIZER_IMPLS, OPTIMIZERS, PRECISIONS

    assert _options("precision")[0] == "bf16-mixed" and sorted(_options("precision")) == sorted(PRECISIONS)
    assert sorted(_options("optimizer")) == sorted(OPTIMIZERS)
    assert sorted(_options("optimizer_impl")) == sorted(OPTIMIZER_IMPLS)  # "" is the default's value


def test_the_packed_models_answer_without_torch(tmp_path):
    """The zip the build copies into the site (book/_ext/planner.py) holds the pure layers only,
    and plan_page runs from it in a process where torch cannot be imported."""
    planner = _load("planner_ext", ROOT / "book" / "_ext" / "planner.py")
    target = tmp_path / "handbook_models.zip"
    count = planner.pack_models(target)
    import zipfile

    names = zipfile.ZipFile(target).namelist()
    assert len(names) == count and all(n.endswith(".py") for n in names)
    assert {n.split("/")[1] for n in names if n.count("/") > 1} == {"core", "models"}
    zipfile.ZipFile(target).extractall(tmp_path / "site")  # as the page's Pyodide unpacks it
    code = ("import sys, json; sys.modules['torch'] = None; sys.path.insert(0, sys.argv[1]); "
            "from handbook_lib.models.plan_output import plan_page; import handbook_lib; "
            "print(handbook_lib.__file__); "
            "print(plan_page(json.dumps({'model': 'llama2-7b', 'gpu': 'h100-80gb', 'gpus': '8'})))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "site")], capture_output=True, text=True,
                         check=True, cwd=tmp_path).stdout.splitlines()
    assert out[0].startswith(str(tmp_path / "site"))  # imported from what was packed, not the checkout
    assert json.loads(out[1])["view"]["pick"]["name"]


def test_the_page_and_the_command_line_compare_numbers_as_json_carries_them():
    checker = _load("check_planner", ROOT / "scripts" / "check_planner.py")
    assert checker.same({"a": [0.0, 1.5]}, {"a": [0, 1.5]})  # JavaScript's 0 for Python's 0.0
    assert checker.same(0.11328090569474715, 0.11328090569474718)  # one ulp
    assert not checker.same(1.0, 1.0001) and not checker.same(True, 1) and not checker.same({"a": 1}, {"b": 1})
    assert len(checker.CONFIGS) >= 20
