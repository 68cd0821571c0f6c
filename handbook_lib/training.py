"""Train the model on one rank: the data, the optimizer and the one training loop of every run.

The model comes from :func:`handbook_lib.parallelize.parallelize` (built once, wrapped once).
Chapter 1 introduces the loop; chapter 5 adds its levers: fp16 with a gradient scaler, gradient
accumulation (micro-steps without gradient sync) and gradient clipping over sharded gradients;
chapter 6 saves checkpoints from its per-step hook.

Data are synthetic and made in code, the same on every machine: each sequence follows
``next = (3 * token + 1) mod vocab_size`` from a random start, so the loss has something to learn
and falls within a few steps.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from tqdm import tqdm

from handbook_lib.config import RunConfig
from handbook_lib.distributed import RankContext
from handbook_lib.measure import (
    CollectiveCall,
    CollectiveCounter,
    StepMemory,
    StepMemoryTracker,
    local_tensor,
)
from handbook_lib.strategies import get_strategy

__all__ = [
    "TrainLog",
    "StepEnd",
    "make_batch",
    "local_slice",
    "local_batch",
    "build_optimizer",
    "build_grad_scaler",
    "grad_zero_fraction",
    "clip_grad_norm",
    "full_grad_norm",
    "train_step",
    "train",
    "train_one_process",
    "one_thread",
    "NonFiniteLoss",
    "check_loss_finite",
]


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


def make_batch(config: RunConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``(inputs, targets)``, int64, each (batch_size, seq_len).

    Deterministic in ``(config.seed, step)`` and independent of the world size, so runs with any
    number of ranks see the same data.
    """
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    start = torch.randint(0, config.vocab_size, (config.batch_size, 1), generator=gen)
    tokens = [start]
    for _ in range(config.seq_len):
        tokens.append((3 * tokens[-1] + 1) % config.vocab_size)
    seq = torch.cat(tokens, dim=1)
    return seq[:, :-1], seq[:, 1:]


def local_slice(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s equal share of a global batch (rows ``rank*b : (rank+1)*b``).

    Raises:
        ValueError: if the batch does not divide evenly across ``world_size`` ranks.
    """
    if batch.shape[0] % world_size:
        raise ValueError(
            f"batch_size={batch.shape[0]} must be divisible by the world size {world_size}"
        )
    per_rank = batch.shape[0] // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]


def local_batch(config: RunConfig, step: int, ctx: RankContext) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(inputs, targets)`` of global batch ``step``, on the rank's device."""
    inputs, targets = make_batch(config, step)
    return (local_slice(inputs, ctx.rank, ctx.world_size).to(ctx.device),
            local_slice(targets, ctx.rank, ctx.world_size).to(ctx.device))


def build_grad_scaler(config: RunConfig, ctx: RankContext) -> torch.amp.GradScaler | None:
    """The gradient scaler fp16 needs, or ``None`` (fp32, bf16, or ``grad_scaler=False``).

    fp16's smallest positive value is about 6e-8 (5.96e-8, subnormal); smaller gradients round
    to zero. The scaler multiplies the loss by a large factor (2**16 at first) so gradients are
    computed scaled, divides them back in fp32 before the optimizer step, skips a step whose
    gradients overflowed to inf/NaN and halves the factor then (and doubles it after 2,000 good
    steps). With FSDP1 the check for inf must agree across ranks, which ``ShardedGradScaler``
    does with an all-reduce; FSDP2's DTensor gradients let ``torch.amp.GradScaler`` do the same.
    """
    if config.precision != "fp16-mixed" or not config.grad_scaler:
        return None
    if config.api == "fsdp1" and get_strategy(config.strategy).wrapper == "fsdp":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=ctx.device.type, init_scale=config.grad_scale_init)
    return torch.amp.GradScaler(ctx.device.type, init_scale=config.grad_scale_init)


def build_optimizer(params, name: str, lr: float) -> torch.optim.Optimizer:
    """The optimizer named by the run config (``adamw``, ``adam``, ``sgd``, ``sgd-momentum``)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise ValueError(f"optimizer must be one of adamw, adam, sgd, sgd-momentum; got {name!r}")


def grad_zero_fraction(model: nn.Module) -> float:
    """Fraction of this rank's gradient elements that are exactly zero (0.0–1.0).

    Embedding rows of tokens absent from the batch have zero gradients in any precision; in
    fp16 without loss scaling, gradients below ~6e-8 also round to zero (underflow), which this
    fraction makes visible.
    """
    zeros = total = 0
    for p in model.parameters():
        if p.grad is not None:
            g = local_tensor(p.grad)
            zeros += int((g == 0).sum())
            total += g.numel()
    return zeros / total if total else 0.0


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
    """Mean cross-entropy over the global batch (nats per token), after each step's forward."""
    step_time_s: list[float]
    """Wall time of each untracked step (forward, backward, optimizer), seconds."""
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
    """Steps whose optimizer step the scaler skipped (inf/NaN gradients found)."""
    grad_norm: list[float] = field(default_factory=list)
    """Per step, the total L2 norm of the global batch's gradient before clipping (only with
    ``max_grad_norm`` > 0)."""
    grad_norm_full: float | None = None
    """With clipping, on the first step: the same norm computed as one process would, from the
    whole gradient gathered to this rank (see :func:`full_grad_norm`)."""
    steps: list[int] = field(default_factory=list)
    """The optimizer step (1-based, counted from the job's start) of each entry of ``losses``."""


@dataclass(frozen=True)
class StepEnd:
    """What the per-step hook of :func:`train` is told after each optimizer step."""

    step: int
    """Optimizer steps done, counted from the job's start (1-based)."""
    loss: float
    """The global batch's mean loss of that step (nats per token)."""
    model: nn.Module
    optimizer: torch.optim.Optimizer


def _total_norm(grads: list[torch.Tensor]) -> float:
    """The L2 norm of all ``grads`` together, each tensor's summed in float64 (a DTensor's norm
    is reduced across its mesh by ``full_tensor()``)."""
    norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]
    norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip the gradients to a total L2 norm of ``max_norm``; return the norm before clipping.

    The norm is the whole model's, over every rank's shard: FSDP2's gradients are DTensors,
    whose norms are reduced across the mesh; DDP and a plain module hold whole gradients; FSDP1
    needs its own ``FullyShardedDataParallel.clip_grad_norm_``. As ``clip_grad_norm_`` does,
    gradients are scaled by ``max_norm / (norm + 1e-6)`` when that is below 1 — but each
    tensor's norm is summed in float64: ``clip_grad_norm_``'s fp32 sums drift by about 1e-4
    relative on a 2.56M-element gradient on a CPU (chapter 5), more than sharding changes.
    The same gradient then gives the same norm on one process and on N ranks.
    """
    if _is_fsdp1(model):
        return float(model.clip_grad_norm_(max_norm))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = _total_norm(grads)
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1:
        for g in grads:
            g.mul_(coefficient)
    return total


def _is_fsdp1(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    return isinstance(model, FSDP1)


def full_grad_norm(model: nn.Module) -> float:
    """The total L2 norm of the gradient as one process computes it: every gradient made
    whole first (a DTensor's ``full_tensor()``, an all-gather), then each tensor's norm summed
    in float64, as :func:`clip_grad_norm` does with the shards.

    A check on :func:`clip_grad_norm`, which combines the norms of the shards across ranks
    instead. Gathering costs a copy of every gradient; FSDP1's flat gradients are not DTensors
    and are refused.

    Raises:
        TypeError: for an FSDP1 model.
    """
    if _is_fsdp1(model):
        raise TypeError("full_grad_norm needs DTensor or whole gradients; FSDP1's are flat shards")
    return _total_norm([p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                        for p in model.parameters() if p.grad is not None])


def _gradient_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Turn the gradient reduction of the next backward on or off (gradient accumulation).

    FSDP2: ``set_requires_gradient_sync``; DDP and FSDP1: their ``no_sync()`` context; a plain
    module has nothing to sync.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if not sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    tracker: StepMemoryTracker | None = None,
    *,
    scaler: torch.amp.GradScaler | None = None,
    after_backward: Callable[[nn.Module], None] | None = None,
    step: int | None = None,
    grad_accum_steps: int = 1,
    max_grad_norm: float = 0.0,
    grad_norms: list[float] | None = None,
    full_norms: list[float] | None = None,
) -> torch.Tensor:
    """One optimizer step: forward, next-token cross-entropy, backward, optimizer step.
    Returns this rank's mean loss over ``inputs``.

    With ``grad_accum_steps`` = k > 1 the rows of ``inputs`` are cut into k equal micro-batches,
    each one's loss divided by k, and gradients are reduced across ranks only in the last
    micro-step's backward (:func:`_gradient_sync`): the optimizer sees the gradient of the
    mean over all rows, as with k = 1. With ``max_grad_norm`` > 0 the gradients are clipped to
    that total norm (after unscaling, with a scaler) and the norm before clipping is appended
    to ``grad_norms`` (and, if ``full_norms`` is given, :func:`full_grad_norm` to it, first).

    Gradients are zeroed, not freed (``set_to_none=False``), so their memory is part of the model
    state at rest, as the memory model of chapter 2 assumes. With a ``scaler`` (fp16), the
    backward pass runs on the scaled loss and the scaler unscales, checks and steps.
    ``after_backward(model)`` is called between the last backward and the optimizer step.

    Raises:
        ValueError: if ``inputs`` has a number of rows that ``grad_accum_steps`` does not divide.
        NonFiniteLoss: if this rank's loss is NaN or infinite (checked once the step's
            collectives are done, so the other ranks are not left waiting in one); ``step``
            (1-based) is named in the message.
    """
    k = grad_accum_steps
    if k < 1 or inputs.shape[0] % k:
        raise ValueError(f"grad_accum_steps={k} must be >= 1 and divide this rank's {inputs.shape[0]} "
                         "sequences")
    total = None
    # (no chunk() for one micro-step: a view made under a memory tracker makes it count the
    # batch's storage as the step's own)
    pieces = [(inputs, targets)] if k == 1 else list(zip(inputs.chunk(k), targets.chunk(k)))
    for micro, (x, y) in enumerate(pieces):
        last = micro == k - 1
        if tracker is not None and micro == 0 and k > 1:
            tracker.mark_start()
        if tracker is not None and micro > 0:
            tracker.next_micro_step()
        with _gradient_sync(model, last):
            logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            if k > 1:
                loss = loss / k
            del logits  # only what autograd saved stays alive
            if tracker is not None:
                tracker.after_forward()
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if k == 1:
            total = loss.detach()
        else:  # a Python float between micro-steps: no tensor of the loop's own stays alive
            total = (total or 0.0) + loss.item()
        del loss
        if tracker is not None and micro == 0 and k > 1:
            tracker.mark_between_micro_steps()
    if after_backward is not None:
        after_backward(model)
    if max_grad_norm > 0:
        if scaler is not None:
            scaler.unscale_(optimizer)
        if full_norms is not None:
            full_norms.append(full_grad_norm(model))
        norm = clip_grad_norm(model, max_grad_norm)
        if grad_norms is not None:
            grad_norms.append(norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    if k > 1:
        total = torch.tensor(total, device=inputs.device)
    check_loss_finite(total.item(), step)
    return total


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: RunConfig,
    ctx: RankContext,
    *,
    start_step: int = 0,
    on_step: Callable[[StepEnd], None] | None = None,
    progress: bool = True,
    track_memory: bool = False,
    count_collectives: bool = False,
    scaler: torch.amp.GradScaler | None = None,
) -> TrainLog:
    """Run optimizer steps ``start_step + 1`` … ``config.steps`` on this rank's share of each
    global batch (the batch of step s is ``make_batch(config, s - 1)``: a resumed job continues
    with the very data where it stopped).

    Every rank gets an equal slice of the same global batch, so the gradient FSDP averages over
    ranks is the gradient of the global batch's mean loss: the same as one process training on
    the whole batch. ``config.grad_accum_steps`` and ``config.max_grad_norm`` are applied by
    :func:`train_step`. After each step, ``on_step`` (if given) is called on every rank with a
    :class:`StepEnd` (a checkpoint save, a log line). A tqdm progress bar is drawn on rank 0
    (stderr) when ``progress`` is set. With ``track_memory`` or ``count_collectives`` (and at
    least 2 steps, so that the optimizer state exists) the last step runs under a
    :class:`StepMemoryTracker` and/or a :class:`CollectiveCounter`; its time is not in
    ``step_time_s``. ``scaler`` is a gradient scaler for fp16 (see :func:`build_grad_scaler`).

    Raises:
        NonFiniteLoss: as soon as a rank's loss is NaN or infinite, naming the step and the rank
            (the launcher then reports that rank as the cause of the failed run).
    """
    losses: list[float] = []
    times: list[float] = []
    zeros: list[float] = []
    scales: list[float] = []
    skipped: list[int] = []
    norms: list[float] = []
    full: list[float] = []
    done: list[int] = []
    inspect_s = [0.0]  # time spent counting zero gradients, kept out of step_time_s

    def inspect(module: nn.Module) -> None:
        begin = time.perf_counter()
        zeros.append(grad_zero_fraction(module))
        inspect_s[0] = time.perf_counter() - begin

    memory = collectives = None
    model.train()
    bar = tqdm(total=config.steps - start_step, desc="train", unit="step", file=_ProgressLines(),
               disable=not (progress and ctx.is_main), mininterval=0, dynamic_ncols=False, ncols=80)
    step_args = {"scaler": scaler, "grad_accum_steps": config.grad_accum_steps,
                 "max_grad_norm": config.max_grad_norm, "grad_norms": norms}
    for step in range(start_step, config.steps):
        inputs, targets = local_batch(config, step, ctx)
        tracked = (track_memory or count_collectives) and config.steps >= 2 and step == config.steps - 1
        if scaler is not None:
            scales.append(float(scaler.get_scale()))
        start = time.perf_counter()
        if tracked:
            tracker = StepMemoryTracker(model, optimizer, ctx.device) if track_memory else None
            counter = CollectiveCounter() if count_collectives else None
            with contextlib.ExitStack() as stack:
                for mode in (tracker, counter):
                    if mode is not None:
                        stack.enter_context(mode)
                loss = train_step(model, optimizer, inputs, targets, tracker, step=step + 1, **step_args)
            memory = tracker.result if tracker else None
            collectives = counter.calls if counter else None
        else:
            check_norm = step == start_step and config.max_grad_norm > 0 and not _is_fsdp1(model)
            loss = train_step(model, optimizer, inputs, targets, after_backward=inspect, step=step + 1,
                              full_norms=full if check_norm else None, **step_args)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        if not tracked:
            times.append(time.perf_counter() - start - inspect_s[0])
        if scaler is not None and scaler.get_scale() < scales[-1]:
            skipped.append(step)  # the scale only drops when inf/NaN gradients were found
        if dist.is_initialized():
            dist.all_reduce(loss)  # SUM (gloo has no AVG), then divide
            loss /= ctx.world_size
        losses.append(loss.item())
        done.append(step + 1)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
        bar.update()
        if on_step is not None:
            on_step(StepEnd(step + 1, losses[-1], model, optimizer))
    bar.close()
    return TrainLog(losses=losses, step_time_s=times, memory=memory, collectives=collectives,
                    grad_zero_fraction=zeros, grad_scale=scales, skipped_steps=skipped,
                    grad_norm=norms, grad_norm_full=full[0] if full else None, steps=done)


def train_one_process(config: RunConfig) -> TrainLog:
    """The reference every distributed run must reproduce: ``config``'s model, built from its
    seed, trained in this process on the whole global batch (no process group, on the CPU).

    Losses agree with an fp32 run on any number of ranks and nodes within rounding (the
    chapters and tests use 1e-5, relative); mixed precision rounds differently by design.
    """
    from handbook_lib.model import build_model

    model = build_model(config.model_config(), seed=config.seed)
    one = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none")
    optimizer = build_optimizer(model.parameters(), config.optimizer, config.lr)
    return train(model, optimizer, config, one, progress=False)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch's CPU kernels on one thread inside the block, then restore the count.

    The book's single-process demonstrations train tiny models: one thread is as fast, is not
    slowed by other jobs competing for the cores, and gives the same sums on machines with any
    number of cores (a thread count changes how a reduction is split, and so its rounding).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
