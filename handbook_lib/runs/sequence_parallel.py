"""Split each sequence over ``sp_size`` ranks (DeepSpeed Ulysses or the book's ring attention), FSDP2 over every rank.

Chapter 9 launches it. The ranks form the job's one mesh (:mod:`handbook_lib.runtime.mesh`), the
sp ranks contiguous: rank r holds rows ``r // sp`` of the global batch and positions ``r % sp``
of each sequence (:func:`~handbook_lib.runtime.axes.layout_batches`). The book's model
(:class:`~handbook_lib.runtime.parallel_model.ParallelTransformer`, the seeded weights of
:class:`~handbook_lib.runtime.model.SimpleTransformer`) gets an attention core that sees the
other ranks' tokens: ``sp_method=ulysses`` is DeepSpeed's ``DistributedAttention`` (4
all-to-alls per layer each way, :mod:`handbook_lib.integrations.ulysses`), ``ring`` the book's
ring of sends (:mod:`handbook_lib.runtime.ring_attention`; on GPUs PyTorch's
``context_parallel`` is the ring). FSDP2 shards the parameters over all ranks, dp × sp
(:func:`~handbook_lib.runtime.build.apply_axes`); any precision, checkpointing,
accumulation, clipping and schedule.

Before training, the core runs once on random q, k, v against full causal attention (output
and gradients, 1e-6 relative). The last step runs under a memory tracker and a collective
counter. Checks (:func:`~handbook_lib.runs.axes_checks.run_axes`, beside
:mod:`handbook_lib.models.axes_run`): parameter, gradient and optimizer bytes per rank (exact),
activations per rank with the sequence split 1/sp (exact on CPU), every collective of the step
by kind and group (count and bytes, exact), and the losses against one process training the
book's model on the whole batch. Tensor parallelism with the sequence split is the
``tensor_parallel`` run's.

Launch::

    python -m handbook_lib run sequence_parallel --nproc 4 --set sp_size=2 --set sp_method=ulysses
"""

from __future__ import annotations

import sys

from handbook_lib.core.parallel_config import ParallelConfig
from handbook_lib.runs.axes_checks import run_axes
from handbook_lib.runs.entry import RankReport, main
from handbook_lib.runs.specs.sequence_parallel import CONFIG as CONFIG, validate
from handbook_lib.runtime.distributed import RankContext


def run(config: ParallelConfig, ctx: RankContext) -> RankReport:
    """Train ``config`` with the sequence split over ``sp_size`` ranks; check every byte and loss."""
    validate(config, ctx.world_size)
    return run_axes(config, ctx)


if __name__ == "__main__":
    main(sys.modules[__name__])
