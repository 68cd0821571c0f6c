"""Figures for the book. Each ``plot_*`` function returns a matplotlib ``Figure``.

Chapter 1 introduces :func:`plot_rank_bytes`. Figures are built with the object-oriented API
(no ``pyplot`` state), so a notebook cell shows a returned figure exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure

from handbook_lib.results import RunResult

__all__ = ["plot_rank_bytes"]

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
