"""Parallelize the book's model over every axis of its layout, in one place and one order.

Chapter 9 runs it. :func:`parallelize_axes` takes a
:class:`~handbook_lib.core.parallel_config.ParallelConfig`, builds the job's one mesh from its
:class:`~handbook_lib.core.parallel_layout.ParallelLayout` (:mod:`handbook_lib.runtime.mesh`)
and applies the steps in torchtitan's order, each where its axis is on:

1. **Tensor parallelism** over ``tp`` (:func:`~handbook_lib.runtime.tensor_parallel.apply_tensor_parallel`):
   Megatron's plan, the vocabulary padded to a multiple of the degree;
2. **The sequence split** over ``sp``: every layer's attention core replaced by one that sees
   the other ranks' positions (the ring, or DeepSpeed Ulysses' all-to-alls, passed in by the run);
3. **Activation checkpointing** of each layer
   (:func:`~handbook_lib.runtime.build.apply_activation_checkpointing`);
4. **FSDP2** over ``dp_shard × sp`` (replicated over ``dp_replicate`` for HSDP): the units of the
   run's ``wrap`` policy (one per layer by default) and the root, with its strategy's resharding
   and its mixed-precision and offload policies (:func:`~handbook_lib.runtime.build.apply_fsdp2`).

The training loop is the book's one (:func:`~handbook_lib.runtime.training.train`);
:func:`axes_step` gives it what the axes change: each rank's rows and positions of the batch,
and, with tensor parallelism, the loss on vocabulary-split logits inside ``loss_parallel``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy

from handbook_lib.core.parallel_config import ParallelConfig
from handbook_lib.core.strategies import get_strategy
from handbook_lib.models.layout import wrap_units
from handbook_lib.runtime.build import (
    apply_activation_checkpointing,
    apply_explicit_prefetch,
    apply_fsdp2,
    build_mp_policy,
)
from handbook_lib.runtime.data import BatchSource, make_batch
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.mesh import LayoutMesh, build_layout_mesh
from handbook_lib.runtime.model import build_model
from handbook_lib.runtime.parallel_model import AttentionCore, ParallelTransformer, from_simple
from handbook_lib.runtime.ring_attention import ring_core
from handbook_lib.runtime.training import next_token_loss

__all__ = ["CoreFactory", "AxesModel", "parallelize_axes", "layout_batches", "axes_step"]

CoreFactory = Callable[[dist.ProcessGroup], AttentionCore]
"""``factory(sp_group) -> core``: the distributed attention of a sequence split over ``sp_group``."""


@dataclass(frozen=True)
class AxesModel:
    """What :func:`parallelize_axes` built: the model and the mesh it is laid out on."""

    model: ParallelTransformer
    mesh: LayoutMesh
    core: AttentionCore | None
    """The sequence split's attention core (``None`` without one)."""


def parallelize_axes(config: ParallelConfig, ctx: RankContext, *,
                     sp_core: CoreFactory | None = None) -> AxesModel:
    """The book's seeded model laid out over ``config``'s axes on this job.

    Args:
        config: The run: its layout on ``ctx.world_size`` ranks
            (:meth:`ParallelConfig.layout`), and FSDP2's levers as
            :func:`~handbook_lib.runtime.build.parallelize` applies them: the
            strategy's resharding (or ``reshard_after_forward_size``), the
            ``precision``'s policy, ``cpu_offload``, the ``wrap`` policy's units,
            ``explicit_prefetch`` and ``activation_checkpointing``.
        ctx: This rank.
        sp_core: The sequence split's attention (default :func:`ring_core`; a run
            passes DeepSpeed's Ulysses for ``sp_method='ulysses'``).

    Raises:
        ValueError: what :meth:`ParallelConfig.layout` refuses.

    Chapter 9 shows this function: lines fit its column (86 characters).
    """
    layout = config.layout(ctx.world_size)
    mesh = build_layout_mesh(layout, ctx.device.type)  # one mesh, named axes
    seeded = build_model(config.model_config(), seed=config.seed, causal=True)
    model = from_simple(seeded, vocab_size=config.padded_vocab_size).to(ctx.device)
    if layout.tp_enabled:  # 1. the tensor-parallel plan
        from handbook_lib.runtime.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh.tp, config.sequence_parallel)
    core = None
    if layout.sp_enabled:  # 2. the sequence split: attention that sees the others
        core = (sp_core or ring_core)(mesh.sp_group)
        model.set_core(core)
    wrapped = wrap_units(config.model_config(), config.wrap, config.wrap_min_params)
    units = [model.get_submodule(u.name) for u in wrapped if not u.root]
    # 3. checkpointing, after the units are found by name
    apply_activation_checkpointing(model, config.activation_checkpointing)
    row = get_strategy(config.strategy)  # 4. FSDP2 over dp_shard x sp
    offload = None
    if config.cpu_offload:
        offload = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
    apply_fsdp2(model, mesh.fsdp, units=units,
                reshard_after_forward=config.reshard_after_forward_size
                or row.reshard_after_forward,
                mp_policy=build_mp_policy(config.precision), offload_policy=offload)
    apply_explicit_prefetch(units, config.explicit_prefetch)
    return AxesModel(model, mesh, core)


def _arrange(batch: torch.Tensor, layout_mesh: LayoutMesh) -> torch.Tensor:
    """Row block r (of ``world`` equal ones) = rank r's rows (its ``dp`` share) and positions
    (its ``sp`` share) of ``batch``; the ranks of a tensor-parallel group get the same block."""
    lay = layout_mesh.layout
    rows, cols = batch.shape[0] // lay.dp, batch.shape[1] // lay.sp
    blocks = []
    for r in range(lay.world_size):
        dp, sp = r // (lay.tp * lay.sp), (r // lay.tp) % lay.sp
        blocks.append(batch[dp * rows:(dp + 1) * rows, sp * cols:(sp + 1) * cols])
    return torch.cat(blocks)


def layout_batches(layout_mesh: LayoutMesh, source: BatchSource = make_batch) -> BatchSource:
    """A :data:`~handbook_lib.runtime.data.BatchSource` for :func:`~handbook_lib.runtime.training.train`
    whose row block r (the loop's slice for rank r) is rank r's rows and positions of
    ``source``'s global batch: shape (world · b/dp, s/sp)."""

    def batches(config: Any, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = source(config, step)
        return _arrange(inputs, layout_mesh), _arrange(targets, layout_mesh)

    return batches


def _own_copy(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The forward pass on the rank's token ids as a tensor of their own, as a data loader hands
    them (the loop's slice is a view of the arranged batch, which would stay alive with it): the
    embedding keeps them for its backward, 8 bytes a token."""
    return model(inputs.clone())


def _own_targets(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`next_token_loss` on the rank's targets as a tensor of their own."""
    return next_token_loss(logits, targets.clone())


def _vocab_parallel_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token cross-entropy of logits split by vocabulary (a ``Shard(-1)`` DTensor),
    without gathering them (inside ``loss_parallel``, :func:`~handbook_lib.runtime.tensor_parallel.tp_loss`);
    reported as this rank's local value (the same on every rank of the group)."""
    from handbook_lib.runtime.tensor_parallel import tp_loss

    loss = tp_loss(logits, targets.clone())
    return loss, loss.to_local()


def axes_step(layout_mesh: LayoutMesh) -> dict[str, Any]:
    """What :func:`~handbook_lib.runtime.training.train` takes for this layout: ``batches``
    (:func:`layout_batches`), ``forward``, ``loss_fn``, with tensor parallelism ``loss_context``
    (``loss_parallel``, around the loss and its backward), and ``functional_collectives``
    (DTensor issues the plan's collectives and the gradient norm's as functional ones)."""
    steps: dict[str, Any] = {"batches": layout_batches(layout_mesh), "functional_collectives": True}
    if layout_mesh.layout.tp_enabled:
        from torch.distributed.tensor.parallel import loss_parallel

        steps.update(forward=_own_copy, loss_fn=_vocab_parallel_loss, loss_context=loss_parallel)
    else:
        steps.update(forward=_own_copy, loss_fn=_own_targets, loss_context=None)
    return steps

