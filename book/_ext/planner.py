"""Sphinx extension: the planner page's runtime and the package's models, served by the book itself.

``book/planner.md`` runs ``handbook_lib.models.plan_output.plan_page`` in the reader's browser.
After an HTML build this copies into the site, so that the page asks nothing of any other host:

- ``_static/planner/handbook_models.zip``: ``handbook_lib/__init__.py`` and the ``core`` and
  ``models`` packages, their ``.py`` files as they are in the repository (pure Python: no torch);
- ``_static/pyodide/``: Pyodide's core runtime (the interpreter in WebAssembly and Python's
  standard library), from the npm package ``scripts/setup.sh book`` installs into
  ``.venv/node`` at the version it pins (:data:`PYODIDE_FILES`).
"""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYODIDE_FILES = ("pyodide.mjs", "pyodide.asm.mjs", "pyodide.asm.wasm", "python_stdlib.zip", "pyodide-lock.json")
"""The files of the npm package ``pyodide`` the page loads (its core, no packages)."""


def pyodide_dir() -> Path:
    """Where ``scripts/setup.sh book`` put Pyodide (``HANDBOOK_PYODIDE`` overrides it)."""
    return Path(os.environ.get("HANDBOOK_PYODIDE", ROOT / ".venv" / "node" / "node_modules" / "pyodide"))


def pack_models(target: Path) -> int:
    """Write the zip of ``handbook_lib``'s pure layers to ``target``; returns the files packed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    package = ROOT / "handbook_lib"
    layers = sorted(p for layer in ("core", "models") for p in (package / layer).rglob("*.py"))
    files = [package / "__init__.py", *layers]
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in files:
            info = zipfile.ZipInfo(str(path.relative_to(ROOT)), date_time=(2026, 1, 1, 0, 0, 0))
            archive.writestr(info, path.read_bytes(), zipfile.ZIP_DEFLATED)
    return len(files)


def _copy(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    static = Path(app.outdir) / "_static"
    source = pyodide_dir()
    missing = [name for name in PYODIDE_FILES if not (source / name).exists()]
    if missing:
        raise RuntimeError(f"the planner page needs Pyodide's {', '.join(missing)} in {source}: "
                           "scripts/setup.sh book installs it (npm)")
    (static / "pyodide").mkdir(parents=True, exist_ok=True)
    for name in PYODIDE_FILES:
        shutil.copyfile(source / name, static / "pyodide" / name)
    pack_models(static / "planner" / "handbook_models.zip")


def setup(app):
    app.connect("build-finished", _copy)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
