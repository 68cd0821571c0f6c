"""No test patches a third-party package where its users cannot reach.

The tests exercise Accelerate, DeepSpeed, Transformers and the other frameworks through what a
user controls (a config file, the environment, constructor arguments, a process group, a
device faked at torch's public level), never by replacing names inside them: such a name can
vanish in any release (``accelerate.utils.dataclasses.is_cuda_available`` did in 1.16), and the
test then breaks for a reason that is not the course's. This reads every test module's syntax
tree and refuses, in a third-party package:

- any patch (``setattr``/``delattr`` of a monkeypatch or the builtin, ``mock.patch``,
  ``mock.patch.object``, an assignment to an attribute) inside the frameworks (:data:`FRAMEWORKS`);
- a patch anywhere else (torch included) of a private name: one starting with ``_``, or reached
  through a private module or class.

Patching torch's public functions (``torch.cuda.is_available``, ``torch.cuda.device_count``,
``torch.accelerator.current_accelerator``) stays allowed: that is the faked device at torch's
level. A target the reader cannot resolve to an import (a local object) is not judged.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = frozenset({"accelerate", "deepspeed", "transformers", "torchdata", "jupyter_book", "sphinx",
                        "nbval", "nbclient", "nbformat", "selenium", "jupyterhub", "nbgitpuller"})
OWN = frozenset({"handbook_lib", "tests", "conftest", "scripts"})
PATCH_METHODS = frozenset({"setattr", "delattr"})


def _imports(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted module path or object path, from the module's imports (any depth)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    names[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, names: dict[str, str]) -> str | None:
    """``a.b.c`` for an attribute chain whose root is an imported name, else ``None``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in names:
        return ".".join([names[node.id], *reversed(parts)])
    return None


def _judge(path: str) -> str | None:
    """Why patching ``path`` (a dotted path ending in the patched name) is refused, or ``None``."""
    parts = path.split(".")
    root = parts[0]
    if root in OWN or root in sys.stdlib_module_names or root == "builtins":
        return None
    if root in FRAMEWORKS:
        return f"patches {path} inside {root}"
    private = [p for p in parts[1:] if p.startswith("_") and not p.startswith("__")]
    if private:
        return f"patches {path}, private to {root} ({private[0]})"
    return None


def violations(source: str, filename: str = "<test>") -> list[str]:
    """Each refused patch in ``source``: ``file:line: why``."""
    tree = ast.parse(source, filename)
    names = _imports(tree)
    found = []

    def report(node: ast.AST, path: str | None) -> None:
        why = path and _judge(path)
        if why:
            found.append(f"{filename}:{node.lineno}: {why}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            method = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            args = node.args
            if method in PATCH_METHODS and len(args) >= 2 and isinstance(args[1], ast.Constant) \
                    and isinstance(args[1].value, str):
                base = _dotted(args[0], names)
                report(node, base and f"{base}.{args[1].value}")
            elif method in PATCH_METHODS and len(args) >= 1 and isinstance(args[0], ast.Constant) \
                    and isinstance(args[0].value, str) and "." in args[0].value:  # setattr("a.b.c", v)
                report(node, args[0].value)
            elif method == "patch" and args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
                report(node, args[0].value)  # mock.patch("pkg.mod.name")
            elif method == "object" and len(args) >= 2 and isinstance(args[1], ast.Constant) \
                    and isinstance(func, ast.Attribute) and getattr(func.value, "attr", None) == "patch":
                base = _dotted(args[0], names)  # mock.patch.object(target, "name")
                report(node, base and f"{base}.{args[1].value}")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute):
                    report(node, _dotted(target, names))
    return found


def test_no_test_patches_a_third_party_package_from_inside():
    files = sorted((ROOT / "tests").rglob("*.py")) + [ROOT / "conftest.py"]
    found = [v for path in files for v in violations(path.read_text(), str(path.relative_to(ROOT)))]
    assert len(files) > 50 and not found, "\n".join(found)


@pytest.mark.parametrize(("source", "refused"), [
    ("import accelerate.utils.dataclasses as d\nmonkeypatch.setattr(d, 'is_cuda_available', f)", True),
    ("import accelerate.utils.launch as al\nenv.setattr(al, 'is_port_in_use', f)", True),
    ("import deepspeed.runtime.config as c\nmp.setattr(c.dist, 'get_world_size', f)", True),
    ("from torch.distributed._tools import mem_tracker\nm.setattr(mem_tracker._WeakRefInfo, 'x', f)", True),
    ("import torch\nm.setattr(torch.cuda, '_lazy_init', f)", True),
    ("from unittest import mock\nmock.patch('transformers.trainer.is_sagemaker_mp_enabled')", True),
    ("from unittest import mock\nimport accelerate\nmock.patch.object(accelerate, 'Accelerator')", True),
    ("import deepspeed.comm.torch as t\nt.build_shm_op = None", True),
    ("monkeypatch.setattr('accelerate.utils.other.is_port_in_use', f)", True),
    ("import torch\nmonkeypatch.setattr(torch.cuda, 'is_available', lambda: True)", False),
    ("import torch\nmp.setattr(torch.accelerator, 'current_accelerator', f)", False),
    ("import shutil\nmonkeypatch.setattr(shutil, 'disk_usage', f)", False),
    ("from handbook_lib.launch import commands\nmonkeypatch.setattr(commands, 'torchrun', f)", False),
    ("monkeypatch.setattr(tracker, '_current_total', f)", False),  # a local object: not judged
    ("import torch\nx = torch.zeros(2)\nx.grad = None", False),
])
def test_the_reader_tells_a_private_patch_from_a_public_one(source, refused):
    assert bool(violations(source)) is refused
