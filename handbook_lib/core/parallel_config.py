"""The run config of chapter 9's runs: the axes beyond FSDP, in the shared vocabulary.

:class:`ParallelConfig` adds to :class:`~handbook_lib.core.config.RunConfig` the keys
``tp_size``, ``sequence_parallel``, ``sp_size`` and ``sp_method``, and refuses, in one line naming
the key, every shape the runs ``tensor_parallel`` and ``sequence_parallel`` cannot split.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

from handbook_lib.core.config import RunConfig
from handbook_lib.core.strategies import get_strategy

__all__ = ["SP_METHODS", "PLAIN_KEYS", "ParallelConfig"]


SpMethod = Literal["ulysses", "ring"]
SP_METHODS: tuple[str, ...] = get_args(SpMethod)
"""How a sequence split over ``sp_size`` ranks is attended: ``ulysses`` (DeepSpeed's
``DistributedAttention``: all-to-alls trade the sequence split for a split of the heads) or
``ring`` (the book's ring attention: key and value blocks passed around the group by
point-to-point sends)."""


PLAIN_KEYS: tuple[str, ...] = (
    "shard_group_size", "wrap", "precision", "grad_accum_steps", "max_grad_norm", "activation_checkpointing",
    "cpu_offload", "explicit_prefetch", "reshard_after_forward_size", "sync_every_micro_step",
    "reshard_after_backward", "count_gathered", "lr_schedule", "warmup_steps")
"""Keys chapter 9's runs leave at their defaults: fp32, one micro-step, no clipping, no
recomputation or offload, a constant learning rate, FSDP2's default schedule (:meth:`ParallelConfig.check_runnable`)."""


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
    embedding's and the head's vocabulary rows. Must divide ``nhead``, ``dim_feedforward`` and
    ``vocab_size`` (an uneven split is refused, not padded)."""
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
        tp, sp = self.tp_size, self.sp_size
        if tp > 1 and sp > 1:
            raise ValueError(f"config keys 'tp_size'={tp} and 'sp_size'={sp}: a run splits one axis "
                             "beyond FSDP, tensors or sequences; set the other to 1")
        if self.sequence_parallel and tp == 1:
            raise ValueError("config key 'sequence_parallel'=True splits the tensor-parallel group's "
                             "activations by sequence: it needs tp_size >= 2, got 1")
        for key in ("nhead", "dim_feedforward", "vocab_size"):
            if getattr(self, key) % tp:
                raise ValueError(f"config key {key!r}={getattr(self, key)} must be divisible by "
                                 f"tp_size={tp} (each tensor-parallel rank holds 1/{tp}; uneven "
                                 "splits are refused)")
        if self.sequence_parallel and self.seq_len % tp:
            raise ValueError(f"config key 'seq_len'={self.seq_len} must be divisible by tp_size={tp} "
                             "with sequence_parallel=True")
        if self.seq_len % sp:
            raise ValueError(f"config key 'seq_len'={self.seq_len} must be divisible by sp_size={sp}")
        if sp > 1 and self.sp_method == "ulysses" and self.nhead % sp:
            raise ValueError(f"config key 'nhead'={self.nhead} must be divisible by sp_size={sp} "
                             "for sp_method=ulysses (its all-to-all splits the heads); use "
                             "sp_method=ring")

    def check_runnable(self, run: str, world_size: int, *, shards_over: str,
                       also_default: tuple[str, ...] = ()) -> int:
        """Refuse, for run ``run`` (``tensor_parallel``, ``sequence_parallel``), what chapter 9's
        runs do not do: a world the axes do not divide (:meth:`data_parallel_size`), another API or
        strategy than FSDP2's FULL_SHARD (which shards ``shards_over``, in words), any key of
        :data:`PLAIN_KEYS` or ``also_default`` away from its default, or fewer than 2 steps.

        Returns:
            The data-parallel size.

        Raises:
            ValueError: one line naming the key and what the run accepts.
        """
        dp = self.data_parallel_size(world_size)
        if self.api != "fsdp2" or not get_strategy(self.strategy).fully_sharded:
            raise ValueError(f"{run} shards {shards_over} with api='fsdp2', strategy='FULL_SHARD' only; "
                             f"got api={self.api!r}, strategy={self.strategy!r}")
        default = ParallelConfig()
        for key in (*PLAIN_KEYS, *also_default):
            if getattr(self, key) != getattr(default, key):
                raise ValueError(f"config key {key!r}={getattr(self, key)!r} is not supported by {run} "
                                 f"(it runs {key}={getattr(default, key)!r})")
        if self.steps < 2:
            raise ValueError(f"config key 'steps'={self.steps}: {run} measures its last step with the "
                             "optimizer state in place; it needs steps >= 2")
        return dp

    @property
    def inner_size(self) -> int:
        """Ranks of the inner mesh axis: ``tp_size * sp_size`` (one of them is 1)."""
        return self.tp_size * self.sp_size

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel ranks (the outer mesh axis), each with its own share of the global
        batch: ``world_size / (tp_size * sp_size)``.

        Raises:
            ValueError: if ``tp_size * sp_size`` does not divide ``world_size``, or the global
                batch does not divide over the data-parallel ranks (and ``grad_accum_steps``).
        """
        key = "tp_size" if self.tp_size > 1 else "sp_size"
        if world_size % self.inner_size:
            raise ValueError(f"config key {key!r}={self.inner_size} must divide the number of "
                             f"ranks {world_size}")
        dp = world_size // self.inner_size
        if self.batch_size % (dp * self.grad_accum_steps):
            raise ValueError(f"batch_size={self.batch_size} must be divisible by the {dp} "
                             f"data-parallel rank(s) (world size {world_size} / {key} "
                             f"{self.inner_size})"
                             + (f" times grad_accum_steps={self.grad_accum_steps}"
                                if self.grad_accum_steps > 1 else ""))
        return dp
