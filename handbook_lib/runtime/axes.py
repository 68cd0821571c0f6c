"""What the axes change in the book's one training loop: each rank's rows and positions of the batch, and the loss.

Chapter 9 runs it. :func:`~handbook_lib.runtime.build.parallelize` lays the model out over the
job's one mesh (:func:`~handbook_lib.runtime.build.apply_axes`); the training loop is the book's
one (:func:`~handbook_lib.runtime.training.train`). :func:`axes_step` gives it what the layout
changes: each rank's rows (its data-parallel share) and positions (its part of each sequence) of
the global batch, and, with tensor parallelism, the loss on vocabulary-split logits inside
``loss_parallel``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from handbook_lib.runtime.data import BatchSource, make_batch
from handbook_lib.runtime.mesh import LayoutMesh
from handbook_lib.runtime.training import next_token_loss

__all__ = ["layout_batches", "axes_step"]


def _arrange(batch: torch.Tensor, layout_mesh: LayoutMesh) -> torch.Tensor:
    """Row block r (of ``world`` equal ones) = rank r's rows (its ``dp`` share) and positions
    (its ``sp`` share) of ``batch``; the ranks of a tensor-parallel group, and the stages of a
    pipeline, get the same block."""
    lay = layout_mesh.layout
    rows, cols = batch.shape[0] // lay.dp, batch.shape[1] // lay.sp
    blocks = []
    for r in range(lay.world_size):
        dp, sp = r // (lay.tp * lay.sp) % lay.dp, (r // lay.tp) % lay.sp
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
    (``loss_parallel``, around the loss and its backward), with a pipeline its ``step_fn``
    (:func:`~handbook_lib.runtime.pipeline.pipeline_step`), and ``functional_collectives``
    (DTensor issues the plan's collectives and the gradient norm's as functional ones)."""
    steps: dict[str, Any] = {"batches": layout_batches(layout_mesh), "functional_collectives": True}
    if layout_mesh.layout.pp > 1:  # the schedule runs the micro-batches, its last stage the loss
        from handbook_lib.runtime.pipeline import pipeline_step

        steps.update(step_fn=pipeline_step, loss_context=None)
    elif layout_mesh.layout.tp_enabled:
        from torch.distributed.tensor.parallel import loss_parallel

        steps.update(forward=_own_copy, loss_fn=_vocab_parallel_loss, loss_context=loss_parallel)
    else:
        steps.update(forward=_own_copy, loss_fn=_own_targets, loss_context=None)
    return steps

