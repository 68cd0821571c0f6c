"""handbook_lib.display: human units and tables."""

import pytest

from handbook_lib.display import Table, checks_table, format_bytes
from handbook_lib.results import Check


@pytest.mark.parametrize("n, kwargs, text", [
    (39_474_240, {}, "39.47 MB"),
    (157_896_960, {}, "157.90 MB"),
    (112 * 10**9, {}, "112.00 GB"),
    (2**30, {"binary": True}, "1.00 GiB"),
    (999, {}, "999 B"),
    (1500, {"digits": 1}, "1.5 kB"),
])
def test_format_bytes(n, kwargs, text):
    assert format_bytes(n, **kwargs) == text


def test_table_text_is_aligned_and_html_escaped():
    table = Table(["name", "bytes"], [["a<b", 1234567], ["c", 0.5]])
    lines = table.text().splitlines()
    assert lines[0] == "name      bytes"
    assert lines[2] == " a<b  1,234,567"
    assert len({len(line) for line in lines}) == 1
    assert "a&lt;b" in table._repr_html_()


def test_checks_table_has_error_column():
    table = checks_table([Check("param_shard_bytes", 1, 10, 12, "bytes")])
    assert table.columns[4] == "error" and table.rows[0][4] == 2


def _run(world, losses, peak, state, **extra):
    from handbook_lib.results import SCHEMA, RunResult

    ranks = [{"rank": r, "losses": losses, "peak_bytes": peak, "param_shard_bytes": state,
              "param_padding_bytes": 0, "grad_shard_bytes": state, "optimizer_state_bytes": 2 * state,
              "optimizer_other_bytes": 0, **extra} for r in range(world)]
    return RunResult.from_dict({"schema": SCHEMA, "run": "fsdp_train", "config": {}, "world_size": world,
                                "backend": "gloo", "device": "cpu", "torch_version": "x", "ranks": ranks,
                                "checks": []})


def test_compare_runs_divides_by_the_baseline():
    from handbook_lib.display import compare_runs

    table = compare_runs({"one": _run(1, [2.0, 1.0], 100, 10), "fsdp": _run(2, [2.0, 1.01], 60, 5)}, "one")
    assert table.rows[0][1:] == [1, "40 B", "1.00", "100 B", "1.00", "0.0e+00"]
    assert table.rows[1][1:] == [2, "20 B", "0.50", "60 B", "0.60", "1.0e-02"]


def test_step_time_table_reports_median_ratios():
    from handbook_lib.display import step_time_table

    result = _run(2, [1.0], 1, 1, step_time_s={"DDP": [1.0, 1.0, 1.0], "FULL_SHARD": [1.5, 2.0, 1.2]},
                  ratio_to_ddp={"DDP": [1.0, 1.0, 1.0], "FULL_SHARD": [1.5, 2.0, 1.2]})
    result.extra["variants"] = ["DDP", "FULL_SHARD"]
    assert [row[2] for row in step_time_table(result).rows] == ["1.00", "1.50"]
    assert step_time_table(result).rows[1][3] == "1.20 - 2.00"


def test_run_summary_lists_losses_and_failed_checks():
    from handbook_lib.display import run_summary
    from handbook_lib.results import Check

    result = _run(1, [2.0, 1.23456], 1, 1)
    assert run_summary(result) == "losses: 2.0000 1.2346\n0 checks, 0 failed"
    result.checks.append(Check("peak_bytes", 0, 100, 120, "bytes", 0.1))
    assert run_summary(result).endswith("1 checks, 1 failed\n  failed: peak_bytes rank 0: predicted 100, measured 120")
