"""handbook_lib.runs.comm_bench: a real 2-rank benchmark returns times and a fit for each collective."""

import pytest

from handbook_lib.launch import torchrun
from handbook_lib.models import AlphaBeta
from handbook_lib.runs.comm_bench import BenchConfig, buffer_sizes


def test_sizes_are_geometric_and_divisible():
    sizes = buffer_sizes(BenchConfig(min_bytes=1000, max_bytes=10**6, points=4), world_size=4)
    assert len(sizes) == 4 and sizes == sorted(sizes)
    assert all(s % 16 == 0 for s in sizes)  # whole fp32 elements on each of 4 ranks
    assert sizes[0] <= 1008 and sizes[-1] >= 10**6 - 16


def test_bench_measures_every_collective(tmp_path, monkeypatch, capsys):
    # a range wide enough for bandwidth to dominate at the top, even on a busy 2-core machine
    config = {"min_bytes": 2**14, "max_bytes": 2**23, "points": 3, "repeats": 3, "warmup": 1}
    result = torchrun("comm_bench", 2, config, out=tmp_path, timeout_s=120, stream=False)
    kinds = ("all_gather", "reduce_scatter", "all_reduce")
    assert [m["kind"] for m in result.extra["measurements"]] == list(kinds) * 3
    assert all(m["seconds"] > 0 for m in result.extra["measurements"])
    for kind in kinds:
        fit = result.extra["fits"][kind]
        model = AlphaBeta(kind, 2, fit["alpha_s"], fit["beta_bytes_per_s"])
        assert fit["alpha_s"] >= 0 and fit["beta_bytes_per_s"] > 0
        assert model.predict_s(2**23) > model.predict_s(2**14)
    assert result.extra["notes"] == []
    # no deprecation warnings from torch in the ranks' output (it used to print eight)
    logs = [p for p in tmp_path.rglob("*.log") if p.is_file()]
    assert logs and not any("FutureWarning" in p.read_text(errors="replace") for p in logs)
    # the CLI's `run comm_bench` prints the fit (alpha in microseconds, beta in GB/s)
    import handbook_lib.face.commands as commands
    from handbook_lib.face import fit_table, main

    table = fit_table(result)
    assert [row[0] for row in table.rows] == list(kinds)
    assert all(float(row[1]) >= 0 and float(row[2]) > 0 for row in table.rows)
    monkeypatch.setattr(commands, "torchrun", lambda *args, **kwargs: result)
    assert main(["run", "comm_bench", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "alpha-beta fit: time = steps x alpha + bytes sent / beta" in out and table.text() in out


@pytest.mark.parametrize("config, nproc, match", [
    ({"min_bytes": 10, "max_bytes": 5}, 2, "min_bytes < max_bytes"),
    ({"points": 1}, 2, "points"),
    ({}, 1, "at least 2 ranks"),
])
def test_bad_bench_config(config, nproc, match):
    with pytest.raises(ValueError, match=match):
        torchrun("comm_bench", nproc, config)
