"""Build, shard and train the model on one rank: the runtime behind every training run.

Chapter 1 introduces it (FSDP2 with ``fully_shard``, per layer then the root); chapter 5 adds the
other strategies and levers: the plain one-process baseline (``NONE``), DDP, FSDP1's
``FullyShardedDataParallel``, the wrapping policies, fp16 with a gradient scaler.

Data are synthetic and made in code, the same on every machine: each sequence follows
``next = (3 * token + 1) mod vocab_size`` from a random start, so the loss has something to learn
and falls within a few steps.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
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
from handbook_lib.model import SimpleTransformer, TransformerLayer, build_model
from handbook_lib.sharding import wrap_units

__all__ = [
    "FSDP2_STRATEGIES",
    "TrainLog",
    "make_batch",
    "local_slice",
    "local_batch",
    "build_mesh",
    "build_mp_policy",
    "build_optimizer",
    "apply_activation_checkpointing",
    "apply_fsdp2",
    "build_fsdp2_model",
    "build_fsdp1_model",
    "build_ddp_model",
    "build_plain_model",
    "build_training_model",
    "build_grad_scaler",
    "grad_zero_fraction",
    "train_step",
    "train",
    "shard_group",
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


FSDP2_STRATEGIES: dict[str, bool] = {
    "FULL_SHARD": True,
    "SHARD_GRAD_OP": False,
    "HYBRID_SHARD": True,
    "HYBRID_SHARD_ZERO2": False,
}
"""FSDP1 strategy name → FSDP2's ``reshard_after_forward``. The HYBRID strategies also use a
2-D (replicate, shard) mesh (see :func:`build_mesh`)."""


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


def shard_group(config: RunConfig, world_size: int) -> int:
    """Ranks that shard one copy of the model: ``shard_group_size`` for HYBRID strategies (0
    means all ranks of a node, torchrun's ``LOCAL_WORLD_SIZE``), 1 for DDP and NO_SHARD (no
    sharding), else the whole world.

    Raises:
        ValueError: if the group does not divide the world size.
    """
    if config.strategy in ("DDP", "NO_SHARD"):
        return 1
    if not config.strategy.startswith("HYBRID"):
        return world_size
    group = config.shard_group_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if group < 1 or world_size % group:
        raise ValueError(
            f"shard_group_size={group} must be >= 1 and divide the number of ranks {world_size}"
        )
    return group


def build_mesh(config: RunConfig, ctx: RankContext) -> DeviceMesh:
    """The device mesh FSDP shards over: 1-D over all ranks, or 2-D (replicate, shard) for HSDP."""
    if not config.strategy.startswith("HYBRID"):
        return init_device_mesh(ctx.device.type, (ctx.world_size,))
    group = shard_group(config, ctx.world_size)
    return init_device_mesh(ctx.device.type, (ctx.world_size // group, group),
                            mesh_dim_names=("replicate", "shard"))


_COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def build_mp_policy(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP2 mixed-precision policy for a ``precision`` value (``None`` for fp32).

    ``bf16-mixed`` / ``fp16-mixed`` compute in bf16 / fp16 (parameters are all-gathered in that
    dtype) and reduce gradients in fp32; the sharded parameters and the optimizer stay fp32.
    fp16 also needs a gradient scaler (:func:`build_grad_scaler`).
    """
    if precision == "fp32":
        return None
    if precision in _COMPUTE_DTYPES:
        return MixedPrecisionPolicy(param_dtype=_COMPUTE_DTYPES[precision], reduce_dtype=torch.float32)
    raise ValueError(f"precision must be fp32, bf16-mixed or fp16-mixed; got {precision!r}")


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
    if config.api == "fsdp1" and config.strategy not in ("NONE", "DDP"):
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


def apply_activation_checkpointing(model: SimpleTransformer) -> None:
    """Wrap each :class:`TransformerLayer` so its activations are recomputed in backward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer)


def apply_fsdp2(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    units: list[nn.Module] | None = None,
) -> None:
    """Shard ``model`` in place: ``fully_shard`` each unit's module, then the root.

    By default every transformer layer becomes one FSDP unit (all-gathered just before it
    runs, freed after) and the root unit holds what is left, the embedding and the output head.
    ``units`` names other modules instead (children before parents, as
    :func:`handbook_lib.sharding.wrap_units` lists them in forward order): ``[]`` leaves one
    unit, the root, holding every parameter.
    """
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    if units is None:
        units = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    # fully_shard a child before its parent: the parent's unit then skips the child's parameters
    depth = {id(m): name.count(".") for name, m in model.named_modules() if name}
    for module in sorted(units, key=lambda m: -depth[id(m)]):
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)


def _unit_modules(model: SimpleTransformer, config: RunConfig) -> list[nn.Module]:
    """The modules the run's wrapping policy makes units of (root excluded), found by name
    before any activation-checkpointing wrapper changes the paths."""
    names = [u.name for u in wrap_units(config.model_config(), config.wrap, config.wrap_min_params)
             if not u.root]
    return [model.get_submodule(name) for name in names]


def build_fsdp2_model(config: RunConfig, ctx: RankContext) -> nn.Module:
    """Build the model with the run's seed on the CPU, then shard it with FSDP2 on ``ctx.device``.

    Raises:
        ValueError: for a strategy or precision this FSDP2 path does not implement.
    """
    if config.strategy not in FSDP2_STRATEGIES:
        raise ValueError(
            f"strategy {config.strategy!r} is not available with api='fsdp2'; "
            f"accepted: {', '.join(FSDP2_STRATEGIES)}"
        )
    model = build_model(config.model_config(), seed=config.seed)
    units = _unit_modules(model, config)
    if config.activation_checkpointing:
        apply_activation_checkpointing(model)
    # The output head returns a view (nn.Linear on a 3-D input); FSDP2 warns that an in-place op
    # on it would skip a hook. Nothing here modifies the logits in place, so silence that warning.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    offload = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if config.cpu_offload else None
    if offload is None:
        model.to(ctx.device)
    apply_fsdp2(
        model,
        build_mesh(config, ctx),
        reshard_after_forward=FSDP2_STRATEGIES[config.strategy],
        mp_policy=build_mp_policy(config.precision),
        offload_policy=offload,
        units=units,
    )
    return model


FSDP1_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
"""Strategies of FSDP1's ``ShardingStrategy`` (HYBRID_SHARD_ZERO2 is its ``_HYBRID_SHARD_ZERO2``)."""


def build_fsdp1_model(config: RunConfig, ctx: RankContext) -> nn.Module:
    """The seeded model wrapped with FSDP1's ``FullyShardedDataParallel`` on ``ctx.device``.

    This is the seed's ``wrap_model_with_fsdp``, made device-aware: ``device_id`` is the rank's
    device (FSDP1 refuses a CPU model without ``device_id=torch.device("cpu")``), the HYBRID
    strategies get an explicit 2-D mesh (without one FSDP1 silently shards within groups of one
    rank and never syncs gradients across them), and the wrapping policy follows ``wrap``:
    ``transformer_auto_wrap_policy`` on :class:`TransformerLayer`, none (one unit), or
    ``size_based_auto_wrap_policy``. Parameters are flattened per unit (``use_orig_params=False``).
    """
    import functools

    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    if config.strategy not in FSDP1_STRATEGIES:
        raise ValueError(f"strategy {config.strategy!r} is not available with api='fsdp1'; "
                         f"accepted: {', '.join(FSDP1_STRATEGIES)}")
    policy = {
        "layer": functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer}),
        "model": None,
        "size": functools.partial(size_based_auto_wrap_policy, min_num_params=config.wrap_min_params),
    }[config.wrap]
    strategy = ShardingStrategy["_HYBRID_SHARD_ZERO2" if config.strategy == "HYBRID_SHARD_ZERO2"
                                else config.strategy]
    mixed = None
    if config.precision in _COMPUTE_DTYPES:
        dtype = _COMPUTE_DTYPES[config.precision]
        mixed = MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype)
    if config.cpu_offload and ctx.device.type == "cpu":
        raise ValueError("FSDP1's CPUOffload pins host memory, which needs an accelerator: on a "
                         "CPU-only machine use api='fsdp2' (CPUOffloadPolicy(pin_memory=False))")
    model = build_model(config.model_config(), seed=config.seed)
    if config.activation_checkpointing:
        apply_activation_checkpointing(model)
    warnings.filterwarnings("ignore", message=r".*NO_SHARD.* is deprecated")  # said in chapter 5
    return FSDP(
        model,
        sharding_strategy=strategy,
        auto_wrap_policy=policy,
        mixed_precision=mixed,
        cpu_offload=CPUOffload(offload_params=True) if config.cpu_offload else None,
        device_id=ctx.device,
        device_mesh=build_mesh(config, ctx) if config.strategy.startswith("HYBRID") else None,
        use_orig_params=False,
    )


def build_plain_model(config: RunConfig, ctx: RankContext) -> nn.Module:
    """The seeded model on ``ctx.device``, unwrapped: strategy ``NONE``, one process."""
    model = build_model(config.model_config(), seed=config.seed).to(ctx.device)
    if config.activation_checkpointing:
        apply_activation_checkpointing(model)
    return model


def build_training_model(config: RunConfig, ctx: RankContext) -> nn.Module:
    """The model the run config asks for: plain (``NONE``), DDP, FSDP2 or FSDP1.

    Raises:
        ValueError: for a combination no builder implements (e.g. ``NONE`` on several ranks).
    """
    if config.strategy == "NONE":
        if ctx.world_size != 1:
            raise ValueError(f"strategy 'NONE' is one plain process; got {ctx.world_size} ranks")
        return build_plain_model(config, ctx)
    if config.strategy == "DDP":
        return build_ddp_model(config, ctx)
    if config.api == "fsdp1":
        return build_fsdp1_model(config, ctx)
    return build_fsdp2_model(config, ctx)


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


def build_ddp_model(config: RunConfig, ctx: RankContext) -> nn.Module:
    """The seeded model, replicated with ``DistributedDataParallel`` (the chapter-3 baseline).

    DDP all-reduces the gradients in buckets during backward; every rank keeps the full
    parameters, gradients and optimizer states.
    """
    from torch.nn.parallel import DistributedDataParallel

    model = build_model(config.model_config(), seed=config.seed).to(ctx.device)
    if config.activation_checkpointing:
        apply_activation_checkpointing(model)
    return DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)


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
) -> torch.Tensor:
    """One step: forward, next-token cross-entropy, backward, optimizer step. Returns the loss.

    Gradients are zeroed, not freed (``set_to_none=False``), so their memory is part of the model
    state at rest, as the memory model of chapter 2 assumes. With a ``scaler`` (fp16), the
    backward pass runs on the scaled loss and the scaler unscales, checks and steps.
    ``after_backward(model)`` is called between backward and the optimizer step.

    Raises:
        NonFiniteLoss: if this rank's loss is NaN or infinite (checked once the step's
            collectives are done, so the other ranks are not left waiting in one); ``step``
            (1-based) is named in the message.
    """
    logits = model(inputs)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    del logits  # only what autograd saved stays alive
    if tracker is not None:
        tracker.after_forward()
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if after_backward is not None:
        after_backward(model)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    loss = loss.detach()
    check_loss_finite(loss.item(), step)
    return loss


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: RunConfig,
    ctx: RankContext,
    *,
    progress: bool = True,
    track_memory: bool = False,
    count_collectives: bool = False,
    scaler: torch.amp.GradScaler | None = None,
) -> TrainLog:
    """Run ``config.steps`` optimizer steps on this rank's share of each global batch.

    Every rank gets an equal slice of the same global batch, so the gradient FSDP averages over
    ranks is the gradient of the global batch's mean loss: the same as one process training on
    the whole batch. A tqdm progress bar is drawn on rank 0 (stderr) when ``progress`` is set.
    With ``track_memory`` or ``count_collectives`` (and at least 2 steps, so that the optimizer
    state exists) the last step runs under a :class:`StepMemoryTracker` and/or a
    :class:`CollectiveCounter`; its time is not in ``step_time_s``. ``scaler`` is a gradient
    scaler for fp16 (see :func:`build_grad_scaler`).

    Raises:
        NonFiniteLoss: as soon as a rank's loss is NaN or infinite, naming the step and the rank
            (the launcher then reports that rank as the cause of the failed run).
    """
    losses: list[float] = []
    times: list[float] = []
    zeros: list[float] = []
    scales: list[float] = []
    skipped: list[int] = []
    inspect_s = [0.0]  # time spent counting zero gradients, kept out of step_time_s

    def inspect(module: nn.Module) -> None:
        begin = time.perf_counter()
        zeros.append(grad_zero_fraction(module))
        inspect_s[0] = time.perf_counter() - begin

    memory = collectives = None
    model.train()
    bar = tqdm(total=config.steps, desc="train", unit="step", file=_ProgressLines(),
               disable=not (progress and ctx.is_main), mininterval=0, dynamic_ncols=False, ncols=80)
    for step in range(config.steps):
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
                loss = train_step(model, optimizer, inputs, targets, tracker, scaler=scaler, step=step + 1)
            memory = tracker.result if tracker else None
            collectives = counter.calls if counter else None
        else:
            loss = train_step(model, optimizer, inputs, targets, scaler=scaler, after_backward=inspect,
                              step=step + 1)
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
        bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
        bar.update()
    bar.close()
    return TrainLog(losses=losses, step_time_s=times, memory=memory, collectives=collectives,
                    grad_zero_fraction=zeros, grad_scale=scales, skipped_steps=skipped)
