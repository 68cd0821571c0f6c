"""scripts/lock.py and the lock it writes: what set-up installs is what the lock pins.

- the lock was resolved from today's ``pyproject.toml`` (its recorded digest), and every
  distribution installed in this environment is at the version the lock pins for this Python
  (torch's local build label aside), so two fresh set-ups give the same ``pip freeze``;
- a lock that no longer matches ``pyproject.toml`` is refused in one line, by ``setup.sh``
  before anything is installed;
- ``make lock`` without the package index says so in one line and leaves the lock as it was.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("lock", ROOT / "scripts" / "lock.py")
lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock)

packaging_markers = pytest.importorskip("packaging.markers")

VENV_OWN = {"pip"}
"""What ``python -m venv`` puts in every environment, whatever the lock says."""


def locked_for_this_python() -> dict[str, str]:
    """``{name: version}`` of the lock's lines whose marker holds in this interpreter."""
    table = lock.pins(lock.LOCK.read_text())
    chosen = {}
    for name, entries in table.items():
        versions = [v for v, marker in entries if not marker or packaging_markers.Marker(marker).evaluate()]
        assert len(versions) <= 1, (name, entries)
        if versions:
            chosen[name] = versions[0]
    return chosen


def test_the_lock_is_the_one_pyproject_gives():
    lock.check()  # raises LockError, naming `make lock`, otherwise
    text = lock.LOCK.read_text()
    assert lock.header_value(text, lock.TORCH_LINE) == "2.13.0"
    assert lock.pin(["torch", "uv"], text) == ["torch==2.13.0", f"uv=={importlib.metadata.version('uv')}"]


def test_every_installed_distribution_is_at_its_locked_version():
    locked = locked_for_this_python()
    installed = {lock.normalize(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    assert len(installed) > 100
    off = {name: (version, locked.get(name)) for name, version in installed.items()
           if name != "handbook-lib" and name not in VENV_OWN
           and locked.get(name) != version.split("+")[0]}
    assert not off, f"installed (version, locked): {off}"
    for name in ("torch", "accelerate", "transformers", "deepspeed", "torchdata", "jupyter-book", "numpy"):
        assert installed[name].split("+")[0] == locked[name]


def test_pins_read_markers_and_normalize_names():
    text = ("# header\nFoo_Bar==1.0 ; python_full_version < '3.11'\n    # via x\n"
            "foo-bar==2.0 ; python_full_version >= '3.11'\nuv==0.9.1\n")
    assert lock.pins(text) == {"foo-bar": [("1.0", "python_full_version < '3.11'"),
                                           ("2.0", "python_full_version >= '3.11'")],
                               "uv": [("0.9.1", "")]}
    assert lock.pin(["uv"], text) == ["uv==0.9.1"]
    with pytest.raises(lock.LockError, match="must pin foo-bar once"):
        lock.pin(["foo-bar"], text)
    with pytest.raises(lock.LockError, match="not a pinned requirement"):
        lock.pins("numpy>=2\n")


def test_the_digest_follows_requirements_not_comments():
    text = (ROOT / "pyproject.toml").read_text()
    base = lock.digest(lock.requirements_of(text, "2.13.0"))
    assert lock.digest(lock.requirements_of(text.replace("# A range", "# Some range"), "2.13.0")) == base
    assert lock.digest(lock.requirements_of(text, "2.14.1")) != base
    changed = text.replace('"accelerate>=1.10,<2"', '"accelerate>=1.11,<2"')
    assert changed != text and lock.digest(lock.requirements_of(changed, "2.13.0")) != base


def _tree_with(tmp_path: Path, pyproject_text: str) -> Path:
    """The files set-up reads, in a folder of their own."""
    (tmp_path / "scripts").mkdir()
    for name in ("setup.sh", "lock.py"):
        shutil.copy2(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    shutil.copy2(lock.LOCK, tmp_path / "requirements.lock")
    (tmp_path / "pyproject.toml").write_text(pyproject_text)
    return tmp_path


def test_setup_refuses_a_stale_lock_in_one_line_before_installing(tmp_path):
    text = (ROOT / "pyproject.toml").read_text().replace('"accelerate>=1.10,<2"', '"accelerate>=1.11,<2"')
    tree = _tree_with(tmp_path, text)
    done = subprocess.run(["bash", "scripts/setup.sh", "test"], cwd=tree, capture_output=True, text=True,
                          env={**os.environ, "VENV": ".venv"}, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "setup: requirements.lock does not match pyproject.toml (a requirement changed since the lock "
        "was made): run `make lock`, then `make check-latest`"]
    venv = tree / ".venv"
    if sys.version_info >= (3, 11):  # tomllib: the check ran before the venv was made
        assert not venv.exists()
    else:  # the check ran in a bare venv: nothing but what venv itself puts there
        assert not list(venv.glob("lib/python*/site-packages/torch"))


def test_a_missing_lock_is_refused_naming_make_lock(tmp_path):
    tree = _tree_with(tmp_path, (ROOT / "pyproject.toml").read_text())
    (tree / "requirements.lock").unlink()
    done = subprocess.run([sys.executable, "scripts/lock.py", "check"], cwd=tree, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "run `make lock`" in done.stderr


def test_make_lock_without_the_index_leaves_the_lock_unchanged(tmp_path):
    """An index nobody answers on (port 9, discard): one line, exit 2, the lock's bytes kept."""
    tree = _tree_with(tmp_path, (ROOT / "pyproject.toml").read_text())
    before = (tree / "requirements.lock").read_bytes()
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
    env.update(UV_INDEX_URL="http://127.0.0.1:9/simple", UV_HTTP_RETRIES="0",
               UV_CACHE_DIR=str(tmp_path / "uv-cache"), VENV=str(ROOT / ".venv"))
    done = subprocess.run([sys.executable, "scripts/lock.py", "write"], cwd=tree, capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "make lock: no network access to the package index; the lock is unchanged"]
    assert (tree / "requirements.lock").read_bytes() == before
    assert not list(tree.glob("requirements.lock.*"))
