"""handbook_lib.launch.diagnose: a rank that never started, because torchrun's rendezvous was still
waiting for a node of the job, is said to be so, not blamed on importing torch."""

from __future__ import annotations

import time

import pytest

from handbook_lib.launch import RunTimeout, torchrun
from handbook_lib.launch.diagnose import NEVER_STARTED, diagnose_failure, where_ranks_were
from handbook_lib.launch.nodes import free_port


def _agent_logs(out, started: bool):
    """The log folders torchrun leaves: its run's folder always, ``attempt_0/<local rank>`` only
    once the rendezvous completed and it started the ranks."""
    run = out / "logs" / "node0" / "handbook-1_abc"
    run.mkdir(parents=True)
    if started:
        (run / "attempt_0" / "0").mkdir(parents=True)


def test_ranks_torchrun_never_started_are_said_to_wait_for_the_rendezvous(tmp_path):
    _agent_logs(tmp_path, started=False)
    cause, states = diagnose_failure(tmp_path, 2)
    assert cause.rank == 0 and cause.status == "starting" and cause.summary == NEVER_STARTED
    assert "importing torch" not in cause.summary and "rendezvous" in cause.summary
    assert where_ranks_were(states) == [
        "--- ranks 0-1: never started: torchrun's rendezvous was still waiting for every node of the job "
        "(a node that never joined, or an endpoint it could not reach) when the run was stopped"]


def test_ranks_started_but_silent_before_the_run_are_still_starting(tmp_path):
    _agent_logs(tmp_path, started=True)
    cause, states = diagnose_failure(tmp_path, 2)
    assert "imported torch" in cause.summary
    assert where_ranks_were(states)[0].startswith("--- ranks 0-1: still starting (Python start-up or importing torch)")


def test_a_missing_second_node_is_named_as_such(tmp_path):
    """Node 0 of a 2-node job whose node 1 never comes: the run stops at its timeout saying its
    ranks never started, waiting at the rendezvous (real torchrun, one agent, one rank)."""
    start = time.monotonic()
    with pytest.raises(RunTimeout) as stopped:
        torchrun("fault", 1, {"mode": "none"}, nnodes=2, node_rank=0, rdzv_endpoint=f"127.0.0.1:{free_port()}",
                 timeout_s=20, out=tmp_path / "run", stream=False)
    message = str(stopped.value)
    assert "never started: torchrun's rendezvous was still waiting for every node" in message, message
    assert "importing torch" not in message
    assert time.monotonic() - start < 60
