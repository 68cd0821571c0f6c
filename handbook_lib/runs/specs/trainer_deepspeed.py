"""Train a Transformers model with the Trainer and DeepSpeed ZeRO, save it whole, load it back, and resume.

The torch-free half of :mod:`handbook_lib.runs.trainer_deepspeed`: its config and the checks the
launcher makes before any process starts (:class:`~handbook_lib.core.run_spec.RunSpec`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from handbook_lib.core.config import LayoutConfig, LeversConfig, RunConfig
from handbook_lib.core.files import check_writable_dir
from handbook_lib.core.run_spec import RunSpec
from handbook_lib.core.strategies import get_strategy, strategies_where

@dataclass(frozen=True)
class TrainerRunConfig(RunConfig):
    """A Trainer + DeepSpeed job: the run config, where the Trainer writes, and when it saves."""

    layout: LayoutConfig = field(default_factory=lambda: LayoutConfig(strategy="ZERO3"))
    """``strategy``: ``ZERO1``, ``ZERO2`` or ``ZERO3``; ZERO3 by default."""
    levers: LeversConfig = field(default_factory=lambda: LeversConfig(init="full"))
    """``init``: the Trainer gets a whole model (DeepSpeed partitions it): ``full`` only."""
    trainer_dir: str = ""
    """The Trainer's ``output_dir`` (required; must not exist yet or be empty): checkpoints and
    the saved model go there."""
    save_every: int = 2
    """``save_steps``: a checkpoint every this many steps; the resume starts from the first."""


CONFIG = TrainerRunConfig


def validate(config: TrainerRunConfig, world_size: int) -> None:
    """Reject, before any process starts, what this run cannot do.

    Raises:
        ValueError: naming the key and what is accepted.
    """
    row = get_strategy(config.strategy)
    if row.wrapper != "deepspeed":
        raise ValueError(f"trainer_deepspeed runs strategy {', '.join(strategies_where(wrapper='deepspeed'))}; "
                         f"got {config.strategy!r}")
    if not config.trainer_dir:
        raise ValueError("trainer_deepspeed needs trainer_dir (the Trainer's output_dir)")
    folder = check_writable_dir("trainer_dir", config.trainer_dir)
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"config key 'trainer_dir': {folder} exists and is not an empty folder; the Trainer "
                         "would write its checkpoints among files this run did not write")
    if not 1 <= config.save_every < config.steps:
        raise ValueError(f"config key 'save_every' must be in 1..steps-1 (a checkpoint to resume from before "
                         f"the end), got {config.save_every} with steps={config.steps}")
    if config.precision != "fp32":
        raise ValueError(f"trainer_deepspeed runs precision 'fp32' (its logits are compared bit for bit with "
                         f"the saved model's); got {config.precision!r}")
    if config.init != "full":
        raise ValueError(f"trainer_deepspeed accepts init='full' only; got {config.init!r}")
    if config.loss_chunks != 1:
        raise ValueError(f"config key 'loss_chunks'={config.loss_chunks}: the Trainer computes its own loss; give 1")
    if config.set_to_none:
        raise ValueError("config key 'set_to_none'=True: the Trainer and DeepSpeed free the gradients themselves; "
                         "give False")
    config.check_batch(world_size)


SPEC = RunSpec("trainer_deepspeed", __doc__, CONFIG, validate)
