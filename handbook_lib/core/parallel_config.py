"""The run config of chapter 9's runs: the axes beyond FSDP, in the shared vocabulary.

:class:`ParallelConfig` is a :class:`~handbook_lib.core.config.RunConfig` whose ``layout`` section
(:class:`AxesLayoutConfig`) adds the keys ``tp_size``, ``sequence_parallel``, ``sp_size``,
``sp_method`` and the pipeline's, and refuses, in one line naming the key, every shape chapter 9's
runs cannot split.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_args

from handbook_lib.core.config import LayoutConfig, RunConfig
from handbook_lib.core.parallel_layout import SP_METHODS, ParallelLayout, SpMethod
from handbook_lib.core.strategies import get_strategy, strategies_where

__all__ = ["SP_METHODS", "PP_SCHEDULES", "MULTI_STAGE", "AXES_LEVERS_REFUSED", "CONFIG_NAMES", "AxesLayoutConfig",
           "ParallelConfig"]

PpSchedule = Literal["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"]
PP_SCHEDULES: tuple[str, ...] = get_args(PpSchedule)
"""The pipeline schedules a run takes (``torch.distributed.pipelining``'s ``Schedule<name>``):
``GPipe`` (every micro-batch's forward, then every backward), ``1F1B`` (one forward, one
backward, once the pipeline is full), ``Interleaved1F1B`` (1F1B over ``pp_stages_per_rank``
stages per rank, each a smaller slice of the layers: a shorter bubble) and ``ZBVZeroBubble``
(two stages per rank placed in a V, rank r holding stages r and 2p − 1 − r, each backward split
into its input's gradient and, later, its weights', which fill the bubble)."""

MULTI_STAGE: tuple[str, ...] = ("Interleaved1F1B", "ZBVZeroBubble")
"""The schedules whose ranks hold more than one stage (``pp_stages_per_rank`` >= 2)."""


CONFIG_NAMES: dict[str, str] = {
    "tp": "config key 'tp_size'={}", "sp": "config key 'sp_size'={}", "world": "the number of ranks {}",
    "nhead": "'nhead'={}", "ffn": "'dim_feedforward'={}", "vocab": "'vocab_size'={}", "seq_len": "'seq_len'={}",
    "sp_method": "'sp_method'={}", "sequence_parallel": "'sequence_parallel'={}", "pp": "config key 'pp_size'={}",
    "layers": "'num_layers'={}"}
"""How a :class:`ParallelConfig`'s refusals name the layout's quantities (its keys)."""


AXES_LEVERS_REFUSED: dict[str, str] = {
    "api": "the tensor and sequence axes compose with FSDP2 (fully_shard on DTensor parameters); "
           "accepted: api='fsdp2'",
    "count_gathered": "count_gathered is fsdp_train's probe of FSDP2's gathered units; accepted: False",
}
"""The keys :meth:`ParallelConfig.check_runnable` refuses away from their defaults, and why: the
only ones; every other key of :class:`~handbook_lib.core.config.RunConfig` runs with any layout."""


@dataclass(frozen=True)
class AxesLayoutConfig(LayoutConfig):
    """The ``layout`` section of chapter 9's runs: :class:`~handbook_lib.core.config.LayoutConfig`'s
    keys (the strategy, over the data-parallel ranks) and the degrees of the other axes."""

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

    pp_size: int = 1
    """Pipeline ranks (the outermost mesh axis): each holds the layers of its stages, cut at layer
    boundaries (the embedding on the first stage, the head on the last), and passes each
    micro-batch's activations on to the next stage and their gradients back."""
    schedule: PpSchedule = "1F1B"
    """With ``pp_size`` > 1: the pipeline's schedule, the order each rank runs its micro-batches'
    forwards and backwards in (:data:`PP_SCHEDULES`)."""
    pp_microbatches: int = 4
    """With ``pp_size`` > 1: micro-batches a data-parallel rank's share of each batch is cut into;
    the schedule accumulates their gradients (``grad_accum_steps`` stays 1)."""
    pp_stages_per_rank: int = 1
    """With ``Interleaved1F1B``: stages each pipeline rank holds, ``v`` >= 2 (rank r holds stages
    r, r + pp, ...); 1 otherwise."""

    MINIMUMS: ClassVar[Mapping[str, int]] = {**LayoutConfig.MINIMUMS, "tp_size": 1, "sp_size": 1, "pp_size": 1,
                                             "pp_microbatches": 1, "pp_stages_per_rank": 1}


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

    layout: AxesLayoutConfig = field(default_factory=AxesLayoutConfig)
    """:class:`AxesLayoutConfig`: the strategy and its FSDP keys, and the axes beyond it."""

    MINIMUMS: ClassVar[Mapping[str, int]] = {**RunConfig.MINIMUMS, **AxesLayoutConfig.MINIMUMS}

    def __post_init__(self) -> None:
        super().__post_init__()
        tp = self.tp_size
        if self.sequence_parallel and tp == 1:
            raise ValueError("config key 'sequence_parallel'=True splits the tensor-parallel group's "
                             "activations by sequence: it needs tp_size >= 2, got 1")
        self.parallel_layout().check_shape(nhead=self.nhead, ffn=self.dim_feedforward, seq_len=self.seq_len,
                                  sequence_parallel=self.sequence_parallel, names=CONFIG_NAMES)
        if self.pp_size > 1:
            self.check_pipeline()
        if self.loss_chunks > 1:  # the axes' runs compute their loss themselves (vocabulary-parallel, per stage)
            raise ValueError(f"config key 'loss_chunks'={self.loss_chunks} chunks the cross-entropy of whole logits; "
                             "the runs of tensor, sequence and pipeline parallelism compute theirs otherwise: give 1")
        if self.set_to_none:  # their checks price the gradients at rest, kept
            raise ValueError("config key 'set_to_none'=True frees the gradients between steps; the runs of tensor, "
                             "sequence and pipeline parallelism price them kept: give False")

    @property
    def pp_stages(self) -> int:
        """Pipeline stages in all: ``pp_size · pp_stages_per_rank``."""
        return self.pp_size * self.pp_stages_per_rank

    def check_pipeline(self) -> None:
        """Refuse, in one line naming the key, a pipeline the schedule cannot run: more stages than
        layers, a stage count the schedule does not take, fewer micro-batches than 1F1B's stages,
        micro-batches the interleaved schedule cannot cut into rounds, or accumulation besides."""
        interleaved = self.schedule == "Interleaved1F1B"
        v, m, stages = self.pp_stages_per_rank, self.pp_microbatches, self.pp_stages
        if (self.schedule in MULTI_STAGE) != (v > 1) or (self.schedule == "ZBVZeroBubble" and v != 2):
            raise ValueError(f"config key 'pp_stages_per_rank'={v} with schedule={self.schedule!r}: "
                             "Interleaved1F1B takes 2 or more stages per rank, ZBVZeroBubble 2, GPipe and 1F1B one")
        if stages > self.num_layers:
            raise ValueError(f"config key 'pp_size'={self.pp_size} x 'pp_stages_per_rank'={v}: {stages} stages must "
                             f"be at most 'num_layers'={self.num_layers} (a stage holds whole layers)")
        if self.schedule != "GPipe" and m < self.pp_size:
            raise ValueError(f"config key 'pp_microbatches'={m}: {self.schedule} needs at least one per "
                             f"pipeline rank (pp_size={self.pp_size})")
        if interleaved and m % self.pp_size:
            raise ValueError(f"config key 'pp_microbatches'={m}: Interleaved1F1B runs them in rounds of "
                             f"pp_size={self.pp_size}; give a multiple of it")
        if self.grad_accum_steps > 1:
            raise ValueError(f"config key 'grad_accum_steps'={self.grad_accum_steps} with pp_size={self.pp_size}: "
                             "the schedule's micro-batches are the accumulation (pp_microbatches); give 1")

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary rows the tensor-parallel model holds: ``vocab_size`` rounded up to a
        multiple of ``tp_size`` (:meth:`ParallelLayout.padded_vocab`)."""
        return self.parallel_layout().padded_vocab(self.vocab_size)

    def parallel_layout(self, world_size: int | None = None) -> ParallelLayout:
        """The parallel layout of this config on ``world_size`` ranks: ``tp_size`` and ``sp_size``
        inner, the data-parallel ranks outside them sharded as ``strategy`` says (FULL_SHARD: all
        of them; a hybrid strategy: groups of ``shard_group_size`` data-parallel ranks, replicated
        across the groups). ``None``: the model-parallel degrees alone, one data-parallel rank.

        Raises:
            ValueError: if ``tp_size * sp_size`` does not divide ``world_size``, or a hybrid
                strategy's ``shard_group_size`` (0 or not dividing) the data-parallel ranks
                (:meth:`ParallelLayout.for_world <handbook_lib.core.parallel_layout.ParallelLayout.for_world>`).
        """
        world = max(1, self.pp_size) * self.inner_size if world_size is None else world_size
        row = get_strategy(self.strategy)
        group = None
        if row.hybrid and world_size is not None:
            if not self.shard_group_size:
                raise ValueError(f"config key 'shard_group_size'=0: strategy {self.strategy!r} with tp_size "
                                 "or sp_size needs the data-parallel ranks of one shard group named, >= 1")
            group = self.shard_group_size
        return ParallelLayout.for_world(world, tp=self.tp_size, sp=self.sp_size, sp_method=self.sp_method,
                                        pp=max(1, self.pp_size), shard_group=group, replicate=not row.sharded,
                                        names=CONFIG_NAMES)

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
        """The data-parallel ranks, each with its own share of the global batch:
        ``world_size / (pp_size · tp_size · sp_size)``.

        Raises:
            ValueError: if the model-parallel degrees do not divide ``world_size``, or the global
                batch does not divide over the data-parallel ranks (and ``grad_accum_steps``, or
                with a pipeline its ``pp_microbatches``).
        """
        named = [f"{key} {size}" for key, size in (("pp_size", self.pp_size), ("tp_size", self.tp_size),
                                                   ("sp_size", self.sp_size)) if size > 1]
        dp = self.parallel_layout(world_size).dp
        cut, cut_by = ((self.pp_microbatches, "pp_microbatches") if self.pp_size > 1
                       else (self.grad_accum_steps, "grad_accum_steps"))
        if self.batch_size % (dp * cut):
            raise ValueError(f"batch_size={self.batch_size} must be divisible by the {dp} "
                             f"data-parallel rank(s) (world size {world_size} / {' x '.join(named) or 1})"
                             + (f" times {cut_by}={cut}" if cut > 1 else ""))
        return dp
