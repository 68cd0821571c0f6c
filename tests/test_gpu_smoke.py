"""make gpu-smoke without a GPU: the plan, the parsing of results and the verdicts, with CUDA
faked in this process (as tests/test_gpu_check.py fakes it for gpu-check)."""

import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from handbook_lib.core import Check, RunResult
from handbook_lib.launch.gpu_smoke import (
    SMOKE_SCHEMA,
    SMOKE_WRITER,
    check_failures,
    mfu_failure,
    smoke_failures,
    smoke_path,
    smoke_plan,
    smoke_summary,
)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_smoke.py"


def test_plan_is_the_review_short_list_and_every_config_validates(tmp_path):
    plan = smoke_plan(tmp_path / "t")
    assert [s.label for s in plan] == ["fp32", "bf16", "accumulation", "offload_clip", "trainer_deepspeed", "mfu"]
    for spec in plan:
        module = importlib.import_module(f"handbook_lib.runs.{spec.run}")
        config = module.CONFIG.from_mapping(spec.config)
        module.validate(config, 1)  # one GPU: every run is valid on one rank
    by = {s.label: module_config(s) for s in plan}
    assert by["bf16"].precision == "bf16-mixed" and by["accumulation"].grad_accum_steps == 2
    assert by["offload_clip"].cpu_offload and by["offload_clip"].max_grad_norm > 0
    assert by["mfu"].precision == "bf16-mixed" and by["mfu"].batch_size * by["mfu"].seq_len == 8 * 1024
    with pytest.raises(ValueError, match="trainer_dir"):
        smoke_plan("")


def module_config(spec):
    return importlib.import_module(f"handbook_lib.runs.{spec.run}").CONFIG.from_mapping(spec.config)


def test_result_set_sits_beside_gpu_checks():
    assert smoke_path("/r", "NVIDIA H200") == Path("/r/results/gpu/smoke-nvidia-h200.json")


def test_failed_checks_are_one_line_each():
    checks = [Check("init_bytes", 0, 1000, 1512, "bytes").to_dict(),
              Check("peak_bytes", 0, 100, 104, "bytes", 0.05).to_dict(),
              Check("steps", None, 3, 2, "steps").to_dict()]
    lines = check_failures("fp32", checks)
    assert lines == ["fp32: init_bytes (rank 0) predicted 1000 measured 1512 bytes (tolerance 0)",
                     "fp32: steps (job) predicted 3 measured 2 steps (tolerance 0)"]


def test_mfu_verdicts():
    assert mfu_failure(0.45, 0.3) is None and mfu_failure(None, 0.3) is None  # unknown GPU: no MFU
    assert "outside (0, 1)" in mfu_failure(1.3, 0.01)
    assert "no positive step time" in mfu_failure(0.5, None)


def test_failures_and_summary():
    runs = {"fp32": {"checks": []}, "bf16": {"error": "RunFailed: rank 0 raised RuntimeError: x"},
            "mfu": {"checks": [], "mfu": 1.2, "step_time_s": 0.01}}
    lines = smoke_failures(runs)
    assert lines[0] == "bf16: RunFailed: rank 0 raised RuntimeError: x" and lines[1].startswith("mfu: 1.200")
    assert smoke_summary(runs, "x.json") == "gpu-smoke: 2 of 3 runs failed (bf16, mfu) -> x.json"
    assert smoke_summary({"fp32": {"checks": []}}, "x.json") == "gpu-smoke: all 1 runs passed every check -> x.json"


# ------------------------------------------------------------------------------- the script
def _script():
    spec = importlib.util.spec_from_file_location("gpu_smoke_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_gpu_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120,
                          env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "gpu-smoke needs a CUDA GPU: none is visible (torch.cuda.is_available() is False)\n"


class FakeLaunch:
    """Stands for launch.torchrun on one GPU: validates each config as the run does, then
    answers with one failed init_bytes check on the fp32 run and a synchronized step time."""

    def __init__(self):
        self.calls = []

    def __call__(self, run, nproc, config, *, timeout_s, stream, allow_failed_checks):
        assert nproc == 1 and allow_failed_checks and not stream and 0 < timeout_s <= 180
        module = importlib.import_module(f"handbook_lib.runs.{run}")
        cfg = module.CONFIG.from_mapping(config)
        module.validate(cfg, nproc)
        self.calls.append(run)
        if run == "trainer_deepspeed":
            raise RuntimeError("run 'trainer_deepspeed' failed: rank 0 raised KeyError: 'lm_head.weight'\nmore")
        plain = cfg.precision == "fp32" and cfg.steps == 3 and not cfg.cpu_offload and cfg.grad_accum_steps == 1
        off = 512 if plain else 0  # the fp32 run: init_bytes one block off
        checks = [Check("init_bytes", 0, 1000, 1000 + off, "bytes")]
        ranks = [{"rank": 0, "step_time_s": [2.0, 0.5, 0.5, 0.5, 0.5], "peak_bytes": 10, "allocator_peak_bytes": 12}]
        return RunResult("handbook.result/1", run, cfg.to_dict(), 1, "nccl", "cuda", "x", ranks, checks)


def test_smoke_on_one_fake_gpu(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    script = _script()
    env = {"gpu_name": "NVIDIA H200", "gpu_count": 1, "torch_version": torch.__version__}
    monkeypatch.setitem(sys.modules, "gpu_check", SimpleNamespace(environment=lambda: env))
    out = tmp_path / "smoke.json"
    launch = FakeLaunch()
    assert script.main(["--out", str(out)], launch=launch) == 1
    assert launch.calls == ["fsdp_train"] * 4 + ["trainer_deepspeed", "fsdp_train"]
    data = json.loads(out.read_text())
    assert (data["schema"], data["written_by"], data["gpu_name"]) == (SMOKE_SCHEMA, SMOKE_WRITER, "NVIDIA H200")
    assert data["failures"] == [
        "fp32: init_bytes (rank 0) predicted 1000 measured 1512 bytes (tolerance 0)",
        "trainer_deepspeed: RuntimeError: run 'trainer_deepspeed' failed: rank 0 raised KeyError: "
        "'lm_head.weight'"]
    mfu = data["runs"]["mfu"]
    assert mfu["step_time_s"] == 0.5 and mfu["preset"] == "h200-141gb"
    assert mfu["mfu"] == pytest.approx(6 * 1_037_552_896 * 8 * 1024 / (0.5 * 989e12))
    assert data["runs"]["bf16"]["ranks"] == [{"peak_bytes": 10, "allocator_peak_bytes": 12,
                                              "step_time_s": [2.0, 0.5, 0.5, 0.5, 0.5]}]
    printed = capsys.readouterr().out.splitlines()
    failed = [line for line in printed if line.startswith("FAILED ")]
    assert [line.rstrip("…") for line in failed] == [f"FAILED {x}"[:99] for x in data["failures"]]
    assert failed[1].endswith("…") and len(failed[1]) == 100
    assert printed[-1] == f"gpu-smoke: 2 of 6 runs failed (fp32, trainer_deepspeed) -> {out}"
    assert all(len(line) <= 100 for line in printed[:-1])
    # a file gpu-smoke did not write is never replaced
    foreign = tmp_path / "mine.json"
    foreign.write_text("{}")
    with pytest.raises(FileExistsError, match="not written by gpu-smoke"):
        script.main(["--out", str(foreign)], launch=launch)
