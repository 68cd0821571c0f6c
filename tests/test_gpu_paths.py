"""CUDA paths checked without a GPU, CUDA faked (issue 29): DeepSpeed's accelerator (S1-3)."""

import warnings

import pytest
import torch

from handbook_lib.integrations import zero_engine
from handbook_lib.integrations.zero_engine import set_ds_accelerator


def test_cpu_accelerator_is_set_only_without_a_gpu():
    env = {}
    assert set_ds_accelerator(env, cuda=False) is None and env == {"DS_ACCELERATOR": "cpu"}
    env = {"DS_ACCELERATOR": "cpu", "OTHER": "1"}
    line = set_ds_accelerator(env, cuda=True)
    assert env == {"OTHER": "1"} and "DS_ACCELERATOR=cpu ignored" in line and "\n" not in line
    env = {"DS_ACCELERATOR": "cuda"}
    assert set_ds_accelerator(env, cuda=True) is None and env == {"DS_ACCELERATOR": "cuda"}


def test_import_deepspeed_drops_an_inherited_cpu_accelerator_on_cuda(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    class Stop(Exception):
        pass

    def refuse(*args, **kwargs):  # stop before DeepSpeed would import against the faked CUDA
        raise Stop

    monkeypatch.setattr(zero_engine.warnings, "filterwarnings", refuse)
    monkeypatch.setitem(__import__("sys").modules, "deepspeed", object())
    with warnings.catch_warnings(record=True) as caught, pytest.raises(Stop):
        warnings.simplefilter("always")
        zero_engine.import_deepspeed()
    assert "DS_ACCELERATOR" not in __import__("os").environ
    assert any("DS_ACCELERATOR=cpu ignored" in str(w.message) for w in caught)


def _fake_init(monkeypatch, cuda: bool) -> dict:
    """Fake CUDA (or its absence) and torch.distributed's process-group creation; the keyword
    arguments init_distributed passes land in the returned dict."""
    from handbook_lib.runtime import distributed

    seen: dict = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1 if cuda else 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen.setdefault("set_device", device))
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    seen["ctx"] = distributed.init_distributed(timeout_s=5)
    return seen


def test_nccl_ranks_get_a_gloo_backend_for_cpu_tensors_too(monkeypatch):
    """S1-7: offloaded gradients (clipping, fp16's scaler) are CPU DTensors on a cuda mesh, so
    the group needs gloo beside NCCL; the context still says nccl, which the memory model reads."""
    seen = _fake_init(monkeypatch, cuda=True)
    assert seen["backend"] == "cpu:gloo,cuda:nccl"
    assert seen["device_id"] == torch.device("cuda", 0) == seen["set_device"]
    assert seen["ctx"].backend == "nccl" and seen["ctx"].device == torch.device("cuda", 0)


def test_cpu_ranks_keep_gloo_alone(monkeypatch):
    seen = _fake_init(monkeypatch, cuda=False)
    assert seen["backend"] == "gloo" and seen["device_id"] is None and seen["ctx"].backend == "gloo"


# ------------------------------------------------------------- S1-2: a CPU torch on a GPU machine
def test_gpu_present_reads_the_device_node_or_nvidia_smi(tmp_path):
    from handbook_lib.launch.gpu_check import gpu_present

    node = tmp_path / "nvidia0"
    assert not gpu_present(node, smi=str(tmp_path / "absent"))
    node.touch()
    assert gpu_present(node, smi=str(tmp_path / "absent"))
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    assert gpu_present(tmp_path / "none", smi=str(smi))
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert not gpu_present(tmp_path / "none", smi=str(smi))


def test_no_gpu_message_tells_the_cases_apart():
    from handbook_lib.launch.gpu_check import NO_GPU_MESSAGE, no_gpu_message

    assert no_gpu_message("12.6", present=False) == no_gpu_message(None, False) == NO_GPU_MESSAGE
    cpu = no_gpu_message(None, True, "2.13.0+cpu")
    assert "CPU build" in cpu and "install torch==2.13.0 from" in cpu and "whl/cu126" in cpu
    driver = no_gpu_message("12.8", True, "2.13.0+cu128")
    assert "CUDA 12.8" in driver and "driver" in driver and "CPU build" not in driver
    assert all(len(line) <= 100 and "\n" not in line for line in (cpu, driver, NO_GPU_MESSAGE))


def test_gpu_check_script_names_a_cpu_build_on_a_gpu_machine(monkeypatch, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check_script_s12", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(script, "gpu_present", lambda: True)
    assert script.main([], launch=lambda *a, **k: pytest.fail("launched")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a CPU build" in err


def _setup_check(tmp_path, with_gpu: bool):
    """scripts/setup.sh's check_gpu_torch, sourced, with this venv's torch and (maybe) a fake
    nvidia-smi first on PATH."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if with_gpu:
        smi = tmp_path / "nvidia-smi"
        smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
        smi.chmod(0o755)
    script = f'source "{root}/scripts/setup.sh"; check_gpu_torch "{sys.executable}"'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, cwd=root,
                          env={"PATH": f"{tmp_path}:/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})


def test_setup_script_parses():
    import subprocess
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "setup.sh"
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs this venv's CPU build of torch")
def test_setup_names_a_cpu_torch_on_a_gpu_machine(tmp_path):
    proc = _setup_check(tmp_path, with_gpu=True)
    assert proc.returncode == 0 and proc.stdout == ""
    assert proc.stderr.startswith("setup: torch is a CPU build on a GPU machine: install torch==")
    assert proc.stderr.count("\n") == 1


@pytest.mark.skipif(__import__("os").path.exists("/dev/nvidia0"), reason="a real GPU is here")
def test_setup_says_nothing_without_a_gpu(tmp_path):
    proc = _setup_check(tmp_path, with_gpu=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
