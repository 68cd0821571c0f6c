"""The run config of chapter 9's runs: the axes beyond FSDP, in the shared vocabulary.

:class:`ParallelConfig` adds to :class:`~handbook_lib.core.config.RunConfig` the keys
``tp_size``, ``sequence_parallel``, ``sp_size`` and ``sp_method``, and refuses, in one line naming
the key, every shape the runs ``tensor_parallel`` and ``sequence_parallel`` cannot split.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from handbook_lib.core.config import RunConfig
from handbook_lib.core.parallel_layout import SP_METHODS, ParallelLayout, SpMethod
from handbook_lib.core.strategies import get_strategy, strategies_where

__all__ = ["SP_METHODS", "AXES_LEVERS_REFUSED", "CONFIG_NAMES", "ParallelConfig"]


CONFIG_NAMES: dict[str, str] = {
    "tp": "config key 'tp_size'={}", "sp": "config key 'sp_size'={}", "world": "the number of ranks {}",
    "nhead": "'nhead'={}", "ffn": "'dim_feedforward'={}", "vocab": "'vocab_size'={}", "seq_len": "'seq_len'={}",
    "sp_method": "'sp_method'={}", "sequence_parallel": "'sequence_parallel'={}"}
"""How a :class:`ParallelConfig`'s refusals name the layout's quantities (its keys)."""


AXES_LEVERS_REFUSED: dict[str, str] = {
    "api": "the tensor and sequence axes compose with FSDP2 (fully_shard on DTensor parameters); "
           "accepted: api='fsdp2'",
    "count_gathered": "count_gathered is fsdp_train's probe of FSDP2's gathered units; accepted: False",
}
"""The keys :meth:`ParallelConfig.check_runnable` refuses away from their defaults, and why: the
only ones; every other key of :class:`~handbook_lib.core.config.RunConfig` runs with any layout."""


@dataclass(frozen=True)
class ParallelConfig(RunConfig):
    """A :class:`RunConfig` plus the axes beyond FSDP (chapter 9): tensor parallelism inside a
    group of ``tp_size`` ranks, or the sequence split over ``sp_size`` ranks.

    The ranks form a 2-D mesh (``dp``, ``tp``) or (``dp``, ``sp``): the inner axis is
    contiguous ranks (those of one node), the outer one strides across them, and the
    ``world_size / (tp_size * sp_size)`` data-parallel ranks each take an equal share of the
    global batch. With tensor parallelism FSDP2 shards over the ``dp`` axis (each rank holds
    1/tp of a layer, then 1/dp of that); with the sequence split it shards over every rank,
    since the ranks of an ``sp`` group hold the same parameters and each computes gradients from
    its part of the sequence (torchtitan folds its context-parallel axis into FSDP the same way). Every shape a key
    allows runs, or is refused here in one line naming the key; what depends on the world size
    is refused by :meth:`data_parallel_size`.
    """

    tp_size: int = 1
    """Ranks of one tensor-parallel group (the inner mesh axis): each holds 1/tp_size of every
    layer's Q, K, V and output projections (its heads) and of its feed-forward width, and of the
    embedding's and the head's vocabulary rows. Must divide ``nhead`` and ``dim_feedforward``;
    a ``vocab_size`` it does not divide is padded to a multiple of it, as Megatron does
    (:attr:`padded_vocab_size`; the padded rows' logits are held out of the loss)."""
    sequence_parallel: bool = False
    """With ``tp_size`` > 1: keep the activations between the tensor-parallel blocks (the norms
    and residuals) split by sequence over the group (Megatron's sequence parallelism): each
    block's all-reduce becomes a reduce-scatter after it and an all-gather before the next.
    Needs ``seq_len`` divisible by ``tp_size``."""
    sp_size: int = 1
    """Ranks that split each sequence (the inner mesh axis): each holds seq_len/sp_size tokens
    of every sequence in its data-parallel share, end to end through the model; the attention
    core (``sp_method``) lets every token see the tokens before it on the other ranks."""
    sp_method: SpMethod = "ulysses"
    """With ``sp_size`` > 1: ``ulysses`` (needs ``nhead`` divisible by ``sp_size``) or ``ring``."""

    MINIMUMS: ClassVar[Mapping[str, int]] = {**RunConfig.MINIMUMS, "tp_size": 1, "sp_size": 1}

    def __post_init__(self) -> None:
        super().__post_init__()
        tp = self.tp_size
        if self.sequence_parallel and tp == 1:
            raise ValueError("config key 'sequence_parallel'=True splits the tensor-parallel group's "
                             "activations by sequence: it needs tp_size >= 2, got 1")
        self.layout().check_shape(nhead=self.nhead, ffn=self.dim_feedforward, seq_len=self.seq_len,
                                  sequence_parallel=self.sequence_parallel, names=CONFIG_NAMES)

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary rows the tensor-parallel model holds: ``vocab_size`` rounded up to a
        multiple of ``tp_size`` (:meth:`ParallelLayout.padded_vocab`)."""
        return self.layout().padded_vocab(self.vocab_size)

    def layout(self, world_size: int | None = None) -> ParallelLayout:
        """The parallel layout of this config on ``world_size`` ranks: ``tp_size`` and ``sp_size``
        inner, the data-parallel ranks outside them sharded as ``strategy`` says (FULL_SHARD: all
        of them; a hybrid strategy: groups of ``shard_group_size`` data-parallel ranks, replicated
        across the groups). ``None``: the model-parallel degrees alone, one data-parallel rank.

        Raises:
            ValueError: if ``tp_size * sp_size`` does not divide ``world_size``, or a hybrid
                strategy's ``shard_group_size`` (0 or not dividing) the data-parallel ranks
                (:meth:`ParallelLayout.for_world <handbook_lib.core.parallel_layout.ParallelLayout.for_world>`).
        """
        world = self.inner_size if world_size is None else world_size
        row = get_strategy(self.strategy)
        group = None
        if row.hybrid and world_size is not None:
            if not self.shard_group_size:
                raise ValueError(f"config key 'shard_group_size'=0: strategy {self.strategy!r} with tp_size "
                                 "or sp_size needs the data-parallel ranks of one shard group named, >= 1")
            group = self.shard_group_size
        return ParallelLayout.for_world(world, tp=self.tp_size, sp=self.sp_size, sp_method=self.sp_method,
                                        shard_group=group, replicate=not row.sharded, names=CONFIG_NAMES)

    def check_runnable(self, run: str, world_size: int) -> int:
        """Refuse, for run ``run`` (``tensor_parallel``, ``sequence_parallel``), what no layout
        can run here: a world the axes do not divide (:meth:`data_parallel_size`), a strategy
        FSDP2 does not apply (``NONE``, ``DDP``, ``NO_SHARD``, DeepSpeed's), a key of
        :data:`AXES_LEVERS_REFUSED` away from its default, or fewer than 2 steps.

        Returns:
            The data-parallel size.

        Raises:
            ValueError: one line naming the key and what the run accepts.
        """
        default = ParallelConfig()
        for key, why in AXES_LEVERS_REFUSED.items():
            if getattr(self, key) != getattr(default, key):
                raise ValueError(f"config key {key!r}={getattr(self, key)!r} with {run}: {why}")
        row = get_strategy(self.strategy)
        if not row.runs_with("fsdp2") or row.wrapper != "fsdp":
            raise ValueError(f"config key 'strategy'={self.strategy!r}: {run} shards with FSDP2; accepted: "
                             f"{', '.join(strategies_where(wrapper='fsdp', fsdp2=True))}")
        dp = self.data_parallel_size(world_size)
        if self.steps < 2:
            raise ValueError(f"config key 'steps'={self.steps}: {run} measures its last step with the "
                             "optimizer state in place; it needs steps >= 2")
        return dp

    @property
    def inner_size(self) -> int:
        """Ranks of the inner mesh axes: ``tp_size * sp_size``."""
        return self.tp_size * self.sp_size

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel ranks (the outer mesh axis), each with its own share of the global
        batch: ``world_size / (tp_size * sp_size)``.

        Raises:
            ValueError: if ``tp_size * sp_size`` does not divide ``world_size``, or the global
                batch does not divide over the data-parallel ranks (and ``grad_accum_steps``).
        """
        key = "tp_size x sp_size" if self.tp_size > 1 and self.sp_size > 1 else \
            "tp_size" if self.tp_size > 1 else "sp_size"
        dp = self.layout(world_size).dp
        if self.batch_size % (dp * self.grad_accum_steps):
            raise ValueError(f"batch_size={self.batch_size} must be divisible by the {dp} "
                             f"data-parallel rank(s) (world size {world_size} / {key} "
                             f"{self.inner_size})"
                             + (f" times grad_accum_steps={self.grad_accum_steps}"
                                if self.grad_accum_steps > 1 else ""))
        return dp
