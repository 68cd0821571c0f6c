"""Tensor parallelism inside each group of ``tp_size`` ranks, FSDP2 over the groups, on a 2-D mesh; every byte checked.

Chapter 9 launches it. The ranks form a (``dp``, ``tp``) mesh, ``tp`` the inner axis (contiguous
ranks, one node's): :mod:`handbook_lib.runtime.tensor_parallel` splits the book's model
(:class:`~handbook_lib.runtime.parallel_model.ParallelTransformer` with the seeded weights of
:class:`~handbook_lib.runtime.model.SimpleTransformer`) Megatron's way over ``tp`` — with
``sequence_parallel`` the norms and residuals split by sequence too — and shards it with FSDP2
over ``dp``; each dp group trains on its rows of the global batch. The last step runs under a
memory tracker and a collective counter that reads TP's functional collectives.

Checks, beside :mod:`handbook_lib.models.tensor_parallel`: the vocabulary's padding rows (a
vocabulary the group does not divide is padded to a multiple of it, as Megatron does, and
the padded logits are held out of the loss), parameter shards and FSDP2's padding,
gradients and optimizer state per rank (exact); activations alive after the forward pass
(exact on CPU in fp32); every collective of the last step, TP's and FSDP2's, by kind, phase,
buffer bytes and group (each call matched, exact); the fp32 losses against one process training
the book's model on the whole batch (1e-5). ``loss_parallel``'s own reductions are issued inside
DTensor's dispatch, where the counter cannot see them: neither counted nor predicted.

Keys: ``tp_size`` (>= 2, dividing the world, ``nhead`` and ``dim_feedforward``; ``vocab_size`` is padded)
and ``sequence_parallel`` (``seq_len`` divisible by ``tp_size``); any ``optimizer``. FSDP2's
FULL_SHARD over dp in fp32 only: the other strategies, FSDP1, mixed precision, offload,
accumulation, clipping, checkpointing and FSDP2's tuning knobs are refused in one line naming
the key. ``init`` is not used: every rank builds the seeded model on the CPU and copies it
into :class:`~handbook_lib.runtime.parallel_model.ParallelTransformer` before splitting it.
TP over the whole world (one dp group, e.g. 2 ranks as 1 × 2) runs too.

Launch::

    python -m handbook_lib run tensor_parallel --nproc 4 --set tp_size=2 --set sequence_parallel=true
"""

from __future__ import annotations

import sys
from collections import Counter

from handbook_lib.core.parallel_config import ParallelConfig
from handbook_lib.core.results import Check
from handbook_lib.models.tensor_parallel import (
    estimate_tp_activation_bytes,
    estimate_tp_state_bytes,
    estimate_tp_step_collectives,
    tp_padded,
)
from handbook_lib.runs.entry import RankReport, main, one_process_loss_checks
from handbook_lib.runs.specs.tensor_parallel import CONFIG as CONFIG, validate
from handbook_lib.runtime.collectives import CollectiveCall, collective_totals
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.measure import (
    measure_grad_bytes,
    measure_optimizer_bytes,
    measure_param_bytes,
)
from handbook_lib.runtime.axes import axes_step, parallelize_axes
from handbook_lib.runtime.optimization import build_optimizer
from handbook_lib.runtime.training import train


LOSS_TOLERANCE = 1e-5
"""Relative tolerance of each fp32 loss against one process's on the same global batch."""
GPU_ACTIVATION_TOLERANCE = 0.05
"""Relative tolerance of the activation check on CUDA, whose attention kernels save other
tensors than the CPU's (on CPU the check is exact)."""


def run(config: ParallelConfig, ctx: RankContext) -> RankReport:
    """Train ``config`` with TP over ``tp_size`` ranks and FSDP2 over the rest; check every byte and loss."""
    validate(config, ctx.world_size)
    dp = config.data_parallel_size(ctx.world_size)
    built = parallelize_axes(config, ctx)
    model, mesh = built.model, built.mesh
    dp_rank = mesh.dp_rank
    optimizer = build_optimizer(model.parameters(), config.optimizer, config.lr)
    log = train(model, optimizer, config, ctx, **axes_step(mesh), track_memory=True, count_collectives=True)
    memory, collectives = log.memory, log.collectives
    assert memory is not None and collectives is not None  # tracked on the last step
    micro = config.batch_size // (dp * config.grad_accum_steps)
    cfg = config.model_config()
    state = estimate_tp_state_bytes(cfg, config.tp_size, dp, dp_rank, config.optimizer)
    params = measure_param_bytes(model)
    sharded, other = measure_optimizer_bytes(optimizer)
    padding = tp_padded(cfg, config.tp_size).vocab_size - cfg.vocab_size
    rows = int(model.embedding.weight.shape[0])  # the global rows of the (TP x FSDP) DTensor
    checks = [Check("vocab_padding_rows", ctx.rank, padding, rows - cfg.vocab_size, "rows"),
              Check("param_shard_bytes", ctx.rank, state.param_shard_bytes, params.shard_bytes, "bytes"),
              Check("param_padding_bytes", ctx.rank, state.param_padding_bytes, params.padding_bytes, "bytes"),
              Check("grad_shard_bytes", ctx.rank, state.grad_bytes, measure_grad_bytes(model), "bytes"),
              Check("optimizer_state_bytes", ctx.rank, state.optimizer_state_bytes, sharded, "bytes"),
              Check("optimizer_step_bytes", ctx.rank, state.optimizer_step_bytes, other, "bytes")]
    acts = estimate_tp_activation_bytes(cfg, micro, config.seq_len, config.tp_size, config.sequence_parallel)
    checks.append(Check("activation_bytes", ctx.rank, acts.total, memory.activation_bytes, "bytes",
                        0.0 if ctx.device.type == "cpu" else GPU_ACTIVATION_TOLERANCE))
    checks += _collective_checks(config, ctx, dp, micro, collectives)
    metrics = {"losses": log.losses, "dp_size": dp, "tp_size": config.tp_size, "dp_rank": dp_rank,
               "vocab_size": cfg.vocab_size, "padded_vocab_size": rows,
               "tp_rank": mesh.tp_rank, "sequence_parallel": config.sequence_parallel,
               "param_shard_bytes": params.shard_bytes, "param_padding_bytes": params.padding_bytes,
               "activation_bytes": memory.activation_bytes, "predicted_activation_bytes": acts.total,
               "activation_per_layer": acts.per_layer, "peak_bytes": memory.peak_bytes,
               "collectives": [vars(c) for c in collectives],
               "sent_bytes": sum(k["sent_bytes"] for k in collective_totals(collectives).values())}
    if ctx.is_main:
        metrics["reference_losses"], loss_checks = one_process_loss_checks(
            config, log.losses, LOSS_TOLERANCE, str(ctx.device))  # the reference on the rank's device
        checks += loss_checks
    return RankReport(metrics=metrics, checks=checks, extra={"dp_size": dp, "tp_size": config.tp_size})


def _collective_checks(config: ParallelConfig, ctx: RankContext, dp: int, micro: int,
                       calls: list[CollectiveCall]) -> list[Check]:
    """The last step's collectives against :func:`estimate_tp_step_collectives`: per (kind, phase)
    count and buffer bytes; how many calls match a predicted one in kind, phase, buffer bytes and
    group size (all of them, and as many as predicted); the bytes this rank sent. The counter
    names the phase after the first backward ``optimizer``; nothing is issued there but the
    backward's last reduce-scatters, so it is read as ``backward``."""
    predicted = estimate_tp_step_collectives(config.model_config(), config.tp_size, dp, micro, config.seq_len,
                                             config.sequence_parallel)
    want: Counter[tuple[str, str | None, int, int]] = Counter(
        (c.kind, c.phase, c.buffer_bytes, c.group_size) for c in predicted)
    got: Counter[tuple[str, str | None, int, int]] = Counter(
        (c.kind, "backward" if c.phase == "optimizer" else c.phase, c.buffer_bytes, c.group_size) for c in calls)
    checks = []
    for kind, phase in sorted({k[:2] for k in want} | {k[:2] for k in got}):
        name = f"{kind}_{'fwd' if phase == 'forward' else 'bwd'}"
        wanted = [(n, k[2]) for k, n in want.items() if k[:2] == (kind, phase)]
        seen = [(n, k[2]) for k, n in got.items() if k[:2] == (kind, phase)]
        checks += [Check(f"{name}_count", ctx.rank, sum(n for n, _ in wanted), sum(n for n, _ in seen),
                         "collectives"),
                   Check(f"{name}_buffer_bytes", ctx.rank, sum(n * b for n, b in wanted),
                         sum(n * b for n, b in seen), "bytes")]
    matched = sum((want & got).values())
    checks.append(Check("collectives_matched", ctx.rank, sum(want.values()),
                        matched if sum(got.values()) == sum(want.values()) else -1, "collectives"))
    sent = sum(k["sent_bytes"] for k in collective_totals(calls).values())
    checks.append(Check("sent_bytes", ctx.rank, sum(c.sent_bytes for c in predicted), sent, "bytes"))
    return checks


if __name__ == "__main__":
    main(sys.modules[__name__])
