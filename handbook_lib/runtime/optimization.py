"""The optimizer of a run, its learning-rate schedule, and fp16's gradient scaler.

Chapter 1 builds the optimizer; chapter 5 adds the scaler that fp16 needs; chapter 6 saves all
three in a checkpoint, since a resumed job must continue each where it stopped (the scheduler's
step count, the scaler's factor and its count of good steps, the optimizer's moments).
"""

from __future__ import annotations

import functools

import torch

from handbook_lib.core.config import RunConfig
from handbook_lib.core.strategies import get_strategy
from handbook_lib.models.lr_schedule import lr_factor
from handbook_lib.runtime.distributed import RankContext

__all__ = ["IMPL_KWARGS", "build_optimizer", "build_zero_redundancy_optimizer", "build_lr_scheduler",
           "build_grad_scaler"]


IMPL_KWARGS: dict[str, dict[str, bool]] = {
    "default": {}, "for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True},
}
"""Each ``optimizer_impl`` of the run config as ``torch.optim``'s keywords (``default``: none,
so torch picks: foreach on CUDA, the for-loop on the CPU)."""


def _optimizer_class(name: str, impl: str) -> tuple[type[torch.optim.Optimizer], dict]:
    """The ``torch.optim`` class and keywords (learning rate aside) of optimizer ``name`` run as
    ``impl``."""
    if impl not in IMPL_KWARGS:
        raise ValueError(f"optimizer_impl must be one of {', '.join(IMPL_KWARGS)}; got {impl!r}")
    how: dict = dict(IMPL_KWARGS[impl])
    table: dict[str, tuple[type[torch.optim.Optimizer], dict]] = {
        "adamw": (torch.optim.AdamW, how), "adam": (torch.optim.Adam, how), "sgd": (torch.optim.SGD, how),
        "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9, **how})}
    if name not in table:
        raise ValueError(f"optimizer must be one of {', '.join(table)}; got {name!r}")
    return table[name]


def build_optimizer(params, name: str, lr: float, impl: str = "default") -> torch.optim.Optimizer:
    """The optimizer named by the run config (``adamw``, ``adam``, ``sgd``, ``sgd-momentum``),
    run as ``impl`` says (:data:`IMPL_KWARGS`)."""
    cls, kwargs = _optimizer_class(name, impl)
    return cls(params, lr=lr, **kwargs)


def build_zero_redundancy_optimizer(params, name: str, lr: float, impl: str = "default",
                                    group: torch.distributed.ProcessGroup | None = None) -> torch.optim.Optimizer:
    """PyTorch's ZeRO-1: the optimizer of :func:`build_optimizer` under
    ``torch.distributed.optim.ZeroRedundancyOptimizer`` over ``group`` (default: the world).
    Each rank keeps the state of, and updates, only its share of the parameter tensors (whole
    tensors: :func:`~handbook_lib.models.zero.zero_redundancy_partition`), then broadcasts
    them to the others; the model stays whole on every rank (DDP). Its local optimizer is
    ``.optim``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls, kwargs = _optimizer_class(name, impl)
    return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=group, lr=lr, **kwargs)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: RunConfig,
                       ) -> torch.optim.lr_scheduler.LambdaLR | None:
    """The scheduler of ``config.lr_schedule`` after ``config.warmup_steps`` of warm-up over
    ``config.steps`` steps (:func:`~handbook_lib.models.lr_schedule.lr_factor`), or ``None`` for a
    constant rate without warm-up. :func:`train` steps it after every optimizer step; its state
    (the steps it has seen) goes into a checkpoint with the optimizer's."""
    if config.lr_schedule == "constant" and config.warmup_steps == 0:
        return None
    factor = functools.partial(lr_factor, schedule=config.lr_schedule, warmup_steps=config.warmup_steps,
                               total_steps=config.steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_grad_scaler(config: RunConfig, ctx: RankContext) -> torch.amp.GradScaler | None:
    """The gradient scaler fp16 needs, or ``None`` (fp32, bf16, or ``grad_scaler=False``).

    fp16's smallest positive value is about 6e-8 (5.96e-8, subnormal); smaller gradients round
    to zero. The scaler multiplies the loss by a large factor (2**16 at first) so gradients are
    computed scaled, divides them back in fp32 before the optimizer step, skips a step whose
    gradients overflowed to inf/NaN and halves the factor then (and doubles it after 2,000 good
    steps). With FSDP1 the check for inf must agree across ranks, which ``ShardedGradScaler``
    does with an all-reduce; FSDP2's DTensor gradients let ``torch.amp.GradScaler`` do the same.
    """
    if config.precision != "fp16-mixed" or not config.grad_scaler:
        return None
    if config.api == "fsdp1" and get_strategy(config.strategy).wrapper == "fsdp":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=ctx.device.type, init_scale=config.grad_scale_init)
    return torch.amp.GradScaler(ctx.device.type, init_scale=config.grad_scale_init)
