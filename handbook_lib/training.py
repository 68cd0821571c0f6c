"""Build, shard and train the model on one rank: the runtime behind every training run.

Chapter 1 introduces it (FSDP2 with ``fully_shard``, per layer then the root); chapter 5 adds the
other strategies. Data are synthetic and made in code, the same on every machine: each sequence
follows ``next = (3 * token + 1) mod vocab_size`` from a random start, so the loss has something
to learn and falls within a few steps.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn import functional as F
from tqdm import tqdm

from handbook_lib.config import RunConfig
from handbook_lib.distributed import RankContext
from handbook_lib.measure import CollectiveCall, CollectiveCounter, StepMemory, StepMemoryTracker
from handbook_lib.model import SimpleTransformer, TransformerLayer, build_model

__all__ = [
    "FSDP2_STRATEGIES",
    "TrainLog",
    "make_batch",
    "local_slice",
    "build_mesh",
    "build_mp_policy",
    "build_optimizer",
    "apply_activation_checkpointing",
    "apply_fsdp2",
    "build_fsdp2_model",
    "build_ddp_model",
    "train_step",
    "train",
    "shard_group",
]

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


def build_mp_policy(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP2 mixed-precision policy for a ``precision`` value (``None`` for fp32).

    ``bf16-mixed`` computes in bf16 (all-gathered parameters in bf16) and reduces gradients in
    fp32; the sharded parameters and the optimizer stay fp32.
    """
    if precision == "fp32":
        return None
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raise ValueError(
        f"precision {precision!r} is not supported here; accepted: fp32, bf16-mixed "
        "(fp16-mixed needs a gradient scaler, see chapter 5)"
    )


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
) -> None:
    """Shard ``model`` in place: ``fully_shard`` each transformer layer, then the root.

    Each layer becomes one FSDP unit (all-gathered just before it runs, freed after); the root
    unit holds what is left, the embedding and the output head.
    """
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    for module in model.modules():
        if isinstance(module, TransformerLayer):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)


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
    )
    return model


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


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    tracker: StepMemoryTracker | None = None,
) -> torch.Tensor:
    """One step: forward, next-token cross-entropy, backward, optimizer step. Returns the loss.

    Gradients are zeroed, not freed (``set_to_none=False``), so their memory is part of the model
    state at rest, as the memory model of chapter 2 assumes.
    """
    logits = model(inputs)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    del logits  # only what autograd saved stays alive
    if tracker is not None:
        tracker.after_forward()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return loss.detach()


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: RunConfig,
    ctx: RankContext,
    *,
    progress: bool = True,
    track_memory: bool = False,
    count_collectives: bool = False,
) -> TrainLog:
    """Run ``config.steps`` optimizer steps on this rank's share of each global batch.

    Every rank gets an equal slice of the same global batch, so the gradient FSDP averages over
    ranks is the gradient of the global batch's mean loss: the same as one process training on
    the whole batch. A tqdm progress bar is drawn on rank 0 (stderr) when ``progress`` is set.
    With ``track_memory`` or ``count_collectives`` (and at least 2 steps, so that the optimizer
    state exists) the last step runs under a :class:`StepMemoryTracker` and/or a
    :class:`CollectiveCounter`; its time is not in ``step_time_s``.
    """
    losses: list[float] = []
    times: list[float] = []
    memory = collectives = None
    model.train()
    bar = tqdm(total=config.steps, desc="train", unit="step", file=_ProgressLines(),
               disable=not (progress and ctx.is_main), mininterval=0, dynamic_ncols=False, ncols=80)
    for step in range(config.steps):
        inputs, targets = make_batch(config, step)
        inputs = local_slice(inputs, ctx.rank, ctx.world_size).to(ctx.device)
        targets = local_slice(targets, ctx.rank, ctx.world_size).to(ctx.device)
        tracked = (track_memory or count_collectives) and config.steps >= 2 and step == config.steps - 1
        start = time.perf_counter()
        if tracked:
            tracker = StepMemoryTracker(model, optimizer, ctx.device) if track_memory else None
            counter = CollectiveCounter() if count_collectives else None
            with contextlib.ExitStack() as stack:
                for mode in (tracker, counter):
                    if mode is not None:
                        stack.enter_context(mode)
                loss = train_step(model, optimizer, inputs, targets, tracker)
            memory = tracker.result if tracker else None
            collectives = counter.calls if counter else None
        else:
            loss = train_step(model, optimizer, inputs, targets)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        if not tracked:
            times.append(time.perf_counter() - start)
        if dist.is_initialized():
            dist.all_reduce(loss)  # SUM (gloo has no AVG), then divide
            loss /= ctx.world_size
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
        bar.update()
    bar.close()
    return TrainLog(losses=losses, step_time_s=times, memory=memory, collectives=collectives)
