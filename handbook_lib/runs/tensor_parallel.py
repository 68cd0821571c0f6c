"""Tensor parallelism inside each group of ``tp_size`` ranks, with any other axis and lever; every byte checked.

Chapter 9 launches it. The ranks form the job's one mesh (:mod:`handbook_lib.runtime.mesh`),
``tp`` innermost (contiguous ranks, one node's): the book's model
(:class:`~handbook_lib.runtime.parallel_model.ParallelTransformer` with the seeded weights of
:class:`~handbook_lib.runtime.model.SimpleTransformer`) is split Megatron's way over ``tp`` —
with ``sequence_parallel`` the norms and residuals split by sequence too — each sequence split
over ``sp_size`` ranks besides if asked (Ulysses or the ring), checkpointed as
``activation_checkpointing`` says, and sharded by FSDP2 over the data-parallel and sequence
ranks (:func:`~handbook_lib.runtime.build.apply_axes`); the book's one loop trains it in
any ``precision``, with accumulation, clipping and a schedule.

Checks (:func:`~handbook_lib.runs.axes_checks.run_axes`, beside
:mod:`handbook_lib.models.axes_run`): the vocabulary's padding rows (a vocabulary the group does
not divide is padded to a multiple of it, as Megatron does, and the padded logits are held out of
the loss); parameter shards and FSDP2's padding, gradients and optimizer state per rank (exact);
activations alive after the forward pass (exact on CPU); every collective of the last step, each
axis's, by kind, buffer bytes and group (each call matched, exact); the losses against one
process training the book's model on the whole batch. ``loss_parallel``'s own reductions are
issued inside DTensor's dispatch, where the counter cannot see them: neither counted nor predicted.

Keys: ``tp_size`` (>= 2, dividing the world, ``nhead`` and ``dim_feedforward``; ``vocab_size`` is
padded), ``sequence_parallel`` (``seq_len / sp_size`` divisible by ``tp_size``), ``sp_size`` and
``sp_method``, and every general key, refused only where :meth:`ParallelConfig.check_runnable
<handbook_lib.core.parallel_config.ParallelConfig.check_runnable>` says why (FSDP1, a strategy
FSDP2 does not apply). ``init`` is not used: every rank builds the seeded model on the CPU and
copies it into :class:`~handbook_lib.runtime.parallel_model.ParallelTransformer` before splitting
it. TP over the whole world (one data-parallel rank, e.g. 2 ranks as 1 × 2) runs too.

Launch::

    python -m handbook_lib run tensor_parallel --nproc 4 --set tp_size=2 --set sequence_parallel=true
"""

from __future__ import annotations

import sys

from handbook_lib.core.parallel_config import ParallelConfig
from handbook_lib.runs.axes_checks import run_axes
from handbook_lib.runs.entry import RankReport, main
from handbook_lib.runs.specs.tensor_parallel import CONFIG as CONFIG, validate
from handbook_lib.runtime.distributed import RankContext


def run(config: ParallelConfig, ctx: RankContext) -> RankReport:
    """Train ``config`` with TP over ``tp_size`` ranks and its other axes; check every byte and loss."""
    validate(config, ctx.world_size)
    return run_axes(config, ctx)


if __name__ == "__main__":
    main(sys.modules[__name__])
