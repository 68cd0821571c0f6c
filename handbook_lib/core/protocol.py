"""The contract between the launcher and the ranks of a run: environment variables, the files
of a run's folder, and what a rank's state file says. Pure: no ``torch``.

Chapter 1 introduces it. :func:`handbook_lib.launch.torchrun` writes the config and sets the
environment; every rank's harness (:mod:`handbook_lib.runs.entry`) writes its state and, on
rank 0, the result; the launcher reads them back to report a success or name the rank that
failed. Both sides import the names below, so neither spells a file or a key of its own::

    OUT/                       the run's folder (a temporary one without ``out=``)
        .handbook-run          RUN_MARKER: claims the folder for one run, and is its lock
        config.json            CONFIG_FILE: the run's config, written by the launcher; for a
                               batch, {"batch": [{"label": ..., "config": {...}}, ...]}
        result.json            RESULT_FILE: written once by rank 0 (handbook_lib.core.results)
        results/{k}.json       a batch's results, one per config, in the batch's order
        ranks/rank{R}.json     each rank's end state (RankStatus), written atomically
        ranks/rank{R}.stacks.txt   Python stacks of a rank stopped by a signal or a deadline
        logs/                  torchrun's per-rank logs (``--log-dir``)

One node of a real multi-node job (``node_rank`` K given, the folder shared by every node):
node 0 claims the folder as above (its logs in ``logs/node0``); node K > 0 writes only
``.handbook-run.nodeK`` (its claim and lock), ``config.nodeK.json`` and ``logs/nodeK``
(:func:`node_files`), so that every node's command can share one folder.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "DEADLINE_ENV", "COLLECTIVE_TIMEOUT_ENV", "RESULTS_LOG_ENV", "collective_timeout_s", "RUN_MARKER", "CONFIG_FILE",
    "RESULT_FILE", "RESULTS_DIR", "BATCH_KEY", "RANKS_DIR", "LOGS_DIR", "RUN_FILES", "rank_status_path",
    "rank_stacks_path", "batch_result_path", "RankStatus", "node_marker", "node_config_file", "node_files",
    "PREEMPT_SIGNALS", "PREEMPTED_EXIT",
]

DEADLINE_ENV = "HANDBOOK_DEADLINE"
"""Environment variable the launcher sets: the Unix time (seconds) at which it kills the run;
a rank dumps its stacks shortly before it."""
COLLECTIVE_TIMEOUT_ENV = "HANDBOOK_COLLECTIVE_TIMEOUT_S"
"""Environment variable the launcher sets: seconds a collective may wait before it fails."""
RESULTS_LOG_ENV = "HANDBOOK_RESULTS_LOG"
"""Environment variable the caller may set to a file: the launcher appends one JSON line per
result it reads (``run``, ``label``, ``world_size``, ``checks``, ``failed``). The test suite
sets it to count the checks of all its runs (``conftest.py``)."""

PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1")
"""The signals that mean "you will be stopped soon: save and stop" to a run that can resume
(chapter 6). Slurm sends SIGTERM before it kills a job at its time limit or on preemption, and
the signal ``sbatch --signal`` names ahead of the limit (the book asks for SIGUSR1)."""
PREEMPTED_EXIT = 75
"""Exit status of a rank, and of the CLI, when a run stopped on a preemption signal after saving
(``EX_TEMPFAIL`` of ``sysexits.h``: a temporary failure, to retry): a batch script requeues on it."""

RUN_MARKER = ".handbook-run"
"""File a run writes into its ``out`` folder: it names the run, marks the folder as a run's, and is
the lock (``fcntl.flock``) held for the whole run so two runs never share a folder."""
CONFIG_FILE = "config.json"
"""The run's config, as the launcher validated it; the ranks read it with ``--config``."""
RESULT_FILE = "result.json"
"""The run's result (:class:`handbook_lib.core.results.RunResult`), written once by rank 0."""
BATCH_KEY = "batch"
"""The key of a batch's config file: several configs run one after another by one job (one
torchrun, one process group), each with its own result."""
RESULTS_DIR = "results"
"""A batch's results, one file per config."""
RANKS_DIR = "ranks"
"""Each rank's state file and stack dump."""
LOGS_DIR = "logs"
"""torchrun's log folder: every rank's own output."""
RUN_FILES = (RESULT_FILE, RESULTS_DIR, CONFIG_FILE, RANKS_DIR, LOGS_DIR)
"""What a run may write into its ``out`` folder (besides :data:`RUN_MARKER`). An overwrite removes
only the files under these that the earlier run listed in its manifest
(``.handbook-run.files.json``), and never while a process that run started is alive."""


def node_marker(node: int | None) -> str:
    """The claim and lock file of one node of a real multi-node job in a shared folder:
    :data:`RUN_MARKER` for node 0 (and for a job started from one machine, ``node=None``),
    ``.handbook-run.node{K}`` for node K."""
    return RUN_MARKER if not node else f"{RUN_MARKER}.node{node}"


def node_config_file(node: int | None) -> str:
    """The config file node ``node``'s launcher writes and its ranks read: :data:`CONFIG_FILE`,
    or ``config.node{K}.json`` for node K > 0 (the same config, another file: two launchers
    never write one file)."""
    return CONFIG_FILE if not node else f"config.node{node}.json"


def node_files(node: int | None) -> tuple[str, ...]:
    """What ``node``'s launcher and ranks write into the folder (besides its marker), relative
    paths: all of :data:`RUN_FILES` for a job started from one machine; for node 0 of a real
    multi-node job the result, the batch's results, the config, the rank states and
    ``logs/node0``; for node K > 0 its config and ``logs/node{K}``. Only these are ever
    removed, and only by that node's launcher."""
    if node is None:
        return RUN_FILES
    if node == 0:
        return (RESULT_FILE, RESULTS_DIR, CONFIG_FILE, RANKS_DIR, f"{LOGS_DIR}/node0")
    return (node_config_file(node), f"{LOGS_DIR}/node{node}")


def collective_timeout_s(timeout_s: float) -> float:
    """Seconds a collective may block in a run that may take ``timeout_s`` in all: 80 % of it,
    kept between 5 s and 300 s, so a hung peer fails the others before the launcher's deadline."""
    return max(5.0, min(300.0, 0.8 * timeout_s))


def rank_status_path(out_dir: str | Path, rank: int) -> Path:
    """``OUT/ranks/rank{R}.json``: where rank ``rank`` writes its :class:`RankStatus`."""
    return Path(out_dir) / RANKS_DIR / f"rank{rank}.json"


def batch_result_path(out_dir: str | Path, index: int) -> Path:
    """``OUT/results/{index}.json``: the result of a batch's ``index``-th config (from 0)."""
    return Path(out_dir) / RESULTS_DIR / f"{index}.json"


def rank_stacks_path(out_dir: str | Path, rank: int) -> Path:
    """``OUT/ranks/rank{R}.stacks.txt``: created by the rank's harness first thing, then filled
    with its Python stacks if it is stopped by a signal or nears the deadline. Its absence means
    the rank never reached the harness."""
    return Path(out_dir) / RANKS_DIR / f"rank{rank}.stacks.txt"


@dataclass(frozen=True)
class RankStatus:
    """How one rank ended, as its harness writes it to :func:`rank_status_path`."""

    rank: int
    status: Literal["ok", "error", "preempted"]
    """``ok``: the run's code returned; ``error``: it raised (see the fields below);
    ``preempted``: it saved and stopped on a signal of :data:`PREEMPT_SIGNALS` (``message``
    says at which step and where the checkpoint is)."""
    time: float
    """Unix time the state was written, seconds: the launcher orders errors by it."""
    host: str = ""
    """The machine's name."""
    node_rank: int = 0
    """torchrun's ``GROUP_RANK``: which agent (node) started the rank."""
    local_rank: int = 0
    """The rank's index on its node."""
    error_type: str = ""
    """The exception's class name (``error`` only)."""
    message: str = ""
    """The exception's message (``error`` only)."""
    traceback: str = ""
    """The rank's Python traceback (``error`` only)."""
    distributed_error: bool = False
    """The exception is a ``torch.distributed.DistError``: often a consequence of another rank's
    failure (a peer gone, a collective timed out)."""
    stage: str = ""
    """In a batch, the label of the config the rank was running (``""`` for one run)."""
    step: int = -1
    """``preempted`` only: the optimizer step at which every rank saved and stopped."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the state file."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankStatus:
        """Parse a state file's JSON object (unknown keys are ignored)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
