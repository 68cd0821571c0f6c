"""Tensor parallelism inside a group of ranks, FSDP2 across the groups: what a rank does.

Chapter 9 runs it. The ranks form a 2-D :class:`~torch.distributed.device_mesh.DeviceMesh`
(``dp``, ``tp``), ``tp`` the inner axis (contiguous ranks: those of one node). On the ``tp``
axis, :func:`apply_tensor_parallel` splits every layer Megatron's way (Shoeybi et al., 2019):
``ColwiseParallel`` on Q, K, V and ``linear1`` (each rank its heads and its slice of the
feed-forward width), ``RowwiseParallel`` on ``out_proj`` and ``linear2`` (their partial sums
reduced), the embedding by vocabulary rows and the head by vocabulary columns (the loss computed
on the split logits, ``loss_parallel``). With ``sequence_parallel`` the activations between the
blocks — the residual adds and the norms — stay split by sequence (Korthikanti et al., 2022):
each block's all-reduce becomes a reduce-scatter after it and an all-gather before the next;
the attention's input is gathered once for Q, K and V together (``PrepareModuleInput``).
:func:`apply_fsdp_over_dp` then shards each layer and the root with ``fully_shard`` over the
``dp`` axis. Every rank of one ``dp`` group gets the same rows of the global batch
(:func:`dp_batch`).

The loop is this module's own (:func:`train_tensor_parallel`), not
:func:`handbook_lib.runtime.training.train`: the batch is sliced by the ``dp`` coordinate, not
the rank; the loss is computed under ``loss_parallel``; the collective counter must read the
functional collectives tensor parallelism issues. It uses the device of the
:class:`~handbook_lib.runtime.distributed.RankContext` (CPU + gloo or CUDA + NCCL alike).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn import functional as F

from handbook_lib.core.parallel_config import CONFIG_NAMES, ParallelConfig
from handbook_lib.core.parallel_layout import ParallelLayout
from handbook_lib.runtime.collectives import CollectiveCall, CollectiveCounter
from handbook_lib.runtime.data import local_slice, make_batch
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.measure import StepMemory, StepMemoryTracker
from handbook_lib.runtime.model import build_model
from handbook_lib.runtime.optimization import build_optimizer
from handbook_lib.runtime.parallel_model import ParallelTransformer, from_simple

__all__ = [
    "TPTrainLog",
    "apply_fsdp_over_dp",
    "apply_tensor_parallel",
    "build_tp_mesh",
    "build_tp_model",
    "dp_batch",
    "tp_loss",
    "train_tensor_parallel",
]


def build_tp_mesh(ctx: RankContext, tp_size: int) -> DeviceMesh:
    """The 2-D mesh (``dp``, ``tp``) of ``ctx.world_size`` ranks, ``tp`` inner: ranks
    ``[g·tp, (g+1)·tp)`` form tensor-parallel group g; ranks with the same ``tp`` coordinate form a
    data-parallel group. On the rank's device type (``cpu`` or ``cuda``).

    Raises:
        ValueError: if ``tp_size`` does not divide the world size.
    """
    layout = ParallelLayout.for_world(ctx.world_size, tp=tp_size, names=CONFIG_NAMES)
    return init_device_mesh(ctx.device.type, (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))


def apply_tensor_parallel(model: ParallelTransformer, tp_mesh: DeviceMesh,
                          sequence_parallel: bool = False) -> None:
    """Split ``model`` in place over the tensor-parallel mesh (the module's plan).

    Placements on the ``tp`` axis (one rank holds 1/tp of each split tensor): the
    embedding, Q/K/V, ``linear1`` and the head split by rows (dim 0, biases too);
    ``out_proj`` and ``linear2`` by columns (dim 1), their biases replicated; the
    norms replicated. The head's output stays a DTensor split by vocabulary
    (``Shard(-1)``) for :func:`tp_loss`. Chapter 9 shows this function: lines fit
    its column (86 characters).
    """
    seq = Shard(1) if sequence_parallel else Replicate()  # between the blocks
    parallelize_module(model, tp_mesh, {
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                  use_local_output=False),  # logits: by vocabulary
    })
    for layer in model.layers:
        plan = {
            "self_attn": PrepareModuleInput(input_layouts=(seq,),
                                            desired_input_layouts=(Replicate(),)),
            "self_attn.q_proj": ColwiseParallel(),  # each rank: its heads
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.out_proj": RowwiseParallel(output_layouts=seq),  # partial sums
            "linear1": ColwiseParallel(input_layouts=seq),  # its slice of the width
            "linear2": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:  # local outputs, for the residual adds
            plan.update({"norm1": SequenceParallel(use_local_output=True),
                         "norm2": SequenceParallel(use_local_output=True)})
        parallelize_module(layer, tp_mesh, plan)


def apply_fsdp_over_dp(model: ParallelTransformer, dp_mesh: DeviceMesh) -> None:
    """``fully_shard`` every layer, then the root, over the data-parallel mesh, each resharded
    after forward (the root too, as :func:`handbook_lib.runtime.build.apply_fsdp2` does).

    A data-parallel mesh of one rank (TP over the whole world) is wrapped too: FSDP2 over one
    rank issues no collective, and its post-backward gives every gradient its parameter's
    placement (unwrapped, the vocabulary-parallel embedding's gradient came back whole, twice
    its shard on 2 ranks)."""
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=True)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=True)


def build_tp_model(config: ParallelConfig, ctx: RankContext) -> tuple[ParallelTransformer, DeviceMesh]:
    """The book's seeded model as a :class:`ParallelTransformer` on the rank's device, its
    vocabulary padded to a multiple of ``tp_size`` (:attr:`ParallelConfig.padded_vocab_size`),
    split over ``tp`` and sharded over ``dp``. Returns ``(model, mesh)``."""
    mesh = build_tp_mesh(ctx, config.tp_size)
    model = from_simple(build_model(config.model_config(), seed=config.seed, causal=True),
                        vocab_size=config.padded_vocab_size).to(ctx.device)
    apply_tensor_parallel(model, mesh["tp"], config.sequence_parallel)
    apply_fsdp_over_dp(model, mesh["dp"])
    return model, mesh


def dp_batch(config: ParallelConfig, step: int, mesh: DeviceMesh, device: torch.device,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of global batch ``step``: its data-parallel group's share
    (``batch_size / dp`` rows, the same on every rank of a tensor-parallel group), each tensor
    its own (rows, seq_len) int64 copy."""
    dp = mesh["dp"]
    inputs, targets = make_batch(config, step)
    rank, size = dp.get_local_rank(), dp.size()
    # copies: the slices are views of the whole batch's (batch, seq + 1) storage, which would
    # otherwise stay alive (and be counted with the activations) on a CPU rank
    return (local_slice(inputs, rank, size).clone().to(device),
            local_slice(targets, rank, size).clone().to(device))


def tp_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits split by vocabulary (a ``Shard(-1)`` DTensor),
    computed without gathering them (``loss_parallel``): a replicated scalar DTensor. Call its
    ``backward`` inside ``loss_parallel()`` too."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclass(frozen=True)
class TPTrainLog:
    """What :func:`train_tensor_parallel` observed."""

    losses: list[float]
    """Per step, the global batch's mean loss (nats per token), averaged over the dp groups."""
    memory: StepMemory | None
    """The last step's memory (activations alive after its forward, its peak)."""
    collectives: list[CollectiveCall]
    """The last step's collectives, functional ones (tensor parallelism's) included."""


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor],
          tracker: StepMemoryTracker | None) -> torch.Tensor:
    inputs, targets = batch
    with loss_parallel():
        loss = tp_loss(model(inputs), targets)
        if tracker is not None:
            tracker.after_forward(settle=True)  # loss_parallel's reductions free late on gloo
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    local = loss.to_local() if isinstance(loss, DTensor) else loss
    return local.detach()


def train_tensor_parallel(config: ParallelConfig, ctx: RankContext, *, measure: bool = True,
                          ) -> tuple[ParallelTransformer, torch.optim.Optimizer, TPTrainLog]:
    """Build the model (:func:`build_tp_model`) and train ``config.steps`` steps; the last one
    (with ``measure`` and ``steps`` >= 2) under a :class:`StepMemoryTracker` and a functional
    :class:`CollectiveCounter`. The logged loss is all-reduced over the world outside the
    counter (every rank of a tp group holds the same value). Returns ``(model, optimizer, log)``.
    """
    model, mesh = build_tp_model(config, ctx)
    optimizer = build_optimizer(model.parameters(), config.optimizer, config.lr)
    losses: list[float] = []
    memory, calls = None, []
    for step in range(config.steps):
        batch = dp_batch(config, step, mesh, ctx.device)
        if measure and config.steps >= 2 and step == config.steps - 1:
            tracker = StepMemoryTracker(model, optimizer, ctx.device)
            counter = CollectiveCounter(functional=True)
            with contextlib.ExitStack() as stack:
                stack.enter_context(tracker)
                stack.enter_context(counter)
                loss = _step(model, optimizer, batch, tracker)
            memory, calls = tracker.result, counter.calls
        else:
            loss = _step(model, optimizer, batch, None)
        total = loss.clone()
        if ctx.world_size > 1:
            dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
    return model, optimizer, TPTrainLog(losses=losses, memory=memory, collectives=calls)
