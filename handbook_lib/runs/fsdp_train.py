"""First real run: train the handbook's model with FSDP2 on N ranks and measure the shards.

Chapter 1 launches it. Each rank builds the same seeded model, ``fully_shard``s every
transformer layer and then the root, trains ``steps`` steps on its slice of the synthetic global
batch, and then measures what it holds: parameter shards (and their padding), gradient shards,
optimizer state. The memory model predicts the same quantities for the same config; both go
into ``checks``.

Launch::

    python -m handbook_lib run fsdp_train --nproc 2 --set steps=3 --out runs/first
    # or, by hand:
    torchrun --nproc-per-node 2 -m handbook_lib.runs.fsdp_train --set steps=3 --out runs/first
"""

from __future__ import annotations

import sys

from handbook_lib.config import RunConfig
from handbook_lib.distributed import RankContext
from handbook_lib.measure import measure_grad_bytes, measure_optimizer_bytes, measure_param_bytes
from handbook_lib.memory import estimate_shard_bytes, optimizer_states
from handbook_lib.model import param_count
from handbook_lib.results import Check
from handbook_lib.runs.entry import RankReport, main
from handbook_lib.training import FSDP2_STRATEGIES, build_fsdp2_model, build_optimizer, train

CONFIG = RunConfig


def validate(config: RunConfig, world_size: int) -> None:
    """Reject, before any process starts, a config this run cannot execute.

    Raises:
        ValueError: naming the key and the values this run accepts.
    """
    if config.api != "fsdp2":
        raise ValueError(f"fsdp_train supports api='fsdp2' only, got api={config.api!r}")
    if config.strategy not in FSDP2_STRATEGIES:
        raise ValueError(
            f"fsdp_train supports strategy {' or '.join(FSDP2_STRATEGIES)}, got {config.strategy!r}"
        )
    if config.precision not in ("fp32", "bf16-mixed"):
        raise ValueError(
            f"fsdp_train supports precision fp32 or bf16-mixed, got {config.precision!r}"
        )
    if config.batch_size % world_size:
        raise ValueError(
            f"batch_size={config.batch_size} must be divisible by the number of ranks {world_size}"
        )


def run(config: RunConfig, ctx: RankContext) -> RankReport:
    validate(config, ctx.world_size)
    model = build_fsdp2_model(config, ctx)
    optimizer = build_optimizer(model.parameters(), config.optimizer, config.lr)
    log = train(model, optimizer, config, ctx)

    params = measure_param_bytes(model)
    grads = measure_grad_bytes(model)
    opt_sharded, opt_other = measure_optimizer_bytes(optimizer)
    shard = estimate_shard_bytes(config.model_config(), ctx.world_size, ctx.rank)
    states = optimizer_states(config.optimizer)

    def check(quantity: str, predicted: int, measured: int) -> Check:
        return Check(quantity, ctx.rank, predicted, measured, "bytes")

    num_params = param_count(config.model_config())
    return RankReport(
        metrics={
            "losses": log.losses,
            "step_time_s": log.step_time_s,
            "param_shard_bytes": params.shard_bytes,
            "param_padding_bytes": params.padding_bytes,
            "grad_shard_bytes": grads,
            "optimizer_state_bytes": opt_sharded,
            "optimizer_other_bytes": opt_other,
        },
        checks=[
            check("param_shard_bytes", shard.shard_bytes, params.shard_bytes),
            check("param_padding_bytes", shard.padding_bytes, params.padding_bytes),
            check("grad_shard_bytes", shard.shard_bytes, grads),
            check("optimizer_state_bytes", states * shard.shard_bytes, opt_sharded),
        ],
        extra={"num_params": num_params, "model_bytes": 4 * num_params},
    )


if __name__ == "__main__":
    main(sys.modules[__name__])
