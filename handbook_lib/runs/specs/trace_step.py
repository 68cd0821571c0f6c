"""Profile one FSDP2 training step and read FSDP2's own ranges from the trace.

The torch-free half of :mod:`handbook_lib.runs.trace_step`: its config and the checks the
launcher makes before any process starts (:class:`~handbook_lib.core.run_spec.RunSpec`).
"""

from __future__ import annotations

from handbook_lib.core.config import RunConfig
from handbook_lib.core.run_spec import RunSpec
from handbook_lib.core.strategies import get_strategy, strategies_where

CONFIG = RunConfig


def validate(config: RunConfig, world_size: int) -> None:
    """Reject, before any process starts, what this run cannot do: it traces FSDP2 with sharded
    parameters over the whole world, one micro-step, a constant learning rate.

    Raises:
        ValueError: naming the key and what is accepted.
    """
    row = get_strategy(config.strategy)
    accepted = strategies_where(wrapper="fsdp", shards_params=True, hybrid=False)
    if config.api != "fsdp2" or config.strategy not in accepted:
        raise ValueError(f"trace_step runs api='fsdp2' with strategy {', '.join(accepted)}; "
                         f"got api={config.api!r}, strategy={row.name!r}")
    if world_size < 2:
        raise ValueError(f"trace_step needs >= 2 ranks, got {world_size}")
    if config.steps < 2 or config.grad_accum_steps != 1:
        raise ValueError(f"trace_step needs steps >= 2 (the last one is traced) and grad_accum_steps=1; "
                         f"got steps={config.steps}, grad_accum_steps={config.grad_accum_steps}")
    config.check_constant_lr("trace_step")
    config.check_batch(world_size)


SPEC = RunSpec("trace_step", __doc__, CONFIG, validate)
