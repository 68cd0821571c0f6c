"""Train the handbook's model on N ranks and measure every byte the memory model predicts.

The torch-free half of :mod:`handbook_lib.runs.fsdp_train`: its config (the vocabulary's
:class:`~handbook_lib.core.config.RunConfig`) and the checks the launcher makes before any
process starts (:class:`~handbook_lib.core.run_spec.RunSpec`), through the strategy table's own
rules (:func:`~handbook_lib.core.strategies.runnable_strategy`,
:func:`~handbook_lib.core.strategies.run_shard_group`), which the runtime applies too.
"""

from __future__ import annotations

from handbook_lib.core.config import RunConfig
from handbook_lib.core.run_spec import RunSpec
from handbook_lib.core.strategies import STRATEGY_TABLE, run_shard_group, runnable_strategy

CONFIG = RunConfig


def validate(config: RunConfig, world_size: int) -> None:
    """Reject, before any process starts, a config this run cannot execute.

    Raises:
        ValueError: naming the key and the values this run accepts.
    """
    if STRATEGY_TABLE[config.strategy].wrapper == "deepspeed":
        raise ValueError(f"fsdp_train runs PyTorch's strategies; {config.strategy} is DeepSpeed's: run deepspeed_zero")
    if not STRATEGY_TABLE[config.strategy].distributed and world_size != 1:
        raise ValueError(f"strategy {config.strategy!r} is the one-process baseline: launch it with 1 rank, "
                         f"not {world_size}")
    try:
        row = runnable_strategy(config.strategy, config.api, world_size)
    except ValueError:
        accepted = [s.name for s in STRATEGY_TABLE.values() if s.runs_with(config.api)]
        raise ValueError(f"fsdp_train with api={config.api!r} supports strategy {', '.join(accepted)}; "
                         f"got {config.strategy!r}") from None
    if row.wrapper != "fsdp" and (config.precision not in ("fp32", "bf16") or config.cpu_offload
                                  or config.wrap != "layer"):
        raise ValueError(f"fsdp_train runs {config.strategy} with precision 'fp32' or 'bf16', cpu_offload=False "
                         "and wrap='layer' only (mixed precision, offload and wrapping are FSDP's)")
    if row.wrapper == "ddp" and config.steps < 3:
        raise ValueError(
            f"fsdp_train needs steps >= 3 with DDP (got {config.steps}): DDP rebuilds its gradient "
            "buckets during the second step, so the measured (last) step must be the third or later"
        )
    config.check_batch(world_size)
    _validate_knobs(config, row, world_size)
    if row.hybrid:
        group = run_shard_group(config.strategy, world_size, config.shard_group_size)
        if group == world_size:
            flat = next(s.name for s in STRATEGY_TABLE.values() if not s.hybrid and s.wrapper == "fsdp"
                        and s.reshard_after_forward == row.reshard_after_forward and s.shards_params)
            size = f"shard_group_size={config.shard_group_size}" if config.shard_group_size else \
                "the default shard group (shard_group_size=0: every rank of the node)"
            raise ValueError(
                f"strategy {config.strategy!r} needs >= 2 replicas, but {size} holds all {world_size} "
                f"ranks: that is {flat} plus an all-reduce over 1 rank the communication model does "
                f"not count; use strategy {flat!r}, or a shard_group_size giving >= 2 groups"
            )


def _validate_knobs(config: RunConfig, row, world_size: int) -> None:
    """FSDP2's tuning knobs (``explicit_prefetch``, ``reshard_after_forward_size``,
    ``reshard_after_backward``) need FSDP2 with sharded parameters; an int reshard must divide
    the shard group and be smaller.

    Raises:
        ValueError: naming the key and what is accepted.
    """
    fsdp2 = config.api == "fsdp2" and row.wrapper == "fsdp" and row.shards_params
    for key, default in (("explicit_prefetch", 0), ("reshard_after_forward_size", 0),
                         ("reshard_after_backward", True), ("count_gathered", False)):
        if getattr(config, key) != default and not fsdp2:
            accepted = ", ".join(s.name for s in STRATEGY_TABLE.values() if s.runs_with("fsdp2") and s.shards_params
                                 and s.wrapper == "fsdp")
            raise ValueError(f"config key {key!r}={getattr(config, key)!r} is FSDP2's: it needs api='fsdp2' and "
                             f"strategy {accepted}; got api={config.api!r}, strategy={config.strategy!r}")
    size = config.reshard_after_forward_size
    if size:
        # a sharding row here: the world unless hybrid
        group = run_shard_group(config.strategy, world_size, config.shard_group_size)
        if not row.reshard_after_forward or group % size or size >= group:
            raise ValueError(f"config key 'reshard_after_forward_size'={size} must divide the shard group of "
                             f"{group} ranks and be smaller, with a strategy that reshards after forward "
                             f"(FULL_SHARD, HYBRID_SHARD); got strategy {config.strategy!r} on {world_size} ranks")
        if config.cpu_offload:
            raise ValueError("config key 'reshard_after_forward_size' with cpu_offload=True: FSDP2 keeps the "
                             "post-forward shards on the device; use one or the other")


SPEC = RunSpec("fsdp_train", __doc__, CONFIG, validate)
