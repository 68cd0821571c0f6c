"""handbook_lib.runs.checkpoint_resume: real FSDP2 jobs, saved, killed with SIGKILL, resumed.

Five torchrun jobs on a tiny model, shared by the tests through module-scoped fixtures:

1. ``reference``: 2 ranks, 6 steps uninterrupted, saving every 2 steps, exporting at the end;
2. ``killed``: the same, but rank 1 SIGKILLs itself in the save of step 4, its shard written;
3. ``resumed``: 2 ranks resume the killed job's directory (from step 2) and finish it;
4. ``grown``: 4 ranks resume the reference's step-2 checkpoint (2 → 4), saving at step 4;
5. ``shrunk``: 2 ranks resume the 4-rank step-4 checkpoint (4 → 2).

The configs differ from chapter 6's runs, so CI does not run the same experiment twice.
"""

import shutil

import pytest
import torch

from handbook_lib.core import RunConfig, max_relative_difference
from handbook_lib.launch import RunFailed, torchrun
from handbook_lib.models import LATEST, MANIFEST, estimate_checkpoint_count
from handbook_lib.runs.checkpoint_resume import EXPORT_FILE, PROBE_FILE
from handbook_lib.runtime import (
    CheckpointError,
    SimpleTransformer,
    count_checkpoint,
    load_checkpoint,
    load_exported,
    validate_checkpoint,
)
from tests.conftest import processes_mentioning

TINY = {"vocab_size": 1001, "d_model": 64, "nhead": 2, "dim_feedforward": 96, "num_layers": 2,
        "batch_size": 8, "seq_len": 16, "steps": 6}
MODEL = RunConfig.from_mapping(TINY).model_config()
RESHARD_TOLERANCE = 1e-5
"""Largest relative loss difference accepted after loading at another world size (fp32)."""


def _run(nproc, config, out, **extra):
    return torchrun("checkpoint_resume", nproc, {**TINY, **config}, out=out, timeout_s=180, stream=False, **extra)


def _max_relative(a: list[float], b: list[float]) -> float:
    assert a, "no losses to compare"
    return max_relative_difference(a, b)  # raises if the lengths differ


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    # resume_if_present on a folder with no checkpoint yet: starts from step 0 (the first launch
    # of a job relaunched with one command)
    result = _run(2, {"ckpt_dir": str(root / "ckpt"), "save_every": 2, "export": True, "resume": True,
                      "resume_if_present": True}, root / "out")
    return root / "ckpt", result


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    root = tmp_path_factory.mktemp("killed")
    config = {"ckpt_dir": str(root / "ckpt"), "save_every": 2, "kill_at_step": 4, "kill_in_save": True,
              "kill_rank": 1}
    with pytest.raises(RunFailed) as failure:
        _run(2, config, root / "out")
    snapshot = {p.name: sorted(f.name for f in p.iterdir()) if p.is_dir() else p.read_text()
                for p in (root / "ckpt").iterdir()}
    return root, failure.value, snapshot


@pytest.fixture(scope="module")
def resumed(killed):
    root = killed[0]
    return _run(2, {"ckpt_dir": str(root / "ckpt"), "save_every": 2, "resume": True}, root / "resumed")


@pytest.fixture(scope="module")
def grown(reference, tmp_path_factory):
    root = tmp_path_factory.mktemp("grown")
    shutil.copytree(reference[0] / "step_000002", root / "ckpt" / "step_000002")
    result = _run(4, {"ckpt_dir": str(root / "ckpt"), "save_every": 4, "resume": True, "resume_step": 2},
                  root / "out")
    return root / "ckpt", result


@pytest.fixture(scope="module")
def shrunk(grown, tmp_path_factory):
    root = tmp_path_factory.mktemp("shrunk")
    return _run(2, {"ckpt_dir": str(grown[0]), "resume": True}, root / "out")  # saves nothing


def test_reference_saves_every_second_step_and_counts_exactly(reference):
    ckpt, result = reference
    assert result.extra["start_step"] == 0 and result.extra["loaded"] is None  # nothing was present
    assert result.metric("steps") == [[1, 2, 3, 4, 5, 6]] * 2
    losses = result.metric("losses")
    assert losses[0] == losses[1] and all(0 < x < 20 for x in losses[0])
    assert [s["name"] for s in result.extra["saves"]] == ["step_000002", "step_000004", "step_000006"]
    assert (ckpt / LATEST).read_text() == "step_000006\n"
    newest = result.extra["saves"][-1]
    # one shard file per rank, DCP's index, our manifest, with the sizes found on disk
    assert set(newest["files"]) == {"__0_0.distcp", "__1_0.distcp", ".metadata", MANIFEST}
    assert newest["files"] == {p.name: p.stat().st_size for p in (ckpt / "step_000006").iterdir()}
    assert [c.quantity for c in result.checks] == [
        "checkpoint_model_tensors", "checkpoint_model_bytes", "checkpoint_optim_tensors",
        "checkpoint_optim_bytes", "export_tensor_bytes"]
    assert all(c.exact for c in result.checks)
    counted, predicted = count_checkpoint(ckpt / "step_000006"), estimate_checkpoint_count(MODEL, "adamw")
    plain = SimpleTransformer(MODEL)  # independent of both: what a plain module holds
    assert counted["model"].bytes == predicted["model"].bytes == 4 * sum(p.numel() for p in plain.parameters())
    assert counted["optim"].tensors == 3 * len(list(plain.parameters()))  # exp_avg, exp_avg_sq, step
    assert counted["rng"].tensors == 2  # one RNG state per rank


def test_kill_in_save_leaves_the_previous_checkpoint(killed):
    root, failure, snapshot = killed
    assert failure.rank == 1 and "died without a Python traceback" in str(failure)
    assert processes_mentioning(str(root / "out")) == []
    # the killed save: every rank's shard written, but no DCP index and no manifest
    assert snapshot == {LATEST: "step_000002\n",
                        "step_000002": [".metadata", "__0_0.distcp", "__1_0.distcp", MANIFEST],
                        "step_000004.tmp": ["__0_0.distcp", "__1_0.distcp"]}


def test_half_checkpoint_fails_clearly_and_the_previous_loads(killed, reference):
    root = killed[0]
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint .*checkpoint\.json is missing"):
        validate_checkpoint(root / "ckpt" / "step_000004.tmp")
    plain = SimpleTransformer(MODEL)
    step2 = load_checkpoint(root / "ckpt" / "step_000002", plain)  # in this process, no process group
    assert (step2.step, step2.world_size, step2.extra) == (2, 2, {"data_position": 2})
    same = SimpleTransformer(MODEL)
    load_checkpoint(reference[0] / "step_000002", same)  # the uninterrupted run's step 2
    assert _same_weights(plain, same)


def test_resume_at_the_same_world_size_is_bit_identical(resumed, reference, killed):
    root = killed[0]
    assert resumed.extra["start_step"] == 2
    assert resumed.extra["loaded"]["name"] == "step_000002" and resumed.metric("rng_restored") == [True, True]
    assert resumed.metric("steps")[0] == [3, 4, 5, 6]
    assert resumed.metric("losses")[0] == reference[1].metric("losses")[0][2:]  # exact floats
    assert all(c.exact for c in resumed.checks)
    # the resumed job redid the save that was killed; nothing half-written is left
    assert sorted(p.name for p in (root / "ckpt").iterdir()) == [
        LATEST, "step_000002", "step_000004", "step_000006"]
    assert (root / "ckpt" / LATEST).read_text() == "step_000006\n"


def test_reshard_two_to_four_ranks(grown, reference):
    _, result = grown
    assert result.world_size == 4 and result.extra["loaded"]["saved_world_size"] == 2
    assert result.metric("rng_restored") == [False] * 4  # RNG states are per rank: not resharded
    assert result.metric("steps")[0] == [3, 4, 5, 6]
    worst = _max_relative(result.metric("losses")[0], reference[1].metric("losses")[0][2:])
    print(f"2 -> 4 ranks: max relative loss difference {worst:.2e}")
    assert worst <= RESHARD_TOLERANCE
    assert all(c.exact for c in result.checks)


def test_reshard_four_to_two_ranks(shrunk, grown, reference):
    assert shrunk.extra["loaded"]["saved_world_size"] == 4 and shrunk.extra["start_step"] == 4
    assert shrunk.metric("steps")[0] == [5, 6]
    worst = _max_relative(shrunk.metric("losses")[0], reference[1].metric("losses")[0][4:])
    print(f"4 -> 2 ranks: max relative loss difference {worst:.2e}")
    assert worst <= RESHARD_TOLERANCE
    assert shrunk.extra["saves"] == [] and all(c.exact for c in shrunk.checks)


def test_export_loads_into_a_plain_module_with_identical_outputs(reference):
    ckpt, result = reference
    assert result.extra["export"]["bytes"] == (ckpt / EXPORT_FILE).stat().st_size
    plain = load_exported(ckpt / EXPORT_FILE, MODEL)
    probe = torch.load(ckpt / PROBE_FILE, weights_only=True)  # logits of the sharded model
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks ran
    try:
        with torch.no_grad():
            assert torch.equal(plain(probe["inputs"]), probe["logits"])
    finally:
        torch.set_num_threads(threads)
    final = SimpleTransformer(MODEL)
    load_checkpoint(ckpt, final)  # latest: the sharded step-6 checkpoint
    assert _same_weights(plain, final)
