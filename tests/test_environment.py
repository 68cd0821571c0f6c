"""environment.yml (for conda on a GPU JupyterHub) must stay in step with pyproject.toml.

Conda is not available where CI runs, so this checks the file statically: it parses, and its pip
section lists exactly the package's requirements and those of its extras.
"""

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parent.parent


def test_environment_pip_section_matches_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert env["name"] == "fsdp-handbook"
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert "-e ." in pip_section
    listed = [r for r in pip_section if r != "-e ."]
    expected = list(project["dependencies"])
    for extra in ("book", "lab", "test", "frameworks"):
        expected += project["optional-dependencies"][extra]
    assert sorted(set(listed)) == sorted(set(expected))
    assert len(listed) == len(set(listed))
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python="))
    assert python.split("=")[1].startswith("3.")
