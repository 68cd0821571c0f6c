"""handbook_lib.face.plots: every ``plot_*`` figure draws its inputs where they say, in the stated unit.

Expected values (MB = 10^6 bytes, GB = 10^9, ms, ring steps and bytes of an all-reduce) are
computed here from the inputs, not by calling the plotting code; each test reads the artists
back from the returned figure (bar heights and bottoms, line and scatter data, image cells,
texts, tick labels, legend entries) and closes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.container import BarContainer  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from handbook_lib.core import SCHEMA, RunResult  # noqa: E402
from handbook_lib.face import diagrams, plots  # noqa: E402
from handbook_lib.models import COMPONENTS, MemoryEstimate  # noqa: E402


@pytest.fixture
def figs() -> Iterator[list[Figure]]:
    """Figures a test made; all are closed afterwards, whatever the outcome."""
    made: list[Figure] = []
    yield made
    for fig in made:
        plt.close(fig)


def _ax(fig: Figure) -> Axes:
    assert len(fig.axes) == 1
    return fig.axes[0]


def _bars(ax: Axes) -> list[BarContainer]:
    return [c for c in ax.containers if isinstance(c, BarContainer)]


def _heights(bars: BarContainer) -> list[float]:
    return [p.get_height() for p in bars.patches]


def _bottoms(bars: BarContainer) -> list[float]:
    return [p.get_y() for p in bars.patches]


def _points(collection: Any) -> list[float]:
    """A scatter's (x, y) offsets, flattened to x0, y0, x1, y1, ... (data coordinates)."""
    return [float(v) for xy in collection.get_offsets() for v in xy]


def _legend(ax: Axes) -> list[str]:
    legend = ax.get_legend()
    assert legend is not None
    return [t.get_text() for t in legend.get_texts()]


def _ticks(labels: list[Any]) -> list[str]:
    return [t.get_text() for t in labels]


def _run(ranks: list[dict[str, Any]], **extra: Any) -> RunResult:
    return RunResult.from_dict({"schema": SCHEMA, "run": "fsdp_train", "config": {}, "world_size": len(ranks),
                                "backend": "gloo", "device": "cpu", "torch_version": "x", "ranks": ranks,
                                "checks": [], **extra})


def _train_rank(rank: int, params: int, grads: int, optim: int, peak: int = 0, padding: int = 0,
                other: int = 0) -> dict[str, Any]:
    return {"rank": rank, "param_shard_bytes": params, "grad_shard_bytes": grads,
            "optimizer_state_bytes": optim, "param_padding_bytes": padding,
            "optimizer_other_bytes": other, "peak_bytes": peak}


def _estimate(**components: int) -> MemoryEstimate:
    full = {name: components.get(name, 0) for name in COMPONENTS}
    return MemoryEstimate(components=full, phases={"peak": sum(full.values())}, peak_phase="peak")


@pytest.mark.parametrize("unsharded", [None, (8_000_000, 8_000_000, 16_000_000)])
def test_rank_bytes_stacks_each_component_in_mb(figs: list[Figure],
                                                unsharded: tuple[int, int, int] | None) -> None:
    # ranks given out of order: bars follow rank order
    result = _run([_train_rank(1, 3_000_000, 3_000_000, 6_000_000),
                   _train_rank(0, 4_000_000, 2_000_000, 5_000_000)])
    figs.append(fig := plots.plot_rank_bytes(result, unsharded, title="State"))
    ax = _ax(fig)
    per_bar = [(4.0, 2.0, 5.0), (3.0, 3.0, 6.0)]
    labels = ["rank 0", "rank 1"]
    if unsharded is not None:
        per_bar.insert(0, (8.0, 8.0, 16.0))
        labels.insert(0, "one device\n(unsharded)")
    bars = _bars(ax)
    assert [b.get_label() for b in bars] == ["parameters", "gradients", "optimizer state"]
    for i, container in enumerate(bars):
        assert _heights(container) == pytest.approx([row[i] for row in per_bar])
        assert _bottoms(container) == pytest.approx([sum(row[:i]) for row in per_bar])
    assert _ticks(ax.get_xticklabels()) == labels
    totals = [sum(row) for row in per_bar]
    assert [t.get_text() for t in ax.texts] == [f"{t:.1f} MB" for t in totals]
    assert ax.get_ylim()[1] >= max(totals)
    assert "MB" in ax.get_ylabel()
    assert ax.get_title() == "State (2 ranks, gloo)"
    assert _legend(ax) == ["parameters", "gradients", "optimizer state"]


def test_memory_breakdown_stacks_nonzero_components_in_gb_with_limit(figs: list[Figure]) -> None:
    estimates = {
        "NO_SHARD": _estimate(params=4_000_000_000, grads=4_000_000_000, optimizer=8_000_000_000,
                              activations=2_000_000_000),
        "FULL_SHARD": _estimate(params=1_000_000_000, grads=1_000_000_000, optimizer=2_000_000_000,
                                unsharded_params=500_000_000, activations=2_000_000_000),
    }
    figs.append(fig := plots.plot_memory_breakdown(estimates, title="Peak", limit_bytes=80_000_000_000,
                                                   limit_label="H100"))
    ax = _ax(fig)
    expected = {  # components with a nonzero value somewhere, in stacking order, GB
        "parameters": [4.0, 1.0], "gradients": [4.0, 1.0], "optimizer state": [8.0, 2.0],
        "unsharded params + all-gather": [0.0, 0.5], "activations": [2.0, 2.0],
    }
    bars = _bars(ax)
    assert [b.get_label() for b in bars] == list(expected)
    bottom = [0.0, 0.0]
    for container, heights in zip(bars, expected.values()):
        assert _heights(container) == pytest.approx(heights)
        assert _bottoms(container) == pytest.approx(bottom)
        bottom = [b + h for b, h in zip(bottom, heights)]
    assert bottom == pytest.approx([e.peak / 1e9 for e in estimates.values()])
    assert _ticks(ax.get_xticklabels()) == list(estimates)
    (limit,) = ax.get_lines()
    assert list(limit.get_ydata()) == pytest.approx([80.0, 80.0])
    assert "GB" in ax.get_ylabel() and ax.get_title() == "Peak"
    assert sorted(_legend(ax)) == sorted([*expected, "H100"])  # matplotlib lists lines first


def test_memory_breakdown_without_limit_draws_no_line(figs: list[Figure]) -> None:
    figs.append(fig := plots.plot_memory_breakdown({"a": _estimate(params=3_000_000_000)}))
    ax = _ax(fig)
    assert ax.get_lines() == []
    assert [_heights(b) for b in _bars(ax)] == [pytest.approx([3.0])]
    assert _legend(ax) == ["parameters"]


def test_predicted_vs_measured_pairs_bars_per_label(figs: list[Figure]) -> None:
    pairs = [("1 GPU", 100_000_000, 104_000_000), ("2 GPUs", 60_000_000, 59_500_000), ("4 GPUs", 40e6, 41e6)]
    figs.append(fig := plots.plot_predicted_vs_measured(pairs, title="Peaks"))
    ax = _ax(fig)
    predicted, measured = _bars(ax)
    assert _heights(predicted) == pytest.approx([100.0, 60.0, 40.0])
    assert _heights(measured) == pytest.approx([104.0, 59.5, 41.0])
    # each pair straddles its tick: predicted left, measured right
    assert list(ax.get_xticks()) == [0, 1, 2]
    assert _ticks(ax.get_xticklabels()) == ["1 GPU", "2 GPUs", "4 GPUs"]
    for x, left, right in zip(range(3), predicted.patches, measured.patches):
        assert left.get_x() + left.get_width() / 2 < x < right.get_x() + right.get_width() / 2
    assert "MB" in ax.get_ylabel() and ax.get_title() == "Peaks"
    assert _legend(ax) == ["predicted", "measured"]


def test_collective_bench_points_and_alpha_beta_lines(figs: list[Figure]) -> None:
    world, alpha, beta = 4, 1e-5, 1e9
    sizes = [4_000, 400_000, 4_000_000]
    measurements = [{"kind": kind, "buffer_bytes": b, "seconds": s * (i + 1)}
                    for kind, s, n in (("all_reduce", 2e-4, 3), ("broadcast", 1e-4, 2))
                    for i, b in enumerate(sizes[:n])]
    fits = {"all_reduce": {"alpha_s": alpha, "beta_bytes_per_s": beta}, "broadcast": None}
    result = _run([{"rank": r} for r in range(world)], measurements=measurements, fits=fits)
    figs.append(fig := plots.plot_collective_bench(result))
    ax = _ax(fig)
    reduce_dots, broadcast_dots = ax.collections
    # points: (bytes, ms)
    assert _points(reduce_dots) == pytest.approx([4_000, 0.2, 400_000, 0.4, 4_000_000, 0.6])
    assert _points(broadcast_dots) == pytest.approx([4_000, 0.1, 400_000, 0.2])
    (line,) = ax.get_lines()  # only the fitted kind gets a model line
    # ring all-reduce on N ranks: 2(N-1) steps, each rank sends 2(N-1)/N·B bytes
    steps = 2 * (world - 1)
    expected_ms = [(steps * alpha + 2 * (world - 1) * b / world / beta) * 1e3 for b in sizes]
    assert list(line.get_xdata()) == sizes
    assert list(line.get_ydata()) == pytest.approx(expected_ms)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert "bytes" in ax.get_xlabel() and "ms" in ax.get_ylabel()
    assert "4 ranks" in ax.get_title() and "gloo" in ax.get_title()
    assert sorted(_legend(ax)) == ["all_reduce (fit)", "broadcast"]


def test_volume_vs_memory_places_each_strategy_in_gb(figs: list[Figure]) -> None:
    points = [("DDP", 16e9, 2e9), ("FULL_SHARD", 4e9, 3e9), ("HSDP", 8e9, 2.5e9)]
    figs.append(fig := plots.plot_volume_vs_memory(points, title="Trade-off"))
    ax = _ax(fig)
    assert len(ax.collections) == len(points)
    for dots, (_, memory, sent) in zip(ax.collections, points):
        assert _points(dots) == pytest.approx([memory / 1e9, sent / 1e9])
    assert [(t.get_text(), *t.xy) for t in ax.texts] == [(n, m / 1e9, s / 1e9) for n, m, s in points]
    assert "GB" in ax.get_xlabel() and "GB" in ax.get_ylabel()
    assert "memory" in ax.get_xlabel() and "sent" in ax.get_ylabel()
    assert ax.get_title() == "Trade-off"


def test_step_time_by_link_bars_and_overlapped_marks(figs: list[Figure]) -> None:
    rows = [("NVLink", 0.5, 0.1, 0.52), ("PCIe", 0.5, 0.8, 0.85), ("Ethernet", 0.5, 6.0, 6.1)]
    figs.append(fig := plots.plot_step_time_by_link(rows, title="Step"))
    ax = _ax(fig)
    compute, comm = _bars(ax)
    assert _heights(compute) == pytest.approx([0.5, 0.5, 0.5])
    assert _heights(comm) == pytest.approx([0.1, 0.8, 6.0])
    (marks,) = ax.collections
    assert _points(marks) == pytest.approx([0, 0.52, 1, 0.85, 2, 6.1])
    assert _ticks(ax.get_xticklabels()) == ["NVLink", "PCIe", "Ethernet"]
    assert ax.get_yscale() == "log" and "seconds" in ax.get_ylabel()
    assert ax.get_title() == "Step"
    assert sorted(_legend(ax)) == ["communication", "compute", "step, overlapped"]


def test_fit_map_grid_colours_and_texts(figs: list[Figure]) -> None:
    answers = {("small", 8): "DDP", ("small", 1): "DDP", ("large", 1): "none",
               ("large", 8): "FULL_SHARD + AC", ("small", 2): "DDP", ("large", 2): "none"}
    figs.append(fig := plots.plot_fit_map(answers, title="Plan"))
    ax = _ax(fig)
    # rows: models in first-seen order; columns: GPU counts ascending; colour: rank of the sorted names
    colour = {"DDP": 0, "FULL_SHARD + AC": 1, "none": 2}
    grid = [[colour[answers[(m, n)]] for n in (1, 2, 8)] for m in ("small", "large")]
    assert grid == [[0, 0, 0], [2, 2, 1]]
    assert ax.images[0].get_array().tolist() == grid
    assert _ticks(ax.get_xticklabels()) == ["1", "2", "8"]
    assert _ticks(ax.get_yticklabels()) == ["small", "large"]
    cells = {(t.get_position(), t.get_text()) for t in ax.texts}
    assert cells == {((c, r), answers[(m, n)].replace(" + ", "\n+ "))
                     for r, m in enumerate(["small", "large"]) for c, n in enumerate([1, 2, 8])}
    assert ax.get_xlabel() == "GPUs" and ax.get_title() == "Plan"


def test_loss_curves_one_line_per_run_from_step_one(figs: list[Figure]) -> None:
    curves = {"1 GPU": [10.4, 9.8, 9.1, 8.7], "FULL_SHARD": [10.4, 9.8, 9.1, 8.7], "short": [10.0, 9.0]}
    figs.append(fig := plots.plot_loss_curves(curves, title="Loss"))
    ax = _ax(fig)
    lines = ax.get_lines()
    assert len(lines) == len(curves)
    for line, losses in zip(lines, curves.values()):
        assert list(line.get_xdata()) == list(range(1, len(losses) + 1))
        assert list(line.get_ydata()) == losses
    assert len({line.get_marker() for line in lines}) == len(curves)  # overlapping runs stay visible
    assert "step" in ax.get_xlabel() and "nats" in ax.get_ylabel()
    assert ax.get_title() == "Loss"
    assert _legend(ax) == list(curves)


def test_peak_by_run_max_over_ranks_in_mb(figs: list[Figure]) -> None:
    results = {
        "1 GPU": _run([_train_rank(0, 10_000_000, 10_000_000, 20_000_000, peak=70_000_000, other=8)]),
        "FULL_SHARD": _run([_train_rank(0, 5_000_000, 5_000_000, 10_000_000, peak=38_000_000, padding=4),
                            _train_rank(1, 5_000_000, 5_000_000, 10_000_000, peak=41_000_000,
                                        padding=2_000_000)]),
    }
    figs.append(fig := plots.plot_peak_by_run(results, title="Peaks"))
    ax = _ax(fig)
    peak, state = _bars(ax)
    assert _heights(peak) == pytest.approx([70.0, 41.0])
    # model state: shards + padding + grads + optimizer states + other, largest rank
    assert _heights(state) == pytest.approx([40.000008, 22.0])
    assert _ticks(ax.get_xticklabels()) == list(results)
    assert "MB" in ax.get_ylabel() and ax.get_title() == "Peaks"
    assert _legend(ax) == ["peak (measured)", "model state at rest"]


# --- readability: every figure the book shows at its column width ------------------------------


def _shown_texts(fig: Figure) -> list[tuple[Any, Any]]:
    """``(Text, window bbox)`` of every non-empty text drawn: tick labels only where their tick
    is inside the axis' view (matplotlib keeps labels for ticks it does not draw)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    canvas = fig.canvas if hasattr(fig.canvas, "get_renderer") else FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    tick_labels, drawn = set(), set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for loc, label in zip(axis.get_ticklocs(), axis.get_ticklabels()):
                tick_labels.add(id(label))
                if ax.axison and lo - 1e-9 * (hi - lo) <= loc <= hi + 1e-9 * (hi - lo):
                    drawn.add(id(label))
    shown = []
    for text in fig.findobj(Text):
        if not text.get_visible() or not text.get_text().strip():
            continue
        if id(text) in tick_labels and id(text) not in drawn:
            continue
        box = text.get_window_extent(renderer)
        if box.width > 0 and box.height > 0:
            shown.append((text, box))
    return shown


def _assert_readable(fig: Figure) -> None:
    """No wider than the book's column (so never scaled down), every text >= 8 pt, inside the
    figure, and no two texts' boxes overlapping."""
    assert fig.get_figwidth() <= plots.BOOK_WIDTH_IN
    shown = _shown_texts(fig)
    assert shown
    small = [(t.get_text(), t.get_fontsize()) for t, _ in shown if t.get_fontsize() < plots.MIN_FONT_PT]
    assert not small
    page = fig.bbox
    outside = [t.get_text() for t, b in shown
               if b.x0 < page.x0 - 1 or b.x1 > page.x1 + 1 or b.y0 < page.y0 - 1 or b.y1 > page.y1 + 1]
    assert not outside
    overlapping = [(a.get_text(), b.get_text()) for i, (a, box_a) in enumerate(shown)
                   for b, box_b in shown[i + 1:] if box_a.overlaps(box_b)]
    assert not overlapping


def test_readability_check_catches_what_it_should(figs: list[Figure]) -> None:
    fig = Figure(figsize=(4, 3))
    figs.append(fig)
    ax = fig.add_subplot()
    ax.text(0.5, 0.5, "one label", fontsize=9)
    ax.text(0.5, 0.5, "on another", fontsize=9)
    with pytest.raises(AssertionError):
        _assert_readable(fig)
    figs.append(small := Figure(figsize=(4, 3)))
    small.add_subplot().set_title("tiny", fontsize=6)
    with pytest.raises(AssertionError):
        _assert_readable(small)
    figs.append(wide := Figure(figsize=(9, 3)))
    wide.add_subplot().set_title("wide")
    with pytest.raises(AssertionError):
        _assert_readable(wide)


def _chapter2_breakdown() -> dict[str, MemoryEstimate]:
    from handbook_lib.models import DECODER_SHAPES, estimate_memory

    return {f"{s}\n{n} GPUs": estimate_memory(DECODER_SHAPES["7b"], n, s, "bf16-mixed", micro_batch=1,
                                              seq_len=4096, activation_checkpointing=True)
            for s in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD") for n in (8, 64)}


def test_memory_breakdown_of_chapter_2_is_readable(figs: list[Figure]) -> None:
    estimates = _chapter2_breakdown()
    figs.append(fig := plots.plot_memory_breakdown(
        estimates, title="7B, bf16-mixed, s=4096, b=1, activation checkpointing",
        limit_bytes=80_000_000_000, limit_label="80 GB GPU"))
    _assert_readable(fig)
    assert _ticks(_ax(fig).get_xticklabels()) == list(estimates)


def test_volume_vs_memory_of_chapter_3_is_readable(figs: list[Figure]) -> None:
    from handbook_lib.models import (
        DECODER_SHAPES,
        estimate_memory,
        estimate_step_traffic,
        wrap_units,
    )

    shape = DECODER_SHAPES["7b"]
    points = []
    for label, name, kwargs in [("DDP", "DDP", {}), ("SHARD_GRAD_OP", "SHARD_GRAD_OP", {}),
                                ("FULL_SHARD", "FULL_SHARD", {}),
                                ("HYBRID_SHARD (4)", "HYBRID_SHARD", {"shard_group_size": 4}),
                                ("HYBRID_SHARD_ZERO2 (4)", "HYBRID_SHARD_ZERO2", {"shard_group_size": 4})]:
        memory = estimate_memory(shape, 8, name, "bf16-mixed", micro_batch=1, seq_len=4096,
                                 activation_checkpointing=True, **kwargs).peak
        sent = estimate_step_traffic(wrap_units(shape), 8, name, param_dtype="bf16",
                                     reduce_dtype="fp32", **kwargs).sent_bytes
        points.append((label, memory, sent))
    figs.append(fig := plots.plot_volume_vs_memory(points, title="7B on 8 GPUs: memory per GPU vs bytes sent"))
    _assert_readable(fig)
    ax = _ax(fig)
    # each label still annotates its own point, and covers no point (its own or another's)
    assert [(t.get_text(), *t.xy) for t in ax.texts] == [(n, m / 1e9, s / 1e9) for n, m, s in points]
    renderer = fig.canvas.get_renderer()
    px = fig.dpi / 72
    discs = [(*ax.transData.transform(xy), c.get_sizes()[0] ** 0.5 / 2 * px)
             for c in ax.collections for xy in c.get_offsets()]
    for text in ax.texts:
        box = text.get_window_extent(renderer)
        assert not [(x, y) for x, y, r in discs if box.x0 - r < x < box.x1 + r and box.y0 - r < y < box.y1 + r]


def test_fit_map_of_chapter_4_is_readable(figs: list[Figure]) -> None:
    from handbook_lib.models import plan

    answers = {}
    for model in ("llama2-7b", "llama2-13b", "llama2-70b", "gpt3-175b"):
        for n in (8, 16, 32, 64, 128, 256, 512, 1024):  # eight columns: names break to fit
            best = plan(model, "h100-80gb", n, seq_len=4096).recommended
            answers[(model, n)] = "none" if best is None else (best.name if best.gpus == n else "more GPUs")
    figs.append(fig := plots.plot_fit_map(answers, title="Recommended on H100 80 GB, s = 4,096"))
    _assert_readable(fig)
    assert len(_ax(fig).texts) == len(answers)


def test_ring_schedule_draws_what_each_rank_holds_after_each_step(figs: list[Figure]) -> None:
    n = 4
    figs.append(fig := diagrams.plot_ring_schedule(n))
    _assert_readable(fig)
    gather, scatter = fig.axes
    for ax, kind in ((gather, "all_gather"), (scatter, "reduce_scatter")):
        squares = {(round(p.get_x()) // (n + 1), round(p.get_y() + 0.4), round(p.get_x()) % (n + 1)): p
                   for p in ax.patches}
        for step in range(n):
            for rank in range(n):
                held = {c for (s, r, c) in squares if (s, r) == (step, rank)}
                if kind == "all_gather":  # after step s: chunks r, r-1, ..., r-s
                    assert held == {(rank - k) % n for k in range(step + 1)}
                else:  # every rank holds a part of every chunk throughout
                    assert held == set(range(n))
            outlined = {(r, c) for (s, r, c), p in squares.items() if s == step and p.get_linewidth() > 0
                        and p.get_edgecolor()[3] > 0}
            assert len(outlined) == (n if step else 0)  # every rank receives one chunk a step
        if kind == "reduce_scatter":  # the last column: rank r holds all N contributions to chunk r
            last = {(round(t.get_position()[0] - 0.45) % (n + 1), round(t.get_position()[1])): t.get_text()
                    for t in ax.texts if round(t.get_position()[0] - 0.45) // (n + 1) == n - 1}
            assert all(last[(r, r)] == str(n) for r in range(n))
            assert sorted(v for (c, r), v in last.items() if c != r) == sorted(
                str(k) for _ in range(n) for k in range(1, n))


def test_commit_protocol_shows_every_step_in_order(figs: list[Figure]) -> None:
    from handbook_lib.models import COMMIT_STEPS

    figs.append(fig := diagrams.plot_commit_protocol(COMMIT_STEPS))
    _assert_readable(fig)
    ax = _ax(fig)
    titles = [t for t in ax.texts if t.get_weight() == "bold"]
    assert [t.get_text() for t in titles] == [f"{i}. {s.name}" for i, s in enumerate(COMMIT_STEPS, 1)]
    assert [t.get_position()[0] for t in titles] == sorted(t.get_position()[0] for t in titles)  # left to right
    crash = [t.get_text().replace("\n", " ") for t in ax.texts if t.get_text().startswith("crash")]
    assert crash == [f"crash: latest = {s.crash_leaves}" for s in COMMIT_STEPS]
    assert len(ax.patches) == 2 * len(COMMIT_STEPS) - 1  # boxes and the arrows between them


def test_memory_vs_seq_len_draws_the_model_in_gb(figs: list[Figure]) -> None:
    from handbook_lib.models import DECODER_SHAPES, estimate_memory, get_accelerator

    lens = [2**k for k in range(9, 16)]
    shape = DECODER_SHAPES["7b"]
    plain, ac = ([estimate_memory(shape, 8, "FULL_SHARD", "bf16-mixed", micro_batch=1, seq_len=s,
                                  activation_checkpointing=a) for s in lens] for a in (False, True))
    gpu = get_accelerator("a100-80gb")
    figs.append(fig := plots.plot_memory_vs_seq_len(lens, plain, ac, limit_bytes=gpu.memory_bytes,
                                                    limit_label="A100 80 GB", title="7B"))
    _assert_readable(fig)
    ax = _ax(fig)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["peak"].get_ydata()) == pytest.approx([e.peak / 1e9 for e in plain])
    assert list(lines["peak, checkpointed"].get_ydata()) == pytest.approx([e.peak / 1e9 for e in ac])
    assert list(lines["activations"].get_ydata()) == pytest.approx([e.forward_activations / 1e9 for e in plain])
    assert list(lines["model state (both)"].get_xdata()) == lens
    assert list(lines["A100 80 GB"].get_ydata()) == pytest.approx([81_920 * 2**20 / 1e9] * 2)  # 85.9 GB
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    # the picture's point: without checkpointing the peak crosses the GPU's memory, with it it does not
    assert plain[-1].peak > gpu.memory_bytes > ac[-1].peak


def test_collective_timeline_one_row_per_unit_in_forward_order(figs: list[Figure]) -> None:
    from handbook_lib.core import ModelConfig
    from handbook_lib.models import estimate_step_traffic, wrap_units

    units = wrap_units(ModelConfig(num_layers=3))
    records = estimate_step_traffic(units, 2, "FULL_SHARD").records
    # one call per ms, each all-gather 0.5 ms long; reduce-scatters without an end, as on gloo
    calls = [{"kind": r.kind, "unit": r.unit, "phase": r.phase, "start_s": i * 1e-3,
              "end_s": i * 1e-3 + 5e-4 if r.kind == "all_gather" else None} for i, r in enumerate(records)]
    figs.append(fig := diagrams.plot_collective_timeline(calls, title="Timeline"))
    _assert_readable(fig)
    ax = _ax(fig)
    assert _ticks(ax.get_yticklabels()) == [u.name for u in units]
    bars = [b for c in ax.collections for b in c.get_paths()]
    gathers = [c for c in calls if c["kind"] == "all_gather"]
    assert len(bars) == len(gathers)
    starts = sorted(round(p.vertices[:, 0].min(), 6) for p in bars)
    assert starts == sorted(round(c["start_s"] * 1e3, 6) for c in gathers)
    marks = [line for line in ax.get_lines() if line.get_marker() == "|"]
    assert sorted(float(m.get_xdata()[0]) for m in marks) == pytest.approx(
        sorted(c["start_s"] * 1e3 for c in calls if c["kind"] == "reduce_scatter"))
    assert ax.get_title() == "Timeline" and "ms" in ax.get_xlabel() and "issued" not in ax.get_xlabel()
    # on CUDA no end is recorded: the times are the host's issue times, and the axis says so
    issued = [{**c, "end_s": None} for c in calls]
    figs.append(fig := diagrams.plot_collective_timeline(issued, title="Timeline on CUDA"))
    _assert_readable(fig)
    assert _ax(fig).get_xlabel().startswith("when the host issued each one, ms since")
    assert not [c for c in _ax(fig).collections if c.get_paths()]  # markers only, no bars


def _fsdp2_calls(layers: int, *, regather: bool = True) -> list[dict[str, Any]]:
    """A FULL_SHARD (or, without ``regather``, SHARD_GRAD_OP) step's collectives as FSDP2
    issues them: every unit gathered in forward; in backward the root first, each layer's
    all-gather prefetching the next before the layer's reduce-scatter, the root reduced last."""
    names = [f"layers.{i}" for i in range(layers)]
    calls = [{"kind": "all_gather", "unit": u, "phase": "forward"} for u in ["root", *names]]
    back = names[::-1]
    if regather:
        calls.append({"kind": "all_gather", "unit": "root", "phase": "backward"})
        calls.append({"kind": "all_gather", "unit": back[0], "phase": "backward"})
    for j, u in enumerate(back):
        if regather and j + 1 < len(back):
            calls.append({"kind": "all_gather", "unit": back[j + 1], "phase": "backward"})
        calls.append({"kind": "reduce_scatter", "unit": u, "phase": "backward"})
    calls.append({"kind": "reduce_scatter", "unit": "root", "phase": "backward"})
    return calls


def test_fsdp_step_slots_place_each_computation_between_the_collectives() -> None:
    slots = diagrams.fsdp_step_slots(_fsdp2_calls(2))
    short = [f"{a[:2]} {u}" for a, u, _ in slots]
    assert short == ["al root", "co root", "al layers.0", "co layers.0", "al layers.1", "co layers.1",
                     "co root",  # the head
                     "al root", "co root", "al layers.1", "al layers.0", "co layers.1", "re layers.1",
                     "co layers.0", "re layers.0", "co root", "re root", "op *"]
    # every collective appears once, in issue order
    assert [(a, u) for a, u, _ in slots if a not in ("compute", "optimizer")] == [
        (c["kind"], c["unit"]) for c in _fsdp2_calls(2)]
    # SHARD_GRAD_OP: nothing gathered in backward, the head's backward opens it
    sgo = diagrams.fsdp_step_slots(_fsdp2_calls(2, regather=False))
    assert sgo[7] == ("compute", "root", "backward")
    with pytest.raises(ValueError, match="forward"):
        diagrams.fsdp_step_slots([{"kind": "all_reduce", "unit": "model", "phase": "backward"}])


def test_gathered_spans_show_resharding_and_the_backward_prefetch() -> None:
    slots = diagrams.fsdp_step_slots(_fsdp2_calls(3))
    spans = diagrams._gathered_spans(slots)
    # FULL_SHARD: each unit gathered twice (forward, backward), each time until its computation ends
    assert sorted(u for u, _, _ in spans) == sorted(["root", "layers.0", "layers.1", "layers.2"] * 2)
    for unit, first, last in spans:
        assert slots[first] == ("all_gather", unit, slots[first][2]) and slots[last][0] == "compute"
    # at most the root and two layers are gathered at once in backward: the one computing, the
    # prefetched one (chapter 2's layer_backward)
    backward = [i for i, s in enumerate(slots) if s[2] == "backward"]
    alive = [sum(a <= i <= b for _, a, b in spans) for i in backward]
    assert max(alive) == 3
    # SHARD_GRAD_OP: one span per unit, from the forward all-gather into backward
    sgo = diagrams._gathered_spans(diagrams.fsdp_step_slots(_fsdp2_calls(3, regather=False)))
    assert len(sgo) == 4 and all(b > a + 1 for _, a, b in sgo)


def test_fsdp_step_draws_one_row_per_unit(figs: list[Figure]) -> None:
    calls = _fsdp2_calls(3)
    figs.append(fig := diagrams.plot_fsdp_step(calls, title="Step"))
    _assert_readable(fig)
    ax = _ax(fig)
    assert _ticks(ax.get_yticklabels()) == ["root", "layers.0", "layers.1", "layers.2"]
    colours = [p.get_facecolor() for p in ax.patches]
    from matplotlib.colors import to_rgba
    assert colours.count(to_rgba("tab:blue")) == sum(c["kind"] == "all_gather" for c in calls)
    assert colours.count(to_rgba("tab:orange")) == sum(c["kind"] == "reduce_scatter" for c in calls)
    assert colours.count(to_rgba("tab:purple")) == 4  # the optimizer, on every unit's shard
    assert "all-gather" in _legend(ax) and ax.get_title() == "Step"


def test_step_phases_stack_the_state_and_each_phase_in_step_order(figs: list[Figure]) -> None:
    from handbook_lib.core import ModelConfig
    from handbook_lib.models import estimate_memory

    est = estimate_memory(ModelConfig(), 2, "FULL_SHARD", "bf16-mixed", micro_batch=4, seq_len=64,
                          backend="gloo")
    figs.append(fig := diagrams.plot_step_phases(est, measured_peak=est.peak))
    _assert_readable(fig)
    ax = _ax(fig)
    assert _ticks(ax.get_yticklabels()) == list(est.phases)
    state, added = _bars(ax)
    widths = [p.get_width() for p in state.patches]
    assert widths == pytest.approx([est.model_state / 1e6] * len(est.phases))
    totals = [a.get_x() + a.get_width() for a in added.patches]
    assert totals == pytest.approx([v / 1e6 for v in est.phases.values()])
    colours = {name: p.get_facecolor() for p, name in zip(added.patches, est.phases)}
    peak = colours.pop(est.peak_phase)
    assert est.peak_phase == "loss_backward" and all(c != peak for c in colours.values())
    line = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert list(line[0].get_xdata()) == pytest.approx([est.peak / 1e6] * 2)


def test_prediction_scatter_puts_each_pair_at_predicted_measured(figs: list[Figure]) -> None:
    pairs = [("1 rank, fp32", 270.4e6, 270.39e6), ("2 ranks, bf16", 130.27e6, 130.0e6)]
    figs.append(fig := plots.plot_prediction_scatter(pairs, title="Peaks"))
    _assert_readable(fig)
    ax = _ax(fig)
    points = [_points(c) for c in ax.collections]
    assert points == [pytest.approx([270.4, 270.39]), pytest.approx([130.27, 130.0])]
    diagonal = ax.get_lines()[0]
    assert list(diagonal.get_xdata()) == list(diagonal.get_ydata())
    assert _legend(ax) == ["measured = predicted", "1 rank,\nfp32", "2 ranks,\nbf16"]


def test_min_tokens_by_link_bars_labels_and_marks(figs: list[Figure]) -> None:
    rows = [("NVLink 4", 1465.0), ("PCIe 5", 8448.0), ("100 GbE", 43256.0)]
    figs.append(fig := plots.plot_min_tokens_by_link(rows, title="Roofline",
                                                     marks={"one sequence": 4096}))
    _assert_readable(fig)
    ax = _ax(fig)
    widths = [p.get_width() for p in ax.patches]
    assert widths == pytest.approx([t for _, t in rows])
    assert _ticks(ax.get_yticklabels()) == ["NVLink 4", "PCIe 5", "100 GbE"]
    assert ax.patches[0].get_y() > ax.patches[2].get_y()  # the first row on top
    assert [t.get_text() for t in ax.texts] == ["1,465", "8,448", "43,256"]
    assert ax.get_xscale() == "log" and [line.get_xdata()[0] for line in ax.lines] == [4096]
    assert _legend(ax) == ["one sequence"]


def test_fit_map_outlines_the_edges(figs: list[Figure]) -> None:
    answers = {("small", 8): "DDP", ("large", 8): "FULL_SHARD + AC"}
    figs.append(fig := plots.plot_fit_map(answers, title="Plan", edges=[("large", 8)]))
    ax = _ax(fig)
    (box,) = ax.patches
    assert box.get_xy() == pytest.approx((-0.47, 0.55)) and "within 5 %" in ax.get_xlabel()
    assert "within" not in _ax(plots.plot_fit_map(answers, title="Plan")).get_xlabel()


def test_micro_batch_fit_draws_the_model_the_runs_and_the_limits_in_gb(figs: list[Figure]) -> None:
    xs = [1, 2, 3, 4]
    peak = [10 * 10**9, 20 * 10**9, 30 * 10**9, 40 * 10**9]
    reserved = [11 * 10**9, 22 * 10**9, 33 * 10**9, 44 * 10**9]
    runs = [(1, 9 * 10**9, 12 * 10**9), (3, 29 * 10**9, 31 * 10**9)]
    figs.append(fig := plots.plot_micro_batch_fit(xs, peak, reserved, runs, 35 * 10**9, 3, 4, title="Fit"))
    ax = _ax(fig)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["model: allocated peak"].get_ydata()) == [10.0, 20.0, 30.0, 40.0]
    assert list(lines["model: reserved (plan)"].get_ydata()) == [11.0, 22.0, 33.0, 44.0]
    assert list(lines["usable memory"].get_ydata()) == [35.0, 35.0]
    assert list(lines["largest that ran (3)"].get_xdata()) == [3, 3]
    assert list(lines["first OOM (4)"].get_xdata()) == [4, 4]
    peaks, reserves = ax.collections
    assert _points(peaks) == [1.0, 9.0, 3.0, 29.0] and _points(reserves) == [1.0, 12.0, 3.0, 31.0]
    assert ax.get_ylabel() == "bytes per rank (GB, 10^9)"
    figs.append(none := plots.plot_micro_batch_fit(xs, peak, reserved, runs, 35 * 10**9, 4, None))
    assert not any(line.get_label().startswith("first OOM") for line in _ax(none).get_lines())
    _assert_readable(fig)


def _pipeline_run(orders: dict[int, list[tuple[str, int, int]]], stages: int) -> RunResult:
    """A ``pipeline`` result whose ranks ran ``orders``, timed as on the unit grid (seconds)."""
    from handbook_lib.models.pipeline import simulate_schedule

    grid = simulate_schedule(orders, stages)
    ranks = [{"rank": r, "pp_rank": r, "dp_rank": 0, "tp_rank": 0,
              "timeline": [[k, s, mb, a / 100, b / 100] for (k, s, mb), a, b in grid[r]]} for r in orders]
    return _run(ranks)


def test_pipeline_schedules_draw_each_rank_s_work_as_run_and_on_the_grid(figs: list[Figure]) -> None:
    from handbook_lib.models.pipeline import schedule_actions

    runs = {name: _pipeline_run({s: schedule_actions(name, 2, 4, s) for s in range(2)}, 2)
            for name in ("GPipe", "1F1B")}
    looped = {0: [("F", 0, i) for i in range(4)] + [("F", 2, i) for i in range(4)] + [("B", 2, i) for i in range(4)]
              + [("B", 0, i) for i in range(4)],
              1: [("F", 1, i) for i in range(4)] + [("F", 3, i) for i in range(4)] + [("B", 3, i) for i in range(4)]
              + [("B", 1, i) for i in range(4)]}
    runs["looped, 2 stages a rank"] = _pipeline_run(looped, 4)
    figs.append(fig := diagrams.plot_pipeline_schedules(runs))
    _assert_readable(fig)
    axes = fig.get_axes()
    assert len(axes) == 6 and axes[0].get_title() == "GPipe: as run (s)"
    assert axes[3].get_title() == "1F1B: on the grid (F 1, B 2)"
    for ax, per_rank in zip(axes, (8, 8, 8, 8, 16, 16)):
        assert len(ax.collections) == 2 * per_rank  # one bar an action, on each of the 2 ranks
    assert [t.get_text() for t in axes[3].get_yticklabels()] == ["rank 0", "rank 1"]
    hatched = [c for c in axes[5].collections if c.get_hatch()]
    assert len(hatched) == 16  # the second stage of each rank: 4 forwards and 4 backwards, 2 ranks
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["forward", "backward (or its input's gradient)", "a rank's second stage"]
