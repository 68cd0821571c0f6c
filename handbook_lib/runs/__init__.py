"""Experiments, one module each, started with ``torchrun`` (see :mod:`handbook_lib.launch`).

Every run has two modules: ``handbook_lib/runs/specs/<name>.py``, torch-free, defines its config
dataclass (``CONFIG``), its ``validate(config, world_size)`` and a
:class:`~handbook_lib.core.run_spec.RunSpec` (``SPEC``); ``handbook_lib/runs/<name>.py`` imports
them, defines ``run(config, ctx)`` and ends by calling :func:`handbook_lib.runs.entry.main`.

The functions here describe the runs from their specs, *without importing the run modules* (a
run module imports torch, about 2 s), so ``python -m handbook_lib runs`` and ``run --help``
answer at once, and the launcher checks a config before anything starts
(:func:`run_spec`).
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.core.run_spec import RunSpec
from handbook_lib.runs.specs import SPECS

__all__ = ["RunConfigInfo", "available_runs", "check_run_name", "describe_runs", "run_config_fields", "run_spec"]


def available_runs() -> list[str]:
    """Names of the runs that can be launched, sorted."""
    return sorted(SPECS)


def describe_runs() -> dict[str, str]:
    """Each run's name and its one-line description (the first line of its spec's docstring,
    which is its run module's too)."""
    return {name: SPECS[name].summary for name in available_runs()}


@dataclass(frozen=True)
class RunConfigInfo:
    """A run's config class, as its spec declares it.

    Attributes:
        class_name: The dataclass ``CONFIG`` names, e.g. ``"StepTimeConfig"``.
        base: Its first base class (``"RunConfig"``, ``"FlatConfig"``), or the class itself when
            the run uses ``RunConfig`` directly.
        fields: ``(key, default's repr)`` for the keys the class adds to its base's, or whose
            default it changes.
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


def run_spec(name: str) -> RunSpec:
    """Run ``name``'s spec: its config class and checks (no torch).

    Raises:
        ValueError: if ``name`` is not a run (:func:`check_run_name`).
    """
    check_run_name(name)
    return SPECS[name]


def run_config_fields(name: str) -> RunConfigInfo:
    """What run ``name`` accepts as config keys, read from its spec's config class.

    Raises:
        ValueError: if ``name`` is not a run.
    """
    cls = run_spec(name).config
    base = cls.__bases__[0].__name__ if cls.__name__ != "RunConfig" and cls.__bases__ else cls.__name__
    if cls.__name__ == "RunConfig":
        return RunConfigInfo(cls.__name__, base, (), {})
    # the keys the class adds to its base's, or whose default it changes (in a section or not)
    shared = cls.__bases__[0]().to_dict()
    defaults = cls().to_dict()
    added = [key for key, value in defaults.items() if key not in shared or shared[key] != value]
    kinds = cls.choices()
    fields = [(key, repr(defaults[key])) for key in added]
    choices = {key: kinds[key] for key in added if key in kinds}
    return RunConfigInfo(cls.__name__, base, tuple(fields), choices)
