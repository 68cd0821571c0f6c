"""The strategy table: what each way of training on many ranks shards, and how each library
spells it. Pure: no ``torch``. One row per strategy; every other module reads this table.

Chapter 1 names the strategies, chapter 2 prices their memory, chapter 3 their communication,
chapter 4 chooses between them, chapter 5 runs each, chapter 7 maps them to DeepSpeed ZeRO.

A row says *what is sharded at rest* (between steps) — parameters, gradients, optimizer state —
and *what happens inside a step*: whether parameters are freed after forward and gathered again
in backward (``reshard_after_forward``), whether the ranks form a 2-D mesh that shards within a
group and replicates across groups (``hybrid``), and how gradients are reduced. From those flags
the memory model (:mod:`handbook_lib.models.memory`), the communication model (:mod:`handbook_lib.models.traffic`),
the planner (:mod:`handbook_lib.models.planner`) and the runtime (:mod:`handbook_lib.runtime.training`) derive
everything they do; none of them compares a strategy's name.

Adding a strategy is one row here plus, if it needs a new wrapper, one apply function in
:mod:`handbook_lib.runtime.build` (see :data:`WRAPPERS`; DeepSpeed's engine is built by
:mod:`handbook_lib.integrations.zero_engine`, since it owns the optimizer too).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from handbook_lib.core.checks import check_int
from handbook_lib.core.parallel_layout import ParallelLayout

__all__ = [
    "StrategyName",
    "Wrapper",
    "WRAPPERS",
    "Strategy",
    "STRATEGY_TABLE",
    "STRATEGIES",
    "PLAN_STRATEGIES",
    "runnable_strategy",
    "run_shard_group",
    "FSDP2_SPELLING",
    "get_strategy",
    "strategies_where",
]

StrategyName = Literal["NONE", "DDP", "NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD",
                       "HYBRID_SHARD_ZERO2", "ZERO1", "ZERO2", "ZERO3"]
"""The run-config values of ``strategy`` (FSDP1's spelling, plus ``NONE``, ``DDP`` and DeepSpeed's
ZeRO stages); the table's keys, in this order (a test keeps the two equal)."""

Wrapper = Literal["none", "ddp", "fsdp", "deepspeed"]
WRAPPERS: dict[str, str] = {
    "none": "the plain module in one process: no wrapper, no collective",
    "ddp": "torch.nn.parallel.DistributedDataParallel: full replicas, gradients all-reduced in "
           "buckets during backward",
    "fsdp": "FSDP (FSDP2's fully_shard, or FSDP1's FullyShardedDataParallel): one collective per "
            "unit, parameters sharded along dim 0",
    "deepspeed": "a DeepSpeed engine (deepspeed.initialize) with ZeRO stage 1, 2 or 3: flat fp32 "
                 "master partitions, one collective per module (stage 3)",
}
"""What applies a strategy at run time (:func:`handbook_lib.runtime.build.parallelize` has one
apply function per PyTorch wrapper; :func:`handbook_lib.integrations.zero_engine.build_engine` applies
DeepSpeed's)."""


@dataclass(frozen=True)
class Strategy:
    """One strategy: what it shards, when it gathers, and its names in FSDP1, FSDP2 and ZeRO."""

    name: str
    """The run-config value, FSDP1's ``ShardingStrategy`` spelling (``FULL_SHARD`` ...)."""
    wrapper: Wrapper
    """What applies it at run time: a key of :data:`WRAPPERS`."""
    shards_params: bool
    """Parameters are sharded at rest (between steps)."""
    shards_grads: bool
    """Gradients are reduce-scattered and kept as shards (else all-reduced, kept whole)."""
    shards_optimizer: bool
    """Optimizer states are sharded."""
    reshard_after_forward: bool
    """Parameters gathered for forward are freed after it and gathered again for backward
    (FSDP2's ``reshard_after_forward``). False keeps them gathered from forward to backward."""
    hybrid: bool
    """Shard within groups of ``shard_group_size`` ranks, replicate across groups (a 2-D
    (replicate, shard) mesh); gradients are then all-reduced across the groups."""
    fsdp1: str | None
    """FSDP1's ``torch.distributed.fsdp.ShardingStrategy`` member, or ``None``."""
    fsdp2: bool
    """Available with FSDP2's ``fully_shard`` (see :attr:`fsdp2_spelling`)."""
    zero_stage: int | None
    """The DeepSpeed ZeRO stage with the same sharding at rest, or ``None`` (see
    :attr:`zero_note`)."""
    zero_note: str
    """How ZeRO's stage differs, in words (empty if it does not)."""
    grad_bucket_copy: bool
    """Gradients are also copied into separate communication buckets (DDP's default,
    ``gradient_as_bucket_view=False``): one more gradient-sized buffer on every rank."""
    summary: str
    """One line for a table: what it shards."""

    @property
    def distributed(self) -> bool:
        """Runs on several ranks (every strategy but ``NONE``)."""
        return self.wrapper != "none"

    @property
    def sharded(self) -> bool:
        """Shards anything across ranks."""
        return self.shards_params or self.shards_grads or self.shards_optimizer

    @property
    def fully_sharded(self) -> bool:
        """FSDP over one group, everything sharded, parameters freed after forward: what chapter
        9's runs compose with tensor and sequence parallelism (FULL_SHARD's row)."""
        return (self.wrapper == "fsdp" and self.shards_params and self.shards_grads and self.shards_optimizer
                and self.reshard_after_forward and not self.hybrid)

    @property
    def fsdp2_spelling(self) -> str:
        """How the strategy is written with FSDP2 (or what replaces it)."""
        if self.wrapper == "none":
            return "the plain module, one process: no wrapper"
        if self.wrapper == "ddp":
            return "DistributedDataParallel (or replicate()); not FSDP"
        if self.wrapper == "deepspeed":
            return f"deepspeed.initialize(...) with ZeRO stage {self.zero_stage}; not FSDP"
        if not self.fsdp2:
            return f"none: FSDP2 has no {self.name}; use DDP"
        mesh = "mesh=<2-D (replicate, shard) mesh>, " if self.hybrid else ""
        return f"fully_shard(m, {mesh}reshard_after_forward={self.reshard_after_forward})"

    def runs_with(self, api: str) -> bool:
        """Whether the runtime can apply this strategy with ``api`` (``fsdp2`` or ``fsdp1``);
        no plain wrapper nor DDP needs one; a DeepSpeed row is applied by DeepSpeed, with
        neither (the ``deepspeed_zero`` run)."""
        if self.wrapper == "deepspeed":
            return False
        if self.wrapper != "fsdp":
            return True
        return self.fsdp2 if api == "fsdp2" else self.fsdp1 is not None

    def torch_only(self, what: str) -> Strategy:
        """This row, if PyTorch applies it (no wrapper, DDP or FSDP); ``what`` names the caller.

        Raises:
            ValueError: for a DeepSpeed row, pointing to :mod:`handbook_lib.models.zero`, which models
                DeepSpeed's own layout and collectives.
        """
        if self.wrapper == "deepspeed":
            raise ValueError(f"{what} models PyTorch's strategies ({', '.join(strategies_where(wrapper='fsdp'))}, "
                             f"DDP, NONE); {self.name} is DeepSpeed's: see handbook_lib.models.zero")
        return self

    def shard_group(self, world_size: int, shard_group_size: int | None = None) -> int:
        """Ranks that shard one copy of the model (:attr:`ParallelLayout.dp_shard
        <handbook_lib.core.parallel_layout.ParallelLayout.dp_shard>` of :meth:`layout`).

        The whole world for a sharded strategy; 1 for a replicating one (DDP, NO_SHARD, NONE);
        ``shard_group_size`` for a hybrid one, where ``None`` or 0 means the whole world (the
        caller resolves torchrun's "one node" default before asking).

        Raises:
            ValueError: if the world size is not an int >= 1, or the group is not >= 1 and a
                divisor of it, or ``shard_group_size`` is given to a strategy that is not hybrid.
        """
        return self.layout(world_size, shard_group_size).dp_shard

    def layout(self, world_size: int, shard_group_size: int | None = None, *, tp: int = 1, sp: int = 1,
               sp_method: str = "ulysses", names: Mapping[str, str] | None = None) -> ParallelLayout:
        """The data-parallel degrees this strategy gives ``world_size`` ranks (beside ``tp`` and
        ``sp``): a sharded strategy shards over every data-parallel rank, a hybrid one over groups
        of ``shard_group_size`` (``None`` or 0: all of them) replicated across the groups, a
        replicating one (DDP, NO_SHARD, NONE) keeps a replica on each.

        Raises:
            ValueError: ``shard_group_size`` given to a strategy that is not hybrid, or what
                :meth:`ParallelLayout.for_world <handbook_lib.core.parallel_layout.ParallelLayout.for_world>`
                refuses, named as ``names`` spells it.
        """
        check_int("world_size", world_size, 1)
        if not self.hybrid and shard_group_size:
            raise ValueError(f"shard_group_size applies only to the hybrid strategies "
                             f"({', '.join(strategies_where(hybrid=True))}), not {self.name}")
        group = (shard_group_size or None) if self.hybrid else None
        return ParallelLayout.for_world(world_size, tp=tp, sp=sp, sp_method=sp_method, shard_group=group,
                                        replicate=not self.sharded, names=names)

    def check_cpu_offload(self, cpu_offload: bool, flag: str = "cpu_offload") -> None:
        """Refuse CPU offload for a strategy without FSDP's or ZeRO's offload (NONE, DDP).

        Raises:
            ValueError: naming ``flag`` (the key or option the caller was given) and the
                strategies that offload.
        """
        if cpu_offload and self.wrapper not in ("fsdp", "deepspeed"):
            offloading = strategies_where(wrapper="fsdp") + strategies_where(wrapper="deepspeed")
            raise ValueError(f"{flag} needs an FSDP or ZeRO strategy ({', '.join(offloading)}): "
                             f"{self.name} keeps the whole model state on the device")

    def deepspeed_config(self) -> dict | None:
        """The ``zero_optimization`` section of a DeepSpeed config with the same sharding at rest
        (``None`` where DeepSpeed 0.19 has none: see :attr:`zero_note`)."""
        if self.zero_stage is None:
            return None
        return {"stage": self.zero_stage}


STRATEGY_TABLE: dict[str, Strategy] = {s.name: s for s in (
    Strategy("NONE", "none", False, False, False, False, False, None, False, None, "",
             False, "one plain process: nothing shared, nothing sharded (the baseline)"),
    Strategy("DDP", "ddp", False, False, False, False, False, None, False, 0, "",
             True, "full replicas; gradients all-reduced in buckets"),
    Strategy("NO_SHARD", "fsdp", False, False, False, False, False, "NO_SHARD", False, 0,
             "ZeRO-0 is DDP: DeepSpeed has no FSDP-style unit-by-unit all-reduce",
             False, "full replicas, as DDP, gradients all-reduced unit by unit"),
    Strategy("SHARD_GRAD_OP", "fsdp", True, True, True, False, False, "SHARD_GRAD_OP", True, 2,
             "ZeRO-2 keeps the parameters whole at rest; FSDP shards them between steps",
             False, "gradients and optimizer state sharded; parameters gathered once per step"),
    Strategy("FULL_SHARD", "fsdp", True, True, True, True, False, "FULL_SHARD", True, 3, "",
             False, "everything sharded; parameters gathered in forward and again in backward"),
    Strategy("HYBRID_SHARD", "fsdp", True, True, True, True, True, "HYBRID_SHARD", True, None,
             "DeepSpeed 0.19 has no hybrid ZeRO-3: MiCS (mics_shard_size) was removed; ZeRO++'s hpZ "
             "keeps a copy of the parameters per node but shards the rest over every rank",
             False, "FULL_SHARD within each group of ranks, replicas across groups"),
    Strategy("HYBRID_SHARD_ZERO2", "fsdp", True, True, True, False, True, "_HYBRID_SHARD_ZERO2",
             True, None, "DeepSpeed has no hybrid ZeRO-2", False,
             "SHARD_GRAD_OP within each group of ranks, replicas across groups"),
    Strategy("ZERO1", "deepspeed", False, False, True, False, False, None, False, 1,
             "FSDP has no stage that shards only the optimizer state", False,
             "DeepSpeed ZeRO-1: fp32 master weights and optimizer state sharded"),
    Strategy("ZERO2", "deepspeed", False, True, True, False, False, None, False, 2,
             "SHARD_GRAD_OP also shards the parameters between steps; ZeRO-2 keeps them whole",
             False, "DeepSpeed ZeRO-2: ZeRO-1 plus gradients kept for this rank's partition only"),
    Strategy("ZERO3", "deepspeed", True, True, True, True, False, None, False, 3,
             "FULL_SHARD gathers per FSDP unit; ZeRO-3 per module, and keeps an fp32 master copy",
             False, "DeepSpeed ZeRO-3: parameters sharded too, gathered module by module"),
)}
"""Every strategy, by run-config name, in the order the book presents them."""

STRATEGIES: tuple[str, ...] = tuple(STRATEGY_TABLE)
"""The names, in table order (the run config's accepted ``strategy`` values)."""

PLAN_STRATEGIES: tuple[str, ...] = ("DDP", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD", "ZERO1", "ZERO2", "ZERO3")
"""What the planner prices (:func:`handbook_lib.models.planner.plan`): PyTorch's strategies a job
on many GPUs chooses among (every one by default, in this order), and DeepSpeed's ZeRO stages
when asked for one strategy."""

if STRATEGIES != get_args(StrategyName):  # pragma: no cover - caught at import and by a test
    raise AssertionError("StrategyName and STRATEGY_TABLE list different strategies")


FSDP2_SPELLING: dict[str, str] = {s.name: s.fsdp2_spelling for s in STRATEGY_TABLE.values()
                                  if s.wrapper != "deepspeed"}
"""How each FSDP1 ``ShardingStrategy`` is written with FSDP2's ``fully_shard`` (from
:data:`STRATEGY_TABLE`)."""


def get_strategy(name: str | Strategy) -> Strategy:
    """The table row of ``name`` (a row is returned as is).

    Raises:
        ValueError: ``strategy must be one of NONE, DDP, ..., got 'X'`` for an unknown name.
    """
    if isinstance(name, Strategy):
        return name
    try:
        return STRATEGY_TABLE[name]
    except (KeyError, TypeError):
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {name!r}") from None


def strategies_where(**flags: object) -> tuple[str, ...]:
    """Names of the rows whose attributes equal ``flags``, e.g.
    ``strategies_where(hybrid=True)`` → ``("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")``."""
    return tuple(s.name for s in STRATEGY_TABLE.values()
                 if all(getattr(s, k) == v for k, v in flags.items()))


def runnable_strategy(name: str, api: str, world_size: int) -> Strategy:
    """The row of strategy ``name``, if the runtime can apply it with ``api`` on ``world_size``
    ranks (what :func:`handbook_lib.runtime.build.check_runnable` asks, before any process starts).

    Raises:
        ValueError: naming the strategy and what is accepted (``NONE`` on several ranks, an
            FSDP strategy the chosen API lacks).
    """
    row = get_strategy(name)
    if not row.distributed and world_size != 1:
        raise ValueError(f"strategy {row.name!r} is one plain process; got {world_size} ranks")
    if not row.runs_with(api):
        accepted = [s.name for s in STRATEGY_TABLE.values() if s.wrapper == "fsdp" and s.runs_with(api)]
        raise ValueError(f"strategy {row.name!r} is not available with api={api!r}; "
                         f"accepted: {', '.join(accepted)}")
    return row


def run_shard_group(name: str, world_size: int, shard_group_size: int = 0) -> int:
    """Ranks that shard one copy of the model for a run of strategy ``name`` (:meth:`Strategy.shard_group`):
    for the hybrid strategies ``shard_group_size``, where 0 means the ranks of one node (torchrun's
    ``LOCAL_WORLD_SIZE`` on a rank; the whole world in the launcher, before any rank exists).

    Raises:
        ValueError: if the group does not divide the world size.
    """
    row = get_strategy(name)
    size = shard_group_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return row.shard_group(world_size, size if row.hybrid else None)
