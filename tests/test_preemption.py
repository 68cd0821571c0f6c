"""handbook_lib.runtime.preemption (a rank's side) and handbook_lib.launch.preempt (the
launcher's), in one process; the real jobs are in test_runs_checkpoint_resume.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from handbook_lib.core import PREEMPT_SIGNALS, PREEMPTED_EXIT, RankStatus, rank_status_path
from handbook_lib.launch import RunPreempted
from handbook_lib.launch.preempt import TORCHRUN_SIGNALS, forward_signals, raise_if_preempted
from handbook_lib.runtime import Preempted, PreemptionWatch


def test_a_signal_sets_the_flag_instead_of_ending_the_process():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionWatch() as watch:
        assert watch.agreed() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal: the first is kept
        assert watch.signal_name == "SIGUSR1" and watch.agreed() == "SIGUSR1"
    assert signal.getsignal(signal.SIGTERM) == before


def test_the_stop_says_where_the_checkpoint_is():
    err = Preempted(3, "SIGTERM", "step_000003 in /ck")
    assert str(err) == "preempted by SIGTERM at step 3; saved step_000003 in /ck"
    assert (err.step, err.signal_name) == (3, "SIGTERM")
    assert PREEMPT_SIGNALS == ("SIGTERM", "SIGUSR1") and PREEMPTED_EXIT == 75


def test_torchrun_is_told_to_pass_sigusr1_on():
    names = TORCHRUN_SIGNALS["TORCHELASTIC_SIGNALS_TO_HANDLE"].split(",")
    assert set(PREEMPT_SIGNALS) <= set(names)
    # torchrun's own default, which lacks SIGUSR1 (so SIGUSR1 would end it, and its ranks)
    from torch.distributed.elastic.multiprocessing import api

    assert '"SIGTERM,SIGINT,SIGHUP,SIGQUIT"' in open(api.__file__).read()


def test_the_launcher_forwards_both_signals_to_torchrun_and_stays():
    child = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                              "got = []\n"
                              "for s in (signal.SIGTERM, signal.SIGUSR1):\n"
                              "    signal.signal(s, lambda n, f: got.append(n))\n"
                              "while len(got) < 2: time.sleep(0.01)\n"
                              "print(sorted(got))"], stdout=subprocess.PIPE, text=True)
    import time

    time.sleep(1.0)  # its handlers are in place
    with forward_signals(child, active=True) as received:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)
        out, _ = child.communicate(timeout=30)
    assert received == ["SIGTERM", "SIGUSR1"]
    assert out.strip() == str(sorted([int(signal.SIGTERM), int(signal.SIGUSR1)]))


def test_inactive_it_leaves_the_handlers_alone():
    before = signal.getsignal(signal.SIGTERM)
    with forward_signals(None, active=False) as received:  # type: ignore[arg-type]
        assert signal.getsignal(signal.SIGTERM) == before
    assert received == []


def _status(out, rank, status, **more):
    path = rank_status_path(out, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(RankStatus(rank=rank, status=status, time=0.0, **more).to_dict()))


def test_preempted_states_become_one_error(tmp_path):
    common = {"out_dir": tmp_path, "returncode": 1, "log_tail": []}
    raise_if_preempted("r", tmp_path, 2, common)  # no state at all: nothing to say
    _status(tmp_path, 0, "ok")
    raise_if_preempted("r", tmp_path, 2, common)
    _status(tmp_path, 1, "preempted", message="preempted by SIGTERM at step 4; saved step_000004 in /ck", step=4)
    with pytest.raises(RunPreempted, match=r"^run 'r' preempted by SIGTERM at step 4; saved step_000004 in /ck$") as info:
        raise_if_preempted("r", tmp_path, 2, common)
    assert info.value.step == 4 and info.value.rank is None


def test_the_cli_prints_a_resume_command_that_fits_and_parses():
    import shlex

    from handbook_lib.face.cli import build_parser, _resume_command

    argv = ["run", "checkpoint_resume", "--nproc", "2", "--out", "/tmp/some run", "--set",
            "ckpt_dir=/shared/checkpoints/of/a/long/path", *("--set num_layers=2 --set d_model=64 "
            "--set nhead=2 --set dim_feedforward=96 --set vocab_size=1001 --set seq_len=16").split()]
    text = _resume_command(argv)
    assert all(len(line) <= 100 for line in text.splitlines()) and len(text.splitlines()) > 1
    words = shlex.split(text.replace("\\\n", " "))
    assert words[:3] == ["python", "-m", "handbook_lib"]
    args = build_parser().parse_args(words[3:])
    assert args.out is not None and str(args.out) == "/tmp/some run" and args.overwrite
    assert args.overrides[-1] == "resume=true"
    assert _resume_command(words[3:]) == text  # asked twice, the same command: nothing added twice
