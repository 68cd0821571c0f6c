"""Diagrams for the book: how a ring collective moves chunks, one step's collectives on a time
axis, and the commit protocol of a checkpoint. Each ``plot_*`` function returns a matplotlib
``Figure``, at most :data:`~handbook_lib.face.plots.BOOK_WIDTH_IN` wide.

Chapter 3 draws :func:`plot_ring_schedule` from :func:`handbook_lib.models.collectives.ring_schedule`,
chapter 5 :func:`plot_collective_timeline` from a run's counted collectives, chapter 6
:func:`plot_commit_protocol` from :data:`handbook_lib.models.checkpoint.COMMIT_STEPS`: the data
come from the models and the runs, never typed into a figure. Chapter 1 draws
:func:`plot_fsdp_step` from its first run's counted collectives, chapter 2
:func:`plot_step_phases` from :func:`~handbook_lib.models.memory.estimate_memory`, chapter 9
:func:`plot_pipeline_schedules` from the ``pipeline`` run's timelines.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from handbook_lib.core.results import RunResult
from handbook_lib.face.plots import BOOK_WIDTH_IN, MIN_FONT_PT
from handbook_lib.models.checkpoint import CommitStep
from handbook_lib.models.collectives import ring_schedule
from handbook_lib.models.memory import MemoryEstimate
from handbook_lib.models.pipeline import simulate_schedule

__all__ = ["plot_ring_schedule", "plot_collective_timeline", "plot_commit_protocol", "fsdp_step_slots",
           "plot_fsdp_step", "plot_step_phases", "plot_pipeline_schedules"]


def _ring_states(kind: str, n: int) -> list[list[dict[int, int]]]:
    """After each step of :func:`~handbook_lib.models.collectives.ring_schedule` (index 0: the start), what each
    rank holds: chunk → how many ranks' contributions it sums (N: complete)."""
    if kind == "all_gather":
        held = [{r: n} for r in range(n)]
    else:
        held = [dict.fromkeys(range(n), 1) for _ in range(n)]
    states = [[dict(h) for h in held]]
    schedule = ring_schedule(kind, n)
    for step in range(n - 1):
        for t in [t for t in schedule if t.step == step]:
            held[t.receiver][t.chunk] = n if not t.summed else len(t.summed) + 1
        states.append([dict(h) for h in held])
    return states

def plot_ring_schedule(group_size: int = 4) -> Figure:
    """What each rank holds after each step of a ring all-gather and a ring reduce-scatter.

    One row per rank, one block of N chunk squares per step, coloured by chunk; the chunk a rank
    has just received from its left neighbour (rank r-1, rank 0 from rank N-1) is outlined. In
    the reduce-scatter a square's number is how many ranks' contributions its partial sum holds,
    and its shade deepens as they add up; after N-1 steps rank r holds the full sum of chunk r.
    Drawn from :func:`~handbook_lib.models.collectives.ring_schedule`.
    """
    n = group_size
    fig = Figure(figsize=(BOOK_WIDTH_IN, 1.0 + 1.1 * n), layout="constrained")
    colours = [f"C{c % 10}" for c in range(n)]
    schedules = {"all_gather": ring_schedule("all_gather", n), "reduce_scatter": ring_schedule("reduce_scatter", n)}
    titles = {"all_gather": "All-gather: each rank forwards the chunk it got last",
              "reduce_scatter": "Reduce-scatter: each rank adds its part and forwards the sum"}
    for i, (kind, schedule) in enumerate(schedules.items()):
        ax = fig.add_subplot(2, 1, i + 1)
        states = _ring_states(kind, n)
        for step, state in enumerate(states):
            new = {(t.receiver, t.chunk) for t in schedule if t.step == step - 1}
            for rank, held in enumerate(state):
                for chunk, count in held.items():
                    x = step * (n + 1) + chunk
                    ax.add_patch(Rectangle((x, rank - 0.4), 0.9, 0.8, facecolor=colours[chunk],
                                           alpha=0.25 + 0.75 * count / n,
                                           edgecolor="black" if (rank, chunk) in new else "none", linewidth=1.6))
                    if kind == "reduce_scatter":
                        ax.text(x + 0.45, rank, str(count), ha="center", va="center", fontsize=8)
        ax.set_xlim(-0.3, n * (n + 1) - 0.8)
        ax.set_ylim(n - 0.5, -0.5)
        ax.set_xticks([s * (n + 1) + n / 2 - 0.05 for s in range(n)],
                      ["start"] + [f"after step {s}" for s in range(1, n)], fontsize=8)
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=8)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(titles[kind], fontsize=9)
    fig.suptitle(f"Ring collectives on {n} ranks: chunk c in colour c; outlined: just received", fontsize=10)
    return fig

_KIND_COLOURS = {"all_gather": "tab:blue", "reduce_scatter": "tab:orange", "all_reduce": "tab:green",
                 "broadcast": "tab:purple"}

def plot_collective_timeline(
    calls: Sequence[Mapping[str, Any]], *, title: str = "One step's collectives, per FSDP unit"
) -> Figure:
    """Each collective of one measured step on a time line, one row per FSDP unit.

    Args:
        calls: A rank's ``collectives`` from an ``fsdp_train`` result (FSDP2): dicts with
            ``kind``, ``unit``, ``phase``, ``start_s`` and ``end_s`` (``None`` where the end was
            not recorded: a marker at the start is drawn instead).
        title: Figure title.

    Rows are the units in the order the forward pass gathers them; time is milliseconds since
    the step began; the backward pass is shaded from its first collective on. Without ends (on
    CUDA) the markers are the times the host *issued* each collective, and the axis says so:
    NCCL runs it later on its own stream, so the figure shows the order, not the overlap.
    """
    units = list(dict.fromkeys(str(c["unit"]) for c in calls if c.get("phase") == "forward"))
    units += [u for u in dict.fromkeys(str(c["unit"]) for c in calls) if u not in units]
    row = {u: i for i, u in enumerate(units)}
    fig = Figure(figsize=(BOOK_WIDTH_IN, 1.6 + 0.45 * len(units)), layout="constrained")
    ax = fig.add_subplot()
    ms = [1e3 * float(c["end_s"] if c.get("end_s") is not None else c["start_s"]) for c in calls]
    backward = [1e3 * float(c["start_s"]) for c in calls if c.get("phase") == "backward"]
    if backward:
        ax.axvspan(min(backward), max(ms), color="0.9", zorder=0, label="backward pass")
    labelled: set[str] = set()
    for c in calls:
        kind, start = str(c["kind"]), 1e3 * float(c["start_s"])
        label = kind.replace("_", "-") if kind not in labelled else None
        labelled.add(kind)
        y = row[str(c["unit"])] + (0.15 if kind == "reduce_scatter" else -0.15)
        if c.get("end_s") is not None:
            width = max(1e3 * float(c["end_s"]) - start, 0.004 * max(ms))
            ax.broken_barh([(start, width)], (y - 0.13, 0.26), color=_KIND_COLOURS.get(kind, "black"), label=label)
        else:
            ax.plot([start], [y], marker="|", markersize=14, markeredgewidth=2.5, linestyle="none",
                    color=_KIND_COLOURS.get(kind, "black"), label=f"{label} (start)"
                    if label else None)
    ax.set_yticks(range(len(units)), units, fontsize=8)
    ax.set_ylim(len(units) - 0.5, -0.5)
    ax.set_xlim(0, max(ms) * 1.03 if ms else 1)
    issued_only = all(c.get("end_s") is None for c in calls)
    ax.set_xlabel("when the host issued each one, ms since the step began (a GPU runs it later)"
                  if issued_only else "time since the step began (ms)")
    ax.set_ylabel("FSDP unit")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    return fig

def plot_commit_protocol(steps: Sequence[CommitStep]) -> Figure:
    """The checkpoint commit protocol as boxes from left to right, each with what a crash
    during or right after it leaves as ``latest`` (read from
    :data:`handbook_lib.models.checkpoint.COMMIT_STEPS`)."""
    n = len(steps)
    fig = Figure(figsize=(BOOK_WIDTH_IN, 3.9), layout="constrained")
    ax = fig.add_subplot()
    ax.set_xlim(0, n)
    ax.set_ylim(0, 1)
    ax.axis("off")
    width = 0.86
    for i, step in enumerate(steps):
        x = i + (1 - width) / 2
        committed = i == n - 1
        ax.add_patch(Rectangle((x, 0.47), width, 0.45, facecolor="#dbe9f6" if not committed else "#d9f0d3",
                               edgecolor="0.3"))
        ax.text(i + 0.5, 0.895, f"{i + 1}. {step.name}", ha="center", va="top", fontsize=8, weight="bold")
        body = textwrap.fill(step.action.replace("step_K", "step_K\u2060"), 15) + "\n\n" + textwrap.fill(
            f"by {step.who}", 15)
        ax.text(i + 0.5, 0.835, body, ha="center", va="top", fontsize=8, linespacing=1.1)
        ax.text(i + 0.5, 0.42, textwrap.fill("crash: latest = " + step.crash_leaves, 16), ha="center",
                va="top", fontsize=8, color="#1a7a1a" if committed else "#8a3a00", linespacing=1.1)
        if i:
            ax.add_patch(FancyArrowPatch((i - (1 - width) / 2 - 0.005, 0.695), (x + 0.005, 0.695),
                                         arrowstyle="-|>", mutation_scale=10, color="0.2"))
    fig.suptitle(f"A save commits in this order: until step {n}, latest names the previous checkpoint",
                 fontsize=10)
    return fig


_STEP_COLOURS = {"all_gather": "tab:blue", "reduce_scatter": "tab:orange", "all_reduce": "tab:green",
                 "compute": "0.45", "optimizer": "tab:purple"}
_STEP_WORDS = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_reduce": "all-reduce",
               "compute": "compute (forward or backward)", "optimizer": "optimizer step on the shard"}


def fsdp_step_slots(calls: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """One FSDP step as a sequence of slots ``(action, unit, phase)``, in the order rank 0 issued
    its collectives, with each unit's computation placed between them.

    ``action`` is a collective's kind, ``compute`` or ``optimizer`` (unit ``"*"``: every rank
    steps its own shard, no communication). The root is the unit gathered first in forward. Its
    forward computes twice (the embedding first, the head after the last layer), and so does its
    backward (the head first, right after backward gathers it, or at backward's start when it
    stayed gathered; the embedding last, just before its reduce-scatter). A layer computes right
    after its forward all-gather and, in backward, just before its reduce-scatter: a later unit's
    all-gather issued in between is FSDP2's backward prefetch.

    Args:
        calls: A rank's ``collectives`` from an ``fsdp_train`` result (FSDP2), in issue order:
            dicts with ``kind``, ``unit`` and ``phase`` (or the same fields of
            :class:`~handbook_lib.models.traffic.CollectiveRecord` as dicts).
    """
    forward = [c for c in calls if c["phase"] == "forward"]
    backward = [c for c in calls if c["phase"] == "backward"]
    if not forward:
        raise ValueError("no forward collective: fsdp_step_slots draws a sharded strategy's step")
    root = str(forward[0]["unit"])
    slots: list[tuple[str, str, str]] = []
    for c in forward:
        slots += [(str(c["kind"]), str(c["unit"]), "forward"), ("compute", str(c["unit"]), "forward")]
    slots.append(("compute", root, "forward"))  # the head and the loss, after the last layer
    if not any(c["kind"] == "all_gather" and c["unit"] == root for c in backward):
        slots.append(("compute", root, "backward"))  # the head's backward: the root stayed gathered
    computed: set[str] = set()
    for c in backward:
        kind, unit = str(c["kind"]), str(c["unit"])
        if kind != "all_gather" and unit not in computed:
            slots.append(("compute", unit, "backward"))
            computed.add(unit)
        slots.append((kind, unit, "backward"))
        if kind == "all_gather" and unit == root:
            slots.append(("compute", root, "backward"))  # the head's backward, first
    slots.append(("optimizer", "*", "optimizer"))
    return slots


def _gathered_spans(slots: Sequence[tuple[str, str, str]]) -> list[tuple[str, int, int]]:
    """``(unit, first, last)`` slot indices during which a unit's parameters are gathered: from
    each all-gather to the unit's last computation before its next collective."""
    spans = []
    for i, (action, unit, _) in enumerate(slots):
        if action != "all_gather":
            continue
        last = i
        for j in range(i + 1, len(slots)):
            a, u, _ = slots[j]
            if u != unit:
                continue
            if a == "compute":
                last = j
            else:
                break
        spans.append((unit, i, last))
    return spans


def plot_fsdp_step(
    calls: Sequence[Mapping[str, Any]], *, title: str = "One FSDP step, unit by unit"
) -> Figure:
    """A schematic of one FSDP step: one row per unit, one slot per collective or computation,
    in the order :func:`fsdp_step_slots` gives (issue order, not time).

    A light band behind a unit's slots marks when its parameters are gathered (unsharded):
    from its all-gather to its last computation before its next collective. The backward pass is
    shaded; the last column is the optimizer step, each rank on its own shard.

    Args:
        calls: A rank's ``collectives`` from an ``fsdp_train`` result (FSDP2), in issue order.
        title: Figure title.
    """
    slots = fsdp_step_slots(calls)
    units = list(dict.fromkeys(u for _, u, p in slots if p == "forward"))
    units += [u for u in dict.fromkeys(u for _, u, _ in slots) if u not in units and u != "*"]
    row = {u: i for i, u in enumerate(units)}
    fig = Figure(figsize=(BOOK_WIDTH_IN, 1.9 + 0.38 * len(units)), layout="constrained")
    ax = fig.add_subplot()
    n = len(slots)
    first_bwd = next(i for i, s in enumerate(slots) if s[2] != "forward")
    ax.axvspan(first_bwd - 0.05, n - 1 - 0.05, color="0.93", zorder=0)
    for unit, a, b in _gathered_spans(slots):
        ax.add_patch(Rectangle((a - 0.05, row[unit] - 0.42), b - a + 1.0, 0.84, facecolor="#cfe3f7",
                               edgecolor="none", zorder=1))
    labelled: set[str] = set()
    for i, (action, unit, _) in enumerate(slots):
        rows = range(len(units)) if unit == "*" else [row[unit]]
        for y in rows:
            label = _STEP_WORDS[action] if action not in labelled else None
            labelled.add(action)
            height = 0.5 if action == "compute" else 0.64
            ax.add_patch(Rectangle((i + 0.05, y - height / 2), 0.8, height, zorder=2,
                                   facecolor=_STEP_COLOURS.get(action, "black"), label=label))
    ax.add_patch(Rectangle((0, 0), 0, 0, facecolor="#cfe3f7", label="parameters gathered (unsharded)"))
    ax.set_xlim(-0.2, n + 0.1)
    ax.set_ylim(len(units) - 0.5, -0.5)
    ax.set_yticks(range(len(units)), units, fontsize=8)
    ax.set_xticks([first_bwd / 2, (first_bwd + n - 1) / 2, n - 0.5],
                  ["forward", "backward (shaded)", "step"], fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
    return fig


def plot_step_phases(
    estimate: MemoryEstimate, *, measured_peak: float | None = None,
    title: str = "Bytes alive in each phase of a step (one rank)",
) -> Figure:
    """One horizontal bar per phase of :func:`~handbook_lib.models.memory.estimate_memory`, in
    step order: the model state at rest (the same in every phase) and what the phase adds on top
    of it; the peak phase's bar is dark. ``measured_peak`` (bytes) draws a run's measured peak.

    Bytes are MB (10^6) below 1 GB, else GB (10^9).
    """
    phases = list(estimate.phases)
    scale, unit = (1e9, "GB") if max(estimate.phases.values()) >= 1e9 else (1e6, "MB")
    state = estimate.model_state / scale
    fig = Figure(figsize=(BOOK_WIDTH_IN, 1.5 + 0.36 * len(phases)), layout="constrained")
    ax = fig.add_subplot()
    ys = range(len(phases))
    extra = [max(estimate.phases[p] / scale - state, 0.0) for p in phases]
    ax.barh(ys, [state] * len(phases), color="0.75", label="model state at rest")
    ax.barh(ys, extra, left=[state] * len(phases), label="what the phase adds",
            color=["tab:red" if p == estimate.peak_phase else "#f2b8a8" for p in phases])
    if measured_peak is not None:
        ax.axvline(measured_peak / scale, color="black", linestyle="--", linewidth=1,
                   label="measured peak")
    ax.set_yticks(list(ys), phases, fontsize=8)
    ax.set_ylim(len(phases) - 0.5, -0.5)
    ax.set_xlabel(f"bytes on the rank ({unit}, 10^{9 if unit == 'GB' else 6}); dark: the peak")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, frameon=False)
    return fig


def _pipeline_lines(result: RunResult) -> dict[int, list[tuple[str, int, int, float, float]]]:
    """The timelines of one pipeline of a ``pipeline`` result (its ranks of data-parallel and
    tensor rank 0), by pipeline rank."""
    return {int(m["pp_rank"]): [(str(k), int(s), int(mb), float(a), float(b)) for k, s, mb, a, b in m["timeline"]]
            for m in result.ranks if m["dp_rank"] == 0 and m.get("tp_rank", 0) == 0}


def plot_pipeline_schedules(results: Mapping[str, RunResult]) -> Figure:
    """Each schedule's last step, one row per schedule: on the left as the ranks ran it (seconds
    from the pipeline's first start, from the run's timelines), on the right the same orders on a
    grid of unit times (a forward 1, a backward 2, sends free:
    :func:`~handbook_lib.models.pipeline.simulate_schedule`), where the idle gaps are the bubble.
    One bar a rank; forwards blue, backwards orange (a split backward's input gradient too, its
    weights' gradient green), each labelled with its micro-batch, a rank's later stages hatched
    (an interleaved schedule's, the V's); a rank with more than 16 blocks goes unlabelled."""
    fig = Figure(figsize=(BOOK_WIDTH_IN, 0.4 + 1.9 * len(results)), layout="constrained")
    axes = fig.subplots(len(results), 2, squeeze=False)
    colours = {"F": "C0", "B": "C1", "I": "C1", "W": "C2"}  # a split backward: its input's half as B
    for row, (label, result) in enumerate(results.items()):
        lines = _pipeline_lines(result)
        stages = max(s for line in lines.values() for _, s, _, _, _ in line) + 1
        grid = simulate_schedule({r: [(k, s, mb) for k, s, mb, _, _ in line] for r, line in lines.items()}, stages)
        many = stages > len(lines)
        drawn = {"as run (s)": {r: [(a, b - a, k, s, mb) for k, s, mb, a, b in line] for r, line in lines.items()},
                 "on the grid (F 1, B 2)": {r: [(a, b - a, k, s, mb) for (k, s, mb), a, b in line]
                                            for r, line in grid.items()}}
        for col, (axis, bars) in enumerate(drawn.items()):
            ax = axes[row][col]
            for rank, blocks in bars.items():
                for start, width, kind, stage, mb in blocks:
                    ax.broken_barh([(start, width)], (rank - 0.4, 0.8), facecolor=colours[kind], edgecolor="white",
                                   hatch="///" if many and stage >= len(lines) else None)
                    if col == 1 and max(len(b) for b in bars.values()) <= 16:  # more: too narrow to label
                        ax.text(start + width / 2, rank, str(mb), ha="center", va="center", fontsize=MIN_FONT_PT,
                                color="white")
            ax.set_yticks(sorted(bars), [f"rank {r}" for r in sorted(bars)], fontsize=MIN_FONT_PT)
            ax.set_ylim(len(bars) - 0.5, -0.5)
            ax.tick_params(labelsize=MIN_FONT_PT)
            ax.set_title(f"{label}: {axis}", fontsize=9)
    handles = [Rectangle((0, 0), 1, 1, color=colours[k]) for k in "FB"]
    labels = ["forward", "backward (or its input's gradient)"]
    if any(k == "W" for r in results.values() for line in _pipeline_lines(r).values() for k, *_ in line):
        handles.append(Rectangle((0, 0), 1, 1, color=colours["W"]))
        labels.append("weights' gradient")
    if any(max(s for line in _pipeline_lines(r).values() for _, s, _, _, _ in line) >= len(_pipeline_lines(r))
           for r in results.values()):
        handles.append(Rectangle((0, 0), 1, 1, facecolor="0.6", hatch="///", edgecolor="white"))
        labels.append("a rank's second stage")
    fig.legend(handles=handles, labels=labels, fontsize=MIN_FONT_PT, loc="outside lower center",
               ncol=len(handles) if len(handles) <= 3 else 2, frameon=False)
    return fig
