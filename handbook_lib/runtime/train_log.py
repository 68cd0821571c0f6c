"""What the training loop records and reports: its log, its per-step hook's argument, its
progress lines and its check for a diverged loss.

:func:`handbook_lib.runtime.training.train` fills a :class:`TrainLog` step by step (through
:class:`_Recorder`) and tells its caller each step's end (:class:`StepEnd`); a NaN or infinite
loss stops the job with :class:`NonFiniteLoss`, naming the step and the rank.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from handbook_lib.runtime.collectives import CollectiveCall
from handbook_lib.runtime.grads import grad_zero_fraction
from handbook_lib.runtime.measure import StepMemory

__all__ = ["NonFiniteLoss", "check_loss_finite", "TrainLog", "StepEnd"]


class NonFiniteLoss(FloatingPointError):
    """The loss became NaN or infinite: training diverged. The message names the step and rank."""


def check_loss_finite(loss: float, step: int | None = None, rank: int | None = None) -> None:
    """Raise :class:`NonFiniteLoss` if ``loss`` (nats per token) is NaN or infinite.

    Args:
        loss: This rank's loss of one step.
        step: The optimizer step it belongs to (1-based), named in the message if given.
        rank: This rank (default: the process group's rank, else 0).

    Raises:
        NonFiniteLoss: e.g. ``loss is nan at step 3 on rank 1: training diverged (lr too large? ...)``.
    """
    if math.isfinite(loss):
        return
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    where = f" at step {step}" if step is not None else ""
    raise NonFiniteLoss(f"loss is {loss}{where} on rank {rank}: training diverged (lr too large? fp16 "
                        f"without a gradient scaler?)")


class _ProgressLines:
    """A file for tqdm that writes each redraw as its own line.

    tqdm redraws with carriage returns; torchrun's ``--tee`` reads the ranks' output line by
    line and would cut such redraws apart. One line per redraw survives the trip, and the
    launcher draws them in place again.
    """

    def write(self, text: str) -> None:
        for part in text.split("\r"):
            if part.strip():
                sys.stderr.write(part.rstrip("\n") + "\n")

    def flush(self) -> None:
        sys.stderr.flush()


@dataclass(frozen=True)
class TrainLog:
    """What :func:`train` observed, per step."""

    losses: list[float]
    """The reported loss over the global batch (nats per token), after each step's forward: by
    default (:func:`next_token_loss`) the mean cross-entropy."""
    step_time_s: list[float]
    """Wall time of each untracked step (forward, backward, optimizer), seconds; the zero count
    and the ``after_backward`` hook are left out."""
    memory: StepMemory | None = None
    """Memory of the last step, measured by :class:`StepMemoryTracker` (if asked for)."""
    collectives: list[CollectiveCall] | None = None
    """Collectives of the last step, recorded by :class:`CollectiveCounter` (if asked for)."""
    grad_zero_fraction: list[float] = field(default_factory=list)
    """Per untracked step, this rank's fraction of gradient elements exactly zero after backward
    (before unscaling): see :func:`grad_zero_fraction`."""
    grad_scale: list[float] = field(default_factory=list)
    """Per step, the gradient scaler's factor used in that step (empty without a scaler)."""
    skipped_steps: list[int] = field(default_factory=list)
    """The optimizer steps (1-based, counted from the job's start, like ``steps``) that the
    scaler skipped because it found inf/NaN gradients: those after which its factor dropped."""
    grad_norm: list[float] = field(default_factory=list)
    """Per step, the total L2 norm of the global batch's gradient before clipping (only with
    ``max_grad_norm`` > 0)."""
    grad_norm_full: float | None = None
    """With clipping, on the first step: the same norm computed as one process would, from the
    whole gradient gathered to this rank (see :func:`full_grad_norm`)."""
    steps: list[int] = field(default_factory=list)
    """The optimizer step (1-based, counted from the job's start) of each entry of ``losses``."""
    lr: list[float] = field(default_factory=list)
    """The learning rate each step used (the first parameter group's), dimensionless; empty
    for an optimizer without parameter groups (DeepSpeed's engine)."""


@dataclass(frozen=True)
class StepEnd:
    """What the per-step hook of :func:`train` is told after each optimizer step."""

    step: int
    """Optimizer steps done, counted from the job's start (1-based)."""
    loss: float
    """The global batch's mean loss of that step (nats per token)."""
    model: nn.Module
    optimizer: torch.optim.Optimizer


@dataclass
class _Recorder:
    """What :func:`train` collects step by step, turned into a :class:`TrainLog` at the end."""

    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    zeros: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    full: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    memory: StepMemory | None = None
    collectives: list[CollectiveCall] | None = None
    hook_s: float = 0.0
    """Seconds this step spent counting zeros and in the caller's hook, kept out of step_time_s."""

    def after_backward(self, hook: Callable[[nn.Module, int], None] | None, step: int,
                       count_zeros: bool, device: torch.device | None = None,
                       ) -> Callable[[nn.Module], None] | None:
        """:func:`train_step`'s ``after_backward`` for 1-based ``step``: the zero count (if
        ``count_zeros``), then the caller's ``hook(model, step)``; ``None`` if neither runs.

        On a GPU it first waits for the queued backward (``torch.cuda.synchronize``): the
        backward returns once its kernels are queued, and the first host read of a gradient
        would wait for the rest of them inside the time kept out of ``step_time_s``, making
        steps look 20-40 % shorter than they are (``../shared/reviews/gpu-path.md``, S2-1)."""
        self.hook_s = 0.0
        if hook is None and not count_zeros:
            return None

        def run(model: nn.Module) -> None:
            if device is not None and device.type == "cuda":
                torch.cuda.synchronize(device)  # the backward's own time stays in the step's
            begin = time.perf_counter()
            if count_zeros:
                self.zeros.append(grad_zero_fraction(model))
            if hook is not None:
                hook(model, step)
            self.hook_s = time.perf_counter() - begin

        return run

    def log(self) -> TrainLog:
        return TrainLog(losses=self.losses, step_time_s=self.times, memory=self.memory,
                        collectives=self.collectives, grad_zero_fraction=self.zeros,
                        grad_scale=self.scales, skipped_steps=self.skipped, grad_norm=self.norms,
                        grad_norm_full=self.full[0] if self.full else None, steps=self.steps,
                        lr=self.lrs)


