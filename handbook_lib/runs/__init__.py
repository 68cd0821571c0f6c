"""Experiments, one module each, started with ``torchrun`` (see :mod:`handbook_lib.launch`).

Every run module defines ``CONFIG`` (its config dataclass), ``run(config, ctx)`` and optionally
``validate(config, world_size)``, and ends by calling :func:`handbook_lib.runs.entry.main`.

The functions here describe the runs *without importing them* (a run module imports torch,
about 2 s): :func:`describe_runs` and :func:`run_config_fields` read the modules' source with
:mod:`ast`, so ``python -m handbook_lib runs`` and ``run --help`` answer at once.
"""

from __future__ import annotations

import ast
import pkgutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunConfigInfo", "available_runs", "check_run_name", "describe_runs", "run_config_fields"]

_NOT_RUNS = {"entry"}
_HERE = Path(__file__).resolve().parent


def available_runs() -> list[str]:
    """Names of the runs that can be launched, sorted."""
    return sorted(
        m.name for m in pkgutil.iter_modules(__path__)
        if not m.name.startswith("_") and m.name not in _NOT_RUNS
    )


def _tree(name: str) -> ast.Module:
    return ast.parse((_HERE / f"{name}.py").read_text(encoding="utf-8"))


def describe_runs() -> dict[str, str]:
    """Each run's name and the first line of its module docstring, read from the source file
    (no import, no torch)."""
    out = {}
    for name in available_runs():
        doc = (ast.get_docstring(_tree(name)) or "").strip()
        out[name] = doc.splitlines()[0] if doc else ""
    return out


@dataclass(frozen=True)
class RunConfigInfo:
    """A run's config class, as written in its source.

    Attributes:
        class_name: The dataclass ``CONFIG`` names, e.g. ``"StepTimeConfig"``.
        base: Its first base class (``"RunConfig"``, ``"FlatConfig"``), or the class itself when
            the run uses ``RunConfig`` directly.
        fields: ``(key, default as written)`` for the keys the class declares itself.
        choices: Accepted values per key, where the class annotates it ``Literal[...]``.
    """

    class_name: str
    base: str
    fields: tuple[tuple[str, str], ...]
    choices: dict[str, tuple[str, ...]]


def check_run_name(name: str) -> None:
    """Refuse a name that is not a run, in one line: the closest run's name when one is close
    (the whole list is one command away), else every run's name.

    Raises:
        ValueError: e.g. ``unknown run 'fsdp-train': did you mean 'fsdp_train'? (all 12 available
            runs: python -m handbook_lib runs)`` or ``unknown run 'nope'; available runs: ...``.
    """
    import difflib

    runs = available_runs()
    if name in runs:
        return
    close = difflib.get_close_matches(str(name), runs, n=1)
    if close:
        raise ValueError(f"unknown run {name!r}: did you mean {close[0]!r}? (all {len(runs)} available runs: "
                         "python -m handbook_lib runs)")
    raise ValueError(f"unknown run {name!r}; available runs: {', '.join(runs)}")


def run_config_fields(name: str) -> RunConfigInfo:
    """What run ``name`` accepts as config keys, read from its source (no import, no torch).

    Raises:
        ValueError: if ``name`` is not a run, or its module has no ``CONFIG = <class>`` line.
    """
    check_run_name(name)
    tree = _tree(name)
    config_name = next((node.value.id for node in tree.body if isinstance(node, ast.Assign)
                        and any(isinstance(t, ast.Name) and t.id == "CONFIG" for t in node.targets)
                        and isinstance(node.value, ast.Name)), None)
    if config_name is None:
        raise ValueError(f"run {name!r} has no 'CONFIG = <class>' line")
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == config_name), None)
    if cls is None:  # imported: RunConfig itself, or a shared config of the vocabulary's own module
        tree = _imported_module(tree, config_name)
        cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == config_name), None)
        if cls is None or config_name == "RunConfig":
            return RunConfigInfo(config_name, config_name, (), {})
    aliases = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
               for t in node.targets if isinstance(t, ast.Name)}  # e.g. SpMethod = Literal[...]
    fields, choices = [], {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if "ClassVar" in ast.unparse(node.annotation):
            continue
        annotation = node.annotation
        if isinstance(annotation, ast.Name) and annotation.id in aliases:
            annotation = aliases[annotation.id]
        if (isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name)
                and annotation.value.id == "Literal"):
            values = ast.literal_eval(annotation.slice)
            choices[node.target.id] = values if isinstance(values, tuple) else (values,)
        fields.append((node.target.id, ast.unparse(node.value) if node.value is not None else ""))
    base = ast.unparse(cls.bases[0]) if cls.bases else config_name
    return RunConfigInfo(config_name, base, tuple(fields), dict(choices))


def _imported_module(tree: ast.Module, name: str) -> ast.Module:
    """The parsed source of the ``handbook_lib`` module a run imports ``name`` from (a config
    class of :mod:`handbook_lib.core`), or an empty module if it imports it from elsewhere."""
    for node in tree.body:
        if (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("handbook_lib.")
                and any(alias.name == name for alias in node.names)):
            path = _HERE.parent.joinpath(*node.module.split(".")[1:]).with_suffix(".py")
            return ast.parse(path.read_text(encoding="utf-8"))
    return ast.Module(body=[], type_ignores=[])
