"""Post-mortem of a failed run: which rank caused it, read from the files its ranks left.

Chapter 1 teaches it. Every rank's harness writes its end state
(:class:`handbook_lib.core.protocol.RankStatus`) and, if stopped, its Python stacks; a rank that
wrote neither never reached the run's code or died without a word. :func:`diagnose_failure`
names the cause (the first rank that raised an error of its own, before ranks that only lost a
peer), and :func:`failure_message` writes what :class:`~handbook_lib.launch.errors.RunFailed`
says.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

from handbook_lib.core.protocol import LOGS_DIR, RankStatus, rank_stacks_path, rank_status_path

__all__ = ["RankFailure", "diagnose_failure"]

_CONSEQUENTIAL = re.compile(
    r"closed by peer|reset by peer|Broken pipe|remote worker|timed out|timeout|"
    r"communicator was aborted|NCCL error",
    re.IGNORECASE,
)

@dataclass(frozen=True)
class RankFailure:
    """How one rank ended, as read from its files in ``DIR/ranks``."""

    rank: int
    status: str
    """``ok``; ``error`` (raised a Python exception); ``stopped`` (killed by a signal, stacks
    dumped); ``silent`` (died without a word: ``os._exit``, a segfault, SIGKILL, out of memory);
    ``starting`` (never reached the run's code: still starting, or died while importing)."""
    summary: str
    traceback: str = ""
    consequential: bool = False
    """True for errors that follow from another rank's failure (a peer gone, a collective timeout)."""
    stage: str = ""
    """In a batch, the label of the config the rank was running when it failed."""

def _raised_in_a_collective(traceback: str) -> bool:
    """Whether the innermost frame of a Python traceback is in ``torch.distributed`` (a
    collective, or DCP's all-reduce of its ranks' errors): the rank was waiting on its peers when
    it failed. gloo's words for a lost peer vary (and DCP wraps them), so the frame says it."""
    frames = [line for line in traceback.splitlines() if line.lstrip().startswith('File "')]
    return bool(frames) and "torch/distributed/" in frames[-1].replace("\\", "/")


NEVER_STARTED = ("was never started: torchrun did not get past its rendezvous, which waits for every "
                 "node of the job (a node that never joined, or a rendezvous endpoint it could not "
                 "reach); torchrun's own output is under logs/")
"""What a rank whose process torchrun never started is said to have done."""


def workers_started(out_dir: Path) -> bool:
    """Whether torchrun started rank processes for the run in ``out_dir``: it makes each start's
    log folder (``logs/.../attempt_N``) only once the rendezvous is complete, as it starts them.
    No such folder: no rank ran here, whatever the ranks' files say."""
    logs = Path(out_dir) / LOGS_DIR
    return any(logs.glob("**/attempt_*")) if logs.is_dir() else True


def read_rank(out_dir: Path, rank: int) -> RankFailure:
    """How rank ``rank`` of the run in ``out_dir`` ended, from its state and stack files."""
    status_file = rank_status_path(out_dir, rank)
    stacks_file = rank_stacks_path(out_dir, rank)
    if status_file.exists():
        info = RankStatus.from_dict(json.loads(status_file.read_text()))
        if info.status == "ok":
            return RankFailure(rank, "ok", "finished")
        summary = f"{info.error_type}: {info.message}".strip()
        consequential = (info.distributed_error or bool(_CONSEQUENTIAL.search(summary))
                         or _raised_in_a_collective(info.traceback))
        return RankFailure(rank, "error", summary, info.traceback, consequential, info.stage)
    if not stacks_file.exists():  # the harness creates it first thing: this rank never got there
        if not workers_started(out_dir):
            return RankFailure(rank, "starting", NEVER_STARTED)
        return RankFailure(
            rank, "starting",
            "ended before reaching the run's code (while Python started or imported torch and the "
            "run's modules); its own output is under logs/",
        )
    stacks = stacks_file.read_text()
    if stacks.strip():
        return RankFailure(rank, "stopped", "stopped by a signal; its Python stacks follow", stacks)
    return RankFailure(
        rank, "silent",
        "died without a Python traceback (os._exit, a signal such as SIGKILL, a crash in C++ "
        "code, or the out-of-memory killer)",
    )

def diagnose_failure(out_dir: Path, world_size: int) -> tuple[RankFailure | None, list[RankFailure]]:
    """Find the rank that caused a failed run, from the files its ranks left in ``out_dir/ranks``.

    The cause is, in this order: the first rank (by time) that raised an exception of its own;
    else a rank that died silently; else the first rank whose error was a consequence of
    another's (a lost peer, a collective timeout); else a rank stopped by a signal.

    Returns:
        ``(cause, all_ranks)``: the cause (``None`` if no rank failed) and every rank's state.
    """
    states = [read_rank(Path(out_dir), r) for r in range(world_size)]

    def when(state: RankFailure) -> float:
        path = rank_status_path(out_dir, state.rank)
        return RankStatus.from_dict(json.loads(path.read_text())).time if path.exists() else 0.0

    errors = sorted((s for s in states if s.status == "error"), key=when)
    for group in (
        [s for s in errors if not s.consequential],
        [s for s in states if s.status in ("silent", "starting")],
        _hung(errors, states),
        errors,
        [s for s in states if s.status == "stopped"],
    ):
        if group:
            return group[0], states
    return None, states

_SELF_EXPLAINED = ("NonFiniteLoss:",)
"""Errors whose message says all (which step, which rank, why): their traceback is kept on
:attr:`RunFailed.rank_traceback` and in ``logs/``, not printed in the message."""

_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)

def _hung(errors: list[RankFailure], states: list[RankFailure]) -> list[RankFailure]:
    """A rank that hung: others timed out waiting in a collective while it, still running, was
    stopped. It is the cause, not the ranks that waited for it."""
    if not errors or not all(e.consequential and _TIMED_OUT.search(e.summary) for e in errors):
        return []
    waited = errors[0]
    first_line = waited.summary.splitlines()[0][:200]
    stopped = [s for s in states if s.status == "stopped"]
    # a rank stopped inside a collective was waiting too: blame first one stopped elsewhere
    stopped.sort(key=lambda s: "torch/distributed" in first_stack(s.traceback))
    return [
        dataclasses.replace(s, summary=(
            f"hung: it never joined the collective that rank {waited.rank} waited in until it "
            f"timed out ({first_line}); rank {s.rank} was still running when it was stopped, at:"))
        for s in stopped
    ]

def where_ranks_were(states: list[RankFailure]) -> list[str]:
    """Timeout report lines: each stopped rank's stack; ranks in any other state grouped."""
    lines: list[str] = []
    others: dict[str, list[int]] = {}
    for s in states:
        if s.status == "stopped":
            lines.append(f"--- rank {s.rank}:\n{first_stack(s.traceback)}")
        else:
            summary = s.summary
            if s.status == "starting" and s.summary == NEVER_STARTED:
                summary = ("never started: torchrun's rendezvous was still waiting for every node of the "
                           "job (a node that never joined, or an endpoint it could not reach) when the run "
                           "was stopped")
            elif s.status == "starting":
                summary = ("still starting (Python start-up or importing torch): it had not reached "
                           "the run's code when the run was stopped")
            elif s.status == "silent":
                summary = "stopped before it could dump its stacks (killed while unresponsive)"
            others.setdefault(summary, []).append(s.rank)
    for summary, ranks in others.items():
        label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranges(ranks)}"
        lines.append(f"--- {label}: {summary}")
    return lines

def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(parts)

def _verb(state: RankFailure) -> str:
    return "raised " if state.status == "error" else ""

def first_stack(stacks: str) -> str:
    """The first thread stack of a faulthandler dump, without interpreter start-up frames."""
    kept: list[str] = []
    for line in stacks.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            if kept:
                break
            kept.append("  (most recent call first)")
        elif line.startswith("  File") and "<frozen runpy>" not in line and "<module>" not in line:
            kept.append(line)
    return "\n".join(kept)


def failure_message(run: str, cause: RankFailure, states: list[RankFailure], *, where: str = "",
                    agent_exit: str = "", own_output: list[str] | None = None) -> str:
    """What :class:`~handbook_lib.launch.errors.RunFailed` says: the rank that caused the failure
    and why, its traceback (or where it was stopped), and one line on every other rank that did
    not finish.

    Args:
        run: The run's name.
        cause: The rank :func:`diagnose_failure` named.
        states: Every rank's state.
        where: `` (node N, local rank L)`` for a job over several nodes.
        agent_exit: How the first torchrun agent to end ended, in words (several nodes).
        own_output: The cause's last output lines, when its ``logs/`` go with a temporary
            folder and it left no traceback (it died starting, or silently).
    """
    during = f" in config {cause.stage!r}" if cause.stage else ""
    message = f"run {run!r} failed{during}: rank {cause.rank}{where} {_verb(cause)}{cause.summary}"
    if agent_exit:
        # (agents are numbered by the rendezvous as they join, so name the rank's node only)
        message += f"\n(the first torchrun agent to end was {agent_exit})"
    if own_output is not None and cause.status in ("starting", "silent"):
        message = message.replace("its own output is under logs/", "its last output follows")
        if own_output:
            message += f"\n\n--- last output of rank {cause.rank}:\n" + "\n".join(own_output)
    if cause.status == "stopped":
        message += f"\n{first_stack(cause.traceback)}"
    elif cause.traceback and not cause.summary.startswith(_SELF_EXPLAINED):
        message += f"\n\n--- traceback of rank {cause.rank} ---\n{cause.traceback.rstrip()}"
    for s in states:
        if s.rank == cause.rank or s.status == "ok":
            continue
        if s.status == "stopped":
            message += f"\n\n--- rank {s.rank} was still running, at:\n{first_stack(s.traceback)}"
        else:
            message += f"\n\n--- then rank {s.rank}: {s.summary.splitlines()[0][:300]}"
    return message
