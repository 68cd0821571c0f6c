"""The faults of chapter 6's table (handbook_lib.models.faults.NODE_FAULTS), each provoked for
real: a node lost mid-step and mid-save (2 nodes x 1 rank on this machine, node 1's torchrun
agent SIGKILLed), a full disk during a save (a file-size limit on every rank), a corrupted
shard. The preemption row is proven in test_runs_checkpoint_resume.py."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from handbook_lib.core import RunConfig
from handbook_lib.launch import RunFailed, torchrun
from handbook_lib.models import LATEST
from handbook_lib.models.faults import NODE_FAULTS
from handbook_lib.runtime import CheckpointError, SimpleTransformer, load_checkpoint, validate_checkpoint
from handbook_lib.runtime.checkpoint_job import JOB_FILE
from tests.conftest import processes_mentioning

TINY = {"vocab_size": 1001, "d_model": 64, "nhead": 2, "dim_feedforward": 96, "num_layers": 2,
        "batch_size": 8, "seq_len": 16, "steps": 6, "seed": 3, "dataset_size": 16, "save_every": 2}
MODEL = RunConfig.from_mapping({k: v for k, v in TINY.items() if k not in ("dataset_size", "save_every")})


def _lose_node(root: Path, **kill) -> tuple[RunFailed, Path]:
    with pytest.raises(RunFailed) as failure:
        torchrun("checkpoint_resume", 1, {**TINY, "ckpt_dir": str(root / "ckpt"), "kill_rank": 1,
                                          "kill_node": True, **kill},
                 nnodes=2, out=root / "out", stream=False, timeout_s=180)
    return failure.value, root / "ckpt"


@pytest.fixture(scope="module")
def lost_mid_step(tmp_path_factory):
    return _lose_node(tmp_path_factory.mktemp("mid_step"), kill_at_step=3)


@pytest.fixture(scope="module")
def lost_mid_save(tmp_path_factory):
    return _lose_node(tmp_path_factory.mktemp("mid_save"), kill_at_step=4, kill_in_save=True)


def _names_the_lost_node(failure: RunFailed) -> None:
    first = str(failure).splitlines()[0]
    assert failure.rank == 1 and "rank 1 (node 1, local rank 0) died without a Python traceback" in first
    assert "the first torchrun agent to end was killed by SIGKILL" in str(failure)
    assert processes_mentioning(str(failure.out_dir)) == []


def test_a_node_lost_mid_step_leaves_the_last_checkpoint(lost_mid_step):
    failure, ckpt = lost_mid_step
    _names_the_lost_node(failure)
    assert sorted(p.name for p in ckpt.iterdir()) == [JOB_FILE, LATEST, "step_000002"]
    plain = SimpleTransformer(MODEL.model_config())
    assert load_checkpoint(ckpt, plain).step == 2  # every checksum verified, in this process


def test_a_node_lost_mid_save_leaves_the_previous_checkpoint(lost_mid_save):
    failure, ckpt = lost_mid_save
    _names_the_lost_node(failure)
    assert sorted(p.name for p in ckpt.iterdir()) == [JOB_FILE, LATEST, "step_000002", "step_000004.tmp"]
    assert (ckpt / LATEST).read_text() == "step_000002\n"
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        validate_checkpoint(ckpt / "step_000004.tmp")
    assert validate_checkpoint(ckpt)["step"] == 2


def _cli(ckpt: Path, out: Path, limit_kib: int | None = None) -> subprocess.CompletedProcess:
    """The CLI resuming from ``ckpt``, under a file-size limit (``ulimit -f``, KiB) if given."""
    sets = [w for k, v in {**TINY, "ckpt_dir": ckpt, "resume": True}.items() for w in ("--set", f"{k}={v}")]
    command = [sys.executable, "-m", "handbook_lib", "run", "checkpoint_resume", "--nproc", "2", "--out",
               str(out), "--quiet", "--timeout", "180", *sets]
    if limit_kib is not None:
        command = ["bash", "-c", f'ulimit -f {limit_kib} && exec "$@"', "bash", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=240)


def test_a_full_disk_refuses_the_save_and_keeps_the_previous(lost_mid_step, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(lost_mid_step[1], ckpt)
    shard = max(p.stat().st_size for p in (ckpt / "step_000002").glob("*.distcp"))
    done = _cli(ckpt, tmp_path / "out", limit_kib=shard // 1024 // 2)  # half a shard
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "file-size limit" in lines[0] and "step_000004" in lines[0], done.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == [JOB_FILE, LATEST, "step_000002"]
    assert validate_checkpoint(ckpt)["step"] == 2
    assert processes_mentioning(str(tmp_path / "out")) == []


def test_a_corrupted_shard_is_refused_by_name_at_load(lost_mid_step, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(lost_mid_step[1], ckpt)
    shard = ckpt / "step_000002" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte, the size unchanged
    shard.write_bytes(bytes(data))
    with pytest.raises(RunFailed) as failure:
        torchrun("checkpoint_resume", 2, {**TINY, "ckpt_dir": str(ckpt), "resume": True},
                 out=tmp_path / "out", stream=False, timeout_s=180)
    first = str(failure.value).splitlines()[0]
    assert "__1_0.distcp does not match its sha256 checksum" in first, str(failure.value)
    assert processes_mentioning(str(tmp_path / "out")) == []


def test_every_row_of_the_table_names_a_test_that_exists():
    here = Path(__file__).parent
    for fault in NODE_FAULTS:
        file, function = fault.test.split("::")
        tree = ast.parse((here.parent / file).read_text())
        assert function in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, fault.test
    assert [f.name for f in NODE_FAULTS] == ["a node lost mid-step", "a node lost mid-save", "a preemption",
                                             "a full disk during a save", "a corrupted file on one rank"]
