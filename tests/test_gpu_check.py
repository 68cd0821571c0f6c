"""handbook_lib.launch.gpu_check and scripts/gpu_check.py: everything of ``make gpu-check`` but the GPU.

The GPU path of the script runs here against a fake ``torch.cuda`` and a fake launcher that
validates each config with the real run's CONFIG and ``validate`` and answers with results shaped
like the runs' own; what a real GPU measures is not tested here.
"""

import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from handbook_lib.core import Check, RunResult, param_count
from handbook_lib.launch import (
    BILLION_MODEL,
    MFU_CONFIG,
    SEQ_CHECKPOINTING,
    SEQ_LENS,
    SEQ_TOKENS,
    WIDTH_MODELS,
    NO_GPU_MESSAGE,
    RESULT_SET_SCHEMA,
    WRITER,
    RunFailed,
    RunTimeout,
    device_capacity,
    estimate_mfu,
    estimate_prefetch_extra_bytes,
    gpu_slug,
    is_cuda_oom,
    match_accelerator,
    memory_figures,
    predict_max_micro_batch,
    steady_step_time_s,
    sweep_micro_batch,
    write_result_set,
)
from handbook_lib.models import ACCELERATORS, estimate_memory, wrap_units

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"

# ---------------------------------------------------------------------------------- MFU
def test_mfu_against_its_definition_by_hand():
    # 6 * 1e9 params * 8192 tokens = 4.9152e13 FLOPs per step; one H200 does 989e12 FLOP/s,
    # so 0.1 s of it is 9.89e13 FLOPs: 4.9152 / 9.89 = 0.496986...
    assert estimate_mfu(10**9, 8192, 0.1, 1, 989e12) == pytest.approx(0.4969868554, rel=1e-9)
    # twice the GPUs doing twice the tokens in the same time: the same utilization
    assert estimate_mfu(10**9, 16384, 0.1, 2, 989e12) == pytest.approx(0.4969868554, rel=1e-9)
    # a step twice as long: half of it
    assert estimate_mfu(10**9, 8192, 0.2, 1, 989e12) == pytest.approx(0.2484934277, rel=1e-9)


@pytest.mark.parametrize("args, name", [
    ((0, 1, 1.0, 1, 1e12), "num_params"), ((1, 1.5, 1.0, 1, 1e12), "tokens_per_step"),
    ((1, 1, 0.0, 1, 1e12), "step_time_s"), ((1, 1, float("nan"), 1, 1e12), "step_time_s"),
    ((1, 1, 1.0, 0, 1e12), "world_size"), ((1, 1, 1.0, 1, -1.0), "peak_flops"),
])
def test_mfu_refuses_bad_arguments(args, name):
    with pytest.raises(ValueError, match=name):
        estimate_mfu(*args)


def test_billion_model_is_about_a_billion_parameters():
    assert param_count(BILLION_MODEL) == 1_037_552_896
    assert {k: MFU_CONFIG[k] for k in BILLION_MODEL.to_dict()} == BILLION_MODEL.to_dict()
    assert (MFU_CONFIG["api"] if "api" in MFU_CONFIG else "fsdp2", MFU_CONFIG["precision"]) == ("fsdp2", "bf16-mixed")


# --------------------------------------------------------------------- device name -> preset
@pytest.mark.parametrize("name, preset", [
    ("NVIDIA H200", "h200-141gb"),
    ("NVIDIA H200 NVL", None),               # lower clock than the SXM preset
    ("NVIDIA H100 80GB HBM3", "h100-80gb"),
    ("NVIDIA H100 PCIe", None),
    ("NVIDIA H100 NVL", None),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb"),
    ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
    ("NVIDIA L4", "l4-24gb"),
    ("NVIDIA L40S", None),                   # not an L4
    ("NVIDIA B200", "b200-180gb"),
    ("AMD Instinct MI300X", "mi300x-192gb"),
    ("NVIDIA GeForce RTX 4090", None),
    ("Tesla V100-SXM2-16GB", None),
    ("", None),
])
def test_device_name_maps_to_a_preset_or_to_unknown(name, preset):
    assert match_accelerator(name) == preset
    if preset is not None:
        assert preset in ACCELERATORS


# ------------------------------------------------------------------------------ OOM recognition
TORCH_OOM = (
    "run 'fsdp_train' failed: rank 0 raised OutOfMemoryError: CUDA out of memory. Tried to allocate "
    "2.00 GiB. GPU 0 has a total capacity of 139.72 GiB of which 1.06 GiB is free. Including "
    "non-PyTorch memory, this process has 138.65 GiB memory in use. Of the allocated memory 135.21 GiB "
    "is allocated by PyTorch, and 1.93 GiB is reserved by PyTorch but unallocated. If reserved but "
    "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
)
OOM_MESSAGES = [
    TORCH_OOM,
    "run 'fsdp_train' failed: rank 1 raised RuntimeError: CUDA error: out of memory\nCUDA kernel errors "
    "might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.",
    "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, "
    "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n"
    "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 'out of memory'",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB",
]
NOT_OOM = [
    "run 'fsdp_train' failed: rank 0 died without a Python traceback (os._exit, a signal such as SIGKILL, "
    "a crash in C++ code, or the out-of-memory killer)",
    "run 'fsdp_train' timed out after 240 s; where each rank was:",
    "RuntimeError: [enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate "
    "memory: you tried to allocate 4000000000 bytes. Error code 12 (Cannot allocate memory)",
    "run 'fsdp_train' failed: rank 0 raised NonFiniteLoss: loss is nan at step 3 on rank 0",
    "batch_size=6 must be divisible by the number of ranks 4",
]


def _failed(message, traceback="", log_tail=(), kind=RunFailed):
    return kind(message, run="fsdp_train", rank=0, rank_traceback=traceback, out_dir=None,
                returncode=1, log_tail=list(log_tail))


@pytest.mark.parametrize("message", OOM_MESSAGES)
def test_cuda_out_of_memory_is_recognised(message):
    assert is_cuda_oom(message)
    assert is_cuda_oom(_failed(message))


@pytest.mark.parametrize("message", NOT_OOM)
def test_other_failures_are_not_out_of_memory(message):
    assert not is_cuda_oom(message)
    assert not is_cuda_oom(_failed(message))


def test_oom_found_in_the_rank_traceback_or_the_log_tail():
    assert is_cuda_oom(_failed("run 'fsdp_train' failed: rank 0 raised an error", traceback=TORCH_OOM))
    assert is_cuda_oom(_failed("run 'fsdp_train' failed", log_tail=["[rank0]: " + TORCH_OOM]))
    assert not is_cuda_oom(_failed("run 'fsdp_train' timed out", kind=RunTimeout))


# ------------------------------------------------------------------------------------ the sweep
class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _runner(limit, clock=None, seconds=10.0, error=None):
    """A fake run: fits up to ``limit``, runs out of CUDA memory above; records the sizes tried."""
    tried = []

    def try_size(size):
        tried.append(size)
        if clock is not None:
            clock.now += seconds
        if error is not None and size >= error:
            raise _failed("run 'fsdp_train' failed: rank 0 raised ValueError: something else")
        if size > limit:
            raise _failed(TORCH_OOM)
    return try_size, tried


def test_sweep_doubles_until_out_of_memory():
    try_size, tried = _runner(40)
    sweep = sweep_micro_batch(try_size, bisect=False)
    assert tried == [1, 2, 4, 8, 16, 32, 64]
    assert (sweep.largest_fit, sweep.first_oom, sweep.stopped, sweep.exact) == (32, 64, "oom", False)
    assert [t.outcome for t in sweep.tries] == ["fits"] * 6 + ["oom"]
    assert "CUDA out of memory" in sweep.tries[-1].detail and "\n" not in sweep.tries[-1].detail


@pytest.mark.parametrize("limit", [1, 2, 5, 40, 63, 64, 65, 82, 127])
def test_sweep_bisects_to_the_exact_largest_fit(limit):
    try_size, tried = _runner(limit)
    sweep = sweep_micro_batch(try_size)
    assert (sweep.largest_fit, sweep.first_oom, sweep.stopped, sweep.exact) == (limit, limit + 1, "oom", True)
    doubling = [1 << k for k in range(limit.bit_length() + 1)]
    assert tried[:len(doubling)] == doubling  # then one try per halving of the bracket
    assert len(tried) == len(doubling) + limit.bit_length() - 1  # the bracket (2^k, 2^(k+1)) halved k times
    assert [t.micro_batch for t in sweep.tries if t.outcome == "fits"][-1] == limit
    assert sweep.to_dict()["exact"] is True


def test_sweep_bisection_keeps_to_its_time_budget():
    clock = FakeClock()
    try_size, tried = _runner(40, clock=clock, seconds=10.0)
    sweep = sweep_micro_batch(try_size, start=16, known_fit=8, time_left_s=lambda: 55.0 - clock.now, clock=clock)
    # 16 fits, 32 fits, 64 OOM (25 s left > 15: try 48; 15 s left: stop): the bracket [32, 48)
    assert tried == [16, 32, 64, 48]
    assert (sweep.largest_fit, sweep.first_oom, sweep.stopped, sweep.exact) == (32, 48, "oom", False)


def test_sweep_starts_above_a_size_known_to_fit():
    try_size, tried = _runner(40)
    sweep = sweep_micro_batch(try_size, start=16, known_fit=8, bisect=False)
    assert tried == [16, 32, 64]
    assert (sweep.largest_fit, sweep.first_oom) == (32, 64)
    try_size, tried = _runner(10)
    assert sweep_micro_batch(try_size, start=16, known_fit=8, bisect=False).largest_fit == 8
    try_size, tried = _runner(10)
    assert sweep_micro_batch(try_size, start=16, known_fit=8).largest_fit == 10
    assert tried == [16, 12, 10, 11]  # bisection starts from the size known to fit
    with pytest.raises(ValueError, match="known_fit"):
        sweep_micro_batch(try_size, start=16, known_fit=16)
    with pytest.raises(ValueError, match="start"):
        sweep_micro_batch(try_size, start=0)


def test_sweep_that_never_fits():
    try_size, _ = _runner(0)
    sweep = sweep_micro_batch(try_size)
    assert (sweep.largest_fit, sweep.first_oom, sweep.stopped) == (0, 1, "oom")


def test_sweep_stops_on_another_failure_undecided():
    try_size, tried = _runner(1000, error=8)
    sweep = sweep_micro_batch(try_size)
    assert tried == [1, 2, 4, 8]
    assert (sweep.largest_fit, sweep.first_oom, sweep.stopped) == (4, None, "error")
    assert sweep.tries[-1].outcome == "error" and "something else" in sweep.tries[-1].detail


def test_sweep_keeps_to_its_time_budget():
    clock = FakeClock()
    try_size, tried = _runner(1000, clock=clock, seconds=10.0)
    sweep = sweep_micro_batch(try_size, time_left_s=lambda: 35.0 - clock.now, clock=clock)
    # 35 s left: try 1 (10 s); 25 > 1.5 * 10 left: try 2; 15 left is not more than 15: stop
    assert tried == [1, 2]
    assert (sweep.largest_fit, sweep.first_oom, sweep.stopped) == (2, None, "budget")
    assert [t.seconds for t in sweep.tries] == [10.0, 10.0]


def test_sweep_stops_at_its_limit():
    try_size, tried = _runner(1000)
    sweep = sweep_micro_batch(try_size, max_micro_batch=4)
    assert tried == [1, 2, 4] and (sweep.largest_fit, sweep.stopped) == (4, "limit")
    assert json.loads(json.dumps(sweep.to_dict()))["tries"][0] == {"micro_batch": 1, "outcome": "fits",
                                                                  "seconds": sweep.tries[0].seconds, "detail": ""}


# ------------------------------------------------------------------- the model's largest batch
@pytest.mark.parametrize("capacity", [9, 10, 13, 100, 101, 3 * 1000 + 10, 10**6])
def test_predict_max_micro_batch_matches_a_brute_force_search(capacity):
    def peak(m):
        return 10 + 3 * m
    brute = max([m for m in range(1, 400_000) if peak(m) <= capacity], default=0)
    assert predict_max_micro_batch(peak, capacity) == brute


def test_predict_max_micro_batch_with_the_memory_model():
    units = wrap_units(BILLION_MODEL, "layer")

    def peak(m):
        return estimate_memory(BILLION_MODEL, 1, "FULL_SHARD", "bf16-mixed", "adamw", micro_batch=m,
                               seq_len=1024, units=units).peak
    capacity = 143_771_287_552  # what an H200 reports as total_memory
    best = predict_max_micro_batch(peak, capacity)
    assert best > 8 and peak(best) <= capacity < peak(best + 1)


# -------------------------------------------------------------------------- memory figures
def test_prefetch_extra_is_the_largest_unit_in_the_compute_dtype():
    # the book's model: root = embedding (10000 x 256) + head (10000 x 256 + 10000) = 5,130,000
    # elements; a layer = 4d^2 + 4d + 2df + f + d + 4d = 789,760 (d=256, f=1024)
    assert estimate_prefetch_extra_bytes({"precision": "fp32"}, 2) == ("root", 4 * 5_130_000)
    assert estimate_prefetch_extra_bytes({"precision": "bf16-mixed"}, 2) == ("root", 2 * 5_130_000)
    assert estimate_prefetch_extra_bytes({"precision": "fp32"}, 2, layers_only=True) == ("layers.0", 4 * 789_760)
    # padding: with 3 ranks, every dim 0 rounds up to a multiple of 3
    padded = sum(-(-s[0] // 3) * 3 * (s[1] if len(s) > 1 else 1) for s in wrap_units(
        BILLION_MODEL, "layer")[1].shapes)
    assert estimate_prefetch_extra_bytes(MFU_CONFIG, 3, layers_only=True) == ("layers.0", 2 * padded)
    with pytest.raises(ValueError, match="no unit but the root"):
        estimate_prefetch_extra_bytes({"wrap": "model"}, 2, layers_only=True)


def test_memory_figures_subtracts_and_divides():
    ranks = [{"rank": 1, "peak_bytes": 1300, "predicted_peak_bytes": 1000, "allocator_peak_bytes": 1500,
              "allocator_reserved_bytes": 3000, "predicted_peak_reserved_bytes": 2000},
             {"rank": 0, "peak_bytes": 1000, "predicted_peak_bytes": 1000, "allocator_peak_bytes": None},
             {"rank": 2}]
    rows = memory_figures(ranks, {"largest_unit": ("root", 600), "largest_layer": ("layers.0", 300)})
    assert [r["rank"] for r in rows] == [0, 1, 2]
    assert rows[1] == {"rank": 1, "predicted_peak_bytes": 1000, "peak_bytes": 1300, "allocator_peak_bytes": 1500,
                       "largest_unit_unit": "root", "largest_unit_bytes": 600, "largest_layer_unit": "layers.0",
                       "largest_layer_bytes": 300, "excess_bytes": 300, "allocator_excess_bytes": 500,
                       "excess_over_largest_unit": 0.5, "excess_over_largest_layer": 1.0,
                       "allocator_reserved_bytes": 3000, "predicted_peak_reserved_bytes": 2000,
                       "reserved_over_predicted": 1.5}
    assert rows[0]["excess_bytes"] == 0 and "allocator_excess_bytes" not in rows[0]
    assert "reserved_over_predicted" not in rows[0]  # CPU or an older result: no reserved peak
    assert "missing" in rows[2] and "excess_bytes" not in rows[2]


def test_memory_figures_name_what_the_allocator_holds_beyond_the_tracker():
    """The allocator's peak less the tracker's is the workspaces and rounding the tracker cannot
    see, as the step began and over it (their sum), reported apart from the excess that is set
    against a prefetched unit."""
    ranks = [{"rank": 0, "peak_bytes": 1_300, "predicted_peak_bytes": 1_000, "allocator_peak_bytes": 1_900,
              "untracked_at_enter_bytes": 450, "untracked_step_bytes": 150, "untracked_what": "cuBLAS ...",
              "device_free_bytes": 10, "device_reserved_bytes": 20, "device_total_bytes": 40}]
    row = memory_figures(ranks, {"largest_layer": ("layers.0", 300)})[0]
    assert (row["untracked_bytes"], row["untracked_at_enter_bytes"], row["untracked_step_bytes"]) == (600, 450, 150)
    assert row["excess_over_largest_layer"] == 1.0 and row["allocator_excess_bytes"] == 900
    assert (row["device_free_bytes"], row["device_reserved_bytes"], row["device_total_bytes"]) == (10, 20, 40)


def test_device_capacity_by_hand():
    rows = [{"rank": 0, "device_free_bytes": 100, "device_reserved_bytes": 30, "device_total_bytes": 200,
             "untracked_at_enter_bytes": 5},
            {"rank": 1, "device_free_bytes": 90, "device_reserved_bytes": 30, "device_total_bytes": 200},
            {"rank": 2}]
    assert device_capacity(rows, 200) == {"capacity_bytes": 120, "capacity_source": "mem_get_info in rank 1",
                                          "outside_allocator_bytes": 80, "gap_bytes": 80}
    assert device_capacity([{"rank": 0}], 200) == {"capacity_bytes": 200, "capacity_source": "total_memory",
                                                   "outside_allocator_bytes": None, "gap_bytes": 0}
    with pytest.raises(ValueError, match="total_bytes must be an int >= 1"):
        device_capacity(rows, 0)


def test_steady_step_time_takes_the_slowest_rank_after_warm_up():
    assert steady_step_time_s([[1.0, 0.2, 0.3, 0.25], [0.9, 0.22, 0.28, 0.3]]) == 0.3
    assert steady_step_time_s([[5.0, 0.1, 0.2]], skip=0) == 0.2
    with pytest.raises(ValueError, match="more than 1"):
        steady_step_time_s([[1.0]])


# --------------------------------------------------------------------------- the result set
def test_gpu_slug():
    assert gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert gpu_slug("NVIDIA A100-SXM4-80GB") == "nvidia-a100-sxm4-80gb"
    with pytest.raises(ValueError):
        gpu_slug(" / ")


def test_result_set_is_stamped_and_replaces_only_its_own_file(tmp_path):
    path = tmp_path / "gpu" / "nvidia-h200.json"
    assert write_result_set(path, {"world_size": 1}) == path
    assert json.loads(path.read_text()) == {"schema": RESULT_SET_SCHEMA, "written_by": WRITER, "world_size": 1}
    write_result_set(path, {"world_size": 8})
    assert json.loads(path.read_text())["world_size"] == 8
    assert [p.name for p in path.parent.iterdir()] == ["nvidia-h200.json"]  # no temporary left


@pytest.mark.parametrize("content", [
    "notes of mine\n",
    json.dumps({"schema": "handbook.result/1", "written_by": WRITER}),
    json.dumps({"schema": RESULT_SET_SCHEMA}),   # right schema, but not stamped by gpu-check
    json.dumps([1, 2, 3]),
])
def test_result_set_never_replaces_a_file_it_did_not_write(tmp_path, content):
    path = tmp_path / "nvidia-h200.json"
    path.write_text(content)
    with pytest.raises(FileExistsError, match="not written by gpu-check"):
        write_result_set(path, {"world_size": 1})
    assert path.read_text() == content


def test_result_set_refuses_a_directory(tmp_path):
    (tmp_path / "x.json").mkdir()
    with pytest.raises(FileExistsError):
        write_result_set(tmp_path / "x.json", {})


# ------------------------------------------------------------------------------- the script
def _load_script(probe_in_child=False):
    spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.PROBE_IN_CHILD = probe_in_child  # the fake torch.cuda lives in this process only
    return module


def test_no_gpu_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120,
                          env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr == NO_GPU_MESSAGE + "\n"
    assert proc.stdout == ""


def test_no_gpu_in_process(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    script = _load_script()
    assert script.main(["--out", str(tmp_path / "r.json")], launch=lambda *a, **k: pytest.fail("launched")) == 2
    assert capsys.readouterr().err == NO_GPU_MESSAGE + "\n"
    assert not (tmp_path / "r.json").exists()


class FakeLaunch:
    """Stands for ``launch.torchrun``: checks each config as the real one does before starting
    anything (the run's CONFIG and ``validate``), then answers like the run would."""

    def __init__(self, oom_above=32, fail=(), free=None):
        self.calls = []
        self.oom_above = oom_above
        self.fail = fail
        self.free = free

    def readings(self, rank):
        """What the tracker's ``allocator_metrics`` adds on CUDA: the allocator and the GPU as
        the tracked step began (``free``: the driver's free bytes; None: an older run without)."""
        if self.free is None:
            return {}
        # the allocator rose 1,200,000 - 850,000 = 350,000 B, the tracker 1,100,000 + rank - 800,000
        return {"allocator_at_enter_bytes": 850_000, "tracked_at_enter_bytes": 800_000,
                "untracked_at_enter_bytes": 50_000, "untracked_step_bytes": 50_000 - rank,
                "untracked_what": "cuBLAS/cuBLASLt workspaces ...", "device_free_bytes": self.free - rank * 10**9,
                "device_reserved_bytes": 2 * 2**30, "device_total_bytes": 143_771_287_552}

    def __call__(self, run, nproc, config, *, timeout_s, stream, allow_failed_checks):
        assert allow_failed_checks and not stream and 0 < timeout_s <= 240
        module = importlib.import_module(f"handbook_lib.runs.{run}")
        cfg = module.CONFIG.from_mapping(config)
        module.validate(cfg, nproc)
        self.calls.append((run, nproc, dict(config)))
        if run in self.fail:
            raise _failed(f"run {run!r} failed: rank 0 raised RuntimeError: boom")
        micro = cfg.batch_size // nproc
        if micro > self.oom_above:
            raise _failed(TORCH_OOM)
        if run == "step_time":
            ranks = [{"rank": r, "median_ratio_to_ddp": {"DDP": 1.0, "FULL_SHARD": 1.2 + r / 10,
                                                         "SHARD_GRAD_OP": 1.1}} for r in range(nproc)]
            return RunResult("handbook.result/1", run, cfg.to_dict(), nproc, "nccl", "cuda", "x", ranks, [],
                             extra={"variants": ["DDP", "FULL_SHARD", "SHARD_GRAD_OP"]})
        step = {"DDP": 0.1, "FULL_SHARD": 0.15}.get(cfg.strategy, 0.15) * (2 if cfg.precision == "bf16-mixed" else 1)
        times = [3.0] + [step] * (cfg.steps - 2)   # the last step is tracked, not timed
        ranks = [{"rank": r, "step_time_s": times, "peak_bytes": 1_100_000 + r, "predicted_peak_bytes": 1_000_000,
                  "allocator_peak_bytes": 1_200_000, **self.readings(r)} for r in range(nproc)]
        checks = [Check("peak_bytes", r, 1_000_000, 1_100_000 + r, "bytes", 0.05) for r in range(nproc)]
        checks.append(Check("param_shard_bytes", 0, 8, 8, "bytes"))
        return RunResult("handbook.result/1", run, cfg.to_dict(), nproc, "nccl", "cuda", "x", ranks, checks)


@pytest.fixture
def fake_gpus(monkeypatch):
    def fake(n, name="NVIDIA H200", memory=143_771_287_552):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: SimpleNamespace(total_memory=memory))
        monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
        monkeypatch.setattr(torch.version, "cuda", "12.8")
    return fake


def test_gpu_path_on_one_fake_gpu(fake_gpus, tmp_path):
    fake_gpus(1)
    launch = FakeLaunch(oom_above=32)
    out = tmp_path / "h200.json"
    assert _load_script().main(["--out", str(out)], launch=launch) == 0
    data = json.loads(out.read_text())
    assert (data["schema"], data["written_by"]) == (RESULT_SET_SCHEMA, WRITER)
    assert (data["gpu_name"], data["world_size"], data["nccl_version"], data["cuda_version"]) == \
        ("NVIDIA H200", 1, "2.21.5", "12.8")
    assert data["torch_version"] == torch.__version__ and data["date"].endswith("+00:00")
    for part in ("memory", "step_time", "mfu", "max_micro_batch"):
        assert "error" not in data[part], data[part]
    # (a) excess = tracker peak - predicted; over the largest unit in the compute dtype
    row = data["memory"]["bf16-mixed"]["ranks"][0]
    assert row["excess_bytes"] == 100_000 and row["allocator_excess_bytes"] == 200_000
    assert row["largest_unit_bytes"] == 2 * 5_130_000 and row["excess_over_largest_unit"] == 100_000 / 10_260_000
    assert data["memory"]["fp32"]["checks"][0]["quantity"] == "peak_bytes"
    assert data["memory"]["fp32"]["failed_checks"] == ["peak_bytes"]
    # (b) one GPU: two fsdp_train jobs, DDP then FULL_SHARD
    assert data["step_time"]["fsdp_over_ddp"] == pytest.approx(1.5)
    assert data["step_time"]["measures"].startswith("wrapper overhead only")  # gpu-path S3-3
    assert [c[2].get("strategy") for c in launch.calls if c[0] == "fsdp_train"][2:4] == ["DDP", "FULL_SHARD"]
    # (c) MFU from the definition, with the H200 preset's peak
    mfu = data["mfu"]
    tokens = 8 * 1024
    assert (mfu["preset"], mfu["tokens_per_step"], mfu["step_time_s"]) == ("h200-141gb", tokens, 0.3)
    assert mfu["mfu"] == pytest.approx(6 * 1_037_552_896 * tokens / (0.3 * 1 * 989e12))
    # (d) the sweep starts above the MFU run's 8 sequences, doubles to the first OOM, then
    # bisects (32, 64) down to (32, 33): the fake runs out of memory above 32
    sweep = data["max_micro_batch"]
    assert [t["micro_batch"] for t in sweep["sweep"]["tries"]] == [16, 32, 64, 48, 40, 36, 34, 33]
    assert (sweep["measured_largest_fit"], sweep["measured_first_oom"], sweep["sweep"]["exact"]) == (32, 33, True)
    assert sweep["predicted_largest_fit"] >= sweep["predicted_largest_fit_with_prefetch"] >= 1
    # the fake device's own total; the preset's is the H200's nvidia-smi total, 143,771 MiB
    assert sweep["device_memory_bytes"] == 143_771_287_552 and sweep["preset_memory_bytes"] == 143_771 * 2**20
    assert all(nproc == 1 for _, nproc, _ in launch.calls)
    # no rank read the GPU's free memory (an older fsdp_train): total_memory, and said so
    assert (sweep["capacity_source"], sweep["capacity_bytes"], sweep["gap_bytes"]) == \
        ("total_memory", 143_771_287_552, 0)
    assert sweep["predicted_largest_fit"] == sweep["predicted_largest_fit_total_memory"]


def test_gpu_check_sizes_the_sweep_by_what_a_rank_found_free(fake_gpus, tmp_path):
    """The MFU run's ranks report ``mem_get_info`` as their tracked step began: the model's
    largest micro-batch is sized by free + reserved less the workspaces already allocated, not
    by ``total_memory``, and the gap (context, NCCL) is recorded; the allocator's excess over
    the tracker is named apart from the prefetch comparison."""
    fake_gpus(2)
    free = 120 * 10**9
    launch = FakeLaunch(oom_above=32, free=free)
    data = _run_parts(tmp_path, "memory,mfu,max_micro_batch", launch)
    sweep = data["max_micro_batch"]
    # rank 1 found 1 GB less free: the smaller is the capacity
    capacity = free - 10**9 + 2 * 2**30 - 50_000
    assert (sweep["capacity_source"], sweep["capacity_bytes"]) == ("mem_get_info in rank 1", capacity)
    assert sweep["outside_allocator_bytes"] == 143_771_287_552 - (free - 10**9) - 2 * 2**30
    assert sweep["gap_bytes"] == 143_771_287_552 - capacity
    units = wrap_units(BILLION_MODEL, "layer")

    def peak(m):
        return estimate_memory(BILLION_MODEL, 2, "FULL_SHARD", "bf16-mixed", "adamw", micro_batch=m,
                               seq_len=1024, units=units, backend="nccl").peak
    best = sweep["predicted_largest_fit"]
    assert peak(best) <= capacity < peak(best + 1)
    assert sweep["predicted_largest_fit_total_memory"] > best  # total_memory is optimistic
    row = data["memory"]["fp32"]["ranks"][1]
    assert (row["untracked_bytes"], row["untracked_at_enter_bytes"], row["untracked_step_bytes"]) == \
        (100_000 - 1, 50_000, 50_000 - 1)
    assert row["untracked_bytes"] == row["untracked_at_enter_bytes"] + row["untracked_step_bytes"]
    assert row["untracked_what"].startswith("cuBLAS") and row["excess_bytes"] == 100_001


def test_gpu_path_on_two_fake_gpus_of_an_unknown_model(fake_gpus, tmp_path):
    fake_gpus(2, name="NVIDIA GeForce RTX 4090", memory=24 * 2**30)
    launch = FakeLaunch(oom_above=8, fail=("step_time",))
    out = tmp_path / "r.json"
    assert _load_script().main(["--out", str(out)], launch=launch) == 0
    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and all(nproc == 2 for _, nproc, _ in launch.calls)
    assert data["step_time"]["error"].startswith("RunFailed: run 'step_time' failed")   # recorded, not fatal
    assert data["mfu"]["mfu"] is None and "unknown GPU 'NVIDIA GeForce RTX 4090'" in data["mfu"]["mfu_skipped"]
    assert data["mfu"]["config"]["batch_size"] == 16
    assert (data["max_micro_batch"]["measured_largest_fit"], data["max_micro_batch"]["measured_first_oom"]) == (8, 9)  # 16 OOM, then 12, 10, 9
    assert data["max_micro_batch"]["preset_memory_bytes"] is None


def _run_parts(tmp_path, parts, launch, name="r.json"):
    """The script's ``main`` on ``--parts parts`` (exit 0 asserted); the result set it wrote."""
    out = tmp_path / name
    assert _load_script().main(["--out", str(out), "--parts", parts], launch=launch) == 0
    return json.loads(out.read_text())


def test_step_time_on_two_gpus(fake_gpus, tmp_path):
    fake_gpus(2)
    launch = FakeLaunch()
    data = _run_parts(tmp_path, "step_time", launch)
    assert [c[0] for c in launch.calls] == ["step_time"]
    assert data["step_time"]["fsdp_over_ddp"] == pytest.approx(1.25)   # median of 1.2 and 1.3
    assert "measures" not in data["step_time"]  # on 2 GPUs it is the price of sharding
    assert "memory" not in data


def test_script_refuses_to_replace_a_foreign_file(fake_gpus, tmp_path):
    fake_gpus(1)
    out = tmp_path / "r.json"
    out.write_text("mine\n")
    launch = FakeLaunch()
    with pytest.raises(FileExistsError):
        _load_script().main(["--out", str(out)], launch=launch)
    assert out.read_text() == "mine\n" and launch.calls == []


def test_script_out_of_budget_records_what_was_not_run(fake_gpus, tmp_path):
    fake_gpus(1)
    out = tmp_path / "r.json"
    assert _load_script().main(["--out", str(out), "--budget-s", "5", "--parts", "memory"],
                               launch=FakeLaunch()) == 0
    memory = json.loads(out.read_text())["memory"]
    for label in ("fp32", "bf16-mixed"):
        assert memory[label]["error"] == "TimeoutError: the 5 s budget is spent: fsdp_train not run"


def test_script_refuses_unknown_parts(tmp_path):
    with pytest.raises(SystemExit):
        _load_script().main(["--parts", "memory,speed"])


def test_the_gpu_probe_runs_in_a_child_and_reports_its_failure():
    # here the child finds no GPU: it exits 2, and the parent says so rather than guessing
    with pytest.raises(RuntimeError, match=r"probing the GPUs failed \(exit 2\): gpu-check needs a CUDA GPU"):
        _load_script(probe_in_child=True).environment()


def test_a_failing_memory_config_does_not_lose_the_other(fake_gpus, tmp_path):
    fake_gpus(1)
    calls = []

    def launch(run, nproc, config, **kwargs):
        calls.append(config["precision"])
        if config["precision"] == "fp32":
            raise _failed(TORCH_OOM)
        return FakeLaunch()(run, nproc, config, **kwargs)
    out = tmp_path / "r.json"
    assert _load_script().main(["--out", str(out), "--parts", "memory"], launch=launch) == 0
    data = json.loads(out.read_text())["memory"]
    assert calls == ["fp32", "bf16-mixed"]
    assert data["fp32"]["error"].startswith("RunFailed: run 'fsdp_train' failed: rank 0 raised OutOfMemoryError")
    assert data["bf16-mixed"]["ranks"][0]["excess_bytes"] == 100_000


def test_axes_configs_split_what_the_gpus_allow():
    from handbook_lib.launch.gpu_check import axes_configs
    from handbook_lib.core.parallel_config import ParallelConfig

    assert axes_configs(1) == {}
    assert set(axes_configs(2)) == {"tp", "tp_sp", "ulysses", "ring", "pipeline"}
    assert set(axes_configs(3)) == set()  # TP needs an even count, and 3 does not divide 16 tokens
    four = axes_configs(4)
    assert four["ring"][1]["sp_size"] == 4 and four["tp"][1]["batch_size"] == 4  # 2 per dp rank
    for _run, config in four.values():  # each is a config its run takes on 4 ranks
        assert ParallelConfig.from_mapping(config).data_parallel_size(4) in (1, 2)


def test_axes_part_runs_chapter_9_on_two_gpus_and_skips_on_one(fake_gpus, tmp_path):
    fake_gpus(2)
    launch = FakeLaunch()
    data = _run_parts(tmp_path, "axes", launch)
    assert [(c[0], c[1]) for c in launch.calls] == ([("tensor_parallel", 2)] * 2 + [("sequence_parallel", 2)]
                                                    + [("pipeline", 2), ("sequence_parallel", 2)])
    assert data["axes"]["ring"]["config"]["sp_method"] == "ring" and data["axes"]["tp"]["checks"]
    fake_gpus(1)
    one = _run_parts(tmp_path, "axes", FakeLaunch(), name="one.json")
    assert "need 2 or more GPUs; 1 visible" in one["axes"]["skipped"]


def test_mfu_at_several_micro_batches_and_the_sweep_starts_above_them(fake_gpus, tmp_path):
    fake_gpus(1)
    launch = FakeLaunch(oom_above=32)
    out = tmp_path / "r.json"
    args = ["--out", str(out), "--parts", "mfu,max_micro_batch", "--mfu-micro-batches", "8,16,64"]
    assert _load_script().main(args, launch=launch) == 0
    data = json.loads(out.read_text())
    mfu = data["mfu"]
    assert mfu["config"]["batch_size"] == 8 and "micro_batch" not in mfu   # the headline is the first size
    row16, row64 = mfu["by_micro_batch"]
    # the fake's bf16 step is 0.3 s at any size: MFU grows with the tokens of a step
    assert (row16["micro_batch"], row16["tokens_per_step"], row16["step_time_s"]) == (16, 16 * 1024, 0.3)
    assert row16["mfu"] == pytest.approx(6 * 1_037_552_896 * 16 * 1024 / (0.3 * 989e12))
    assert row16["mfu"] == pytest.approx(2 * mfu["mfu"])
    assert row64["micro_batch"] == 64 and "out of memory" in row64["error"]   # recorded, not fatal
    # the sweep starts above 16, the largest MFU run that ran
    tries = [t["micro_batch"] for t in data["max_micro_batch"]["sweep"]["tries"]]
    assert tries == [32, 64, 48, 40, 36, 34, 33]
    assert data["max_micro_batch"]["measured_largest_fit"] == 32


@pytest.mark.parametrize("value", ["", "0,8", "16,8", "8,8", "eight"])
def test_gpu_check_refuses_bad_mfu_micro_batches(value, capsys):
    with pytest.raises(SystemExit) as exc:
        _load_script().main(["--mfu-micro-batches", value])
    assert exc.value.code == 2
    assert "--mfu-micro-batches takes ascending whole numbers >= 1" in capsys.readouterr().err


def test_error_line_is_the_type_and_the_first_line_at_most_500_characters():
    from handbook_lib.launch import error_line

    assert error_line(ValueError("bad key\nsecond line")) == "ValueError: bad key"
    assert error_line(RuntimeError("")) == "RuntimeError: "
    long = error_line(RuntimeError("x" * 600))
    assert len(long) == 500 and long.startswith("RuntimeError: xxx")


def test_seq_len_part_holds_tokens_and_prices_attention(fake_gpus, tmp_path):
    """Every run of the sequence-length part has SEQ_TOKENS tokens per rank; its MFU counts
    attention's 12·L·w·s per token, its HFU the recomputed forward, by hand."""
    fake_gpus(1)
    launch = FakeLaunch(oom_above=10**6)
    part = _run_parts(tmp_path, "seq_len", launch)["seq_len"]
    rows = part["rows"]
    assert [(r["seq_len"], r["activation_checkpointing"]) for r in rows] == \
        [(s, "none") for s in SEQ_LENS] + [(s, ac) for ac, s in SEQ_CHECKPOINTING]
    assert [c[2]["batch_size"] * c[2]["seq_len"] for c in launch.calls] == [SEQ_TOKENS] * len(rows)
    p, d, layers = 1_037_552_896, 2048, 18
    for r in rows:
        s, step = r["seq_len"], r["step_time_s"]
        assert step == pytest.approx(0.3)    # the fake's bf16 step
        dense, attention = 6 * p * SEQ_TOKENS, 12 * layers * d * s * SEQ_TOKENS
        recompute = (2 * p * SEQ_TOKENS + 4 * layers * d * s * SEQ_TOKENS) if r["activation_checkpointing"] == "full" else 0
        assert r["flops"] == {"dense": dense, "attention": attention, "recompute": recompute}
        assert r["mfu_6pt"] == pytest.approx(dense / (step * 989e12))
        assert r["mfu"] == pytest.approx((dense + attention) / (step * 989e12))
        assert r["hfu"] == pytest.approx((dense + attention + recompute) / (step * 989e12))
        assert r["memory"]["failed_checks"] == ["peak_bytes"]
    assert rows[0]["mfu"] / rows[0]["mfu_6pt"] == pytest.approx(1 + 2 * layers * d * 1024 / p)


def test_seq_len_part_records_a_failed_length_and_goes_on(fake_gpus, tmp_path):
    fake_gpus(1)
    launch = FakeLaunch(oom_above=8)   # 32 sequences of 1,024 and 16 of 2,048 run out of memory
    rows = _run_parts(tmp_path, "seq_len", launch)["seq_len"]["rows"]
    assert [r["micro_batch"] > 8 for r in rows] == [True, True, False, False, False, False, True, False, False]
    assert [("error" in r) for r in rows] == [r["micro_batch"] > 8 for r in rows]
    assert rows[0]["error"].startswith("RunFailed")


def test_width_part_runs_each_width_at_the_same_tokens(fake_gpus, tmp_path):
    fake_gpus(1)
    launch = FakeLaunch(oom_above=10**6)
    rows = _run_parts(tmp_path, "width", launch)["width"]["rows"]
    assert [r["d_model"] for r in rows] == [m.d_model for m in WIDTH_MODELS] == [1024, 4096, 8192]
    for r, m in zip(rows, WIDTH_MODELS):
        p = param_count(m)
        assert (r["num_params"], r["tokens_per_rank"], r["seq_len"]) == (p, SEQ_TOKENS, 1024)
        attention = 12 * m.num_layers * m.d_model * 1024 * SEQ_TOKENS
        assert r["mfu"] == pytest.approx((6 * p * SEQ_TOKENS + attention) / (0.3 * 989e12))
    assert 0.3e9 < param_count(WIDTH_MODELS[0]) < param_count(WIDTH_MODELS[2]) < 2.2e9
