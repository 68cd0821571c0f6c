"""Split each sequence over ``sp_size`` ranks (DeepSpeed Ulysses or the book's ring attention), FSDP2 over every rank.

Chapter 9 launches it. The ranks form a (dp, sp) mesh, the sp ranks contiguous: rank r holds
rows ``r // sp`` of the global batch and positions ``r % sp`` of each sequence
(:mod:`handbook_lib.runtime.sequence_parallel`). The book's model
(:class:`~handbook_lib.runtime.parallel_model.ParallelTransformer`, the seeded weights of
:class:`~handbook_lib.runtime.model.SimpleTransformer`) gets an attention core that sees the
other ranks' tokens: ``sp_method=ulysses`` is DeepSpeed's ``DistributedAttention`` (4
all-to-alls per layer each way, :mod:`handbook_lib.integrations.ulysses`), ``ring`` the book's
ring of sends (:mod:`handbook_lib.runtime.ring_attention`; on GPUs PyTorch's
``context_parallel`` is the ring). FSDP2 shards the parameters over all ranks, dp × sp.

Before training, the core runs once on random q, k, v against full causal attention (output
and gradients, 1e-6 relative). The last step runs under a memory tracker and a collective
counter. Checks, beside :mod:`handbook_lib.models.sequence_parallel`: parameter, gradient and
optimizer bytes per rank (exact), activations per rank with the sequence split 1/sp (exact),
every collective of the step by kind, phase and group (count and bytes, exact), and the fp32
losses against one process training the book's model on the whole batch (1e-5).

Launch::

    python -m handbook_lib run sequence_parallel --nproc 4 --set sp_size=2 --set sp_method=ulysses
"""

from __future__ import annotations

import sys

import torch

from handbook_lib.core.parallel_config import ParallelConfig
from handbook_lib.core.results import Check
from handbook_lib.models.model_state import optimizer_states, optimizer_step_bytes
from handbook_lib.models.sequence_parallel import (
    estimate_sp_activation_bytes,
    estimate_sp_step_traffic,
    parallel_layout,
)
from handbook_lib.runs.entry import RankReport, main, one_process_loss_checks
from handbook_lib.runs.specs.sequence_parallel import CONFIG as CONFIG, validate
from handbook_lib.runtime.collectives import CollectiveCall, collective_totals
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.measure import (
    measure_grad_bytes,
    measure_optimizer_bytes,
    measure_param_bytes,
)
from handbook_lib.runtime.optimization import build_optimizer
from handbook_lib.runtime.ring_attention import ring_core
from handbook_lib.runtime.axes import CoreFactory, axes_step, parallelize_axes
from handbook_lib.runtime.sequence_parallel import measure_attention_error
from handbook_lib.runtime.training import train


LOSS_TOLERANCE = 1e-5
"""Relative tolerance of each fp32 loss against one process's on the same global batch."""
ATTENTION_TOLERANCE = 1e-6
"""The distributed attention's largest difference from full causal attention, relative to the
reference's largest magnitude (fp32; measured about 1e-7)."""


def run(config: ParallelConfig, ctx: RankContext) -> RankReport:
    """Train ``config`` with the sequence split over ``sp_size`` ranks; check every byte and loss."""
    validate(config, ctx.world_size)
    built = parallelize_axes(config, ctx, sp_core=sp_core_factory(config))
    model, mesh = built.model, built.mesh
    assert built.core is not None  # sp_size >= 2
    error = measure_attention_error(built.core, config, mesh, ctx.device)
    optimizer = build_optimizer(model.parameters(), config.optimizer, config.lr)
    log = train(model, optimizer, config, ctx, **axes_step(mesh), track_memory=True, count_collectives=True)
    memory, collectives = log.memory, log.collectives
    assert memory is not None and collectives is not None  # tracked on the last step
    dp = mesh.layout.dp
    micro = config.batch_size // (dp * config.grad_accum_steps)
    checks = [
        Check("attention_output", ctx.rank, error.out_scale, error.out_scale + error.out_diff, "max |value|",
              ATTENTION_TOLERANCE),
        Check("attention_grads", ctx.rank, error.grad_scale, error.grad_scale + error.grad_diff, "max |value|",
              ATTENTION_TOLERANCE),
        *_state_checks(config, ctx, model, optimizer),
    ]
    acts = tracked_activation_bytes(config, micro)
    checks.append(Check("activation_bytes", ctx.rank, acts, memory.activation_bytes, "bytes"))
    checks += _collective_checks(config, ctx, micro, collectives)
    metrics = {"losses": log.losses, "step_time_s": log.step_time_s, "dp_size": dp,
               "sp_size": mesh.layout.sp, "dp_rank": mesh.dp_rank, "sp_rank": mesh.sp_rank,
               "activation_bytes": memory.activation_bytes, "predicted_activation_bytes": acts,
               "peak_bytes": memory.peak_bytes, "attention_error": vars(error),
               "collectives": [vars(c) for c in collectives],
               "sent_bytes": sum(k["sent_bytes"] for k in collective_totals(collectives).values())}
    if ctx.is_main:
        metrics["reference_losses"], loss_checks = one_process_loss_checks(
            config, log.losses, LOSS_TOLERANCE, str(ctx.device))  # the reference on the rank's device
        checks += loss_checks
    return RankReport(metrics=metrics, checks=checks,
                      extra={"num_params": parallel_layout(config.model_config()).num_params})


def sp_core_factory(config: ParallelConfig) -> CoreFactory:
    """The attention of ``config.sp_method``: DeepSpeed's Ulysses (``ulysses``) or the book's
    ring (``ring``), each over the sequence-parallel group it is given."""
    if config.sp_method == "ulysses":
        from handbook_lib.integrations.ulysses import ulysses_core

        return ulysses_core
    return ring_core


def tracked_activation_bytes(config: ParallelConfig, micro_batch: int) -> int:
    """What the memory tracker files as activations after the forward pass on one rank:
    :func:`~handbook_lib.models.sequence_parallel.estimate_sp_activation_bytes` (what autograd
    keeps) less the int64 token ids (the model's input, which the tracker files as an input,
    not as something the forward pass made), plus the 4-byte loss itself, alive but kept by
    nobody. Measured equal on 1, 2 and 4 ranks, with and without FSDP2, Ulysses and the ring."""
    tokens = micro_batch * config.seq_len // config.sp_size
    saved = estimate_sp_activation_bytes(config.model_config(), micro_batch, config.seq_len, config.sp_size,
                                         config.sp_method).total
    return saved - 8 * tokens + 4


def _state_checks(config: ParallelConfig, ctx: RankContext, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer) -> list[Check]:
    """Parameter shards and padding, gradients and optimizer state of this rank, against
    :func:`parallel_layout`'s shards over the whole world."""
    layout = parallel_layout(config.model_config())
    shard = layout.shard_bytes(ctx.world_size, ctx.rank)
    params = measure_param_bytes(model)
    sharded, other = measure_optimizer_bytes(optimizer)
    return [Check("param_shard_bytes", ctx.rank, shard.shard_bytes, params.shard_bytes, "bytes"),
            Check("param_padding_bytes", ctx.rank, shard.padding_bytes, params.padding_bytes, "bytes"),
            Check("grad_shard_bytes", ctx.rank, shard.shard_bytes, measure_grad_bytes(model), "bytes"),
            Check("optimizer_state_bytes", ctx.rank, optimizer_states(config.optimizer) * shard.shard_bytes,
                  sharded, "bytes"),
            Check("optimizer_step_bytes", ctx.rank, optimizer_step_bytes(layout, config.optimizer), other, "bytes")]


def _collective_checks(config: ParallelConfig, ctx: RankContext, micro: int,
                       calls: list[CollectiveCall]) -> list[Check]:
    """Every collective of the last step by (kind, phase, group size): count and buffer bytes,
    and the bytes this rank sent, against :func:`estimate_sp_step_traffic`. The counter names
    the phase after the first backward ``optimizer``; FSDP2 issues nothing there, so those are
    the backward's last reduce-scatters."""
    traffic = estimate_sp_step_traffic(config.model_config(), ctx.world_size, micro, config.seq_len,
                                       config.sp_size, config.sp_method)
    measured: dict[tuple[str, str | None, int], tuple[int, int]] = {}
    for c in calls:
        key = (c.kind, "backward" if c.phase == "optimizer" else c.phase, c.group_size)
        n, b = measured.get(key, (0, 0))
        measured[key] = (n + 1, b + c.buffer_bytes)
    checks = []
    expected: dict[tuple[str, str | None, int], tuple[int, int]] = {k: v for k, v in traffic.counts().items()}
    for key in sorted(set(expected) | set(measured)):
        want, got = expected.get(key, (0, 0)), measured.get(key, (0, 0))
        name = f"{key[0]}_{'fwd' if key[1] == 'forward' else 'bwd'}_{key[2]}ranks"
        checks += [Check(f"{name}_count", ctx.rank, want[0], got[0], "collectives"),
                   Check(f"{name}_buffer_bytes", ctx.rank, want[1], got[1], "bytes")]
    sent = sum(k["sent_bytes"] for k in collective_totals(calls).values())
    checks.append(Check("sent_bytes", ctx.rank, traffic.sent_bytes, sent, "bytes"))
    return checks


if __name__ == "__main__":
    main(sys.modules[__name__])
