"""handbook_lib.face.gpu_results: the GPU result sets read and laid beside the models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from handbook_lib.face.gpu_results import (
    gpu_fit_table,
    gpu_memory_rows,
    gpu_memory_table,
    gpu_mfu_table,
    gpu_smoke_table,
    read_gpu_results,
    root_resharded,
)
from handbook_lib.launch.gpu_check import RESULT_SET_SCHEMA, SWEEP_CONFIG, WRITER
from handbook_lib.launch.gpu_smoke import SMOKE_SCHEMA, SMOKE_WRITER
from handbook_lib.launch.gpu_sweep import sweep_peak_bytes
from handbook_lib.models import estimate_memory, reserved_bytes, wrap_units
from handbook_lib.models.layout import ModelConfig

STORED = Path(__file__).resolve().parents[1] / "results" / "gpu"


def _rank(predicted, measured, allocator, reserved):
    return {"rank": 0, "predicted_peak_bytes": predicted, "peak_bytes": measured,
            "allocator_peak_bytes": allocator, "allocator_reserved_bytes": reserved, "device_free_bytes": 9}


def _memory(config, *rank):
    return {"config": config, "ranks": [_rank(*rank)], "checks": [], "failed_checks": []}


def _check_set(world=2):
    small = {"strategy": "FULL_SHARD", "precision": "fp32", "steps": 3, "batch_size": 4 * world}
    big = {**SWEEP_CONFIG, "steps": 6}
    return {
        "schema": RESULT_SET_SCHEMA, "written_by": WRITER, "world_size": world,
        "memory": {"fp32": _memory(small, 1000, 1010, 1500, 2000), "wall_s": 1.0},
        "mfu": {"config": {**big, "batch_size": 8 * world}, "tokens_per_step": 8 * world * 1024, "step_time_s": 0.5,
                "tokens_per_s": 8 * world * 1024 / 0.5, "mfu": 0.25,
                "memory": _memory({**big, "batch_size": 8 * world}, 10**9, 10**9 - 5, 10**9 + 100, 11 * 10**8),
                "by_micro_batch": [
                    {"micro_batch": 16, "config": {**big, "batch_size": 16 * world}, "tokens_per_step": 16 * world * 1024,
                     "step_time_s": 0.8, "tokens_per_s": 16 * world * 1024 / 0.8, "mfu": 0.3125,
                     "memory": {"ranks": [_rank(2 * 10**9, 2 * 10**9 + 7, 2 * 10**9 + 200, 21 * 10**8)],
                                "failed_checks": []}},
                    {"micro_batch": 64, "error": "RunFailed: CUDA out of memory"}]},
        "max_micro_batch": {"config": SWEEP_CONFIG | {"steps": 2}, "root_reshard_after_forward": False,
                            "measured_largest_fit": 40,
                            "measured_first_oom": 41, "predicted_largest_fit": 44, "capacity_bytes": 80 * 10**9,
                            "device_memory_bytes": 81 * 10**9,
                            "sweep": {"exact": True, "tries": [{"micro_batch": m} for m in (16, 32, 64, 48, 40, 44, 42, 41)]}},
    }


def _write(folder, name, data):
    (folder / f"{name}.json").write_text(json.dumps(data))


def test_read_gpu_results_keeps_only_what_gpu_check_and_gpu_smoke_wrote(tmp_path):
    assert read_gpu_results(tmp_path / "absent") == {}
    _write(tmp_path, "b-check", _check_set())
    _write(tmp_path, "a-smoke", {"schema": SMOKE_SCHEMA, "written_by": SMOKE_WRITER, "runs": {}})
    _write(tmp_path, "other", {"schema": "something/1", "written_by": "me"})
    _write(tmp_path, "list", [1, 2])
    assert list(read_gpu_results(tmp_path)) == ["a-smoke", "b-check"]
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match=r"broken\.json: not a GPU result set"):
        read_gpu_results(tmp_path)


def test_memory_rows_take_every_run_once_per_micro_batch():
    data = _check_set(world=2)
    rows = gpu_memory_rows({"x": data, "y": data})   # the same bytes in two sets: listed once
    assert [(r["set"], r["model"], r["precision"], r["micro_batch"]) for r in rows] == [
        ("x", "book's", "fp32", 4), ("x", "18x2048", "bf16-mixed", 8), ("x", "18x2048", "bf16-mixed", 16)]
    assert (rows[2]["predicted"], rows[2]["measured"], rows[2]["reserved"]) == (2 * 10**9, 2 * 10**9 + 7, 21 * 10**8)
    table = gpu_memory_table({"x": data})
    assert table.rows[0][:5] == ["book's fp32", 4, "1.00 kB", "1.01 kB", "+10"]
    assert table.rows[1][4] == "-5" and table.rows[1][-1] == f"{11 * 10**8 / (10**9 + 100):.3f}"


def test_mfu_table_lists_every_size_that_ran():
    table = gpu_mfu_table({"x": _check_set(world=2)})
    assert [r[0] for r in table.rows] == [8, 16]   # the failed 64 is not a row
    assert table.rows[0][2:] == [16 * 1024, "500.0", f"{16 * 1024 / 0.5:,.0f}", "25.0%"]
    assert table.rows[1][-1] == "31.2%"


def _largest(peak, capacity):
    """The largest m whose peak fits, by a plain linear search (the module bisects)."""
    m = 0
    while peak(m + 1) <= capacity:
        m += 1
    return m


def test_sweep_peak_bytes_is_the_memory_model_of_the_sweep_run():
    model = ModelConfig(**{k: SWEEP_CONFIG[k] for k in ("vocab_size", "d_model", "nhead", "dim_feedforward",
                                                         "num_layers")})
    expected = estimate_memory(model, 2, "FULL_SHARD", "bf16-mixed", "adamw", micro_batch=3, seq_len=1024,
                               units=wrap_units(model, "layer"), backend="nccl").peak
    assert sweep_peak_bytes(SWEEP_CONFIG, 2, 3) == expected
    assert sweep_peak_bytes(SWEEP_CONFIG, 2, 3, reserved=True) == reserved_bytes(expected)


def test_fit_table_prices_the_reserve_as_a_plan_does():
    data = _check_set(world=1)
    row = gpu_fit_table({"x": data}).rows[0]
    reserved = _largest(lambda m: sweep_peak_bytes(SWEEP_CONFIG, 1, m, reserved=True), 80 * 10**9)
    assert row == ["x", "40", 44, reserved, "80.00 GB", "81.00 GB", 8]
    data["max_micro_batch"]["sweep"]["exact"] = False
    data["max_micro_batch"]["measured_first_oom"] = 64
    assert gpu_fit_table({"x": data}).rows[0][1] == "[40, 64)"


def test_smoke_table_counts_checks_that_held_and_exact_ones():
    smoke = {"schema": SMOKE_SCHEMA, "written_by": SMOKE_WRITER, "runs": {
        "fp32": {"run": "fsdp_train", "checks": [
            {"quantity": "a", "rank": 0, "predicted": 10, "measured": 10, "unit": "bytes", "tolerance": 0.0},
            {"quantity": "b", "rank": 0, "predicted": 10, "measured": 11, "unit": "bytes", "tolerance": 0.0},
            {"quantity": "c", "rank": 0, "predicted": 100, "measured": 104, "unit": "bytes", "tolerance": 0.05}]},
        "broken": {"run": "trainer_deepspeed", "checks": [], "error": "RunFailed: " + "x" * 80}}}
    rows = gpu_smoke_table({"s": smoke, "c": _check_set()}).rows
    assert rows[0] == ["s", "fp32", "fsdp_train", "2/3", "1/2", "ran"]
    assert rows[1][:5] == ["s", "broken", "trainer_deepspeed", "0/0", "0/0"]
    assert rows[1][5].endswith("...") and len(rows[1][5]) == 40


# ----------------------------------------------------- the result sets stored with the book
@pytest.fixture(scope="module")
def stored():
    sets = read_gpu_results(STORED)
    if not sets:
        pytest.skip("no GPU result set is stored in results/gpu/")
    return sets


def test_stored_sets_every_smoke_check_held(stored):
    rows = gpu_smoke_table(stored).rows
    assert rows and all(r[5] == "ran" for r in rows)
    for row in rows:
        held, total = map(int, row[3].split("/"))
        assert held == total, row


def test_stored_sets_the_memory_model_is_within_one_percent_of_the_tracker_on_gpus(stored):
    rows = gpu_memory_rows(stored)
    assert rows
    for row in rows:
        assert abs(row["measured"] - row["predicted"]) <= 0.01 * row["predicted"], row
        assert row["reserved"] >= row["allocator"] >= row["measured"], row


def test_stored_sweeps_agree_with_todays_memory_model(stored):
    """Each stored sweep's ``predicted_largest_fit`` is what the memory model says today."""
    for name, data in stored.items():
        sweep = data.get("max_micro_batch")
        if not sweep or "predicted_largest_fit" not in sweep:
            continue
        config, world = sweep["config"], data["world_size"]
        again = root_resharded(sweep)  # the sets measured so far resharded their root
        assert again == ("root_reshard_after_forward" not in sweep)
        assert sweep["predicted_largest_fit"] == _largest(
            lambda m, c=config, w=world, r=again: sweep_peak_bytes(c, w, m, root_reshard_after_forward=r),
            sweep["capacity_bytes"]), name
        tries = {t["micro_batch"]: t["outcome"] for t in sweep["sweep"]["tries"]}
        assert tries.get(sweep["measured_first_oom"]) == "oom", name
        if sweep["sweep"].get("exact"):
            assert tries[sweep["measured_largest_fit"]] == "fits" and \
                sweep["measured_first_oom"] == sweep["measured_largest_fit"] + 1, name


def test_fit_curve_takes_the_exact_sweep_and_the_runs_of_its_model():
    from handbook_lib.face.gpu_results import gpu_fit_curve

    data = _check_set(world=1) | {"gpu_name": "NVIDIA H200"}
    curve = gpu_fit_curve({"x": data}, step=10)
    assert curve["micro_batches"] == list(range(1, 46, 10))   # to the first OOM (41) + 10 %
    assert curve["model_peak"] == [sweep_peak_bytes(SWEEP_CONFIG, 1, m) for m in curve["micro_batches"]]
    assert curve["model_reserved"] == [reserved_bytes(p) for p in curve["model_peak"]]
    # the book's model (fp32) is another model: only the 18x2048 bf16 runs are points
    assert curve["measured"] == [(8, 10**9 - 5, 11 * 10**8), (16, 2 * 10**9 + 7, 21 * 10**8)]
    assert (curve["capacity"], curve["largest_fit"], curve["first_oom"]) == (80 * 10**9, 40, 41)
    assert curve["title"].startswith("What fits on one NVIDIA H200: 18x2048 in bf16-mixed")
    del data["max_micro_batch"]["root_reshard_after_forward"]  # a set from runs that resharded the root
    again = gpu_fit_curve({"x": data}, step=10)["model_peak"]
    assert again == [sweep_peak_bytes(SWEEP_CONFIG, 1, m, root_reshard_after_forward=True)
                     for m in curve["micro_batches"]] != curve["model_peak"]
    data["max_micro_batch"]["sweep"]["exact"] = False
    assert gpu_fit_curve({"x": data}) is None


def test_sets_table_says_what_wrote_each_set_where():
    from handbook_lib.face.gpu_results import gpu_sets_table

    check = _check_set() | {"gpu_name": "NVIDIA H200", "gpu_count": 1, "torch_version": "2.11.0+cu130",
                            "nccl_version": "2.28.9", "date": "2026-12-04T14:54:11+00:00", "total_wall_s": 157.04}
    smoke = {"schema": SMOKE_SCHEMA, "written_by": SMOKE_WRITER, "runs": {}}
    assert gpu_sets_table({"a": check, "b": smoke}).rows == [
        ["a", "gpu-check", "NVIDIA H200", 1, "2.11.0+cu130", "2.28.9", "2026-12-04", "157"],
        ["b", "gpu-smoke", "-", "-", "-", "-", "-", "-"]]


def test_budget_table_sets_the_planners_usable_memory_beside_the_measured():
    from handbook_lib.face.gpu_results import gpu_budget_table
    from handbook_lib.models.hardware import ACCELERATORS, TRAINING_CONTEXT_BYTES

    data = _check_set(world=1) | {"gpu_name": "NVIDIA H200"}
    rows = gpu_budget_table({"a": data, "b": data}).rows   # one block per GPU model
    assert [r[0] for r in rows] == ["NVIDIA H200"] * 4
    smi = ACCELERATORS["h200-141gb"].memory_bytes
    measured = 80 * 10**9
    planner = ACCELERATORS["h200-141gb"].runtime_memory_bytes - TRAINING_CONTEXT_BYTES
    assert [r[3] for r in rows] == [f"{smi - measured:+,}", f"{81 * 10**9 - measured:+,}",
                                    f"{planner - measured:+,}", "+0"]
    unknown = _check_set(world=1) | {"gpu_name": "Some Other GPU"}
    assert gpu_budget_table({"x": unknown}).rows == []


def test_utilization_rows_of_the_stored_h200_sets_fit_the_width_curve_and_the_model(stored):
    """The stored seq_len and width parts: every run at 32,768 tokens; the width fit of their
    calibration rows (this book's unfused model: d_0 = 1,058) is wider than the published fused
    stack's UTILIZATION_HALF_WIDTH; the compute model is within 8 % of the
    steps it was not fitted on up to 4,096-token sequences, and too fast beyond (attention's
    kernel runs below the matrix products' rate): the table says so in its error column."""
    from handbook_lib.face.gpu_results import (
        gpu_utilization_fit,
        gpu_utilization_rows,
        gpu_utilization_table,
        plot_utilization,
    )
    from handbook_lib.models import UTILIZATION_HALF_WIDTH

    rows = gpu_utilization_rows(stored)
    if not rows:
        pytest.skip("no stored seq_len or width part")
    assert all(r["tokens_per_rank"] == 32_768 for r in rows)
    assert all(r["mfu"] >= r["mfu_6pt"] and r["hfu"] >= r["mfu"] for r in rows)
    u_max, d0 = gpu_utilization_fit(rows)
    assert (d0, round(u_max, 3)) == (1058, 0.703) and d0 > UTILIZATION_HALF_WIDTH
    table = gpu_utilization_table(stored)
    errors = {(r[0], r[1], r[3]): float(r[9].rstrip("%")) for r in table.rows}
    assert all(abs(e) <= 3.1 for (w, *_), e in errors.items() if w.endswith("*"))   # the fit, within 3 %
    assert abs(errors[("2048", "2,048", "none")]) < 7 and abs(errors[("2048", "4,096", "none")]) < 8
    assert errors[("2048", "32,768", "none")] < -25   # too fast where attention dominates
    assert plot_utilization(stored).axes[0].get_xlabel() == "sequence length (tokens)"
