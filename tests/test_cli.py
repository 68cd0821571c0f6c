"""handbook_lib.cli: ``python -m handbook_lib`` commands and exit codes."""

import json
import subprocess
import sys

from handbook_lib.cli import main


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
    assert [line.split()[0] for line in done.stdout.splitlines()] == ["fault", "fsdp_train"]
