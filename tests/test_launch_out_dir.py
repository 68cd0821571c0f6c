"""handbook_lib.launch: the output folder is claimed, locked and never wiped; argument errors come
before any file; a timeout while ranks start, and a hung rank, are told as they are.

Most tests need no torchrun job (the folder rules run before one starts); two real jobs check
the timeout of a 16-rank start-up (no process may outlive it) and the blame for a hang.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import psutil
import pytest

from handbook_lib.core import RUN_FILES, RUN_MARKER
from handbook_lib.launch import RunFailed, RunTimeout, torchrun
from handbook_lib.launch.outdir import manifest_name, prepare_out_dir
from tests.conftest import processes_mentioning


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_an_empty_or_new_folder_is_claimed_with_a_marker(tmp_path):
    for folder in (tmp_path, tmp_path / "new" / "nested"):
        claimed = prepare_out_dir("fault", folder)
        try:
            assert claimed.path == folder
            assert json.loads((folder / RUN_MARKER).read_text())["run"] == "fault"
            assert sorted(p.name for p in folder.iterdir()) == [RUN_MARKER]
        finally:
            claimed.release()


def test_a_folder_with_files_no_run_wrote_is_refused_and_left_untouched(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "important.txt").write_text("keep")
    (tmp_path / "config.json").write_text("mine")
    with pytest.raises(ValueError, match=r"^out \(--out\) .* is not empty and no run wrote it; "
                                         r"accepted: a new or empty folder, or a run's \(overwrite=True, --overwrite\)$"):
        torchrun("fault", 2, {"mode": "none"}, out=tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["config.json", "important.txt", "logs"]
    assert (tmp_path / "config.json").read_text() == "mine"


_RUN_WRITES = ["config.json", "logs/handbook-1-x_ab/attempt_0/0/stdout.log", "ranks/rank0.json",
               "ranks/rank0.stacks.txt", "result.json", "results/0.json"]
"""Files a run writes, laid out as the launcher, torchrun and the ranks' harness name them."""


def _write(folder, paths, text="{}"):
    for rel in paths:
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)


def _tree(folder):
    """Every path under ``folder`` with its content (``None`` for a folder)."""
    return {str(p.relative_to(folder)): (None if p.is_dir() else p.read_bytes()) for p in folder.rglob("*")}


def test_an_earlier_runs_folder_needs_overwrite_which_removes_only_what_it_wrote(tmp_path):
    claimed = prepare_out_dir("fault", tmp_path)
    _write(tmp_path, _RUN_WRITES)  # what the run writes while it holds the folder
    claimed.release()
    manifest = json.loads((tmp_path / manifest_name(None)).read_text())
    assert manifest == {"run": "fault", "node": None, "files": _RUN_WRITES,
                        "folders": ["logs", "logs/handbook-1-x_ab", "logs/handbook-1-x_ab/attempt_0",
                                    "logs/handbook-1-x_ab/attempt_0/0", "ranks", "results"]}
    with pytest.raises(ValueError, match=r"holds the files of an earlier run 'fault' \(result\.json, results, "
                                         r"config\.json, ranks, logs\); pass overwrite=True \(--overwrite\)"):
        prepare_out_dir("fault", tmp_path)
    # files added by the user since, beside the run's and inside its folders: overwrite refuses
    _write(tmp_path, ["notes.txt", "logs/MY_NOTES.txt", "results/my_plot.csv", "ranks/a/b.txt"], "mine")
    (tmp_path / "empty").mkdir()
    before = _tree(tmp_path)
    with pytest.raises(ValueError) as info:
        prepare_out_dir("fsdp_train", tmp_path, overwrite=True)
    assert str(info.value) == (f"out (--out) {str(tmp_path)!r} holds 5 paths no run wrote (logs/MY_NOTES.txt, "
                               "notes.txt, ranks/a/b.txt and 2 more); nothing removed; accepted: a new or empty "
                               "folder, or only a run's files (overwrite=True, --overwrite)")
    assert _tree(tmp_path) == before  # refused: nothing removed, nothing written
    for rel in ("notes.txt", "logs/MY_NOTES.txt", "results/my_plot.csv", "ranks/a/b.txt"):
        (tmp_path / rel).unlink()
    (tmp_path / "ranks" / "a").rmdir()
    (tmp_path / "empty").rmdir()
    claimed = prepare_out_dir("fsdp_train", tmp_path, overwrite=True)
    claimed.release()
    assert claimed.removed == len(_RUN_WRITES)  # every file the manifest listed, and its empty folders
    assert sorted(p.name for p in tmp_path.iterdir()) == [RUN_MARKER, manifest_name(None)]
    assert json.loads((tmp_path / RUN_MARKER).read_text())["run"] == "fsdp_train"
    assert set(RUN_FILES) == {"result.json", "results", "config.json", "ranks", "logs"}


def test_a_folder_without_a_manifest_is_read_by_what_a_run_writes(tmp_path):
    """A folder from before manifests (or whose launcher was killed): the files shaped as a run
    writes them are its; anything else is the user's, and refuses overwrite."""
    (tmp_path / RUN_MARKER).write_text('{"run": "fault"}')
    _write(tmp_path, [*_RUN_WRITES, "ranks/.rank1.json.tmp4242"])  # a state cut by a kill mid-write
    _write(tmp_path, ["logs/MY_NOTES.txt", "results/my_plot.csv"], "mine")
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match=r"holds 2 paths no run wrote \(logs/MY_NOTES\.txt, results/my_plot\.csv\); "
                                         r"nothing removed"):
        prepare_out_dir("fault", tmp_path, overwrite=True)
    assert _tree(tmp_path) == before
    (tmp_path / "logs" / "MY_NOTES.txt").unlink()
    (tmp_path / "results" / "my_plot.csv").unlink()
    claimed = prepare_out_dir("fault", tmp_path, overwrite=True)
    claimed.release()
    assert claimed.removed == len(_RUN_WRITES) + 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [RUN_MARKER, manifest_name(None)]


def test_the_cli_refuses_overwrite_of_a_real_runs_folder_holding_a_users_files(tmp_path, capsys):
    """`run fsdp_train --out DIR --overwrite` on an earlier run's folder where the user has put
    ``logs/MY_NOTES.txt`` and ``results/my_plot.csv`` (fsdp_train never writes ``results/``):
    refused in one line naming both, every file intact."""
    from handbook_lib.face import main

    out = tmp_path / "run"
    torchrun("fault", 2, {"mode": "none"}, out=out, stream=False, timeout_s=120)
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()
                     and not p.name.startswith(RUN_MARKER))
    assert json.loads((out / manifest_name(None)).read_text())["files"] == written
    _write(out, ["logs/MY_NOTES.txt", "results/my_plot.csv"], "mine")
    before = _tree(out)
    capsys.readouterr()
    assert main(["run", "fsdp_train", "--quiet", "--out", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: out (--out) ") and err.count("error") == 1  # one message (the CLI wraps it)
    assert "holds 2 paths no run wrote (logs/MY_NOTES.txt, results/my_plot.csv)" in " ".join(err.split())
    assert _tree(out) == before
    (out / "logs" / "MY_NOTES.txt").unlink()
    (out / "results" / "my_plot.csv").unlink()
    (out / "results").rmdir()
    claimed = prepare_out_dir("fsdp_train", out, overwrite=True)
    claimed.release()
    assert claimed.removed == len(written) >= 7  # config, result, 2 states, 2 stack files, the logs


def test_two_runs_can_never_share_a_folder(tmp_path):
    first = prepare_out_dir("fault", tmp_path)  # holds the lock, as a running run does
    try:
        before = _children()
        start = time.monotonic()
        with pytest.raises(ValueError, match=rf"is in use by another run \(run 'fault', pid {os.getpid()}, holds its "
                                             r"lock\): give each run its own folder$"):
            torchrun("fault", 2, {"mode": "none"}, out=tmp_path, overwrite=True)
        assert time.monotonic() - start < 5 and _children() == before  # at once, nothing started
    finally:
        first.release()
    prepare_out_dir("fault", tmp_path).release()  # free again once the first run ends


def test_the_nodes_of_one_job_share_a_folder_each_with_its_own_claim(tmp_path):
    """Issue 26: a real multi-node job's nodes (node_rank given) share one folder: each locks its
    own marker and owns only its own files; a second command of the same node is refused."""
    one = prepare_out_dir("fault", tmp_path, node=1)  # node 1 may arrive first
    (tmp_path / "logs" / "node1").mkdir(parents=True)
    zero = prepare_out_dir("fault", tmp_path, node=0)
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == [RUN_MARKER, f"{RUN_MARKER}.node1", "logs"]
        with pytest.raises(ValueError, match="is in use by another run"):
            prepare_out_dir("fault", tmp_path, node=1)
        (tmp_path / "config.node1.json").write_text("{}")  # each node's files, written during the job
        (tmp_path / "logs" / "node0").mkdir()
        (tmp_path / "result.json").write_text("{}")
    finally:
        one.release()
        zero.release()
    assert json.loads((tmp_path / manifest_name(1)).read_text())["files"] == ["config.node1.json"]
    assert json.loads((tmp_path / manifest_name(0)).read_text())["folders"] == ["logs/node0"]
    # the next job: node 1's earlier files ask for overwrite, which removes only those
    with pytest.raises(ValueError, match=r"earlier run .*\(config\.node1\.json, logs/node1\)"):
        prepare_out_dir("fault", tmp_path, node=1)
    prepare_out_dir("fault", tmp_path, node=1, overwrite=True).release()
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["node0"]
    assert (tmp_path / "result.json").exists() and not (tmp_path / "config.node1.json").exists()


@pytest.mark.parametrize("make_out, match", [
    (lambda d: (d / "file.txt", (d / "file.txt").write_text("x")), r"out \(--out\) '.*file\.txt' is a file, not a folder"),
    (lambda d: (d / "file.txt" / "sub", (d / "file.txt").write_text("x")), r"out \(--out\) '.*sub' cannot be created"),
])
def test_out_at_a_file_or_an_impossible_path_is_one_clear_line(tmp_path, make_out, match):
    out, _ = make_out(tmp_path)
    with pytest.raises(ValueError, match=match) as info:
        torchrun("fault", 2, {"mode": "none"}, out=out)
    assert "\n" not in str(info.value)
    assert (tmp_path / "file.txt").read_text() == "x"


@pytest.mark.parametrize("kwargs, match", [
    ({"timeout_s": None}, r"timeout_s \(--timeout\) must be a finite number of seconds > 0, got None"),
    ({"timeout_s": float("inf")}, r"timeout_s \(--timeout\) must be a finite number"),
    ({"config": "mode=none"}, r"config must be a dict of key -> value .*got str 'mode=none'"),
    ({"env": {"X": 1}}, r"env must map str to str .*'X': 1"),
    ({"config": {"sleep_s": float("nan")}}, r"config key 'sleep_s' must be a finite number, got nan"),
    ({"overwrite": "yes"}, r"overwrite must be True or False"),
])
def test_bad_api_arguments_fail_before_the_out_folder_is_made(tmp_path, kwargs, match):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        torchrun("fault", 2, **{"config": {"mode": "none"}, **kwargs}, out=out)
    assert not out.exists()


def test_a_timeout_while_16_ranks_start_stops_them_all_and_says_so(tmp_path):
    """torchrun is still starting its ranks when the deadline passes: every one must be stopped
    (none orphaned), and none is said to have died without a traceback."""
    start = time.monotonic()
    with pytest.raises(RunTimeout) as info:  # at 6 s, 16 ranks on 2 cores are still importing torch
        torchrun("fault", 16, {"mode": "sleep"}, out=tmp_path, stream=False, timeout_s=6)
    assert time.monotonic() - start < 20
    assert processes_mentioning(str(tmp_path)) == []  # at once, not after a while
    message = str(info.value)
    killed = re.match(r"run 'fault' did not finish within 6 s and was stopped \((\d+) process(es)? killed\)",
                      message)
    # torchrun and the ranks it had started by then: all 16 on an idle machine, none yet when a
    # loaded one is still importing torch in torchrun itself (CI saw both); none is left either way
    assert killed and 1 <= int(killed.group(1)) <= 17
    assert "still starting (Python start-up or importing torch)" in message
    assert "died without a Python traceback" not in message and "out-of-memory" not in message
    assert json.loads((tmp_path / RUN_MARKER).read_text())["run"] == "fault"


def test_a_hang_blames_the_rank_that_never_joined_not_the_one_that_waited(tmp_path):
    with pytest.raises(RunFailed) as info:
        torchrun("fault", 2, {"mode": "hang", "fail_rank": 1}, out=tmp_path, stream=False, timeout_s=60,
                 env={"HANDBOOK_COLLECTIVE_TIMEOUT_S": "1"})
    err = info.value
    assert err.rank == 1 and not isinstance(err, RunTimeout)
    first = str(err).splitlines()[0]
    assert first.startswith("run 'fault' failed: rank 1 hung: it never joined the collective that rank 0 "
                            "waited in until it timed out")
    assert 'fault.py", line' in str(err)  # where rank 1 was when it was stopped
    assert "--- then rank 0:" in str(err)
    assert processes_mentioning(str(tmp_path)) == []


def test_the_cli_refuses_a_runs_folder_without_overwrite(tmp_path, capsys):
    from handbook_lib.face import main

    claimed = prepare_out_dir("fault", tmp_path)
    (tmp_path / "result.json").write_text("{}")
    claimed.release()
    assert main(["run", "fault", "--quiet", "--out", str(tmp_path)]) == 2
    err = " ".join(capsys.readouterr().err.split())  # the CLI may wrap long lines
    assert "holds the files of an earlier run 'fault' (result.json); pass overwrite=True (--overwrite)" in err
    assert (tmp_path / "result.json").read_text() == "{}"


_KILLED_LAUNCHER = """
import os, signal, subprocess, sys
from handbook_lib.launch.outdir import prepare_out_dir
claimed = prepare_out_dir("fault", sys.argv[1])
writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
claimed.record_writers([writer.pid], "torchrun")
print(writer.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # its flock goes with it; its record stays
"""


def test_a_lock_naming_a_live_writer_is_refused_and_a_dead_ones_taken_over(tmp_path):
    """The launcher was killed (its flock went with it) but a process its lock record names
    still runs (its torchrun, stopping the ranks): a new claim, overwrite or not, is refused
    naming that process; once it has ended the record is stale and the folder is taken over.
    A record naming a reused process id (another start time) is stale too."""
    launcher = subprocess.run([sys.executable, "-c", _KILLED_LAUNCHER, str(tmp_path)], capture_output=True,
                              text=True, timeout=60)
    assert launcher.returncode == -9
    writer = psutil.Process(int(launcher.stdout))
    try:
        record = json.loads((tmp_path / RUN_MARKER).read_text())
        assert record["writers"][1] == {"pid": writer.pid, "started": writer.create_time(), "what": "torchrun"}
        before = _tree(tmp_path)
        for overwrite in (False, True):
            with pytest.raises(ValueError) as info:
                prepare_out_dir("fault", tmp_path, overwrite=overwrite)
            assert str(info.value) == (f"out (--out) {str(tmp_path)!r} is in use by another run (run 'fault': its "
                                       f"torchrun pid {writer.pid} still runs): wait for it to end or give each "
                                       "run its own folder")
        assert _tree(tmp_path) == before
    finally:
        writer.kill()
        writer.wait(10)
    prepare_out_dir("fault", tmp_path, overwrite=True).release()  # stale: taken over
    # a record naming this very process, but with another start time: a reused id, stale
    (tmp_path / RUN_MARKER).write_text(json.dumps({"run": "fault", "writers": [
        {"pid": os.getpid(), "started": psutil.Process().create_time() - 100, "what": "launcher"}]}))
    prepare_out_dir("fault", tmp_path).release()
