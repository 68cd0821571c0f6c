"""Runs placed by the GPU hub's policy: several runs of one chapter, each on the devices its
plan (:func:`~handbook_lib.launch.gpus.ranks_for`) gives it, in as few jobs as possible.

Chapter 8 explains the policy; chapters 2, 3 and 5 start their runs through it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from handbook_lib.core.results import RunResult
from handbook_lib.launch.gpus import RankPlan
from handbook_lib.launch.runner import torchrun_batches

__all__ = ["torchrun_planned"]


def torchrun_planned(run: str, runs: Mapping[str, tuple[int, dict[str, Any] | None]], plan: RankPlan, *,
                     needs: Mapping[str, RankPlan] | None = None, **kwargs: Any) -> dict[str, RunResult]:
    """:func:`~handbook_lib.launch.runner.torchrun_batches` of ``runs``, each run placed by a plan.

    ``runs[label] = (n, config)`` is a run written for ``n`` ranks: it runs on ``plan.ranks(n)``
    ranks with ``plan.env``, or, for a label in ``needs``, by that lesson's own plan (a 2x2 mesh
    needs 4 GPUs: on 2 it runs on the CPU while the chapter's other runs use the GPUs). Runs that
    share an environment share one ``torchrun_batches`` call: on a CPU, or with GPUs enough for
    every plan, that is the one call ``torchrun_batches(run, runs)`` would make.

    Args:
        run: Name of a run module.
        runs: Label -> ``(n, config)``, as :func:`~handbook_lib.launch.runner.torchrun_batches`.
        plan: The chapter's plan (:func:`ranks_for`).
        needs: Label -> the plan of a run that needs more than ``plan`` gives.
        **kwargs: ``torchrun_batches``'s others (``timeout_s``, ``stream``, ...), not ``env``.

    Returns:
        Label -> parsed result, in the order of ``runs``.

    Raises:
        ValueError: for a label of ``needs`` not in ``runs``, an entry that is not ``(n, config)``,
            ``env`` given (the plans hold it), or as ``torchrun_batches``.
    """

    needs = dict(needs or {})
    if "env" in kwargs:
        raise ValueError("env comes from the plans (RankPlan.env): do not pass it to torchrun_planned")
    unknown = sorted(set(needs) - set(runs))
    if unknown:
        raise ValueError(f"needs names runs that runs does not hold: {', '.join(map(repr, unknown))}")
    groups: dict[tuple[tuple[str, str], ...], tuple[dict[str, str], dict[str, Any]]] = {}
    for label, entry in runs.items():
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise ValueError(f"runs[{label!r}] must be (n, config), got {entry!r}")
        placed = needs.get(label, plan)
        env, batch = groups.setdefault(tuple(sorted(placed.env.items())), (dict(placed.env), {}))
        batch[label] = (placed.ranks(entry[0]), entry[1])
    results: dict[str, RunResult] = {}
    for env, batch in groups.values():
        results.update(torchrun_batches(run, batch, env=env, **kwargs))
    return {label: results[label] for label in runs}
