"""Train the handbook's model with DeepSpeed ZeRO and with FSDP2 side by side; check DeepSpeed's bytes and collectives.

The torch-free half of :mod:`handbook_lib.runs.deepspeed_zero`: its config, the losses' tolerance
(whose keys are the precisions it runs) and the checks the launcher makes before any process
starts (:class:`~handbook_lib.core.run_spec.RunSpec`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import ClassVar

from handbook_lib.core.config import LayoutConfig, LeversConfig, RunConfig
from handbook_lib.core.run_spec import RunSpec
from handbook_lib.core.strategies import get_strategy, strategies_where
from handbook_lib.models.zero_peak import BOOK_RUNS, ZeroKnobs

@dataclass(frozen=True)
class ZeroRunConfig(RunConfig):
    """A ZeRO run: the book's run config, a ZeRO strategy, and ZeRO-3's keys (elements)."""

    MINIMUMS: ClassVar[Mapping[str, int]] = {**RunConfig.MINIMUMS, "persistence_threshold": 0,
                                             "prefetch_bucket_size": 0, "max_reuse_distance": 0}

    layout: LayoutConfig = field(default_factory=lambda: LayoutConfig(strategy="ZERO3"))
    """``strategy``: ``ZERO1``, ``ZERO2`` or ``ZERO3`` (DeepSpeed's stage); ZERO3 by default."""
    levers: LeversConfig = field(default_factory=lambda: LeversConfig(init="full"))
    """``init``: DeepSpeed partitions the whole seeded model in ``deepspeed.initialize``: ``full`` only."""
    persistence_threshold: int = 0
    """ZeRO-3 keeps tensors of at most this many elements whole on every rank
    (``stage3_param_persistence_threshold``; 0 shards every tensor; DeepSpeed's default is
    100000)."""
    prefetch_bucket_size: int = 0
    """ZeRO-3 gathers this many elements ahead of their use (``stage3_prefetch_bucket_size``;
    0, the measurement config, gathers each module when it runs; DeepSpeed's default is 5e7)."""
    max_reuse_distance: int = 0
    """ZeRO-3 keeps a module gathered if the step uses it again within this many elements
    (``stage3_max_reuse_distance``; 0, the measurement config, gathers again in backward;
    DeepSpeed's default is 1e9)."""

    def zero3_knobs(self) -> ZeroKnobs:
        """ZeRO-3's keys as the engine gets them."""
        return replace(BOOK_RUNS, persistence_threshold=self.persistence_threshold,
                       prefetch_bucket_size=self.prefetch_bucket_size, max_reuse_distance=self.max_reuse_distance)


CONFIG = ZeroRunConfig


LOSS_TOLERANCE = {"fp32": 1e-6, "bf16-mixed": 1e-3, "bf16": 1e-3}
"""Relative tolerance of DeepSpeed's losses against FSDP2's. fp32: the same arithmetic in
another order (1e-6 of a loss near 7 is 7e-6 nats). bf16: both compute in bf16 from the same
fp32 weights, but round in different places; 1e-3 is a quarter of bf16's 2**-8 spacing. Pure bf16
(ZeRO's bf16 master and states, FSDP2's bf16 model) measured within 5e-5 of each other."""


def validate(config: ZeroRunConfig, world_size: int) -> None:
    """Reject, before any process starts, what this run cannot do.

    Raises:
        ValueError: naming the key and what is accepted.
    """
    row = get_strategy(config.strategy)
    if row.wrapper != "deepspeed":
        raise ValueError(f"deepspeed_zero runs strategy {', '.join(strategies_where(wrapper='deepspeed'))}; "
                         f"got {config.strategy!r} (run FSDP and DDP with fsdp_train)")
    if world_size < 2:
        raise ValueError(f"deepspeed_zero needs >= 2 ranks to shard anything, got {world_size}")
    if row.zero_stage != 3 and (config.persistence_threshold or config.prefetch_bucket_size
                                or config.max_reuse_distance):
        raise ValueError("config keys 'persistence_threshold', 'prefetch_bucket_size' and 'max_reuse_distance' "
                         f"are ZeRO-3's; with strategy {config.strategy!r} leave them 0")
    if config.precision not in LOSS_TOLERANCE:
        raise ValueError(f"deepspeed_zero runs precision {', '.join(LOSS_TOLERANCE)}; got {config.precision!r}")
    if config.set_to_none:
        raise ValueError("config key 'set_to_none'=True: DeepSpeed's engine frees the gradients itself (its step "
                         "releases them); give False")
    if config.precision == "bf16" and config.cpu_offload:
        raise ValueError("config key 'precision'='bf16' with 'cpu_offload'=True: DeepSpeed offloads a bf16 master "
                         "and bf16 optimizer states only to its compiled CPU Adam; use precision bf16-mixed")
    if config.init != "full":
        raise ValueError(f"deepspeed_zero accepts init='full' only (DeepSpeed partitions a whole model); "
                         f"got {config.init!r}")
    if config.grad_accum_steps != 1 or config.activation_checkpointing != "none":
        raise ValueError("deepspeed_zero runs grad_accum_steps=1 and activation_checkpointing=none only")
    config.check_constant_lr("deepspeed_zero")
    if config.steps < 2:
        raise ValueError(f"deepspeed_zero needs steps >= 2 (the optimizer state exists after the first), "
                         f"got {config.steps}")
    if row.zero_stage == 3 and config.steps < 3:
        raise ValueError(
            f"deepspeed_zero needs steps >= 3 with ZeRO-3 (got {config.steps}): DeepSpeed records the "
            "order of the modules in the first steps and compares it across ranks with broadcasts, so "
            "the measured (last) step must be the third or later"
        )
    config.check_batch(world_size)


SPEC = RunSpec("deepspeed_zero", __doc__, CONFIG, validate)
