"""Figures for the book. Each ``plot_*`` function returns a matplotlib ``Figure``.

Chapter 1 introduces :func:`plot_rank_bytes`; chapter 2 adds :func:`plot_memory_breakdown`,
:func:`plot_memory_vs_seq_len` and :func:`plot_predicted_vs_measured`; chapter 3 the
communication plots (:func:`plot_min_tokens_by_link`, the roofline); chapter 4
:func:`plot_fit_map`; chapter 5 :func:`plot_loss_curves` and :func:`plot_peak_by_run`. The
diagrams (a ring's steps, one step's collectives on a time axis, the commit protocol) are in
:mod:`handbook_lib.face.diagrams`. Figures are built with the object-oriented API (no ``pyplot``
state), so a notebook cell shows a returned figure exactly once. Every figure is at most
:data:`BOOK_WIDTH_IN` wide, so the book shows it unscaled, and no text is below 8 pt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from handbook_lib.core.results import RunResult, model_state_bytes
from handbook_lib.models.collectives import AlphaBeta
from handbook_lib.models.memory import MemoryEstimate

__all__ = [
    "plot_rank_bytes", "plot_memory_breakdown", "plot_predicted_vs_measured",
    "plot_collective_bench", "plot_volume_vs_memory", "plot_step_time_by_link", "plot_fit_map",
    "plot_loss_curves", "plot_peak_by_run", "plot_memory_vs_seq_len", "BOOK_WIDTH_IN", "MIN_FONT_PT",
    "plot_min_tokens_by_link", "plot_prediction_scatter", "plot_micro_batch_fit",
]

BOOK_WIDTH_IN = 7.2
"""Width of the book's text column, inches at 100 dpi (720 px): no figure is wider."""
MIN_FONT_PT = 8.0
"""Smallest font size of any text in a figure, points."""

_COMPONENTS = (
    ("param_shard_bytes", "parameters"),
    ("grad_shard_bytes", "gradients"),
    ("optimizer_state_bytes", "optimizer state"),
)


def plot_rank_bytes(
    result: RunResult,
    unsharded: Sequence[int] | None = None,
    *,
    title: str = "Model state held by each rank",
) -> Figure:
    """Stacked bars of each rank's measured model-state bytes, beside the unsharded total.

    Args:
        result: A run whose ranks report ``param_shard_bytes``, ``grad_shard_bytes`` and
            ``optimizer_state_bytes``.
        unsharded: Optional ``(params, grads, optimizer)`` bytes of the whole model on one
            device, drawn as a first bar for comparison.
        title: Figure title.
    """
    ranks = sorted(result.ranks, key=lambda r: r["rank"])
    labels = [f"rank {r['rank']}" for r in ranks]
    columns = [[r[key] for r in ranks] for key, _ in _COMPONENTS]
    if unsharded is not None:
        labels.insert(0, "one device\n(unsharded)")
        columns = [[total, *col] for total, col in zip(unsharded, columns)]
    fig = Figure(figsize=(6.4, 3.6), layout="constrained")
    ax = fig.add_subplot()
    bottom = [0.0] * len(labels)
    for (_, name), values in zip(_COMPONENTS, columns):
        mb = [v / 1e6 for v in values]
        ax.bar(labels, mb, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, mb)]
    for x, total in enumerate(bottom):
        ax.annotate(f"{total:.1f} MB", (x, total), ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("bytes (MB, 10^6)")
    ax.set_ylim(0, max(bottom) * 1.15)
    ax.set_title(f"{title} ({result.world_size} ranks, {result.backend})")
    ax.legend(loc="upper right", fontsize=8)
    return fig


_COMPONENT_LABELS = {
    "params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
    "unsharded_params": "unsharded params + all-gather", "grad_buffers": "gradient buffers",
    "activations": "activations", "loss_buffers": "loss buffers",
}


def plot_memory_breakdown(
    estimates: Mapping[str, MemoryEstimate],
    *,
    title: str = "Predicted peak memory per rank",
    limit_bytes: int | None = None,
    limit_label: str = "device memory",
) -> Figure:
    """Stacked bars of :class:`~handbook_lib.models.memory.MemoryEstimate` components at each peak.

    Args:
        estimates: Bar label → estimate (e.g. ``"FULL_SHARD\\n8 GPUs"``).
        title: Figure title.
        limit_bytes: Draw a horizontal line at this many bytes (e.g. a GPU's memory).
        limit_label: Legend label of that line.
    """
    labels = list(estimates)
    fig = Figure(figsize=(BOOK_WIDTH_IN, 4.4), layout="constrained")
    ax = fig.add_subplot()
    bottom = [0.0] * len(labels)
    for key, name in _COMPONENT_LABELS.items():
        values = [estimates[label].components[key] / 1e9 for label in labels]
        if any(values):
            ax.bar(labels, values, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, values)]
    if limit_bytes is not None:
        ax.axhline(limit_bytes / 1e9, color="black", linestyle="--", linewidth=1, label=limit_label)
    ax.set_ylabel("bytes per rank (GB, 10^9)")
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    # a label wider than its bar's slot: every other one drops a line lower, so neighbours
    # never share a line (the longest strategy name, SHARD_GRAD_OP, is wider than 1/6 of the axis)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    _stagger_wide_labels(ax, labels)
    return fig


def _renderer(fig: Figure):
    """Draw ``fig`` (on an Agg canvas, attached if it has none) and return the renderer."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = fig.canvas if hasattr(fig.canvas, "get_renderer") else FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def _stagger_wide_labels(ax, labels: Sequence[str], fontsize: float = 8.0) -> None:
    """Drop every other x tick label below its neighbours if, drawn, neighbours would touch."""
    renderer = _renderer(ax.figure)
    boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels()]
    if not any(a.x1 + 2 > b.x0 for a, b in zip(boxes, boxes[1:])):
        return
    lines = max(label.count("\n") + 1 for label in labels)
    for i, tick in enumerate(ax.xaxis.get_major_ticks()):
        if i % 2:
            tick.set_pad(tick.get_pad() + 1.25 * fontsize * lines)


def plot_predicted_vs_measured(
    pairs: Sequence[tuple[str, float, float]],
    *,
    title: str = "Peak memory per rank: model vs run",
) -> Figure:
    """Side-by-side bars of predicted and measured bytes, one pair per label (MB, 10^6)."""
    labels = [p[0] for p in pairs]
    xs = range(len(labels))
    fig = Figure(figsize=(max(6.4, 1.1 * len(labels)), 3.8), layout="constrained")
    ax = fig.add_subplot()
    ax.bar([x - 0.2 for x in xs], [p[1] / 1e6 for p in pairs], width=0.4, label="predicted")
    ax.bar([x + 0.2 for x in xs], [p[2] / 1e6 for p in pairs], width=0.4, label="measured")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("bytes (MB, 10^6)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def plot_collective_bench(result: RunResult) -> Figure:
    """Measured collective times (points) against the fitted alpha-beta model (lines), log-log.

    Args:
        result: A ``comm_bench`` run (its ``measurements`` and ``fits``).
    """
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.add_subplot()
    for kind, fit in result.extra["fits"].items():
        points = [m for m in result.extra["measurements"] if m["kind"] == kind]
        sizes = [m["buffer_bytes"] for m in points]
        dots = ax.scatter(sizes, [m["seconds"] * 1e3 for m in points], s=14,
                          label=kind if fit is None else None)
        if fit is not None:
            model = AlphaBeta(kind, result.world_size, fit["alpha_s"], fit["beta_bytes_per_s"])
            ax.plot(sizes, [model.predict_s(b) * 1e3 for b in sizes], color=dots.get_facecolor()[0],
                    label=f"{kind} (fit)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("buffer (bytes)")
    ax.set_ylabel("time per collective (ms)")
    ax.set_title(f"Collectives here: {result.world_size} ranks, {result.backend} (points: measured, lines: fit)")
    ax.legend(fontsize=8)
    return fig


def plot_volume_vs_memory(points: Sequence[tuple[str, float, float]], *, title: str) -> Figure:
    """Scatter of strategies: memory per rank (x, GB) against bytes sent per step (y, GB).

    Args:
        points: ``(label, memory_bytes, sent_bytes)`` per strategy.
        title: Figure title.
    """
    fig = Figure(figsize=(BOOK_WIDTH_IN, 4.4), layout="constrained")
    ax = fig.add_subplot()
    xs = [m / 1e9 for _, m, _ in points]
    ys = [v / 1e9 for _, _, v in points]
    for x, y in zip(xs, ys):
        ax.scatter([x], [y], s=40)
    # room for the labels: a margin of the data's span on every side
    for lo_hi, setter in (((min(xs), max(xs)), ax.set_xlim), ((min(ys), max(ys)), ax.set_ylim)):
        span = (lo_hi[1] - lo_hi[0]) or abs(lo_hi[1]) or 1.0
        setter(lo_hi[0] - 0.15 * span, lo_hi[1] + 0.15 * span)
    ax.set_xlabel("peak memory per rank (GB, 10^9)")
    ax.set_ylabel("bytes sent per rank per step (GB, 10^9)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    labels = [ax.annotate(label, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
              for (label, _, _), x, y in zip(points, xs, ys)]
    _place_labels(fig, ax, labels)
    return fig


_OFFSETS = [(6, 4), (6, -12), (-6, 4), (-6, -12), (0, 10), (0, -18), (10, 16), (10, -24), (-10, 16),
            (-10, -24), (14, 28), (14, -36), (-14, 28), (-14, -36)]
"""Label positions tried, in points from the point labelled: right, left, above, below, farther."""


def _marker_discs(ax) -> list[tuple[float, float, float]]:
    """``(x, y, radius)`` in display pixels of every scatter marker in ``ax`` (a marker of size
    ``s`` points² is about sqrt(s) points across)."""
    scale = ax.figure.dpi / 72
    return [(*ax.transData.transform(xy), (float(c.get_sizes()[0]) ** 0.5 / 2) * scale)
            for c in ax.collections for xy in c.get_offsets()]


def _place_labels(fig: Figure, ax, labels: list) -> None:
    """Move each annotation to the first offset of :data:`_OFFSETS` where it overlaps no label
    placed before it, no marker, and stays inside the axes (drawn once, on an Agg canvas)."""
    renderer = _renderer(fig)
    box = ax.get_window_extent(renderer)
    markers = _marker_discs(ax)
    placed: list[Any] = []
    for text in labels:
        for dx, dy in _OFFSETS:
            text.set_position((dx, dy))
            text.set_horizontalalignment("left" if dx >= 0 else "right")
            bb = text.get_window_extent(renderer)
            inside = box.x0 <= bb.x0 and bb.x1 <= box.x1 and box.y0 <= bb.y0 and bb.y1 <= box.y1
            free = not any(bb.overlaps(other) for other in placed)
            clear = not any(bb.x0 - r < mx < bb.x1 + r and bb.y0 - r < my < bb.y1 + r for mx, my, r in markers)
            if inside and free and clear:
                break
        placed.append(text.get_window_extent(renderer))


def plot_step_time_by_link(rows: Sequence[tuple[str, float, float, float]], *, title: str) -> Figure:
    """Bars of compute and communication time per link, with the overlapped step time marked.

    Args:
        rows: ``(link name, compute_s, comm_s, overlapped_step_s)`` per link.
        title: Figure title.
    """
    labels = [r[0] for r in rows]
    xs = range(len(rows))
    fig = Figure(figsize=(BOOK_WIDTH_IN, 4.0), layout="constrained")
    ax = fig.add_subplot()
    ax.bar([x - 0.2 for x in xs], [r[1] for r in rows], width=0.4, label="compute")
    ax.bar([x + 0.2 for x in xs], [r[2] for r in rows], width=0.4, label="communication")
    ax.scatter(list(xs), [r[3] for r in rows], color="black", marker="_", s=400, label="step, overlapped", zorder=3)
    ax.set_xticks(list(xs), labels, fontsize=8, rotation=35, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("seconds per step")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def plot_fit_map(
    answers: Mapping[tuple[str, int], str],
    *,
    title: str = "What the planner recommends",
    edges: Sequence[tuple[str, int]] = (),
    edge_label: str = "outlined: within 5 % of the budget",
) -> Figure:
    """A grid of recommendations: models (rows) by GPU counts (columns), coloured by option.

    Args:
        answers: ``(model name, GPU count)`` → the recommended option's name (or "none").
        title: Figure title.
        edges: Cells to outline (a verdict on a knife edge), as keys of ``answers``.
        edge_label: What an outline means, added to the x label when ``edges`` is not empty.
    """
    models = list(dict.fromkeys(m for m, _ in answers))
    counts = sorted({n for _, n in answers})
    labels = sorted(set(answers.values()))
    index = {label: i for i, label in enumerate(labels)}
    grid = [[index[answers[(m, n)]] for n in counts] for m in models]
    cell = lambda a: (a.replace("_", "_\n", 1) if len(counts) > 5 else a).replace(" + ", "\n+ ")  # noqa: E731
    lines = max(cell(a).count("\n") + 1 for a in answers.values())
    fig = Figure(figsize=(BOOK_WIDTH_IN, (0.18 * lines + 0.25) * len(models) + 1.4), layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(grid, cmap="Pastel1", vmin=0, vmax=8, aspect="auto")
    for r, m in enumerate(models):
        for c, n in enumerate(counts):
            ax.text(c, r, cell(answers[(m, n)]), ha="center", va="center", fontsize=8)
    for m, n in edges:
        r, c = models.index(m), counts.index(n)
        ax.add_patch(Rectangle((c - 0.47, r - 0.45), 0.94, 0.9, fill=False, edgecolor="black",
                               linewidth=2, linestyle="--"))
    ax.set_xticks(range(len(counts)), [str(n) for n in counts], fontsize=9)
    ax.set_yticks(range(len(models)), models, fontsize=9)
    ax.set_xlabel(f"GPUs ({edge_label})" if edges else "GPUs")
    ax.set_title(title, fontsize=10)
    return fig


def plot_min_tokens_by_link(
    rows: Sequence[tuple[str, float]],
    *,
    title: str,
    marks: Mapping[str, float] | None = None,
) -> Figure:
    """Horizontal bars of the tokens per GPU per step above which compute hides the
    communication (:func:`~handbook_lib.models.roofline.min_tokens_per_gpu`), one bar per link,
    on a log axis, each labelled with its figure.

    Args:
        rows: ``(link name, minimum tokens per GPU)``, drawn top to bottom in this order.
        title: Figure title.
        marks: Vertical reference lines, label → tokens (e.g. ``{"one 4,096-token sequence":
            4096}``).
    """
    fig = Figure(figsize=(BOOK_WIDTH_IN, 0.32 * len(rows) + 1.3), layout="constrained")
    ax = fig.add_subplot()
    ys = list(range(len(rows)))[::-1]
    ax.barh(ys, [t for _, t in rows], color="tab:blue", height=0.6)
    for y, (_, t) in zip(ys, rows):
        ax.text(t * 1.08, y, f"{t:,.0f}", va="center", fontsize=8)
    for i, (label, t) in enumerate((marks or {}).items()):
        ax.axvline(t, color="tab:red", linestyle=("--", ":", "-.")[i % 3], linewidth=1,
                   label=label)
    ax.set_yticks(ys, [name for name, _ in rows], fontsize=8)
    ax.set_xscale("log")
    top = max(t for _, t in rows)
    ax.set_xlim(right=top * 3)
    ax.set_xlabel("tokens per GPU per step for compute to hide the communication")
    ax.set_title(title, fontsize=10)
    if marks:
        ax.legend(fontsize=8, loc="upper right")
    return fig


def plot_loss_curves(
    curves: Mapping[str, Sequence[float]], *, title: str = "Training loss, per run"
) -> Figure:
    """One line per run: loss (nats per token) against optimizer step. Runs that compute the
    same thing lie on top of each other; markers differ so that every run stays visible."""
    fig = Figure(figsize=(6.4, 3.8), layout="constrained")
    ax = fig.add_subplot()
    markers = "o^sDvx+*<>ph"
    for i, (label, losses) in enumerate(curves.items()):
        ax.plot(range(1, len(losses) + 1), losses, marker=markers[i % len(markers)],
                markersize=9 - 0.5 * i, fillstyle="none", linewidth=1, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return fig


def plot_peak_by_run(
    results: Mapping[str, RunResult], *, title: str = "Peak memory per rank, measured"
) -> Figure:
    """Bars of each run's measured peak per rank (the largest over ranks, MB = 10^6 bytes),
    with the model-state part (:func:`~handbook_lib.core.results.model_state_bytes`) shaded."""
    labels = list(results)
    peaks = [max(r.metric("peak_bytes")) / 1e6 for r in results.values()]
    states = [max(model_state_bytes(x) for x in r.ranks) / 1e6 for r in results.values()]
    fig = Figure(figsize=(max(6.4, 1.0 * len(labels)), 3.8), layout="constrained")
    ax = fig.add_subplot()
    ax.bar(labels, peaks, color="tab:orange", label="peak (measured)")
    ax.bar(labels, states, color="tab:blue", label="model state at rest")
    ax.set_ylabel("bytes per rank (MB, 10^6)")
    ax.set_title(title)
    ax.tick_params(axis="x", labelsize=8, rotation=20)
    ax.legend(fontsize=8)
    return fig


def plot_memory_vs_seq_len(
    seq_lens: Sequence[int],
    plain: Sequence[MemoryEstimate],
    checkpointed: Sequence[MemoryEstimate],
    *,
    limit_bytes: int | None = None,
    limit_label: str = "device memory",
    title: str = "Peak memory per rank against sequence length",
) -> Figure:
    """Model state, activations and the predicted peak (GB, 10^9 bytes, log scale) against the
    sequence length (log2 scale), without (solid) and with (dashed) activation checkpointing.

    Args:
        seq_lens: Tokens per sequence, one per estimate.
        plain: :func:`~handbook_lib.models.memory.estimate_memory` at each length, no checkpointing.
        checkpointed: The same with ``activation_checkpointing=True``.
        limit_bytes: Draw a horizontal line at this many bytes (e.g. a GPU's memory).
        limit_label: Legend label of that line.
        title: Figure title.
    """
    fig = Figure(figsize=(BOOK_WIDTH_IN, 4.2), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(seq_lens, [e.model_state / 1e9 for e in plain], color="tab:blue", marker="o", markersize=4,
            label="model state (both)")
    for estimates, style, suffix in ((plain, "-", ""), (checkpointed, "--", ", checkpointed")):
        ax.plot(seq_lens, [e.forward_activations / 1e9 for e in estimates], style, color="tab:orange",
                marker="o", markersize=4, label=f"activations{suffix}")
        ax.plot(seq_lens, [e.peak / 1e9 for e in estimates], style, color="tab:red", marker="o",
                markersize=4, label=f"peak{suffix}")
    if limit_bytes is not None:
        ax.axhline(limit_bytes / 1e9, color="black", linestyle=":", linewidth=1.2, label=limit_label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(seq_lens), [f"{s:,}" for s in seq_lens], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("bytes per rank (GB, 10^9)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return fig


def plot_prediction_scatter(
    pairs: Sequence[tuple[str, float, float]],
    *,
    title: str = "Peak memory per rank: model against run",
) -> Figure:
    """Measured against predicted bytes, one point per label, with the line y = x (MB, 10^6).

    A point on the line is a prediction that holds; the legend names the points (a label's
    commas start new lines, so ``"2 ranks, FULL_SHARD, bf16"`` stays narrow). Made for pairs
    whose errors are small next to their spread, as a run's checks are.
    """
    fig = Figure(figsize=(BOOK_WIDTH_IN, 3.9), layout="constrained")
    ax = fig.add_subplot()
    values = [v / 1e6 for _, p, m in pairs for v in (p, m)]
    lo, hi = min(values), max(values)
    pad = 0.08 * (hi - lo or hi or 1.0)
    ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="0.5", linestyle="--", linewidth=1,
            label="measured = predicted")
    markers = "osD^vP*X"
    for i, (label, predicted, measured) in enumerate(pairs):
        ax.scatter([predicted / 1e6], [measured / 1e6], s=42, marker=markers[i % len(markers)],
                   color=f"C{i % 10}", zorder=3, label=label.replace(", ", ",\n"))
    ax.set_xlim(lo - pad, hi + pad)
    ax.set_ylim(lo - pad, hi + pad)
    ax.set_aspect("equal")
    ax.set_xlabel("predicted (MB, 10^6)")
    ax.set_ylabel("measured (MB, 10^6)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    return fig


def plot_micro_batch_fit(
    micro_batches: Sequence[int],
    model_peak: Sequence[int],
    model_reserved: Sequence[int],
    measured: Sequence[tuple[int, int, int]],
    capacity: int,
    largest_fit: int,
    first_oom: int | None,
    *,
    title: str = "What fits on one GPU: the memory model against the runs",
) -> Figure:
    """Peak bytes per rank against the micro-batch (GB, 10^9): the memory model's allocated and
    reserved peaks (lines), the runs' (points), the usable memory, the largest micro-batch that
    ran and the first that ran out of memory (straight lines).

    Args:
        micro_batches: Sequences per rank at which the model's lines are drawn.
        model_peak: The memory model's allocated peak at each of ``micro_batches``, bytes.
        model_reserved: Its peak with the allocator's reserve, bytes.
        measured: ``(micro-batch, tracker peak, max_memory_reserved)`` of each run, bytes.
        capacity: The memory a rank found usable, bytes.
        largest_fit: The largest micro-batch that ran.
        first_oom: The smallest that ran out of memory (None: none did).
        title: Figure title."""
    fig = Figure(figsize=(BOOK_WIDTH_IN, 3.9), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(micro_batches, [b / 1e9 for b in model_peak], color="tab:blue", label="model: allocated peak")
    ax.plot(micro_batches, [b / 1e9 for b in model_reserved], color="tab:blue", linestyle="--",
            label="model: reserved (plan)")
    ax.scatter([m for m, _, _ in measured], [b / 1e9 for _, b, _ in measured], color="tab:orange", zorder=3,
               s=22, label="run: tracker peak")
    ax.scatter([m for m, _, _ in measured], [b / 1e9 for _, _, b in measured], color="tab:red", marker="^",
               zorder=3, s=22, label="run: reserved")
    ax.axhline(capacity / 1e9, color="black", linewidth=1, label="usable memory")
    ax.axvline(largest_fit, color="tab:green", linewidth=1, linestyle=":", label=f"largest that ran ({largest_fit})")
    if first_oom is not None:
        ax.axvline(first_oom, color="tab:red", linewidth=1, linestyle=":", label=f"first OOM ({first_oom})")
    ax.set_xlabel("micro-batch (sequences per rank)")
    ax.set_ylabel("bytes per rank (GB, 10^9)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    return fig
