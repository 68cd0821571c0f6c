"""handbook_lib.runs.checkpoint_resume: real FSDP2 jobs, saved, killed with SIGKILL, preempted
by SIGUSR1 and SIGTERM, resumed.

Every job trains with a cosine schedule after 2 warm-up steps, from a data loader whose dataset
holds 2 batches (so 6 steps are 3 epochs, each in its own order): a resumed job continues the
schedule and the loader where the saved one stopped. Nine runs on a tiny model, in seven torchrun
jobs, shared by the tests through module-scoped fixtures:

1. ``reference``: 2 ranks, 6 steps uninterrupted, saving every 2 steps, exporting at the end;
2. ``killed``: the same, but rank 1 SIGKILLs itself in the save of step 4, its shard written;
3. ``resumed``: 2 ranks resume the killed job's directory (from step 2) and finish it;
4. ``grown``: 4 ranks resume the reference's step-2 checkpoint (2 → 4), saving at step 4
   asynchronously;
5. ``shrunk``: 2 ranks resume the 4-rank step-4 checkpoint (4 → 2);
6. ``fp16_reference``: 8 steps of fp16 with a gradient scaler, uninterrupted;
7. ``preempted_by_rank``: the same, but rank 1 sends itself SIGUSR1 after step 3;
8. ``cli_preempted``: the same through the CLI, which gets SIGTERM after step 1, then resumed
   with the command the CLI prints.

Runs that end cleanly on 2 ranks share a job (:func:`torchrun_batch`: one torchrun, the configs
one after another, each with the result a separate run writes): the two references (1 and 6),
and the two resumes (3 and 5). The configs differ from chapter 6's runs, so CI does not run the
same experiment twice.
"""

import shutil

import pytest
import torch

from handbook_lib.core import RunConfig, max_relative_difference
from handbook_lib.face import main
from handbook_lib.launch import RunFailed, torchrun, torchrun_batch
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
from handbook_lib.runtime.checkpoint_job import JOB_FILE, job_identity, read_job
from tests.conftest import processes_mentioning

TINY = {"vocab_size": 1001, "d_model": 64, "nhead": 2, "dim_feedforward": 96, "num_layers": 2,
        "batch_size": 8, "seq_len": 16, "steps": 6, "lr_schedule": "cosine", "warmup_steps": 2,
        "dataset_size": 16}
MODEL = RunConfig.from_mapping({k: v for k, v in TINY.items() if k != "dataset_size"}).model_config()
RESHARD_TOLERANCE = 1e-6
"""Largest relative loss difference accepted after loading at another world size (fp32; the
issue asks 1e-6, measured 7e-8 for 2 -> 4 ranks and 1.4e-7 for 4 -> 2)."""


def _run(nproc, config, out, **extra):
    return torchrun("checkpoint_resume", nproc, {**TINY, **config}, out=out, timeout_s=180, stream=False, **extra)


def _batch(configs, out):
    """Several 2-rank runs (label -> config) in one job, in the order given."""
    return torchrun_batch("checkpoint_resume", 2, {k: {**TINY, **c} for k, c in configs.items()}, out=out,
                          timeout_s=240, stream=False)


def _max_relative(a: list[float], b: list[float]) -> float:
    assert a, "no losses to compare"
    return max_relative_difference(a, b)  # raises if the lengths differ


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


FP16 = {"precision": "fp16-mixed", "steps": 8}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The fp32 reference and the fp16 one, in one job (each in its own checkpoint folder)."""
    root = tmp_path_factory.mktemp("reference")
    # resume_if_present on a folder with no checkpoint yet: starts from step 0 (the first launch
    # of a job relaunched with one command)
    results = _batch({"reference": {"ckpt_dir": str(root / "ckpt"), "save_every": 2, "export": True,
                                    "resume": True, "resume_if_present": True},
                      "fp16_reference": {**FP16, "ckpt_dir": str(root / "fp16")}}, root / "out")
    return root, results


@pytest.fixture(scope="module")
def reference(uninterrupted):
    root, results = uninterrupted
    return root / "ckpt", results["reference"]


@pytest.fixture(scope="module")
def fp16_reference(uninterrupted):
    return uninterrupted[1]["fp16_reference"]


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
def resumes(killed, grown, tmp_path_factory):
    """The killed job resumed at its own world size, and the 4-rank one resumed on 2: one job."""
    return _batch({"resumed": {"ckpt_dir": str(killed[0] / "ckpt"), "save_every": 2, "resume": True},
                   "shrunk": {"ckpt_dir": str(grown[0]), "resume": True}},  # shrunk saves nothing
                  tmp_path_factory.mktemp("resumes") / "out")


@pytest.fixture(scope="module")
def resumed(resumes):
    return resumes["resumed"]


@pytest.fixture(scope="module")
def grown(reference, tmp_path_factory):
    root = tmp_path_factory.mktemp("grown")
    shutil.copytree(reference[0] / "step_000002", root / "ckpt" / "step_000002")
    # its save is asynchronous (DCP's async_save), committed when training ends; shrunk loads it
    result = _run(4, {"ckpt_dir": str(root / "ckpt"), "save_every": 4, "resume": True, "resume_step": 2,
                      "async_checkpoint": True}, root / "out")
    return root / "ckpt", result


@pytest.fixture(scope="module")
def shrunk(resumes):
    return resumes["shrunk"]


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
    assert snapshot == {LATEST: "step_000002\n", JOB_FILE: (root / "ckpt" / JOB_FILE).read_text(),
                        "step_000002": [".metadata", "__0_0.distcp", "__1_0.distcp", MANIFEST],
                        "step_000004.tmp": ["__0_0.distcp", "__1_0.distcp"]}


def test_half_checkpoint_fails_clearly_and_the_previous_loads(killed, reference):
    root = killed[0]
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint .*checkpoint\.json is missing"):
        validate_checkpoint(root / "ckpt" / "step_000004.tmp")
    plain = SimpleTransformer(MODEL)
    step2 = load_checkpoint(root / "ckpt" / "step_000002", plain)  # in this process, no process group
    assert (step2.step, step2.world_size) == (2, 2)
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
        JOB_FILE, LATEST, "step_000002", "step_000004", "step_000006"]
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


def test_resharding_reads_each_stored_piece_whole(resumed, grown):
    """DCP's file reader loads every stored item a rank needs whole, then narrows it: from 2 ranks
    to 4 each rank's quarter lies in a half the first job saved (or straddles two, and reads
    both), so every rank of 4 reads about what a rank of 2 read, and the 4 at least twice as
    much, of checkpoints of the same size."""
    _, result = grown
    two, four = resumed.metric("read_bytes"), result.metric("read_bytes")
    assert len(two) == 2 and len(four) == 4
    assert sum(four) >= 1.95 * sum(two) and min(four) > 0.95 * min(two)


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


def test_the_checkpoint_holds_the_whole_job(reference):
    """Issue 26: model, optimizer, the scheduler, the data loader and every rank's generators."""
    from handbook_lib.runtime import read_metadata

    ckpt, result = reference
    parts = {key.split(".", 1)[0] for key in read_metadata(ckpt / "step_000004").state_dict_metadata}
    assert parts == {"model", "optim", "rng", "scheduler", "data"}
    lr = result.metric("lr")[0]  # the rates the steps used: warm-up from 0, then half a cosine
    assert lr[:3] == [0.0, 0.0005, 0.001] and lr[3] == pytest.approx(0.001 * 0.5 * (1 + 0.5 ** 0.5))
    assert result.extra["epochs_begun"] == 3  # 6 steps of a 2-batch dataset


def test_resumed_jobs_continue_the_schedule_and_the_loader(resumed, shrunk, reference):
    assert resumed.metric("lr")[0] == reference[1].metric("lr")[0][2:]
    assert shrunk.metric("lr")[0] == reference[1].metric("lr")[0][4:]
    assert resumed.extra["loaded"]["epoch"] == 0 and shrunk.extra["loaded"]["epoch"] == 1


@pytest.fixture(scope="module")
def preempted_by_rank(tmp_path_factory):
    from handbook_lib.launch import RunPreempted

    root = tmp_path_factory.mktemp("preempted")
    with pytest.raises(RunPreempted) as stopped:
        _run(2, {**FP16, "ckpt_dir": str(root / "ckpt"), "kill_at_step": 3, "kill_signal": "SIGUSR1"},
             root / "out")
    return root, stopped.value


def test_a_signal_to_one_rank_stops_every_rank_saved(preempted_by_rank):
    """Rank 1 alone gets SIGUSR1 (as sbatch --signal sends it); the flag's all-reduce at the step's
    end tells rank 0 too: both save step 3 and stop, saying so."""
    import json

    from handbook_lib.core import PREEMPTED_EXIT, rank_status_path

    root, stopped = preempted_by_rank
    assert str(stopped) == f"run 'checkpoint_resume' preempted by SIGUSR1 at step 3; saved step_000003 in {root / 'ckpt'}"
    assert stopped.step == 3 and stopped.returncode != 0
    states = [json.loads(rank_status_path(root / "out", r).read_text()) for r in (0, 1)]
    assert [(s["status"], s["step"]) for s in states] == [("preempted", 3)] * 2
    assert (root / "ckpt" / LATEST).read_text() == "step_000003\n"
    assert validate_checkpoint(root / "ckpt")["step"] == 3  # complete, every checksum verified
    from handbook_lib.models import JOB_STATE
    from handbook_lib.runtime import read_metadata

    parts = {key.split(".", 1)[0] for key in read_metadata(root / "ckpt" / "step_000003").state_dict_metadata}
    assert parts == set(JOB_STATE)  # fp16: the scaler too; the chapter's table names every part
    assert not (root / "out" / "result.json").exists()
    assert processes_mentioning(str(root / "out")) == []
    assert PREEMPTED_EXIT == 75


@pytest.fixture(scope="module")
def cli_preempted(tmp_path_factory):
    """The CLI, sent SIGTERM once step 1 is done (as Slurm would); then the command it prints."""
    import contextlib
    import io
    import shlex
    import signal
    import subprocess
    import sys

    from handbook_lib.face import main

    root = tmp_path_factory.mktemp("cli")
    sets = [f"{k}={v}" for k, v in {**TINY, **FP16, "ckpt_dir": root / "ckpt"}.items()]
    command = [sys.executable, "-m", "handbook_lib", "run", "checkpoint_resume", "--nproc", "2",
               "--out", str(root / "out"), "--timeout", "180", *[w for kv in sets for w in ("--set", kv)]]
    cli = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in cli.stdout:
        if "step 1: loss" in line:
            cli.send_signal(signal.SIGTERM)
            break
    out, err = cli.communicate(timeout=180)
    printed = err.split("resume with:\n", 1)[1].replace("\\\n", " ")
    again = shlex.split(printed)
    assert again[:3] == ["python", "-m", "handbook_lib"]
    # the rest of it, given to what `python -m handbook_lib` runs (the CLI's main), in this process:
    # the SIGTERM above needed a CLI process of its own; a second one would only import torch again
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        code = main(again[3:])
    return root, cli.returncode, err, again, (code, said.getvalue())


def test_sigterm_to_the_cli_saves_and_exits_75_with_the_command_to_resume(cli_preempted):
    root, code, err, again, _ = cli_preempted
    lines = err.strip().splitlines()
    assert code == 75, err
    first = lines[0]
    assert first.startswith("error: run 'checkpoint_resume' preempted by SIGTERM at step ") and "; saved step_" in first
    assert all(len(line) <= 100 for line in lines)
    assert again[-3:] == ["--set", "resume=true", "--overwrite"]
    step = int(first.split(" at step ")[1].split(";")[0])
    assert 1 <= step < 8 and (root / "ckpt" / LATEST).read_text() == f"step_{step:06d}\n"
    assert processes_mentioning(str(root / "out")) == []


def test_the_printed_command_completes_bit_identically(cli_preempted, fp16_reference):
    root, _, err, _, (code, said) = cli_preempted
    assert code == 0, said
    from handbook_lib.core import load_result

    done = load_result(root / "out" / "result.json")
    start = done.extra["start_step"]
    assert start >= 1 and done.metric("steps")[0] == list(range(start + 1, 9))
    for key in ("losses", "lr", "grad_scale"):  # exact floats: weights, schedule, scaler, data
        assert done.metric(key)[0] == fp16_reference.metric(key)[0][start:], key
    assert fp16_reference.metric("grad_scale")[0][0] == 65536.0


def test_an_asynchronous_save_blocks_less_and_commits_a_verified_checkpoint(grown, shrunk):
    ckpt, result = grown
    (save,) = result.extra["saves"]
    assert save["name"] == "step_000004" and (ckpt / LATEST).read_text() == "step_000004\n"
    assert 0 < save["blocked_s"] < save["save_s"]  # the loop waited for the copy, not the write
    assert validate_checkpoint(ckpt)["step"] == 4  # complete, every checksum verified
    assert shrunk.extra["loaded"]["name"] == "step_000004"  # and it loads, resharded to 2 ranks


def test_another_model_into_a_ckpt_dir_is_refused_in_one_line_before_anything_starts(reference, tmp_path,
                                                                                       capsys):
    """A d_model=128 job into the d_model=64 reference's ckpt_dir, fresh or resumed: one line naming
    the key and the folder, and every byte of the folder as it was (``latest`` still step 6)."""
    ckpt = reference[0]
    assert read_job(ckpt) == job_identity("checkpoint_resume", MODEL, "adamw")  # its first save wrote it
    before = {str(p.relative_to(ckpt)): p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file()}
    sets = [w for k, v in {**TINY, "d_model": 128, "ckpt_dir": ckpt, "save_every": 2}.items()
            for w in ("--set", f"{k}={v}")]
    for resume in ([], ["--set", "resume=true"], ["--set", "resume=true", "--set", "resume_if_present=true"]):
        out = tmp_path / f"out{len(resume)}"
        assert main(["run", "checkpoint_resume", "--nproc", "2", "--quiet", "--out", str(out), *sets, *resume]) == 2
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and not err.startswith(" ")
        assert " ".join(line.strip() for line in err.splitlines()) == (
            f"error: ckpt_dir {str(ckpt)!r} holds another job's checkpoints: d_model=128 here, 64 in its "
            f"{JOB_FILE}; use another ckpt_dir")
        assert not out.exists() and processes_mentioning(str(out)) == []  # nothing started
    after = {str(p.relative_to(ckpt)): p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file()}
    assert after == before and (ckpt / LATEST).read_text() == "step_000006\n"
