"""handbook_lib.runs.entry, the rank harness: its status file and its stack dumps under SIGTERM.

torchrun stops a failed job's other ranks with SIGTERM. A rank must not die between writing its
status and renaming it into place (the launcher would blame it as a rank that died silently),
and a SIGTERM after a run's own signal handling must still dump the rank's stacks.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import textwrap

from handbook_lib.runs import entry


def test_a_sigterm_during_the_status_write_waits_until_it_is_in_place(tmp_path, monkeypatch):
    (tmp_path / "ranks").mkdir()
    status = tmp_path / "ranks" / "rank0.json"
    seen: list[bool] = []
    real = entry.write_json_atomic

    def write_then_get_stopped(path, data):  # torchrun's SIGTERM arrives as the status is written
        os.kill(os.getpid(), signal.SIGTERM)
        real(path, data)

    def handler(*_):
        seen.append(status.exists())

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        monkeypatch.setattr(entry, "write_json_atomic", write_then_get_stopped)
        with open(tmp_path / "stacks.txt", "w") as stacks:
            entry._write_status(tmp_path, 0, "error", stacks, error_type="RuntimeError", message="peer gone")
        assert signal.getsignal(signal.SIGTERM) is handler  # the handler before it, put back
    finally:
        faulthandler.unregister(signal.SIGTERM)  # the harness's, armed again over the handler
        signal.signal(signal.SIGTERM, previous)
    assert seen == [True]  # the signal landed once the status was in place, not before
    assert json.loads(status.read_text())["status"] == "error"


def test_a_rank_stopped_while_writing_its_status_leaves_it_whole_and_its_stacks(tmp_path):
    """The race a loaded machine showed (1 run in 10): rank 1 killed itself, torchrun's SIGTERM
    reached rank 0 as it wrote its status, and rank 0 was blamed as silent. In a real process,
    with faulthandler's handler armed as the harness arms it."""
    child = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from handbook_lib.runs import entry
        out = Path({str(tmp_path)!r})
        (out / "ranks").mkdir()
        stacks = open(out / "stacks.txt", "w")
        entry._dump_on_sigterm(stacks)
        real = entry.write_json_atomic
        def write(path, data):
            os.kill(os.getpid(), signal.SIGTERM)
            real(path, data)
        entry.write_json_atomic = write
        entry._write_status(out, 0, "error", stacks, error_type="RuntimeError", message="peer gone")
        print("survived SIGTERM")
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM and "survived" not in done.stdout, done.stderr
    assert json.loads((tmp_path / "ranks" / "rank0.json").read_text())["status"] == "error"
    assert "File " in (tmp_path / "stacks.txt").read_text()  # the signal still dumped the stacks


def test_stacks_are_dumped_on_sigterm_after_a_run_watched_for_it(tmp_path):
    """A preemption watch can only restore SIGTERM to Python's default; the harness arms
    faulthandler again after each run, so the stacks of a rank stopped later are not lost."""
    child = textwrap.dedent(f"""
        import os, signal
        from handbook_lib.runs import entry
        from handbook_lib.runtime.preemption import PreemptionWatch
        stacks = open({str(tmp_path / "stacks.txt")!r}, "w")
        entry._dump_on_sigterm(stacks)
        with PreemptionWatch():  # a run's own handler, put back as SIG_DFL on exit
            pass
        if os.environ["REARM"] == "1":
            entry._dump_on_sigterm(stacks)  # what the harness does after each run
        os.kill(os.getpid(), signal.SIGTERM)
    """)
    for rearm, dumped in (("0", False), ("1", True)):
        done = subprocess.run([sys.executable, "-c", child], env={**os.environ, "REARM": rearm},
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == -signal.SIGTERM, done.stderr
        assert ("File " in (tmp_path / "stacks.txt").read_text()) is dumped
