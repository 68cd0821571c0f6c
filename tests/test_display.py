"""handbook_lib.face.display: human units and tables."""

import inspect

import pytest

from handbook_lib.core import Check
from handbook_lib.face import Table, checks_table, format_bytes


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
    from handbook_lib.core import SCHEMA, RunResult

    ranks = [{"rank": r, "losses": losses, "peak_bytes": peak, "param_shard_bytes": state,
              "param_padding_bytes": 0, "grad_shard_bytes": state, "optimizer_state_bytes": 2 * state,
              "optimizer_other_bytes": 0, **extra} for r in range(world)]
    return RunResult.from_dict({"schema": SCHEMA, "run": "fsdp_train", "config": {}, "world_size": world,
                                "backend": "gloo", "device": "cpu", "torch_version": "x", "ranks": ranks,
                                "checks": []})


def test_compare_runs_divides_by_the_baseline():
    from handbook_lib.face import compare_runs

    table = compare_runs({"one": _run(1, [2.0, 1.0], 100, 10), "fsdp": _run(2, [2.0, 1.01], 60, 5)}, "one")
    assert table.rows[0][1:] == [1, "40 B", "1.00", "100 B", "1.00", "0.0e+00"]
    assert table.rows[1][1:] == [2, "20 B", "0.50", "60 B", "0.60", "1.0e-02"]


def test_step_time_table_reports_median_ratios():
    from handbook_lib.face import step_time_table

    result = _run(2, [1.0], 1, 1, step_time_s={"DDP": [1.0, 1.0, 1.0], "FULL_SHARD": [1.5, 2.0, 1.2]},
                  ratio_to_ddp={"DDP": [1.0, 1.0, 1.0], "FULL_SHARD": [1.5, 2.0, 1.2]})
    result.extra["variants"] = ["DDP", "FULL_SHARD"]
    assert [row[2] for row in step_time_table(result).rows] == ["1.00", "1.50"]
    assert step_time_table(result).rows[1][3] == "1.20 - 2.00"


def test_run_summary_lists_losses_and_failed_checks():
    from handbook_lib.core import Check
    from handbook_lib.face import run_summary

    result = _run(1, [2.0, 1.23456], 1, 1)
    assert run_summary(result) == "losses: 2.00 1.23\n0 checks, 0 failed"
    result.checks.append(Check("peak_bytes", 0, 100, 120, "bytes", 0.1))
    assert run_summary(result).endswith("1 checks, 1 failed\n  failed: peak_bytes rank 0: predicted 100, measured 120")


def test_checks_table_shows_tolerance_and_verdict():
    from handbook_lib.face import checks_legend, checks_verdict, format_tolerance

    checks = [Check("param_shard_bytes", 0, 10, 10, "bytes"), Check("peak_bytes", 1, 100, 120, "bytes", 0.1),
              Check("loss_FULL_SHARD_vs_DDP", None, 9.35, 9.35, "nats", 1e-5)]
    table = checks_table(checks)
    assert list(table.columns) == ["quantity", "rank", "predicted", "measured", "error", "unit", "tolerance", "ok"]
    assert [row[6:] for row in table.rows] == [["exact", "yes"], ["±10%", "NO"], ["±0.001%", "yes"]]
    assert table.rows[2][1] == "all"  # a quantity of the whole job
    assert format_tolerance(0.05) == "±5%"
    assert checks_verdict(checks) == "3 checks: 2 within tolerance, 1 outside (ok = NO)"
    assert checks_verdict(checks[:1]) == "1 checks: 1 within tolerance"
    assert checks_legend(checks) == "nats = loss in natural-log units (cross-entropy)"
    assert checks_legend(checks[:2]) == ""


def test_checks_table_fits_100_columns_for_the_longest_quantities():
    # fsdp_train's longest quantity names and units, with byte counts beyond the default model's
    # (9.9M parameters: 158 MB of model state on one rank, peak about 250 MB)
    checks = [Check("reduce_scatter_buffer_bytes", 3, 157_896_960, 157_896_960, "bytes"),
              Check("optimizer_state_bytes", 3, 315_793_920, 315_793_921, "bytes"),
              Check("peak_bytes", 3, 999_123_456, 998_012_345, "bytes", 0.1),
              Check("reduce_scatter_count", 3, 9, 9, "collectives"),
              Check("loss_SHARD_GRAD_OP_vs_DDP", 3, 9.352252960205078, 9.352252006530762, "nats", 1e-5)]
    assert max(len(line) for line in checks_table(checks).text().splitlines()) <= 100


def _bench(fits):
    from handbook_lib.core import SCHEMA, RunResult

    sizes = [2**14, 2**23]
    measurements = [{"kind": k, "buffer_bytes": b, "seconds": 1e-4 + b / 1e9} for b in sizes for k in fits]
    return RunResult.from_dict({"schema": SCHEMA, "run": "comm_bench", "config": {}, "world_size": 2,
                                "backend": "gloo", "device": "cpu", "torch_version": "x", "ranks": [{"rank": 0}],
                                "checks": [], "measurements": measurements, "fits": fits, "notes": []})


def test_fit_table_shows_alpha_beta_and_the_fit_beside_the_measurement():
    from handbook_lib.face import fit_table

    table = fit_table(_bench({"all_reduce": {"alpha_s": 5e-5, "beta_bytes_per_s": 2e9}, "all_gather": None}))
    assert list(table.columns) == ["collective", "alpha (us)", "beta (GB/s)", "largest buffer", "fit (ms)",
                                   "measured (ms)"]
    # all-reduce on 2 ranks: 2 ring steps of alpha, and 8 MiB sent (half the buffer, twice) at 2 GB/s
    assert table.rows[0] == ["all_reduce", "50.0", "2.000", "8.00 MiB", f"{(2 * 5e-5 + 2**23 / 2e9) * 1e3:.3f}",
                             f"{(1e-4 + 2**23 / 1e9) * 1e3:.3f}"]
    assert table.rows[1][:3] == ["all_gather", "-", "-"]


def test_step_time_summary_is_one_line_of_median_ratios():
    from handbook_lib.face import step_time_summary

    result = _run(2, [1.0], 1, 1, step_time_s={"DDP": [1.0] * 3, "FULL_SHARD": [1.5, 2.0, 1.2]},
                  ratio_to_ddp={"DDP": [1.0] * 3, "FULL_SHARD": [1.5, 2.0, 1.2]})
    result.extra["variants"] = ["DDP", "FULL_SHARD"]
    assert step_time_summary(result) == "FSDP/DDP step time (median of 3 repeats): FULL_SHARD 1.50x"


def test_losses_are_shown_at_the_stored_precision():
    from handbook_lib.face import LOSS_DECIMALS, format_loss, format_losses

    assert LOSS_DECIMALS == 2
    assert format_loss(9.166393280) == "9.17" and format_loss(9.166393280, 4) == "9.1664"
    assert format_losses([9.155891418, 9.094903946]) == "9.16 9.09"
    # the same run replayed with other CPU kernels (fp32, fp16-mixed, bf16-mixed): same text
    for replay in ([9.166393280, 9.166395187], [9.131373405, 9.131326675], [9.094511032, 9.094879150]):
        assert len({format_loss(x) for x in replay}) == 1


def test_format_bound_states_the_bound_and_refuses_a_false_one():
    from handbook_lib.face import format_bound

    assert format_bound(1.1e-07, below=1e-06) == "< 1e-06"
    assert format_bound(3e-02, above=1e-02) == "> 1e-02"
    with pytest.raises(ValueError, match="is not below 1e-06"):
        format_bound(2e-06, below=1e-06)
    with pytest.raises(ValueError, match="is not above"):
        format_bound(1e-03, above=1e-02)
    with pytest.raises(ValueError, match="exactly one"):
        format_bound(1.0)


def test_zero_vs_fsdp_table_adds_up_each_side():
    from handbook_lib.core import SCHEMA, RunResult
    from handbook_lib.face import zero_vs_fsdp_table

    calls = {"all_gather": {"count": 3, "buffer_bytes": 30, "sent_bytes": 15},
             "all_reduce": {"count": 1, "buffer_bytes": 8, "sent_bytes": 8}}
    rank = {"params_bytes": 100, "master_bytes": 50, "grads_bytes": 40, "optimizer_bytes": 100,
            "optimizer_step_bytes": 4, "collectives": calls,
            "fsdp2": {"strategy": "FULL_SHARD", "params": 60, "grads": 60, "optimizer": 120, "optimizer_step": 108,
                      "collectives": {"all_gather": {"count": 5, "buffer_bytes": 50, "sent_bytes": 25}}}}
    result = RunResult.from_dict({"schema": SCHEMA, "run": "deepspeed_zero", "config": {"strategy": "ZERO3"},
                                  "world_size": 2, "backend": "gloo", "device": "cpu", "torch_version": "x",
                                  "ranks": [rank, rank], "checks": []})
    table = zero_vs_fsdp_table({"ZeRO-3": result})
    assert table.rows == [["ZeRO-3", 100, 50, 40, 104, 294], ["  FSDP2 FULL_SHARD", 60, 0, 60, 228, 348]]
    calls = zero_vs_fsdp_table({"ZeRO-3": result}, "collectives")
    assert calls.rows == [["ZeRO-3", 3, 0, 1, 23], ["  FSDP2 FULL_SHARD", 5, 0, 0, 25]]
    with pytest.raises(ValueError, match="what must be 'bytes' or 'collectives'"):
        zero_vs_fsdp_table({"ZeRO-3": result}, "time")


# --- fitting the book's column (86 characters) -------------------------------------------------

def _widest(shown) -> int:
    return max(len(line) for line in repr(shown).splitlines())


def _fsdp_result(label_world: int, strategy: str, peak_off: float = 0.0):
    """A training run's result as the book's runs report it, its numbers from the memory model
    (the default model of chapter 1), its measurements off by ``peak_off`` where a run's are."""
    from handbook_lib.core import SCHEMA, ModelConfig, RunResult
    from handbook_lib.models import estimate_rank_state

    model = ModelConfig()
    ranks, checks = [], []
    for r in range(label_world):
        s = estimate_rank_state(model, label_world, strategy, rank=r)
        metrics = {"param_shard_bytes": s.params, "param_padding_bytes": 0, "grad_shard_bytes": s.grads,
                   "optimizer_state_bytes": s.optimizer, "optimizer_other_bytes": s.optimizer_step}
        peak = 3 * s.total
        ranks.append({"rank": r, "peak_bytes": round(peak * (1 + peak_off)), "losses": [9.0], **metrics})
        checks += [Check(k, r, v, v, "bytes") for k, v in metrics.items()]
        checks += [Check("reduce_scatter_buffer_bytes", r, 2 * s.grads, 2 * s.grads, "bytes"),
                   Check("reduce_scatter_count", r, 7, 7, "collectives"),
                   Check("activation_bytes", r, s.params, round(s.params * 0.9999), "bytes", 0.05),
                   Check("peak_bytes", r, peak, round(peak * (1 + peak_off)), "bytes", 0.1)]
    return RunResult.from_dict({"schema": SCHEMA, "run": "fsdp_train", "config": {"strategy": strategy},
                                "world_size": label_world, "backend": "gloo", "device": "cpu", "torch_version": "x",
                                "ranks": ranks, "checks": [c.to_dict() for c in checks]})


def test_ranks_table_fits_the_column_and_says_its_unit_once():
    from handbook_lib.core import BOOK_WIDTH
    from handbook_lib.face import ranks_table

    keys = ["param_shard_bytes", "param_padding_bytes", "grad_shard_bytes", "optimizer_state_bytes",
            "optimizer_other_bytes"]
    result = _fsdp_result(2, "FULL_SHARD")
    table = ranks_table(result, keys)
    assert _widest(table) <= BOOK_WIDTH == 86  # it was 108
    assert table.note == "all in bytes (metric names without _bytes)"
    assert table.text().splitlines()[:2] == ["           param    param        grad   optimizer  optimizer",
                                             "rank       shard  padding       shard       state      other"]
    assert [row[1] for row in table.rows] == result.metric("param_shard_bytes")  # the values, unchanged


def test_summarize_runs_fits_the_column_for_chapter_2s_labels():
    from handbook_lib.core import BOOK_WIDTH
    from handbook_lib.face import summarize_runs

    runs = {"1 rank, FULL_SHARD, fp32, AdamW": _fsdp_result(1, "FULL_SHARD"),
            "2 ranks, SHARD_GRAD_OP, fp32, SGD": _fsdp_result(2, "SHARD_GRAD_OP", peak_off=-0.0004),
            "4 ranks, HYBRID_SHARD 2x2, fp32": _fsdp_result(4, "HYBRID_SHARD")}
    table = summarize_runs(runs)
    assert _widest(table) <= BOOK_WIDTH  # it was 132
    exact = sum(c.tolerance == 0 for c in runs["2 ranks, SHARD_GRAD_OP, fp32, SGD"].checks)
    assert table.rows[1][2] == f"{exact}/{exact}" and table.rows[1][3] == "-0.01%"
    assert table.rows[1][6] == "-0.04%"


def test_checks_table_fits_the_column_for_the_books_quantities():
    from handbook_lib.core import BOOK_WIDTH

    result = _fsdp_result(2, "FULL_SHARD")
    table = checks_table(result)
    assert _widest(table) <= BOOK_WIDTH
    assert [row[0] for row in table.rows[:2]] == ["param_shard", "param_padding"]  # the unit says bytes
    assert table.rows[6][5] == "calls" and table.rows[6][0] == "reduce_scatter_count"


def test_definitions_fit_the_column_for_long_texts():
    from handbook_lib.core import BOOK_WIDTH
    from handbook_lib.face import definitions
    from handbook_lib.models import ACCELERATORS, FSDP1_STATE_DICT_TYPES

    types = definitions(FSDP1_STATE_DICT_TYPES, ["what is saved", "with FSDP2 / DCP", "use it for"])
    assert _widest(types) <= BOOK_WIDTH
    words = " ".join(repr(types).split())
    for name, parts in FSDP1_STATE_DICT_TYPES.items():  # every word kept, in order
        assert f"{name} what is saved: {parts[0]} with FSDP2 / DCP: {parts[1]} use it for: {parts[2]}" in words
    sources = definitions({k: a.source for k, a in ACCELERATORS.items()})
    assert _widest(sources) <= BOOK_WIDTH and "<dl>" in sources._repr_html_()
    with pytest.raises(ValueError, match="fields must name each of the 3 texts"):
        definitions(FSDP1_STATE_DICT_TYPES, ["one"])


def test_show_exception_is_one_wrapped_line_with_the_rest_folded():
    from handbook_lib.core import BOOK_WIDTH
    from handbook_lib.face import show_exception

    err = ValueError("incomplete checkpoint /tmp/x/step_4.tmp: " + "a long explanation " * 12 + "\ntrace line")
    shown = show_exception(err, replace={"/tmp/x": "<root>"})
    lines = repr(shown).splitlines()
    assert max(len(line) for line in lines) <= BOOK_WIDTH and len(lines) > 1
    assert " ".join(repr(shown).split()) == "ValueError: incomplete checkpoint <root>/step_4.tmp: " \
        + " ".join(("a long explanation " * 12).split())
    assert "trace line" not in repr(shown) and "trace line" in shown._repr_html_()


def test_show_source_shows_the_objects_own_source():
    import inspect

    from handbook_lib.face import format_bytes as shown_fn
    from handbook_lib.face import show_source

    code = show_source(shown_fn)
    assert repr(code) == inspect.getsource(shown_fn).rstrip("\n")  # short lines: as written
    assert repr(code).startswith("def format_bytes(n: float")
    assert "format_bytes" in code._repr_html_() and "<span" in code._repr_html_()  # highlighted
    with pytest.raises(ValueError, match="show_source needs a function, class or module"):
        show_source(len)


def test_describe_run_is_one_line_without_paths_or_timings():
    from handbook_lib.launch import RunReport, describe_run

    result = _fsdp_result(2, "FULL_SHARD")
    defaults = {"steps": 5, "strategy": "FULL_SHARD", "precision": "fp32", "ckpt_dir": ""}
    config = {"steps": 5, "strategy": "FULL_SHARD", "precision": "bf16-mixed", "ckpt_dir": "/tmp/a/b"}
    line = describe_run("fsdp_train", 2, config, defaults, result)
    n = len(result.checks)
    assert " ".join(line.split()) == ("fsdp_train on 2 ranks (gloo, cpu), 5 steps, FULL_SHARD "
                                      f"precision=bf16-mixed: {n}/{n} checks passed")
    assert max(len(part) for part in line.splitlines()) <= 86  # wrapped, not cut
    assert describe_run("fault", 2, {"mode": "raise"}, {"mode": "none"}, outcome="failed (rank 1)") == \
        "fault on 2 ranks, mode=raise: failed (rank 1)"
    report = RunReport(line, ("[rank0] a <b>",), "6.1 s wall")
    assert repr(report) == line
    assert "<details>" in report._repr_html_() and "a &lt;b&gt;" in report._repr_html_()
    assert "<summary>run log: 1 line; 6.1 s wall</summary>" in report._repr_html_()


def test_show_result_shows_one_config_of_a_batch_as_torchrun_shows_a_run(monkeypatch, capsys):
    """A batch's result, shown alone: the line torchrun shows when that run ends alone (its
    changes from the run's defaults, not its model shape), printed in a terminal and a
    RunReport in a notebook, and the result handed back."""
    import dataclasses

    from handbook_lib.core import RunConfig
    from handbook_lib.launch import RunReport, show, show_result

    base = _fsdp_result(2, "FULL_SHARD")
    config = RunConfig(steps=4, strategy="NO_SHARD", precision="bf16-mixed", d_model=128).to_dict()
    result = dataclasses.replace(base, config=config)
    n = len(result.checks)
    expected = f"fsdp_train on 2 ranks (gloo, cpu), 4 steps, NO_SHARD precision=bf16-mixed: {n}/{n} checks passed"
    monkeypatch.setattr(show, "in_notebook", lambda: False)
    assert show_result(result) is result
    assert " ".join(capsys.readouterr().out.split()) == expected
    shown = []
    monkeypatch.setattr(show, "in_notebook", lambda: True)
    assert show_result(result, display=shown.append) is result
    assert len(shown) == 1 and isinstance(shown[0], RunReport)
    assert " ".join(shown[0].line.split()) == expected
    assert "<details><summary>run log: 0 lines; this config&#x27;s output is in the log of the batch" \
        in shown[0]._repr_html_()


def test_show_source_folds_long_lines_in_text_only():
    from handbook_lib.core import BOOK_WIDTH
    from handbook_lib.face import show_source
    from handbook_lib.runtime import save_checkpoint

    code = show_source(save_checkpoint)
    assert max(len(line) for line in repr(code).splitlines()) <= BOOK_WIDTH
    assert " ".join(repr(code).split()) == " ".join(inspect.getsource(save_checkpoint).split())  # nothing lost
    assert "save_checkpoint" in code._repr_html_()


def test_checks_summary_folds_agreeing_ranks_into_one_row():
    from handbook_lib.face import checks_summary

    import dataclasses

    checks = [Check("param_shard_bytes", r, 10, 10, "bytes") for r in range(4)] + [
        Check("peak_bytes", r, 100, 100 if r else 130, "bytes", 0.1) for r in range(4)] + [
        Check("loss_FULL_SHARD_vs_DDP", None, 9.35, 9.35, "nats", 1e-5)]
    run = dataclasses.replace(_run(4, [1.0], 1, 1), checks=checks)
    table = checks_summary(run)
    assert list(table.columns) == ["quantity", "ranks", "predicted", "measured", "error", "unit",
                                   "tolerance", "ok"]
    # four equal shards: one row; rank 0's peak differs from the other three: two rows, in order
    assert [row[:4] for row in table.rows] == [["param_shard", "4/4", 10, 10], ["peak", "1/4", 100, 130],
                                               ["peak", "3/4", 100, 100],
                                               ["loss_FULL_SHARD_vs_DDP", "all", 9.35, 9.35]]
    assert [row[-1] for row in table.rows] == ["yes", "NO", "yes", "yes"]
    # a plain list of checks knows no world size: the count alone
    assert checks_summary(run.checks[:4]).rows[0][1] == "4"
    # only / leave_out: by the quantity's prefix, the world size kept
    assert [row[0] for row in checks_summary(run, only=("peak",)).rows] == ["peak", "peak"]
    assert [row[:2] for row in checks_summary(run, leave_out=("loss", "peak")).rows] == [["param_shard", "4/4"]]


def test_checks_bound_states_the_largest_relative_error_as_its_bound():
    from handbook_lib.face import checks_bound

    checks = [Check("loss_step1", None, 4.0, 4.0, "nats", 1e-5), Check("loss_step2", None, 2.0, 2.000001, "nats", 1e-5),
              Check("peak_bytes", 0, 100, 130, "bytes", 0.1)]
    assert checks_bound(checks, ("loss",), below=1e-5) == "< 1e-05"  # 5e-7 at most; the peak is not read
    with pytest.raises(ValueError, match="does not meet|not below|must be"):
        checks_bound(checks, ("loss", "peak"), below=1e-5)  # 30 % is no rounding noise
    with pytest.raises(ValueError, match="no check's quantity begins with attention"):
        checks_bound(checks, ("attention",), below=1e-6)


def test_collective_checks_keep_counts_and_bytes_of_collectives_only():
    from handbook_lib.face import collective_checks

    names = ["fsdp_unit_count", "all_gather_count", "all_gather_buffer_bytes",
             "reduce_scatter_buffer_bytes", "all_reduce_buffer_bytes", "sent_bytes",
             "peak_bytes", "activation_bytes", "param_shard_bytes", "loss_FULL_SHARD_vs_DDP"]
    checks = [Check(q, r, 1, 1, "bytes") for r in range(2) for q in names]
    kept = collective_checks(checks)
    assert [c.quantity for c in kept] == names[:6] * 2
    assert [c.quantity for c in collective_checks(checks, rank=1)] == names[:6]
    assert all(c.rank == 1 for c in collective_checks(checks, rank=1))


def test_compare_runs_note_names_the_baseline():
    from handbook_lib.face import compare_runs

    table = compare_runs({"one": _run(1, [2.0, 1.0], 100, 10)}, "one")
    assert table.note.endswith("from the baseline's")


def test_gathered_table_names_units_and_the_peaks():
    from handbook_lib.face import gathered_table

    seen = [{"phase": "forward", "unit": "layers.0", "gathered": ["root", "layers.0"], "gathered_bytes": 30},
            {"phase": "backward", "unit": "layers.0", "gathered": ["root", "layers.0", "layers.1"],
             "gathered_bytes": 50}]
    predicted = [dict(s, gathered_bytes=s["gathered_bytes"] + 1) for s in seen]
    table = gathered_table({"a": _run(2, [1.0], 1, 1, gathered=seen, predicted_gathered=predicted)})
    assert table.rows[0] == ["fwd", "L0", "root L0"] and table.rows[1][2] == "root L0 L1"
    assert table.rows[-1] == ["peak", "", "50 B (51 B)"]  # the largest of each, measured (predicted)


def test_knob_traffic_table_counts_groups_and_reads_the_checks():
    import dataclasses

    from handbook_lib.core import Check
    from handbook_lib.face import knob_traffic_table

    calls = [{"kind": "all_gather", "group_size": 4}, {"kind": "all_gather", "group_size": 2},
             {"kind": "reduce_scatter", "group_size": 4}]
    result = dataclasses.replace(_run(4, [1.0], 1, 1, collectives=calls), checks=[
        Check("sent_bytes", 0, 90, 90, "bytes", 0.0), Check("held_between_micro_steps", 0, 8, 8, "bytes", 0.0)])
    row = knob_traffic_table({"r": result}).rows[0]
    assert row == ["r", "2 in 4/2", 1, "90 B (90 B)", "8 B (8 B)"]


def test_checks_by_run_counts_the_ranks_that_pass():
    import dataclasses

    from handbook_lib.core import Check
    from handbook_lib.face import checks_by_run

    result = dataclasses.replace(_run(2, [1.0], 1, 1), checks=[
        Check("issue_order", 0, 12, 12, "in place", 0.0), Check("issue_order", 1, 12, 11, "in place", 0.0),
        Check("peak_bytes", 0, 100, 104, "bytes", 0.1), Check("peak_bytes", 1, 100, 104, "bytes", 0.1)])
    rows = checks_by_run({"r": result}, ("issue_order", "peak_bytes", "absent")).rows
    assert rows == [["r", "issue_order", "12", "12", "1/2"], ["r", "peak", "100 B", "104 B", "2/2"]]


def test_checks_halves_puts_a_cases_broken_and_fixed_checks_side_by_side():
    from handbook_lib.face import checks_halves

    import dataclasses

    checks = [Check("broken.units", r, 1, 1, "units") for r in range(2)] + [
        Check("fixed.units", r, 3, 3, "units") for r in range(2)] + [
        Check("broken.state_dict_bytes", 0, 280, 280, "bytes"), Check("broken.state_dict_bytes", 1, 0, 0, "bytes"),
        Check("fixed.grad", 0, 10, 10, "bytes"), Check("broken.symptom", None, 1, 1, "flag")]
    run = dataclasses.replace(_run(2, [1.0], 1, 1), checks=checks)
    table = checks_halves(run)
    assert list(table.columns) == ["quantity", "broken", "fixed", "unit"]
    assert table.rows == [["units", "1 / 1", "3 / 3", "units"], ["state_dict", "280 / 280; 0 / 0", "-", "bytes"],
                          ["grad", "-", "10 / 10", "bytes"]]  # the job-wide symptom: counted, no row
    assert table.note == "model / run; 8 checks, every one within its tolerance (all exact)"
    off = dataclasses.replace(run, checks=[*checks, Check("fixed.units", 0, 3, 4, "units")])
    assert checks_halves(off).note == "model / run; outside their tolerance: fixed.units"
    assert checks_halves(off).rows[0] == ["units", "1 / 1", "3 / 3; 3 / 4", "units"]
