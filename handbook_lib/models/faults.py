"""What goes wrong in a job of several nodes, what a checkpointing job does about each, and how
the book proves it. Pure: no ``torch``.

Chapter 6 shows it as a table. Each fault is provoked for real in a test (named in its row:
``tests/test_faults.py`` and ``tests/test_runs_checkpoint_resume.py``), and the table is checked
against those tests, so a row cannot outlive the proof behind it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Fault", "NODE_FAULTS"]


@dataclass(frozen=True)
class Fault:
    """One fault, as a learner meets it and as the book provokes it."""

    name: str
    """Short name, e.g. ``"a node lost mid-step"``."""
    provoked_by: str
    """How the test causes it."""
    the_job: str
    """What the job does and says."""
    on_disk: str
    """What is left under ``ckpt_dir``."""
    recovery: str
    """What to do next."""
    test: str
    """The test that provokes it, ``file::function``."""


NODE_FAULTS: tuple[Fault, ...] = (
    Fault("a node lost mid-step",
          "2 nodes x 1 rank; node 1's torchrun agent SIGKILLed in step 3, after its backward",
          "fails at once, naming rank 1 (node 1) and the agent killed by SIGKILL; rank 0's collective "
          "errors with 'Connection reset by peer'",
          "step_000002, complete, still latest",
          "relaunch with resume=true: it continues from step 2",
          "tests/test_faults.py::test_a_node_lost_mid_step_leaves_the_last_checkpoint"),
    Fault("a node lost mid-save",
          "the same, during the save of step 4, once its shard is written",
          "fails the same way",
          "step_000004.tmp without .metadata or manifest (never loaded); step_000002 still latest",
          "relaunch with resume=true: it redoes step 4's save",
          "tests/test_faults.py::test_a_node_lost_mid_save_leaves_the_previous_checkpoint"),
    Fault("a preemption",
          "SIGTERM to the CLI (Slurm's notice), or SIGUSR1 to one rank (sbatch --signal)",
          "every rank saves at its next step boundary and stops: exit 75, 'preempted by SIGTERM at "
          "step k; saved step_k', and the command that resumes",
          "step_k, complete, latest",
          "the printed command; the sbatch script requeues itself",
          "tests/test_runs_checkpoint_resume.py::test_sigterm_to_the_cli_saves_and_exits_75_with_the_"
          "command_to_resume"),
    Fault("a full disk during a save",
          "a file-size limit below one shard's size (ulimit -f) on every rank",
          "refused before any byte is written, in one line: the bytes the save needs and the limit",
          "nothing new; the previous checkpoint still latest",
          "free space (or raise the limit), then relaunch with resume=true",
          "tests/test_faults.py::test_a_full_disk_refuses_the_save_and_keeps_the_previous"),
    Fault("a corrupted file on one rank",
          "one byte of rank 1's shard file flipped, its size unchanged",
          "refused at load by the rank that reads it, naming the file and its SHA-256 mismatch",
          "unchanged: nothing is loaded from it",
          "resume_step= an earlier checkpoint (keep_last > 1 keeps one)",
          "tests/test_faults.py::test_a_corrupted_shard_is_refused_by_name_at_load"),
)
"""The faults of chapter 6's table, in its order."""
