"""environment.yml (for conda on a GPU JupyterHub, and hub/Dockerfile's image) installs the same
locked set as ``scripts/setup.sh``: the course with its book, test, lab and frameworks extras,
constrained by ``requirements.lock``.

Conda is not available where CI runs, so this checks the file statically: it parses, its pip
section is the lock as constraints plus the editable course with extras pyproject.toml defines,
and every line of the lock is a requirement pip reads (``name==version`` with a valid marker).
"""

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
tomllib = pytest.importorskip("tomllib")
requirements = pytest.importorskip("packaging.requirements")

ROOT = Path(__file__).resolve().parent.parent


def test_environment_installs_the_locked_set():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert env["name"] == "fsdp-handbook"
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert pip_section == ["-c requirements.lock", "-e .[book,test,lab,frameworks]"]
    assert {"book", "test", "lab", "frameworks"} <= set(project["optional-dependencies"])
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python="))
    major, minor = map(int, python.split("=")[1].split(".")[:2])
    assert (major, minor) >= (3, 10)  # the lock covers Python 3.10 and later
    assert (ROOT / "requirements.lock").is_file()


def test_every_lock_line_is_a_pinned_requirement_pip_reads():
    lines = [line.strip() for line in (ROOT / "requirements.lock").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert len(lines) > 100
    for line in lines:
        req = requirements.Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==" and not req.extras and req.url is None, line
        if req.marker:
            req.marker.evaluate()  # a marker pip can evaluate here
