"""Train the model on one rank: the optimizer and the one training loop of every run.

The model comes from :func:`handbook_lib.runtime.build.parallelize` (built once, wrapped once),
the data from :mod:`handbook_lib.runtime.data`. Chapter 1 introduces the loop; chapter 5 adds its
levers: fp16 with a gradient scaler, gradient accumulation (micro-steps without gradient sync)
and gradient clipping over sharded gradients; chapter 6 saves checkpoints from its per-step hook.
The single-process lessons (:mod:`handbook_lib.lessons`) train through it too, with their own
batches, forward pass and loss (:func:`train`'s hooks), so their step numbers are the runs'.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from tqdm import tqdm

from handbook_lib.core.config import RunConfig
from handbook_lib.runtime.collectives import CollectiveCounter
from handbook_lib.runtime.data import BatchSource, local_batch, make_batch
from handbook_lib.runtime.distributed import RankContext, resolve_device
from handbook_lib.runtime.grads import (
    clip_grad_norm,
    full_grad_norm,
    is_fsdp1,
)
from handbook_lib.runtime.measure import StepMemoryTracker
from handbook_lib.runtime.model import build_model
from handbook_lib.runtime.optimization import build_lr_scheduler, build_optimizer
from handbook_lib.runtime.train_log import (
    NonFiniteLoss,
    StepEnd,
    TrainLog,
    _ProgressLines,
    _Recorder,
    check_loss_finite,
)

__all__ = [
    "ForwardFn",
    "LossFn",
    "LossContext",
    "StepFn",
    "next_token_loss",
    "TrainLog",
    "StepEnd",
    "train_step",
    "train",
    "train_one_process",
    "one_thread",
    "NonFiniteLoss",
    "check_loss_finite",
]


ForwardFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]
"""``(model, inputs) -> logits``: the forward pass of one micro-batch (token ids (batch, seq) to
logits (batch, seq, vocab)). The default is ``model(inputs)``; chapter 5's loss-scaling lesson
passes an fp16 forward from fp32 parameters."""

LossFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``(logits, targets) -> (loss to backpropagate, loss to report)`` of one micro-batch, both
scalar tensors; the reported one in nats per token. With gradient accumulation over k
micro-batches the loop divides both by k, so the function returns a micro-batch's loss as if it
were the whole step's. :func:`next_token_loss` is the default."""

StepFn = Callable[..., torch.Tensor]
"""``step_fn(model, optimizer, inputs, targets, tracker, **train_step's keywords) -> loss``: one
optimizer step, :func:`train_step`'s signature (a step may ignore the keywords it has no use for)."""

LossContext = Callable[[], contextlib.AbstractContextManager]
"""``loss_context()``: a context the loss and its backward run inside, for a loss that needs one:
tensor parallelism's ``loss_parallel`` (cross-entropy on logits split by vocabulary, whose
reductions are functional collectives)."""


def next_token_loss(
    logits: torch.Tensor, targets: torch.Tensor, chunks: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The default :data:`LossFn`: the mean next-token cross-entropy (nats per
    token), computed in fp32 whatever the logits' dtype, backpropagated and
    reported alike (one tensor, twice).

    ``chunks`` k > 1 (the ``loss_chunks`` key) cuts the sequence into k equal
    chunks and sums each chunk's cross-entropy, upcast and reduced by itself,
    before dividing by the tokens: the same loss, whose backward holds one
    chunk's fp32 gradients at a time."""
    if chunks == 1:
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return loss, loss
    pieces = zip(logits.chunk(chunks, dim=1), targets.chunk(chunks, dim=1))
    total = sum(
        F.cross_entropy(part.float().flatten(0, 1), aim.flatten(), reduction="sum")
        for part, aim in pieces
    )
    loss = total / targets.numel()
    return loss, loss


def _gradient_sync(model: nn.Module, sync: bool, reshard: bool = True) -> contextlib.AbstractContextManager:
    """Turn the next backward's gradient reduction on or off, and (FSDP2) its reshard after
    backward: ``set_requires_gradient_sync``, ``set_reshard_after_backward``; DDP and FSDP1:
    ``no_sync()``; a plain module has nothing to sync."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
        model.set_reshard_after_backward(reshard)
        return contextlib.nullcontext()
    if not sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def _forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, k: int, last: bool,
                      scaler: torch.amp.GradScaler | None, forward: ForwardFn | None, loss_fn: LossFn,
                      tracker: StepMemoryTracker | None, sync_every: bool = False,
                      reshard_after_backward: bool = True, loss_context: LossContext | None = None,
                      settle: bool = False) -> torch.Tensor:
    """One micro-step of :func:`train_step`: forward, loss (divided by ``k``), backward, gradients
    reduced if ``last`` or ``sync_every``, units resharded (FSDP2) if ``last`` or
    ``reshard_after_backward``; the loss and its backward inside ``loss_context()`` if given;
    ``settle``: the tracker reads the activations as the smallest over ~30 ms (gloo's worker
    thread may still hold a finished transfer's buffer). Returns the reported loss, detached."""
    with _gradient_sync(model, last or sync_every, last or reshard_after_backward), \
            (loss_context() if loss_context is not None else contextlib.nullcontext()):
        logits = model(x) if forward is None else forward(model, x)
        loss, reported = loss_fn(logits, y)
        if k > 1:  # each micro-batch's share of the step's mean
            same = reported is loss
            loss = loss / k
            reported = loss if same else reported / k
        del logits  # only what autograd saved stays alive
        if tracker is not None:
            tracker.after_forward(settle=settle)
        (scaler.scale(loss) if scaler is not None else loss).backward()
    return reported.detach()


def _optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler | None, max_grad_norm: float,
                    grad_norms: list[float] | None, full_norms: list[float] | None,
                    set_to_none: bool = False) -> None:
    """The end of :func:`train_step`: clip (after unscaling), step through the scaler if any,
    zero the gradients (free them with ``set_to_none``)."""
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
    optimizer.zero_grad(set_to_none=set_to_none)


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
    forward: ForwardFn | None = None,
    loss_fn: LossFn = next_token_loss,
    sync_every_micro_step: bool = False,
    reshard_after_backward: bool = True,
    unshard_first: bool = False,
    loss_context: LossContext | None = None,
    settle: bool = False,
    set_to_none: bool = False,
) -> torch.Tensor:
    """One optimizer step: forward, loss, backward, optimizer step. Returns this rank's reported
    loss over ``inputs`` (by default the mean next-token cross-entropy, nats per token).

    ``forward(model, x)`` computes the logits (default ``model(x)``); ``loss_fn(logits, y)``
    returns the loss to backpropagate and the loss to report (see :data:`LossFn`; default
    :func:`next_token_loss`). With ``grad_accum_steps`` = k > 1 the rows of ``inputs`` are cut
    into k equal micro-batches, each one's losses divided by k, and gradients are reduced across
    ranks only in the last micro-step's backward (:func:`_gradient_sync`): the optimizer sees the
    gradient of the mean over all rows, as with k = 1. With ``max_grad_norm`` > 0 the gradients
    are clipped to that total norm (after unscaling, with a scaler) and the norm before clipping
    is appended to ``grad_norms`` (and, if ``full_norms`` is given, :func:`full_grad_norm` to it,
    first).

    Gradients are zeroed, not freed, so their memory is part of the model state at rest, as the
    memory model of chapter 2 assumes by default (a zeroed gradient plus the next one is that
    gradient exactly, so the numbers are those of freed gradients); ``set_to_none`` frees them
    instead, as PyTorch's ``zero_grad()`` does by default (the ``set_to_none`` key). With a ``scaler``
    (fp16), the backward pass runs on the scaled loss and the scaler unscales, checks and steps.
    ``after_backward(model)`` is called between the last backward and the optimizer step.
    ``sync_every_micro_step`` reduces in every micro-step; ``reshard_after_backward=False``
    (FSDP2) keeps units gathered between micro-steps; ``unshard_first``: root ``unshard()`` first;
    ``loss_context`` (:data:`LossContext`) wraps each micro-step's loss and backward; ``settle``:
    see :func:`_forward_backward`.

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
    total: torch.Tensor | float = 0.0
    # (no chunk() for one micro-step: a view made under a memory tracker makes it count the
    # batch's storage as the step's own)
    pieces = [(inputs, targets)] if k == 1 else list(zip(inputs.chunk(k), targets.chunk(k)))
    for micro, (x, y) in enumerate(pieces):
        if tracker is not None and micro == 0 and k > 1:
            tracker.mark_start()
        if tracker is not None and micro > 0:
            tracker.next_micro_step()
        if unshard_first and micro == 0 and hasattr(model, "unshard"):
            model.unshard()
        loss = _forward_backward(model, x, y, k=k, last=micro == k - 1, scaler=scaler, forward=forward,
                                 loss_fn=loss_fn, tracker=tracker, sync_every=sync_every_micro_step,
                                 reshard_after_backward=reshard_after_backward, loss_context=loss_context,
                                 settle=settle)
        # a Python float between micro-steps: no tensor of the loop's own stays alive
        total = loss if k == 1 else total + loss.item()
        del loss
        if tracker is not None and micro == 0 and k > 1:
            tracker.mark_between_micro_steps()
    if after_backward is not None:
        after_backward(model)
    _optimizer_step(model, optimizer, scaler, max_grad_norm, grad_norms, full_norms, set_to_none)
    if k > 1:
        total = torch.tensor(total, device=inputs.device)
    check_loss_finite(float(total), step)
    return total


def _tracked_step(record: _Recorder, model: nn.Module, optimizer: torch.optim.Optimizer,
                  batch: tuple[torch.Tensor, torch.Tensor], device: torch.device, track_memory: bool,
                  count_collectives: bool, functional: bool = False, step_fn: StepFn | None = None,
                  **step_args: Any) -> torch.Tensor:
    """:func:`train_step` under a :class:`StepMemoryTracker` and/or a :class:`CollectiveCounter`,
    whose findings go to ``record``."""
    tracker = StepMemoryTracker(model, optimizer, device) if track_memory else None
    counter = CollectiveCounter(functional=functional) if count_collectives else None
    with contextlib.ExitStack() as stack:
        for mode in (tracker, counter):
            if mode is not None:
                stack.enter_context(mode)
        loss = (step_fn or train_step)(model, optimizer, *batch, tracker, **step_args)
    record.memory = tracker.result if tracker else None
    record.collectives = counter.calls if counter else None
    return loss


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
    batches: BatchSource = make_batch,
    forward: ForwardFn | None = None,
    loss_fn: LossFn = next_token_loss,
    after_backward: Callable[[nn.Module, int], None] | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    loss_context: LossContext | None = None,
    functional_collectives: bool = False,
    step_fn: StepFn | None = None,
) -> TrainLog:
    """Run optimizer steps ``start_step + 1`` … ``config.steps`` on this rank's share of each
    global batch (the batch of step s is ``batches(config, s - 1)``, :func:`make_batch` by
    default: a resumed job continues with the very data where it stopped).

    Every rank gets an equal slice of the same global batch, so the gradient FSDP averages over
    ranks is the gradient of the global batch's mean loss: the same as one process training on
    the whole batch. ``config.grad_accum_steps`` and ``config.max_grad_norm`` are applied by
    :func:`train_step`, as are ``forward`` (:data:`ForwardFn`, default ``model(inputs)``) and
    ``loss_fn`` (:data:`LossFn`, default :func:`next_token_loss`); the logged loss is the reported
    one, averaged over ranks. ``after_backward(model, step)`` (if given) is called on every step,
    ``step`` 1-based, between the last backward and the optimizer step (gradients still scaled,
    with a scaler); its time is kept out of ``step_time_s``. After each step, ``on_step`` (if
    given) is called on every rank with a :class:`StepEnd` (a checkpoint save, a log line). A
    tqdm progress bar is drawn on rank 0 (stderr) when ``progress`` is set. With
    ``track_memory`` or ``count_collectives`` (and at least 2 steps, so that the optimizer state
    exists) the last step runs under a :class:`StepMemoryTracker` and/or a
    :class:`CollectiveCounter`; its time is not in ``step_time_s`` and its zeros are not
    counted. ``scaler`` is a gradient scaler for fp16 (see :func:`build_grad_scaler`).
    ``scheduler`` is stepped after every optimizer step; without one, the loop builds
    ``config``'s (:func:`build_lr_scheduler`; none for a constant rate). A caller that saves
    the scheduler's state passes its own, restored where a resumed job needs it.
    ``loss_context`` (:data:`LossContext`) wraps every loss and its backward.
    ``functional_collectives``: the counter records functional collectives too (DTensor's:
    tensor parallelism's, and the gradient norm's partial sums over a mesh). With either, the
    tracker reads the activations as the smallest over ~30 ms (:func:`_forward_backward`).
    ``step_fn`` (:data:`StepFn`) takes :func:`train_step`'s place: a pipeline's schedule runs
    the micro-batches' forwards and backwards in its own order
    (:func:`~handbook_lib.runtime.pipeline.pipeline_step`).

    Raises:
        NonFiniteLoss: as soon as a rank's loss is NaN or infinite, naming the step and the rank
            (the launcher then reports that rank as the cause of the failed run).
    """
    record = _Recorder()
    if loss_fn is next_token_loss and config.loss_chunks > 1:
        loss_fn = functools.partial(next_token_loss, chunks=config.loss_chunks)
    if scheduler is None:
        scheduler = build_lr_scheduler(optimizer, config)
    model.train()
    bar = tqdm(total=config.steps - start_step, desc="train", unit="step", file=_ProgressLines(),
               disable=not (progress and ctx.is_main), mininterval=0, dynamic_ncols=False, ncols=80)
    step_args: dict[str, Any] = {"scaler": scaler, "grad_accum_steps": config.grad_accum_steps, "forward": forward,
                 "loss_fn": loss_fn, "max_grad_norm": config.max_grad_norm, "grad_norms": record.norms,
                 "sync_every_micro_step": config.sync_every_micro_step, "unshard_first": config.explicit_prefetch > 0,
                 "reshard_after_backward": config.reshard_after_backward, "loss_context": loss_context,
                 "settle": loss_context is not None or functional_collectives, "set_to_none": config.set_to_none}
    for step in range(start_step, config.steps):
        batch = local_batch(config, step, ctx, batches)
        tracked = (track_memory or count_collectives) and config.steps >= 2 and step == config.steps - 1
        if scaler is not None:
            record.scales.append(float(scaler.get_scale()))
        if hasattr(optimizer, "param_groups"):  # (DeepSpeed's engine steps an optimizer of its own)
            record.lrs.append(float(optimizer.param_groups[0]["lr"]))
        hook = record.after_backward(after_backward, step + 1, count_zeros=not tracked, device=ctx.device)
        start = time.perf_counter()
        if tracked:
            loss = _tracked_step(record, model, optimizer, batch, ctx.device, track_memory,
                                 count_collectives, functional_collectives, step_fn, after_backward=hook,
                                 step=step + 1,
                                 **step_args)
        else:
            check_norm = step == start_step and config.max_grad_norm > 0 and not is_fsdp1(model)
            loss = (step_fn or train_step)(model, optimizer, *batch, after_backward=hook, step=step + 1,
                              full_norms=record.full if check_norm else None, **step_args)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        if not tracked:
            record.times.append(time.perf_counter() - start - record.hook_s)
        if scaler is not None and scaler.get_scale() < record.scales[-1]:
            record.skipped.append(step + 1)  # the scale only drops when inf/NaN gradients were found
        if scheduler is not None:
            scheduler.step()
        if ctx.world_size > 1 and dist.is_initialized():  # train_one_process may run inside a rank
            dist.all_reduce(loss)  # SUM (gloo has no AVG), then divide
            loss /= ctx.world_size
        record.losses.append(loss.item())
        record.steps.append(step + 1)
        bar.set_postfix(loss=f"{record.losses[-1]:.4f}", refresh=False)
        bar.update()
        if on_step is not None:
            on_step(StepEnd(step + 1, record.losses[-1], model, optimizer))
    bar.close()
    return record.log()


def train_one_process(config: RunConfig, device: str | torch.device = "cpu") -> TrainLog:
    """The reference every distributed run must reproduce: ``config``'s model, built from its
    seed, trained in this process on the whole global batch (through no process group: also
    inside a rank of a job, as chapter 9's runs compute it on rank 0).

    Args:
        config: The run's configuration (its model, seed, batch, steps and optimizer).
        device: Where this process trains: ``"cpu"`` (the default) or a CUDA device
            (``"cuda"``, ``"cuda:1"``). Compare a job with a reference on the job's own kind of
            device: the weights are the same everywhere (built on the CPU from the seed, then
            moved), but cuBLAS and MKL, CUDA's and the CPU's attention kernels, round differently.

    Losses agree with an fp32 run on any number of ranks and nodes on the same kind of device
    within rounding (the chapters and tests use 1e-5, relative); mixed precision rounds
    differently by design.

    Raises:
        ValueError: if ``device`` is neither the CPU nor a visible CUDA device.
    """
    where = resolve_device(device)
    model = build_model(config.model_config(), seed=config.seed).to(where)
    one = RankContext(rank=0, world_size=1, local_rank=0, device=where, backend="none")
    optimizer = build_optimizer(model.parameters(), config.optimizer, config.lr, config.optimizer_impl)
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
