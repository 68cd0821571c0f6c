"""Pipeline parallelism: the model cut into stages over ``pp_size`` ranks, run by a schedule; every byte sent checked.

The torch-free half of :mod:`handbook_lib.runs.pipeline`: its config (the vocabulary's
:class:`~handbook_lib.core.parallel_config.ParallelConfig`, with ``pp_size``, ``schedule``,
``pp_microbatches`` and ``pp_stages_per_rank``) and the checks the launcher makes before any
process starts (:class:`~handbook_lib.core.run_spec.RunSpec`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from handbook_lib.core.parallel_config import AxesLayoutConfig, ParallelConfig
from handbook_lib.core.parallel_layout import ParallelLayout
from handbook_lib.core.run_spec import RunSpec
from handbook_lib.core.strategies import get_strategy, strategies_where


@dataclass(frozen=True)
class PipelineLayoutConfig(AxesLayoutConfig):
    """The pipeline run's ``layout`` section: the pipeline spans every rank unless told otherwise."""

    pp_size: int = 0
    """Pipeline ranks; 0: every rank of the job (divided by ``tp_size · sp_size``)."""

    MINIMUMS: ClassVar[Mapping[str, int]] = {**AxesLayoutConfig.MINIMUMS, "pp_size": 0}


@dataclass(frozen=True)
class PipelineConfig(ParallelConfig):
    """A :class:`ParallelConfig` whose pipeline spans every rank unless told otherwise."""

    layout: PipelineLayoutConfig = field(default_factory=PipelineLayoutConfig)
    """:class:`PipelineLayoutConfig`: ``pp_size`` 0 by default, checked once the world is known
    (:meth:`on_world`)."""

    MINIMUMS: ClassVar[Mapping[str, int]] = {**ParallelConfig.MINIMUMS, **PipelineLayoutConfig.MINIMUMS}

    def on_world(self, world_size: int) -> PipelineConfig:
        """This config with ``pp_size`` 0 made every rank's (``world_size / (tp_size · sp_size)``),
        its pipeline checked (:meth:`ParallelConfig.check_pipeline`)."""
        if self.pp_size:
            return self
        return self.replace(pp_size=max(1, world_size // self.inner_size))

    def parallel_layout(self, world_size: int | None = None) -> ParallelLayout:
        """:meth:`ParallelConfig.parallel_layout`, the pipeline over every rank when ``pp_size`` is 0."""
        if self.pp_size == 0 and world_size is not None:
            return self.on_world(world_size).parallel_layout(world_size)
        return super().parallel_layout(world_size)


CONFIG = PipelineConfig

NOT_WITH_A_PIPELINE: dict[str, str] = {
    "sp_size": "the pipeline is not composed with a sequence split here yet; accepted: 1",
    "max_grad_norm": "clipping needs the norm of every stage's gradients, all-reduced over the pipeline, "
                     "which this run does not compute; accepted: 0",
    "cpu_offload": "offload is not applied to the stages here; accepted: False",
    "wrap": "each stage is wrapped per layer; accepted: 'layer'",
    "explicit_prefetch": "the schedule orders the stages' work; accepted: 0",
    "reshard_after_forward_size": "the strategy's resharding applies to the stages; accepted: 0",
}
"""The keys a pipeline run refuses away from their defaults, and why (the rest run)."""


def validate(config: ParallelConfig, world_size: int) -> None:
    """Reject, before any process starts, a config this run cannot execute.

    Raises:
        ValueError: naming the key and the values this run accepts.
    """
    if isinstance(config, PipelineConfig):
        config = config.on_world(world_size)
    if config.pp_size == 1:
        raise ValueError("config key 'pp_size'=1 cuts no pipeline: the pipeline run needs pp_size >= 2 "
                         "(or 0: every rank)")
    default = ParallelConfig()
    for key, why in NOT_WITH_A_PIPELINE.items():
        if getattr(config, key) != getattr(default, key):
            raise ValueError(f"config key {key!r}={getattr(config, key)!r} with pipeline: {why}")
    if config.precision == "fp16-mixed" and config.grad_scaler:
        raise ValueError("config key 'precision'='fp16-mixed' with pipeline: the schedule's backward runs "
                         "without a gradient scaler here; accepted: fp32, bf16-mixed")
    config.check_runnable("pipeline", world_size)
    if config.schedule == "ZBVZeroBubble":  # its stages run unwrapped (FSDP2's grads go unset)
        dp = config.data_parallel_size(world_size)
        if dp > 1:
            raise ValueError(f"config key 'pp_size'={config.pp_size} with ZBVZeroBubble leaves {dp} data-parallel "
                             "ranks; torch 2.13's weight-gradient pass leaves FSDP2-sharded stages' gradients unset, "
                             "so its stages run unsharded: give every rank to the pipeline (pp_size 0)")
        if config.tp_size > 1:
            raise ValueError(f"config key 'tp_size'={config.tp_size} with ZBVZeroBubble: its unsharded stages' "
                             "gradient bytes under TP are not modelled here (measured 88,512 B against 82,368 on "
                             "4 ranks); accepted: 1")
        if config.precision != "fp32":
            raise ValueError(f"config key 'precision'={config.precision!r} with ZBVZeroBubble: its stages run "
                             "without FSDP2, whose policy casts for mixed precision; accepted: fp32")
    if get_strategy(config.strategy).hybrid:
        accepted = ", ".join(strategies_where(hybrid=False, wrapper="fsdp", fsdp2=True))
        raise ValueError(f"config key 'strategy'={config.strategy!r} with pipeline: the stages shard over their "
                         f"whole data-parallel group here; accepted: {accepted}")


SPEC = RunSpec("pipeline", __doc__, CONFIG, validate)
