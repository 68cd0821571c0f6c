"""The launcher's side of preemption: pass a preemption signal on to the ranks, and report a run
that stopped on one, saved.

Chapter 6 teaches it. Slurm sends SIGTERM (or, with ``sbatch --signal``, SIGUSR1) to every
process of a job step before it kills the job; a learner may also ``kill`` the CLI alone. While
a run that can resume (its module sets ``PREEMPTIBLE``) is running, the launcher catches both
and sends the same signal to each torchrun agent, which passes it to its ranks
(``TORCHELASTIC_SIGNALS_TO_HANDLE`` adds SIGUSR1 to the signals torchrun handles) and gives
them 30 s to stop. The ranks save at the next step boundary and exit with
:data:`~handbook_lib.core.protocol.PREEMPTED_EXIT`; :func:`raise_if_preempted` turns their
``preempted`` states into :class:`~handbook_lib.launch.errors.RunPreempted`.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from handbook_lib.core.protocol import PREEMPT_SIGNALS, RankStatus, rank_status_path
from handbook_lib.launch.errors import RunPreempted
from handbook_lib.launch.processes import Agents

__all__ = []  # the launcher's own part: TORCHRUN_SIGNALS, forward_signals, raise_if_preempted

TORCHRUN_SIGNALS = {"TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT",
                                                                "SIGUSR1"))}
"""torchrun's environment: the signals its agent turns into a clean stop of its ranks, passing the
signal on (torchrun's default list lacks SIGUSR1, which would end the agent at once and its
ranks with it, unsaved)."""


@contextlib.contextmanager
def forward_signals(proc: subprocess.Popen | Agents, active: bool) -> Iterator[list[str]]:
    """While ``active`` (in the main thread), SIGTERM and SIGUSR1 to this process are sent on to
    every torchrun agent of ``proc`` instead of ending it; yields the names of those received.
    The previous handlers come back afterwards."""
    received: list[str] = []
    if not active or threading.current_thread() is not threading.main_thread():
        yield received
        return
    agents = proc.procs if isinstance(proc, Agents) else [proc]

    def forward(signum: int, frame: object) -> None:
        received.append(signal.Signals(signum).name)
        for agent in agents:
            if agent.poll() is None:
                agent.send_signal(signum)

    previous = {number: signal.signal(number, forward)
                for number in (getattr(signal, name) for name in PREEMPT_SIGNALS)}
    try:
        yield received
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)


def raise_if_preempted(run: str, out_dir: Path, world_size: int, common: dict[str, Any]) -> None:
    """Raise :class:`RunPreempted` if a rank of this node wrote the state ``preempted``.

    ``common`` holds :class:`~handbook_lib.launch.errors.RunFailed`'s other keyword arguments
    (``out_dir``, ``returncode``, ``log_tail``; ``run`` is given here)."""
    for rank in range(world_size):
        path = rank_status_path(out_dir, rank)
        if not path.exists():
            continue
        state = RankStatus.from_dict(json.loads(path.read_text()))
        if state.status == "preempted":
            raise RunPreempted(f"run {run!r} {state.message}", step=state.step,
                               **{**common, "run": run})
