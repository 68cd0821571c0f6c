"""scripts/check_latest.py's pure parts (no install, no network): which packages moved beyond the
lock, pytest's JUnit XML read back, the moved packages a failure's file imports, the list of
framework tests and notebooks, and the report's width. Every expected value is written here."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_latest", ROOT / "scripts" / "check_latest.py")
check_latest = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("check_latest", check_latest)  # its dataclasses look their module up
_spec.loader.exec_module(check_latest)
Move, Failure, Outcome = check_latest.Move, check_latest.Failure, check_latest.Outcome

OLD, NEW = "python_full_version < '3.11'", "python_full_version >= '3.11'"
LOCK = f"""# The project's lock
# torch: 2.13.0
accelerate==1.15.0 ; {OLD}
    # via handbook-lib (pyproject.toml)
accelerate==1.16.0 ; {NEW}
    # via handbook-lib (pyproject.toml)
numpy==2.3.0
Sphinx==7.4.7
    # via jupyter-book
torch==2.13.0
typing-extensions==4.16.0
"""
INSTALLED = {"accelerate": "1.16.0", "numpy": "2.4.1", "sphinx": "7.4.7", "torch": "2.13.0+cpu",
             "typing_extensions": "4.16.0", "Brand.New_Dep": "0.3", "pip": "24.0", "handbook_lib": "0.1.0"}
ON_311 = {OLD: False, NEW: True}
ON_310 = {OLD: True, NEW: False}


def test_moved_on_311_ignores_torchs_local_label_and_names_what_the_lock_lacks():
    moves = check_latest.moved(LOCK, INSTALLED, ON_311, {"pip", "handbook-lib"})
    assert moves == [Move("brand-new-dep", None, "0.3"), Move("numpy", "2.3.0", "2.4.1")]
    assert [m.line() for m in moves] == ["brand-new-dep  (not in the lock) -> 0.3", "numpy  2.3.0 -> 2.4.1"]


def test_moved_follows_the_markers_of_the_python_it_is_for():
    moves = check_latest.moved(LOCK, INSTALLED, ON_310, {"pip", "handbook-lib"})
    assert moves == [Move("accelerate", "1.15.0", "1.16.0"), Move("brand-new-dep", None, "0.3"),
                     Move("numpy", "2.3.0", "2.4.1")]


def test_moved_markers_evaluated_by_packaging():
    markers = pytest.importorskip("packaging.markers")
    env = {"python_full_version": "3.10.14", "python_version": "3.10"}
    evaluated = {m: markers.Marker(m).evaluate(env) for m in (OLD, NEW)}
    assert evaluated == ON_310
    assert Move("accelerate", "1.15.0", "1.16.0") in check_latest.moved(LOCK, INSTALLED, evaluated)


def test_nothing_moved_and_the_venvs_own_pip_ignored_by_default():
    same = {"accelerate": "1.16.0", "numpy": "2.3.0", "Sphinx": "7.4.7", "torch": "2.13.0+cpu",
            "typing-extensions": "4.16.0", "pip": "24.0"}
    assert check_latest.moved(LOCK, same, ON_311) == []


def test_a_torch_of_another_version_moved_whatever_its_label():
    assert check_latest.moved(LOCK, {"torch": "2.14.0+cpu"}, ON_311) == [Move("torch", "2.13.0", "2.14.0+cpu")]
    assert check_latest.same_version("2.13.0+cpu", "2.13.0")
    assert not check_latest.same_version("2.13.0", "2.13.0+cu128")
    assert check_latest.same_version("1.0.4.post1", "1.0.4post1")  # the same version, spelt two ways


# pytest's own XML (junit_family=xunit2), in the shapes it writes for these cases (attributes and
# texts shortened): a parametrized method in a class, a file that failed to collect, a module
# fixture's error, a plain skip, a module-level importorskip, a notebook's cell (nbval, colours as
# pytest escapes them) and passing tests.
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest"
errors="1" failures="2" skipped="2" tests="7">
<testcase classname="" name="tests.test_runs_deepspeed_zero" time="0.000"><skipped message="collection skipped"
>('/w/tests/test_runs_deepspeed_zero.py', 11, "Skipped: could not import 'deepspeed': No module named 'deepspeed'")</skipped></testcase>
<testcase classname="tests.test_frameworks.TestZero" name="test_p[a.b-2]" time="0.001"><failure
message="AssertionError: assert 'a.b' == 2">long traceback</failure></testcase>
<testcase classname="tests.test_frameworks.TestZero" name="test_p[2]" time="0.000" />
<testcase classname="" name="tests.test_hf_config" time="0.000"><error message="collection failure"
>tests/test_hf_config.py:3: in &lt;module&gt;
    import transformers
E   ValueError: Either a revision or a version must be specified.</error></testcase>
<testcase classname="tests.test_book" name="test_every_toc_page_is_built" time="0.000"><error
message="failed on setup with &quot;RuntimeError: boom&quot;">traceback</error></testcase>
<testcase classname="tests.test_frameworks" name="test_gpu" time="0.000"><skipped type="pytest.skip"
message="no gpu">/w/tests/test_frameworks.py:10: no gpu</skipped></testcase>
<testcase classname="notebooks.06_checkpointing.ipynb" name="Cell 11" time="0.5"><failure
message="#x1B[91mNotebook cell execution failed#x1B[0m&#10;#x1B[94mCell 11: Cell outputs differ&#10;&#10;Input:"
>x</failure></testcase>
<testcase classname="notebooks.06_checkpointing.ipynb" name="Cell 12" time="0.1" />
</testsuite></testsuites>"""
PATHS = ["tests/test_frameworks.py", "tests/test_runs_deepspeed_zero.py", "tests/test_book.py", "tests/test_hf_config.py",
         "notebooks/06_checkpointing.ipynb"]


def test_junit_read_back_to_node_ids():
    assert check_latest.parse_junit(JUNIT, PATHS) == Outcome(passed=2, failed=5, skipped=1, failures=(
        Failure("tests/test_runs_deepspeed_zero.py", "tests/test_runs_deepspeed_zero.py", "import skipped",
                "could not import 'deepspeed': No module named 'deepspeed'"),
        Failure("tests/test_frameworks.py", "tests/test_frameworks.py::TestZero::test_p[a.b-2]", "failed",
                "AssertionError: assert 'a.b' == 2"),
        Failure("tests/test_hf_config.py", "tests/test_hf_config.py", "error",
                "ValueError: Either a revision or a version must be specified."),
        Failure("tests/test_book.py", "tests/test_book.py::test_every_toc_page_is_built", "error",
                'failed on setup with "RuntimeError: boom"'),
        Failure("notebooks/06_checkpointing.ipynb", "notebooks/06_checkpointing.ipynb::Cell 11", "failed",
                "Notebook cell execution failed: Cell 11: Cell outputs differ"),
    ))


def test_a_test_case_of_no_file_run_keeps_pytests_names():
    assert check_latest.node_id("other.mod", "test_x", PATHS) == ("", "other.mod::test_x")
    # a file whose dotted name starts another's is not taken for it
    assert check_latest.node_id("tests.test_frameworks_more", "t", PATHS) == ("", "tests.test_frameworks_more::t")


def test_guess_names_the_moved_packages_a_file_imports_then_their_dependencies():
    requires = {"accelerate": {"huggingface-hub", "numpy", "torch"}, "torch": {"sympy"},
                "huggingface-hub": {"tqdm"}, "sympy": {"mpmath"}}
    moved = {"accelerate", "tqdm", "mpmath", "sphinx"}
    assert check_latest.guess({"accelerate", "torch"}, moved, requires) == (["accelerate"], ["mpmath", "tqdm"])
    assert check_latest.guess({"torch"}, moved, requires) == ([], ["mpmath"])
    assert check_latest.guess({"yaml"}, moved, requires) == ([], [])


def test_imported_modules_follow_the_projects_own_modules(tmp_path):
    (tmp_path / "handbook_lib" / "runs").mkdir(parents=True)
    (tmp_path / "handbook_lib" / "__init__.py").write_text("")
    (tmp_path / "handbook_lib" / "runs" / "__init__.py").write_text("from .job import run\n")
    (tmp_path / "handbook_lib" / "runs" / "job.py").write_text(
        "import os\n\ndef run():\n    from accelerate import Accelerator\n    import deepspeed.comm\n")
    (tmp_path / "handbook_lib" / "unused.py").write_text("import transformers\n")
    test = tmp_path / "test_x.py"
    test.write_text("import pytest\nfrom handbook_lib.runs import run\n")
    assert check_latest.imported_modules(test, tmp_path) == {"pytest", "os", "accelerate", "deepspeed"}
    notebook = tmp_path / "n.ipynb"
    notebook.write_text(json.dumps({"cells": [
        {"cell_type": "markdown", "source": ["import sphinx\n"]},
        {"cell_type": "code", "source": ["%matplotlib inline\n", "import torchdata\n"]}]}))
    assert check_latest.imported_modules(notebook, tmp_path) == {"torchdata"}


def test_every_framework_has_a_test_and_a_notebook_or_the_book():
    by_framework = {}
    for check in check_latest.CHECKS:
        assert (ROOT / check.path).is_file(), check.path
        for framework in check.frameworks:
            by_framework.setdefault(framework, set()).add(check.phase)
    assert set(by_framework) == {"accelerate", "transformers", "deepspeed", "torchdata", "jupyter-book"}
    for framework in ("accelerate", "transformers", "deepspeed", "torchdata"):
        assert {"tests", "notebooks"} <= by_framework[framework], framework
    assert by_framework["jupyter-book"] == {"book"}
    paths = {c.phase: set() for c in check_latest.CHECKS}
    for c in check_latest.CHECKS:
        paths[c.phase].add(c.path)
    assert paths["notebooks"] == {"notebooks/07_accelerate_trainer_deepspeed.ipynb", "notebooks/06_checkpointing.ipynb"}
    assert paths["book"] == {"tests/test_book.py"}
    assert {"tests/test_frameworks.py", "tests/test_runs_accelerate_fsdp.py", "tests/test_runs_trainer_deepspeed.py",
            "tests/test_runs_deepspeed_zero.py", "tests/test_data_loader.py"} <= paths["tests"]


@pytest.mark.parametrize("check", [c for c in check_latest.CHECKS if c.phase != "book"], ids=lambda c: c.path)
def test_each_listed_file_reaches_the_frameworks_it_is_listed_for(check):
    """Through its own imports or the project's modules it imports (what the report's guess reads)."""
    modules = check_latest.imported_modules(ROOT / check.path)
    assert set(check.frameworks) <= modules


def test_the_book_entry_builds_the_book_with_the_book_targets_flags():
    text = (ROOT / "tests" / "test_book.py").read_text()
    assert '"build", str(ROOT), "--path-output", str(out), "-n", "-W", "--keep-going"' in text


@pytest.mark.parametrize("relative, patterns, excluded", [
    (".venv-latest", ["_build", ".venv", "tests"], False),
    (".venv", ["_build", ".venv"], True),
    (".venv-latest", [".venv*"], True),
    ("a/b", ["a"], True),
    ("ab", ["a"], False),
    ("x/.venv-latest", ["*/.venv-latest"], True),
    ("x/y/.venv-latest", ["*/.venv-latest"], False),
    ("x/y/.venv-latest", ["**/.venv-latest"], True),
])
def test_book_excludes_reads_patterns_as_sphinx(relative, patterns, excluded):
    assert check_latest.book_excludes(relative, patterns) is excluded


def test_report_fits_100_columns_and_says_a_repeated_failure_once():
    moves = [Move("accelerate", "1.16.0", "1.15.0"), Move("brand-new-dep", None, "0.3")]
    long_id = "tests/test_frameworks.py::test_" + "x" * 120 + "[param]"
    message = "AssertionError: " + "word " * 60
    outcomes = {"tests": Outcome(10, 3, 1, (
        Failure("tests/test_frameworks.py", long_id, "failed", message),
        Failure("tests/test_book.py", "tests/test_book.py::test_a", "error", "boom"),
        Failure("tests/test_book.py", "tests/test_book.py::test_b", "error", "boom")))}
    lines = check_latest.report(moves, outcomes, {"set-up": 20.0, "tests": 125.0},
                                {"tests/test_frameworks.py": (["accelerate"], ["tqdm"])}, ["a note"])
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    text = "\n".join(lines)
    assert "  accelerate  1.16.0 -> 1.15.0\n  brand-new-dep  (not in the lock) -> 0.3" in text
    assert "moved among its imports (a guess): accelerate, tqdm (a dependency)" in text
    assert text.count("boom") == 1 and "tests/test_book.py::test_b (error, as above)" in text
    assert "times: set-up 20 s; tests 2 min 05 s (10 passed, 3 failed, 1 skipped)" in text
    assert "note: a note" in text


def test_nothing_moved_in_one_line():
    lines = check_latest.report([], {}, {"set-up": 3.0}, {})
    assert "nothing moved: every installed package is at the version the lock pins" in lines
    assert "failed: none" in lines


def test_the_projects_own_venv_is_refused(capsys):
    assert check_latest.main(["--venv", str(ROOT / ".venv")]) == 2
    assert capsys.readouterr().err.strip().endswith("refusing to upgrade the project's own .venv (use --venv DIR)")
