"""handbook_lib.launch: real torchrun jobs with 2 gloo ranks that succeed, crash, hang, or are killed.

Each test runs the ``fault`` run (cheap: a barrier and an all-reduce) and checks what the caller
gets back and that no process of the run survives it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from handbook_lib.core import RUN_MARKER
from handbook_lib.launch import (
    ChecksFailed,
    RunFailed,
    RunInterrupted,
    RunTimeout,
    torchrun,
)
from handbook_lib.launch.outdir import prepare_out_dir
from tests.conftest import processes_mentioning


def test_successful_run_returns_parsed_result_and_streams_prefixed_output(no_leftovers, capsys):
    result = torchrun("fault", 2, {"mode": "none"}, out=no_leftovers, timeout_s=120)
    assert (result.run, result.world_size, result.backend, result.device) == ("fault", 2, "gloo", "cpu")
    assert result.metric("all_reduce_sum") == [2.0, 2.0]  # a real collective over 2 ranks
    assert result.config == {"fail_rank": 1, "mode": "none", "sleep_s": 3600.0}
    out = capsys.readouterr().out
    assert "[rank0] rank 0 passed the barrier" in out and "[rank1] rank 1 passed the barrier" in out
    assert sorted(p.name for p in (no_leftovers / "ranks").glob("*.json")) == ["rank0.json", "rank1.json"]


def test_raising_rank_is_named_with_its_traceback(no_leftovers, capsys):
    (no_leftovers / RUN_MARKER).write_text('{"run": "fault"}')  # an earlier run's folder...
    (no_leftovers / "result.json").write_text("{}")  # ...whose stale result must not survive
    (no_leftovers / "notes.txt").write_text("mine")  # a file no run wrote is never removed:
    with pytest.raises(ValueError, match=r"holds 1 path no run wrote \(notes\.txt\); nothing removed"):
        torchrun("fault", 2, {"mode": "raise", "fail_rank": 1}, out=no_leftovers, stream=False, timeout_s=120,
                 overwrite=True)  # overwrite refuses such a folder
    assert (no_leftovers / "notes.txt").read_text() == "mine" and (no_leftovers / "result.json").exists()
    (no_leftovers / "notes.txt").rename(no_leftovers.parent / f"{no_leftovers.name}-notes.txt")
    with pytest.raises(RunFailed) as info:
        torchrun("fault", 2, {"mode": "raise", "fail_rank": 1}, out=no_leftovers, stream=False, timeout_s=120,
                 overwrite=True)
    assert capsys.readouterr().err.splitlines()[0] == (f"out (--out) {str(no_leftovers)!r}: removed the 1 file of "
                                                       "the earlier run (--overwrite); nothing else")
    err = info.value
    assert err.rank == 1 and not isinstance(err, RunTimeout)
    first = str(err).splitlines()[0]
    assert first == ("run 'fault' failed: rank 1 raised RuntimeError: "
                     "deliberate failure on rank 1 (fault run, mode=raise)")
    assert 'fault.py", line' in err.rank_traceback and "traceback of rank 1" in str(err)
    # the peer is mentioned after the cause: with its consequent error, or — when torchrun stopped
    # it while it was still reporting that error — with where it was
    assert "then rank 0" in str(err) or "rank 0 was still running, at:" in str(err)
    assert str(err).index("traceback of rank 1") < str(err).index("rank 0")
    assert not (no_leftovers / "result.json").exists()
    assert (no_leftovers.parent / f"{no_leftovers.name}-notes.txt").read_text() == "mine"


def test_a_failed_check_fails_the_run_and_keeps_its_result(no_leftovers):
    with pytest.raises(ChecksFailed) as info:
        torchrun("fault", 2, {"mode": "bad_check"}, out=no_leftovers, stream=False, timeout_s=120)
    err = info.value
    assert str(err).startswith("run 'fault' finished, but 2 of its 2 checks are outside their tolerance")
    assert "ranks_counted (rank 1): predicted 3, measured 2.0 ranks" in str(err)
    assert [c.rank for c in err.failed] == [0, 1] and err.result.metric("all_reduce_sum") == [2.0, 2.0]
    assert (no_leftovers / "result.json").exists()
    # (asked to hand back a failing result, the same run returns it: tests/test_launch_batch.py,
    # test_a_batch_result_equals_a_separate_run, runs it so beside a batch)


def test_rank_dying_without_traceback_is_named(no_leftovers):
    with pytest.raises(RunFailed) as info:
        torchrun("fault", 2, {"mode": "exit", "fail_rank": 0}, out=no_leftovers, stream=False, timeout_s=120)
    assert info.value.rank == 0
    assert "rank 0 died without a Python traceback" in str(info.value)


def test_timeout_kills_every_process_and_shows_where_ranks_were(no_leftovers):
    # 20 s: on a loaded 2-core machine (CI's two workers each running torchrun jobs) the ranks
    # once took over 10 s to import torch, and the stacks then showed them still starting
    start = time.monotonic()
    with pytest.raises(RunTimeout) as info:
        torchrun("fault", 2, {"mode": "sleep"}, out=no_leftovers, stream=False, timeout_s=20)
    assert time.monotonic() - start < 40
    message = str(info.value)
    assert message.startswith("run 'fault' did not finish within 20 s and was stopped")
    # torchrun + 2 ranks were signalled, and each rank's stack points into the sleeping line
    assert "(3 processes killed)" in message
    assert message.count('fault.py", line') >= 2
    assert processes_mentioning(str(no_leftovers)) == []


def _press_ctrl_c(done: threading.Event, out: Path, world: int = 2) -> None:
    """Ctrl-C once every rank is up (its harness has written its stacks file), as a user would
    press it during a run; not at all if the run ends first. (A fixed delay pressed it before
    torchrun had started the ranks on a loaded machine.)"""
    while not done.wait(0.2):
        if all((out / "ranks" / f"rank{r}.stacks.txt").exists() for r in range(world)):
            os.kill(os.getpid(), signal.SIGINT)
            return


def test_interrupt_stops_the_run(no_leftovers):
    # A suite started in the background by a non-interactive shell (``cmd &`` in a CI script, or
    # under nohup) inherits SIGINT *ignored*, and the press would never arrive: give this process
    # Python's own Ctrl-C handler, which a terminal or a Jupyter kernel has.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    done = threading.Event()
    presser = threading.Thread(target=_press_ctrl_c, args=(done, no_leftovers), daemon=True)
    presser.start()
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            torchrun("fault", 2, {"mode": "sleep"}, out=no_leftovers, stream=False, timeout_s=120)
    finally:
        done.set()
        presser.join()
        signal.signal(signal.SIGINT, previous)
    assert isinstance(info.value, RunInterrupted)
    assert str(info.value) == "run 'fault' interrupted; torchrun and 2 ranks stopped"
    assert info.value._render_traceback_() == ["RunInterrupted: " + str(info.value)]  # one line in Jupyter
    assert processes_mentioning(str(no_leftovers)) == []


def test_ranks_die_with_a_killed_torchrun_agent(no_leftovers):
    """SIGKILL of torchrun itself (it cannot clean up) must not orphan its ranks."""
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
         "-m", "handbook_lib.runs.fault", "--set", "mode=sleep", "--out", str(no_leftovers)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 60
    ranks: list[psutil.Process] = []
    while len(ranks) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
        ranks = [p for p in psutil.Process(agent.pid).children() if "handbook_lib.runs.fault" in " ".join(p.cmdline())]
    assert len(ranks) == 2, "ranks did not start"
    while not all((no_leftovers / "ranks" / f"rank{r}.stacks.txt").exists() for r in (0, 1)):
        time.sleep(0.2)  # the harness is armed (parent-death signal set) once this file exists
    agent.kill()
    agent.wait()
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert alive == []


@pytest.mark.parametrize("call, match", [
    (lambda: torchrun("no_such_run"), "available runs: .*comm_bench, deepspeed_zero, fault, fsdp_train"),
    (lambda: torchrun("fault", 0), "nproc"),
    (lambda: torchrun("fault", 2, {"modez": "raise"}), "accepted keys: fail_rank, mode, sleep_s"),
    (lambda: torchrun("fault", 2, {"mode": "explode"}), "accepted values: raise, exit, hang, sleep, bad_check, kill_agent, none"),
    (lambda: torchrun("fault", 2, {"fail_rank": 2}), "fail_rank must be in"),
    (lambda: torchrun("fsdp_train", 3, {"batch_size": 8}), "divisible"),
    (lambda: torchrun("fsdp_train", 2, {"strategy": "NO_SHARD"}), "api='fsdp2' supports strategy NONE, DDP, SHARD_GRAD_OP, FULL_SHARD"),
    (lambda: torchrun("fsdp_train", 2, {"strategy": "NONE"}), "one-process baseline: launch it with 1 rank"),
    (lambda: torchrun("fsdp_train", 2, {"strategy": "DDP", "wrap": "model"}), "wrapping are FSDP's"),
    (lambda: torchrun("fsdp_train", 2, {"strategy": "DDP", "steps": 2}), "steps >= 3 with DDP"),
    (lambda: torchrun("fsdp_train", 4, {"strategy": "HYBRID_SHARD", "shard_group_size": 3}), "divide"),
    (lambda: torchrun("fault", 2, timeout_s=0), "timeout_s"),
])
def test_bad_arguments_fail_before_any_process_starts(call, match):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match=match):
        call()
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before


@pytest.fixture
def fresh_tmpdir(tmp_path, monkeypatch):
    """A temporary directory of its own for the runs of one test (here and in the ranks)."""
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def test_in_a_notebook_a_run_is_one_stable_line_its_log_folded_and_no_folder_left(fresh_tmpdir, monkeypatch,
                                                                                   capsys):
    import IPython.display

    import handbook_lib.launch.show as show
    from handbook_lib.launch import RunReport

    shown: list[object] = []

    class Handle:
        def update(self, obj):
            shown.append(obj)

    def display(obj, display_id=False):
        assert display_id  # updated in place: one output per run
        shown.append(obj)
        return Handle()

    monkeypatch.setattr(show, "in_notebook", lambda: True)
    monkeypatch.setattr(IPython.display, "display", display)
    result = torchrun("fault", 2, {"mode": "none"}, timeout_s=120)
    assert capsys.readouterr().out == ""  # nothing streamed into the cell
    final = shown[-1]
    assert isinstance(final, RunReport)
    assert repr(final) == "fault on 2 ranks (gloo, cpu), mode=none: " + (
        f"{len(result.checks)}/{len(result.checks)} checks passed" if result.checks else "no checks")
    assert "[rank0] rank 0 passed the barrier" in final.log and "[rank1] rank 1 passed the barrier" in final.log
    assert "<details>" in final._repr_html_() and "s wall" in final._repr_html_()  # timings in HTML only
    assert result.path is None
    assert [p.name for p in fresh_tmpdir.iterdir() if p.name.startswith("handbook-")] == []


def test_a_failing_run_without_out_removes_its_folder_and_still_names_the_rank(fresh_tmpdir, capsys):
    with pytest.raises(RunFailed) as info:
        torchrun("fault", 2, {"mode": "raise", "fail_rank": 1}, timeout_s=120)
    err = info.value
    assert err.rank == 1 and 'fault.py", line' in err.rank_traceback and "traceback of rank 1" in str(err)
    assert err.out_dir is None
    assert [p.name for p in fresh_tmpdir.iterdir() if p.name.startswith("handbook-")] == []
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "fault on 2 ranks: starting"  # a terminal: what runs (mode=raise is the default)...
    assert "[rank1] " in "\n".join(out[1:-1])  # ...its ranks' output...
    assert out[-1].startswith("fault on 2 ranks: failed (rank 1); ") and out[-1].endswith(" s wall")  # ...its end


def test_a_progress_bar_is_labelled_with_the_run_and_redraws_once_in_the_log():
    import io

    from handbook_lib.launch.show import Streamer

    out = io.StringIO()
    streamer = Streamer(echo=True, out=out, label="fsdp_train")
    for step in range(3):
        streamer.feed(f"[default0]:train:  {step * 50}%|##   | {step}/2 [00:00<00:00]\n".encode())
    streamer.feed(b"[default1]:hello\n[default0]:  50%|##   | 1/2\n")
    streamer.close()
    shown = out.getvalue().split("\r")
    assert shown[0] == "fsdp_train: 0%|##   | 0/2 [00:00<00:00]"
    assert shown[2].startswith("fsdp_train: 100%|") and "[rank1] hello\n" in shown[2]
    assert out.getvalue().endswith("fsdp_train: 50%|##   | 1/2\n")  # a bar without a label gets one too
    assert list(streamer.log) == ["[rank0] train:  100%|##   | 2/2 [00:00<00:00]", "[rank1] hello",
                                  "[rank0]   50%|##   | 1/2"]


def test_killed_lines_are_the_ranks_lines_that_say_sigkill():
    from handbook_lib.launch import RunFailed, killed_lines

    tail = ["[rank1]: step 3 done", "[rank1]: sending SIGKILL to itself", "torchrun: SIGKILL (rank 1)",
            "[rank0]: waiting"]
    err = RunFailed("x", run="r", rank=1, rank_traceback="", out_dir=None, returncode=1, log_tail=tail)
    assert killed_lines(err) == ["[rank1]: sending SIGKILL to itself"]
    assert killed_lines(err, "waiting") == ["[rank0]: waiting"]


def test_sigterm_to_the_cli_stops_torchrun_and_every_rank(tmp_path):
    """Slurm's preemption signal (SIGTERM) to the CLI while a job runs: the launcher's Ctrl-C path
    stops torchrun and the ranks; one line, exit 128 + 15. (Issue 26 found the agent left behind
    when the CLI was terminated.)"""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "handbook_lib", "run", "fault", "--nproc", "2", "--out",
                             str(out), "--quiet", "--set", "mode=sleep", "--set", "sleep_s=120"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(processes_mentioning(str(out))) < 4 and time.monotonic() < deadline:  # the CLI, torchrun, 2 ranks
        time.sleep(0.2)
    assert len(processes_mentioning(str(out))) >= 4, "the ranks never started"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.strip().splitlines() == ["error: run 'fault' stopped by SIGTERM; torchrun and its ranks were stopped"]
    assert processes_mentioning(str(out)) == []


def _cli_run_with_ranks_up(out: Path) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """``python -m handbook_lib run fault`` (2 sleeping ranks) into ``out``, once both ranks'
    harnesses are armed; with every process it started (torchrun and the ranks)."""
    cli = subprocess.Popen([sys.executable, "-m", "handbook_lib", "run", "fault", "--nproc", "2", "--out", str(out),
                            "--quiet", "--set", "mode=sleep", "--set", "sleep_s=120"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while not all((out / "ranks" / f"rank{r}.stacks.txt").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and cli.poll() is None, "the ranks never started"
            time.sleep(0.2)
        family = psutil.Process(cli.pid).children(recursive=True)
        ranks = [p for p in family if p.parent().pid != cli.pid and "handbook_lib.runs.fault" in p.cmdline()]
        assert len(ranks) == 2 and len(family) == 3, [p.cmdline() for p in family]  # torchrun and its 2 ranks
    except BaseException:
        cli.terminate()  # its Ctrl-C path stops torchrun and the ranks
        cli.wait(60)
        raise
    return cli, family


def test_sigkill_to_the_cli_leaves_no_process_of_the_run(tmp_path):
    """SIGKILL to the CLI (the out-of-memory killer, a closed terminal) cannot be caught: torchrun
    gets the parent-death signal and stops its ranks; 10 s later none of the three is left. The
    folder's lock then names only dead processes: the next run takes it over and removes the
    killed run's files (read by their shape: it wrote no manifest)."""
    out = tmp_path / "run"
    cli, family = _cli_run_with_ranks_up(out)
    cli.kill()
    cli.wait()
    _, alive = psutil.wait_procs(family, timeout=10)
    _kill(alive)
    assert alive == [] and processes_mentioning(str(out)) == []
    written = [p for p in out.rglob("*") if p.is_file() and p.name != RUN_MARKER]
    claimed = prepare_out_dir("fault", out, overwrite=True)
    claimed.release()
    assert claimed.removed == len(written) >= 5  # config, 2 stack files, torchrun's logs


def test_overwrite_is_refused_while_a_killed_clis_torchrun_lives(tmp_path, capsys):
    """The CLI is gone with its flock, but its torchrun still runs (held here with SIGSTOP, as a
    busy agent stopping its ranks would): ``run ... --overwrite`` into the folder is refused,
    naming torchrun's process, and leaves the folder as it was; once torchrun resumes, it acts
    on the parent-death signal and it and its ranks end within 10 s."""
    from handbook_lib.face import main

    out = tmp_path / "run"
    cli, family = _cli_run_with_ranks_up(out)
    agent = next(p for p in family if p.parent().pid == cli.pid)
    agent.suspend()
    try:
        cli.kill()
        cli.wait()
        before = sorted(str(p) for p in out.rglob("*"))
        capsys.readouterr()
        assert main(["run", "fault", "--quiet", "--out", str(out), "--overwrite"]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"is in use by another run (run 'fault': its torchrun pid {agent.pid} still runs)" in err
        assert sorted(str(p) for p in out.rglob("*")) == before
    finally:
        agent.resume()
    _, alive = psutil.wait_procs(family, timeout=10)
    _kill(alive)
    assert alive == [] and processes_mentioning(str(out)) == []


def _kill(procs: list[psutil.Process]) -> None:
    """SIGKILL what a failing test would leave behind (its assertion still fails)."""
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
