"""handbook_lib.cli: ``python -m handbook_lib`` commands and exit codes."""

import json
import subprocess
import sys

from handbook_lib.cli import main
from handbook_lib.runs import available_runs


def test_params_prints_the_breakdown(capsys):
    assert main(["params"]) == 0
    out = capsys.readouterr().out
    assert "total   9,868,560" in out and "embedding   2,560,000" in out


def test_bad_argument_exits_2_with_a_message(capsys):
    assert main(["params", "--set", "nhead=5"]) == 2
    assert "nhead=5 must divide d_model=256" in capsys.readouterr().err
    assert main(["run", "nope"]) == 2
    assert "available runs" in capsys.readouterr().err


def test_run_writes_result_json_single_rank(tmp_path, capsys):
    assert main(["run", "fault", "--nproc", "1", "--set", "mode=none", "--set", "fail_rank=0",
                 "--out", str(tmp_path), "--quiet"]) == 0
    data = json.loads((tmp_path / "result.json").read_text())
    assert data["world_size"] == 1 and data["ranks"] == [{"rank": 0, "all_reduce_sum": 1.0}]
    assert f"result: {tmp_path / 'result.json'}" in capsys.readouterr().out


def test_module_entry_point_lists_runs():
    done = subprocess.run([sys.executable, "-m", "handbook_lib", "runs"], capture_output=True, text=True, check=True)
    listed = [line.split()[0] for line in done.stdout.splitlines()]
    assert listed == available_runs()  # every run module, sorted
    assert {"checkpoint_resume", "comm_bench", "fault", "fsdp_train", "step_time"} <= set(listed)


def test_memory_command_text_and_json(capsys):
    assert main(["memory", "--params", "7e9", "--world-size", "8", "--strategy", "FULL_SHARD",
                 "--precision", "bf16-mixed", "--optimizer", "adamw"]) == 0
    out = capsys.readouterr().out
    assert "params   3,500,000,000" in out  # 4 bytes x 7e9 / 8 ranks
    assert "note: activations not included" in out
    assert main(["memory", "--params", "7e9", "--world-size", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["components"]["params"] == 4 * 7_000_000_000 // 8 and data["peak"] == 16 * 7_000_000_000 // 8


def test_comm_command(capsys):
    assert main(["comm", "--params", "8e6", "--world-size", "4", "--strategy", "FULL_SHARD",
                 "--precision", "fp32", "--link", "nvlink4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # two all-gathers and one reduce-scatter of 8e6 fp32 values, each sending 3/4 of the buffer
    assert data["sent_bytes"] == 3 * (3 * 8_000_000 * 4 // 4)
    assert data["counts"] == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 0, "broadcast": 0}
    assert main(["comm", "--model", "70b", "--link", "nvlink4", "--gpu", "h100-80gb", "--tokens", "4096"]) == 0
    assert "compute-bound" in capsys.readouterr().out
    assert main(["comm", "--params", "1e6", "--link", "carrier-pigeon"]) == 2


def test_plan_command_is_fast_and_explains(capsys):
    import time

    start = time.perf_counter()
    assert main(["plan", "--model", "llama2-13b", "--gpu", "a100-40gb", "--gpus", "8", "--seq-len", "4096"]) == 0
    assert time.perf_counter() - start < 1.0
    out = capsys.readouterr().out
    assert "- Recommended: FULL_SHARD + AC on 8 GPUs" in out and "activations decide" in out
    assert main(["plan", "--model", "llama2-7b", "--gpu", "h100-80gb", "--gpus", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommended"]["name"] == "FULL_SHARD" and len(data["options"]) == 7


def test_planning_commands_do_not_import_torch():
    code = "import sys, handbook_lib.cli; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_run_exits_1_on_a_failed_check_that_is_not_bytes(tmp_path, capsys):
    """Any check outside its tolerance fails the CLI, whatever its unit (here: a count)."""
    code = main(["run", "fault", "--nproc", "1", "--set", "mode=bad_check", "--set", "fail_rank=0",
                 "--out", str(tmp_path), "--quiet"])
    captured = capsys.readouterr()
    assert code == 1
    assert "1 of 1 checks are outside their tolerance" in captured.err
    assert "ranks_counted (rank 0): predicted 2, measured 1.0 ranks" in captured.err
    assert "ranks_counted" in captured.out  # the checks table is printed too
    assert (tmp_path / "result.json").exists()  # the result is kept for inspection
