"""How a plan's verdict moves with its assumptions. Pure arithmetic over :func:`plan`.

Chapter 4 teaches it: a recommendation is only as firm as its margin. :func:`plan_sensitivity`
plans the job again with one assumption changed at a time (headroom, the card's capacity read
as decimal GB, the model FLOPs utilization, the network, the CPU optimizer's speed) and says
whether the recommendation changes; :func:`flip_points` gives, for the recommended option, the
value of each assumption at which its verdict flips (it stops fitting, or its step stops being
compute-bound).
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any

from handbook_lib.models.allocator import RESERVE_FRACTION
from handbook_lib.models.hardware import datasheet_bytes, get_accelerator
from handbook_lib.models.layout import ModelLike
from handbook_lib.models.offload import CPU_ADAM_PARAMS_PER_S_PER_CORE
from handbook_lib.models.planner import Option, Plan, plan

__all__ = ["Sensitivity", "plan_sensitivity", "flip_points", "FlipPoints"]


@dataclass(frozen=True)
class Sensitivity:
    """The plan with one assumption changed."""

    assumption: str
    """What changed, in words (``"headroom"``)."""
    planned: str
    """Its value in the plan, in words (``"0 %"``)."""
    changed: str
    """Its value here (``"10 %"``)."""
    recommended: str
    """The recommendation here, ``"FULL_SHARD + AC on 64 GPUs"`` (or ``"nothing fits"``)."""
    step_s: float
    """Its step, seconds (0 when nothing fits)."""
    margin_bytes: int
    """Its budget less its reserved peak, bytes."""
    margin: float
    """The same as a fraction of its budget."""
    flips: bool
    """The recommendation differs from the plan's."""


@dataclass(frozen=True)
class FlipPoints:
    """Where the recommended option's verdict flips, each assumption alone."""

    headroom: float
    """Above this headroom (a fraction of usable memory) it no longer fits."""
    memory_bytes: int
    """Below this capacity (bytes) it no longer fits."""
    utilization: float | None
    """Above this model FLOPs utilization its step turns communication-bound (compute shrinks
    below the communication); ``None`` if it is communication-bound already, or stays
    compute-bound up to 100 %."""
    network_factor: float | None
    """Below this fraction of the planned link bandwidths its step turns communication-bound;
    ``None`` if it already is."""


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _label(option: Option | None) -> str:
    """The recommendation's name (the planner names an option on more GPUs "... on N GPUs")."""
    return "nothing fits" if option is None else option.name


def flip_points(result: Plan) -> FlipPoints | None:
    """The flip points of ``result``'s recommendation (``None`` when nothing fits).

    Fitting: the option fits while ``reserved peak <= (capacity - context - NCCL's buffers) x
    (1 - headroom)``.
    Bound: compute scales as 1/utilization and the collectives' time about as 1/bandwidth (their
    latency ignored), so the step stays compute-bound while each phase's compute outlasts its
    busiest link's hidden collectives (:attr:`~handbook_lib.models.plan_option.Option.compute_margin`).
    """
    o = result.recommended
    if o is None:
        return None
    usable = o.budget_bytes / (1 - result.headroom)
    headroom = 1 - o.peak_reserved_bytes / usable
    memory = o.peak_reserved_bytes / (1 - result.headroom) + result.context_bytes + o.nccl_bytes
    margin = o.compute_margin
    compute_bound = margin > 1
    mfu = result.utilization * margin if compute_bound and math.isfinite(margin) else None
    return FlipPoints(headroom, int(memory), mfu if mfu is not None and mfu < 1 else None,
                      1 / margin if compute_bound else None)


def plan_sensitivity(model: ModelLike, gpu: str, gpus: int, **kwargs: Any) -> tuple[Plan, list[Sensitivity]]:
    """Plan ``model`` on ``gpus`` x ``gpu`` as :func:`plan` does, then again with each assumption
    changed alone: headroom 10 %, capacity in decimal GB (the datasheet's figure x 1e9), model
    FLOPs utilization x 0.75 and x 1.25, one network port per node, half the CPU optimizer
    speed. Returns the plan and one row per change.

    Args:
        model, gpu, gpus, **kwargs: As for :func:`plan` (``gpu`` a preset name).
    """
    base = plan(model, gpu, gpus, **kwargs)
    acc = get_accelerator(gpu)
    u = base.utilization  # the one the plan assumed (the GPU's at the model's width unless given)
    h = kwargs.get("headroom", 0.0)
    cpu = kwargs.get("cpu_params_per_s_per_core", CPU_ADAM_PARAMS_PER_S_PER_CORE)
    reserve = kwargs.get("reserve_fraction", RESERVE_FRACTION)
    decimal = datasheet_bytes(acc)
    changes: list[tuple[str, str, str, dict[str, Any]]] = [
        ("headroom", _pct(h), _pct(h + 0.10), {"headroom": h + 0.10}),
        ("capacity", f"{(acc.runtime_memory_bytes or acc.memory_bytes) / 2**30:.2f} GiB",
         f"{decimal / 1e9:.0f} GB (1e9)",
         {"memory_bytes": decimal}),
        ("allocator reserve", _pct(reserve), "none", {"reserve_fraction": 0.0}),
        ("allocator reserve", _pct(reserve), _pct(0.30), {"reserve_fraction": 0.30}),
        ("utilization", _pct(u), _pct(0.75 * u), {"utilization": 0.75 * u}),
        ("utilization", _pct(u), _pct(1.25 * u), {"utilization": 1.25 * u}),
    ]
    if gpus > base.gpus_per_node and base.nics_per_node > 1:
        changes.append(("network ports", f"{base.nics_per_node} per node", "1 per node",
                        {"nics_per_node": 1}))
    if any(o.cpu_offload for o in base.options):
        changes.append(("CPU optimizer", f"{cpu / 1e6:.0f} M/s/core", f"{cpu / 2e6:.0f} M/s/core",
                        {"cpu_params_per_s_per_core": cpu / 2}))
    was = _label(base.recommended)
    rows = []
    for assumption, planned, changed, change in changes:
        other = plan(model, gpu, gpus, **{**kwargs, **change})
        o = other.recommended
        label = _label(o)
        rows.append(Sensitivity(assumption, planned, changed, label, o.step_s if o else 0.0,
                                o.margin_bytes if o else 0, o.margin if o else 0.0, label != was))
    return base, rows
