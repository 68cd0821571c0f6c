"""Preemption: a signal that says the job will be stopped soon, turned into a save and a stop.

Chapter 6 teaches it. A cluster does not kill a job without notice: Slurm sends SIGTERM (or the
signal ``sbatch --signal`` asks for, SIGUSR1 in the book's script) some seconds before SIGKILL.
A rank that gets one only sets a flag, because a signal may arrive in the middle of a
collective; at the next step boundary every rank asks, in one all-reduce of that flag, whether
any rank was told. All ranks then see the same answer at the same step, save one checkpoint
together and raise :class:`Preempted`; the harness turns it into the exit status
:data:`~handbook_lib.core.protocol.PREEMPTED_EXIT` and one line for the launcher.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from handbook_lib.core.protocol import PREEMPT_SIGNALS

__all__ = ["Preempted", "PreemptionWatch"]


class Preempted(Exception):
    """Every rank saved at ``step`` and stopped because a rank got ``signal_name``.

    ``str(err)`` is one line: ``preempted by SIGTERM at step 3; saved step_000003 in /ck``.
    """

    def __init__(self, step: int, signal_name: str, checkpoint: str) -> None:
        super().__init__(f"preempted by {signal_name} at step {step}; saved {checkpoint}")
        self.step, self.signal_name, self.checkpoint = step, signal_name, checkpoint


class PreemptionWatch:
    """While entered (in a rank's main thread), :data:`~handbook_lib.core.protocol.PREEMPT_SIGNALS`
    set a flag instead of ending the process; :meth:`agreed` tells every rank whether any rank
    got one. The previous handlers come back on exit.

    Args:
        device: The rank's device (the flag's all-reduce runs there: NCCL needs a GPU tensor).
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.signal_name: str | None = None
        """The first signal this rank got, by name (``None``: none yet)."""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is threading.main_thread():
            for name in PREEMPT_SIGNALS:
                number = getattr(signal, name)
                self._previous[number] = signal.signal(number, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
        print(f"got {signal.Signals(signum).name}: saving at the next step boundary", flush=True)

    def agreed(self) -> str | None:
        """Collective: the name of a signal some rank got, the same on every rank, or ``None``.

        One all-reduce (MAX) of this rank's signal index (0: none), so a signal caught by one
        rank alone stops them all at this boundary.
        """
        index = 0 if self.signal_name is None else 1 + PREEMPT_SIGNALS.index(self.signal_name)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([index], dtype=torch.int32, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            index = int(flag.item())
        return None if index == 0 else PREEMPT_SIGNALS[index - 1]
