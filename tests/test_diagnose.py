"""handbook_lib.launch.diagnose: which rank caused a failed run, from its ranks' files."""

from __future__ import annotations

import json

from handbook_lib.core import RankStatus, rank_stacks_path, rank_status_path
from handbook_lib.launch.diagnose import diagnose_failure

IN_A_COLLECTIVE = """Traceback (most recent call last):
  File "/x/handbook_lib/runs/checkpoint_resume.py", line 306, in run
  File "/x/site-packages/torch/distributed/checkpoint/utils.py", line 263, in all_reduce
RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation
"""
OWN_BUG = """Traceback (most recent call last):
  File "/x/handbook_lib/runs/checkpoint_resume.py", line 306, in run
  File "/x/handbook_lib/runtime/training.py", line 44, in train
ValueError: a bug of the run itself
"""


def _error(out, rank, traceback, message="failed"):
    for path in (rank_status_path(out, rank), rank_stacks_path(out, rank)):
        path.parent.mkdir(parents=True, exist_ok=True)
    rank_stacks_path(out, rank).write_text("")
    state = RankStatus(rank=rank, status="error", time=float(rank), error_type="RuntimeError",
                       message=message, traceback=traceback)
    rank_status_path(out, rank).write_text(json.dumps(state.to_dict()))


def _silent(out, rank):
    rank_stacks_path(out, rank).parent.mkdir(parents=True, exist_ok=True)
    rank_stacks_path(out, rank).write_text("")  # started, then died without a word


def test_a_rank_killed_silently_is_blamed_over_a_peer_that_failed_in_a_collective(tmp_path):
    """Seen under load: rank 0's error, raised in DCP's all-reduce, matched none of gloo's usual
    words for a lost peer, and the launcher blamed rank 0 for rank 1's SIGKILL."""
    _error(tmp_path, 0, IN_A_COLLECTIVE, message="CheckpointException ranks:dict_keys([0])")
    _silent(tmp_path, 1)
    cause, _ = diagnose_failure(tmp_path, 2)
    assert cause.rank == 1 and cause.status == "silent"


def test_a_rank_that_raised_its_own_error_is_still_the_cause(tmp_path):
    _error(tmp_path, 0, OWN_BUG, message="a bug of the run itself")
    _error(tmp_path, 1, IN_A_COLLECTIVE, message="Connection closed")
    cause, _ = diagnose_failure(tmp_path, 2)
    assert cause.rank == 0 and "a bug of the run itself" in cause.summary
