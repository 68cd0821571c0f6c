"""The launcher's preflight: /dev/shm of 64 MB (faked statvfs), and the resources a job needs against this machine."""

import os
from types import SimpleNamespace

from handbook_lib.launch.preflight import SHM_MIN_BYTES, shm_warning


def _fs(size):
    return lambda path: SimpleNamespace(f_frsize=4096, f_blocks=size // 4096)


def test_a_64_mb_shm_is_named_in_one_line():
    line = shm_warning(2, cuda=True, statvfs=_fs(64 * 2**20))
    assert line.startswith("/dev/shm is 64 MiB: NCCL may fail") and "--shm-size" in line
    assert "\n" not in line and len(line) <= 100


def test_nothing_to_say():
    assert shm_warning(8, True, statvfs=_fs(SHM_MIN_BYTES)) is None   # large enough
    assert shm_warning(1, True, statvfs=_fs(2**20)) is None          # one rank: no NCCL peers
    assert shm_warning(4, False, statvfs=_fs(2**20)) is None         # gloo ranks on the CPU

    def missing(path):
        raise FileNotFoundError(path)
    assert shm_warning(4, True, statvfs=missing) is None


def test_reads_the_real_filesystem(tmp_path):
    real = os.statvfs(tmp_path)
    expected = real.f_frsize * real.f_blocks < SHM_MIN_BYTES
    assert (shm_warning(2, True, str(tmp_path)) is not None) == expected


# --- resources: a job this machine cannot hold is refused before it starts ------------------------

import pytest  # noqa: E402

from handbook_lib.launch.preflight import (  # noqa: E402
    RANKS_PER_CORE,
    check_job_resources,
    check_resources,
    predicted_rank_bytes,
)


def test_ranks_beyond_eight_per_core_are_refused_with_both_figures():
    with pytest.raises(ValueError) as refused:
        check_resources(64, None, cores=2, available=23 * 10**9)
    line = str(refused.value)
    assert line.startswith("64 ranks on this machine's 2 CPU cores (nproc): more than 8 per core, at most 16 here")
    assert "--force-resources" in line and "\n" not in line and len(line) < 200
    check_resources(64, None, cores=2, force=True)  # the flag goes ahead
    # what the tests and chapters start: up to 8 ranks on a 2-core machine (4 per core)
    for ranks in range(1, 2 * RANKS_PER_CORE + 1):
        check_resources(ranks, 10**6, cores=2, available=2 * 10**9)


def test_the_book_prediction_beyond_the_available_memory_is_refused():
    import handbook_lib.runs.fsdp_train as fsdp_train
    from handbook_lib.core.config import RunConfig
    from handbook_lib.models.memory import estimate_memory

    config = RunConfig(d_model=16384)
    per_rank = predicted_rank_bytes(fsdp_train, config, 2, 2, cuda=False)
    # the same model, priced directly: the step's peak of one of 2 gloo ranks with 4 sequences
    expected = estimate_memory(config.model_config(), 2, "FULL_SHARD", "fp32", "adamw", micro_batch=4,
                               seq_len=64, activation_checkpointing="none", backend="gloo").peak
    assert per_rank == expected > 50 * 10**9
    with pytest.raises(ValueError) as refused:
        check_resources(2, per_rank, cores=2, available=23 * 10**9)
    line = str(refused.value)
    assert line.startswith(f"the run needs {2 * per_rank / 1e9:.3g} GB of host memory by its own prediction "
                           f"(2 ranks x {per_rank / 1e9:.3g} GB), 23 GB is available")
    check_resources(2, per_rank, cores=2, available=23 * 10**9, force=True)
    # on GPUs the step lives on the devices: only offloaded state is host memory
    assert predicted_rank_bytes(fsdp_train, config, 2, 2, cuda=True) == 0


def test_the_benchmark_prices_its_own_buffers():
    from handbook_lib.runs import comm_bench

    config = comm_bench.BenchConfig(max_bytes=10**12)
    largest = comm_bench.buffer_sizes(config, 2)[-1]
    assert abs(largest - 10**12) <= 8
    assert predicted_rank_bytes(comm_bench, config, 2, 2, cuda=False) == 2 * largest + largest // 2
    with pytest.raises(ValueError, match=r"^the run needs 5,000 GB of host memory by its own prediction "
                                         r"\(2 ranks x 2,500 GB\)"):
        check_resources(2, predicted_rank_bytes(comm_bench, config, 2, 2, cuda=False), cores=2,
                        available=23 * 10**9)


@pytest.mark.parametrize("run", ["fsdp_train", "comm_bench", "fault", "step_time", "checkpoint_resume"])
def test_every_default_run_passes_on_a_small_machine(run, tmp_path, monkeypatch):
    """A run's default config on up to 8 ranks fits a 2-core machine with 2 GB free: the check
    costs nothing to the book's own runs."""
    import importlib

    module = importlib.import_module(f"handbook_lib.runs.{run}")
    extra = {"ckpt_dir": str(tmp_path / "ck")} if run == "checkpoint_resume" else {}
    for nproc in (2, 4, 8):
        config = module.CONFIG.from_mapping(extra)
        per_rank = predicted_rank_bytes(module, config, nproc, nproc, cuda=False)
        check_resources(nproc, per_rank, cores=2, available=2 * 10**9)


def test_the_launch_check_reads_this_machine(monkeypatch):
    from handbook_lib.runs import run_spec

    fault, bench = run_spec("fault"), run_spec("comm_bench")
    hidden = {"CUDA_VISIBLE_DEVICES": ""}
    check_job_resources(fault, [fault.config()], 2, world_size=2, local_ranks=2, env=hidden)  # nothing to say
    too_many = RANKS_PER_CORE * len(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match="per core"):
        check_job_resources(fault, [fault.config()], too_many, world_size=too_many, local_ranks=too_many, env=hidden)
    check_job_resources(fault, [fault.config()], 10**4, world_size=10**4, local_ranks=10**4, env=hidden, force=True)
    with pytest.raises(ValueError, match="of host memory by its own prediction"):
        check_job_resources(bench, [bench.config.from_mapping({"max_bytes": 10**15})], 2, world_size=2,
                            local_ranks=2, env=hidden)
