"""Train the handbook's model through Accelerate's FSDP config, and report the sharding Accelerate really applied.

The torch-free half of :mod:`handbook_lib.runs.accelerate_fsdp`: its config and the checks the
launcher makes before any process starts (:class:`~handbook_lib.core.run_spec.RunSpec`).
"""

from __future__ import annotations

from handbook_lib.core.config import RunConfig
from handbook_lib.core.run_spec import RunSpec
from handbook_lib.core.strategies import get_strategy
from handbook_lib.integrations.frameworks import fsdp_strategies

CONFIG = RunConfig


def validate(config: RunConfig, world_size: int) -> None:
    """Reject, before any process starts, what this run cannot do.

    Raises:
        ValueError: naming the key and what is accepted.
    """
    row = get_strategy(config.strategy)
    accepted = fsdp_strategies("fsdp2")  # what the Accelerate writer takes, with FSDP2
    if config.strategy not in accepted or config.api != "fsdp2":
        raise ValueError(f"accelerate_fsdp runs api='fsdp2' with strategy {', '.join(accepted)}; "
                         f"got api={config.api!r}, strategy={row.name!r}")
    if world_size < 2:
        raise ValueError(f"accelerate_fsdp needs >= 2 ranks, got {world_size}")
    if config.precision != "fp32" or config.cpu_offload or config.activation_checkpointing != "none":
        raise ValueError("accelerate_fsdp runs precision='fp32' without cpu_offload or activation_checkpointing")
    if config.steps < 2 or config.grad_accum_steps != 1 or config.max_grad_norm:
        raise ValueError("accelerate_fsdp needs steps >= 2, grad_accum_steps=1 and max_grad_norm=0")
    config.check_batch(world_size)


SPEC = RunSpec("accelerate_fsdp", __doc__, CONFIG, validate)
