"""The parallel layout: how many ranks each axis of a job spans, and every rule about them.

Pure: no ``torch``. Chapter 4 shards over one axis (data parallel, replicated or sharded,
:mod:`handbook_lib.core.strategies`), chapter 8 adds HSDP's second one, chapter 9 the tensor and
sequence axes and the pipeline. A :class:`ParallelLayout` holds the degree of every axis, as
torchtitan's ``ParallelDims`` does, and this module alone knows what they must divide: the product
of the degrees is the world; the pipeline degree divides it and is at most the layers (a stage
holds whole layers); the tensor degree divides the heads, the key/value heads, the feed-forward
width and the vocabulary (when the model does not pad it), and the sequence under Megatron's
sequence parallelism; the sequence degree divides the sequence, and the heads and key/value heads
with Ulysses' all-to-all; a shard group divides the data-parallel ranks; the tensor axis stays
inside a node (:data:`INTRA_NODE_AXES`). Every model, run, mesh builder and command asks
:meth:`ParallelLayout.for_world` or :meth:`ParallelLayout.check_shape` (or
:meth:`ParallelLayout.allows`) instead of restating a rule.

A refusal is one ``ValueError`` line in one phrase, ``<degree> must divide <what it does not>``,
each side spelt as the caller names it (``names``: a format string per quantity, as
:func:`~handbook_lib.models.planner.check_whole_nodes` takes), e.g. ``"--tp-size 16 must divide
the GPUs per node (8) and the KV heads (8)"`` or ``"config key 'tp_size'=2 must divide the number of
ranks 3"``.

The strategy table keeps what it is good at (what is sharded at rest, resharding after forward);
:meth:`~handbook_lib.core.strategies.Strategy.layout` maps a strategy and its
``shard_group_size`` onto the data-parallel degrees here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from handbook_lib.core.checks import check_int

__all__ = ["SP_METHODS", "MESH_DIMS", "INTRA_NODE_AXES", "LAYOUT_NAMES", "ParallelLayout"]

SpMethod = Literal["ulysses", "ring"]
SP_METHODS: tuple[str, ...] = get_args(SpMethod)
"""How a sequence split over ``sp`` ranks is attended: ``ulysses`` (DeepSpeed's
``DistributedAttention``: all-to-alls trade the sequence split for a split of the heads) or
``ring`` (the book's ring attention: key and value blocks passed around the group by
point-to-point sends)."""

MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "sp", "tp")
"""The mesh's dimensions, outermost first (torchtitan's order, its ``cp`` named ``sp`` here): the
innermost, ``tp``, is contiguous ranks, one node's."""

INTRA_NODE_AXES: tuple[str, ...] = ("tp",)
"""Axes whose groups must stay inside a node (their degree divides the GPUs per node): tensor
parallelism, whose collectives sit between two matrix products and need NVLink. The sequence
split may cross nodes (chapter 9 prices a ring across them and says when it stops hiding)."""

LAYOUT_NAMES: dict[str, str] = {
    "world": "world_size={}", "gpus_per_node": "gpus_per_node={}", "dp": "the {} data-parallel ranks",
    "pp": "pp_size={}", "tp": "tp_size={}", "sp": "sp_size={}", "dp_shard": "shard_group_size={}",
    "sp_method": "sp_method={}", "sequence_parallel": "sequence_parallel={}",
    "nhead": "nhead={}", "kv_heads": "num_kv_heads={}", "ffn": "dim_feedforward={}",
    "vocab": "vocab_size={}", "seq_len": "seq_len={}", "layers": "num_layers={}",
}
"""How a refusal spells each quantity by default: a format string its value fills. A caller
passes ``names`` with its own spelling of some (``{"tp": "--tp-size {}"}``)."""


def _key(spelt: Mapping[str, str], key: str) -> str:
    """How ``spelt`` names quantity ``key`` without its value (``"--tp-size {}"`` -> ``--tp-size``)."""
    return spelt[key].split("{")[0].rstrip(" =(") or key


def _and(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def _must_divide(names: Mapping[str, str], degree: str, value: int, wholes: list[tuple[str, int | None]],
                 also: str = "", then: str = "") -> str | None:
    """The one refusal of this module: ``value`` (axis ``degree``) must divide each ``(key,
    size)`` of ``wholes`` (``None``: not given); ``None`` when it does."""
    missed = [names[key].format(size) for key, size in wholes if size is not None and size % value]
    if not missed:
        return None
    return f"{names[degree].format(value)}{also} must divide {_and(missed)}{then}"


def _refusal(spelt: Mapping[str, str], tp: int, sp: int, sp_method: str, world: int | None,
             gpus_per_node: int | None, *, nhead: int | None = None, kv_heads: int | None = None,
             ffn: int | None = None, vocab: int | None = None, seq_len: int | None = None,
             sequence_parallel: bool = False, pp: int = 1, layers: int | None = None) -> str | None:
    """Every rule of a degree against what it must divide, in one place; the first refusal or
    ``None``. ``world`` (the ranks of one pipeline stage) is checked by the only model-parallel
    degree above 1 (both: by the caller); ``None`` leaves a quantity unchecked."""
    if pp > 1 and layers is not None and pp > layers:  # a stage holds whole layers, at least one
        return f"{spelt['pp'].format(pp)} must be at most {spelt['layers'].format(layers)} (a stage holds whole layers)"
    inner = world if tp == 1 or sp == 1 else None
    node = {axis: gpus_per_node if axis in INTRA_NODE_AXES else None for axis in ("tp", "sp")}
    checks = []
    if tp > 1:
        checks.append(_must_divide(spelt, "tp", tp, [("gpus_per_node", node["tp"]), ("world", inner),
                                                     ("nhead", nhead), ("kv_heads", kv_heads), ("ffn", ffn),
                                                     ("vocab", vocab)]))
        if sequence_parallel:
            checks.append(_must_divide(spelt, "tp", tp, [("seq_len", seq_len)],
                                       also=f" with {spelt['sequence_parallel'].format(True)}"))
    if sp > 1:
        checks.append(_must_divide(spelt, "sp", sp, [("gpus_per_node", node["sp"]), ("world", inner),
                                                     ("seq_len", seq_len)]))
        if sp_method == "ulysses":
            checks.append(_must_divide(
                spelt, "sp", sp, [("nhead", nhead), ("kv_heads", kv_heads)],
                also=f" with {spelt['sp_method'].format('ulysses')}",
                then=f" (its all-to-all splits the heads); {spelt['sp_method'].format('ring')} needs neither"))
    if tp > 1 and sp > 1:  # both split what each rank holds of a sequence's heads and positions
        both = {**spelt, "tp_sp": f"{spelt['tp'].format(tp)} x {spelt['sp'].format(sp)}".replace("{", "{{")
                .replace("}", "}}")}
        if sp_method == "ulysses":
            checks.append(_must_divide(both, "tp_sp", tp * sp, [("nhead", nhead), ("kv_heads", kv_heads)],
                                       also=f" with {spelt['sp_method'].format('ulysses')}",
                                       then=" (each tensor rank's heads are split again by the all-to-all)"))
        if sequence_parallel:
            checks.append(_must_divide(both, "tp_sp", tp * sp, [("seq_len", seq_len)],
                                       also=f" with {spelt['sequence_parallel'].format(True)}"))
    return next((c for c in checks if c), None)


@dataclass(frozen=True)
class ParallelLayout:
    """The degree of every axis of a job: ranks per group along it. Their product is the world.

    Build one from a world size with :meth:`for_world` (or from a strategy with
    :meth:`~handbook_lib.core.strategies.Strategy.layout`); ask it whether a model's shape splits
    with :meth:`check_shape`.
    """

    dp_replicate: int = 1
    """Data-parallel replicas of each shard (HSDP's outer dimension; DDP's and NO_SHARD's whole
    data-parallel degree)."""
    dp_shard: int = 1
    """Ranks that shard one copy of the model (FSDP's group; 1 for a replicating strategy)."""
    tp: int = 1
    """Tensor-parallel ranks: each holds 1/tp of every split projection, inside a node."""
    sp: int = 1
    """Sequence-split ranks: each holds seq_len/sp tokens of every sequence (context parallelism)."""
    sp_method: SpMethod = "ulysses"
    """How the sequence split attends across ranks (:data:`SP_METHODS`; unused at ``sp`` 1)."""
    pp: int = 1
    """Pipeline ranks (the outermost axis): each holds the layers of its stages (its share of the
    model, cut at layer boundaries) and passes activations to the next."""

    def __post_init__(self) -> None:
        for key in ("dp_replicate", "dp_shard", "tp", "sp", "pp"):
            check_int(key, getattr(self, key), 1)
        if self.sp_method not in SP_METHODS:
            raise ValueError(f"sp_method must be one of {', '.join(SP_METHODS)}, got {self.sp_method!r}")

    @property
    def world_size(self) -> int:
        """Ranks in all: the product of the degrees."""
        return self.pp * self.dp_replicate * self.dp_shard * self.sp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each takes its own share of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_group(self) -> int:
        """Ranks that shard one copy of the model's state (``dp_shard``)."""
        return self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP shards over: ``dp_shard`` times ``sp`` (the ranks of a sequence split hold the
        same parameters, so they shard them too: torchtitan's ``dp_shard_cp``)."""
        return self.dp_shard * self.sp

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp > 1

    @property
    def hybrid(self) -> bool:
        """Sharded within groups and replicated across them (HSDP's 2-D data-parallel mesh)."""
        return self.dp_replicate > 1 and self.dp_shard > 1

    def mesh_dims(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """``(names, sizes)`` of the axes with more than one rank, in :data:`MESH_DIMS` order: what
        ``init_device_mesh(device, sizes, mesh_dim_names=names)`` takes (empty for one process)."""
        dims = [(name, getattr(self, name)) for name in MESH_DIMS if getattr(self, name) > 1]
        return tuple(n for n, _ in dims), tuple(s for _, s in dims)

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, sp: int = 1, sp_method: str = "ulysses", pp: int = 1,
                  shard_group: int | None = None, replicate: bool = False, gpus_per_node: int | None = None,
                  names: Mapping[str, str] | None = None, **shape: Any) -> ParallelLayout:
        """The layout of ``world_size`` ranks with these model-parallel degrees; the data-parallel
        ranks are the rest: sharded over groups of ``shard_group`` (``None``: all of them) and
        replicated across the groups, or all replicas (``replicate``: DDP, NO_SHARD). With
        ``shape`` (as :meth:`shape_refusal` takes it), the model's sizes are checked too, in the
        same line as the world's.

        Raises:
            ValueError: one line, naming the degree as ``names`` spells it: a degree that is not an
                int >= 1, ``pp`` not dividing the world, ``tp x sp`` not dividing a stage's ranks, a
                shard group not dividing the data-parallel ranks, an intra-node axis not dividing
                ``gpus_per_node``, a size of ``shape`` a degree does not divide.
        """
        problem = cls.refusal(world_size, tp=tp, sp=sp, sp_method=sp_method, pp=pp, shard_group=shard_group,
                              gpus_per_node=gpus_per_node, names=names, **shape)
        if problem:
            raise ValueError(problem)
        dp = world_size // (pp * tp * sp)
        group = 1 if replicate else shard_group or dp
        return cls(dp // group, group, tp, sp, sp_method, pp)  # type: ignore[arg-type]

    @classmethod
    def refusal(cls, world_size: int, *, tp: int = 1, sp: int = 1, sp_method: str = "ulysses", pp: int = 1,
                shard_group: int | None = None, gpus_per_node: int | None = None,
                names: Mapping[str, str] | None = None, **shape: Any) -> str | None:
        """Why :meth:`for_world` refuses these degrees on ``world_size`` ranks (and
        :meth:`check_shape` a model of sizes ``shape``), in one line, or ``None``."""
        spelt = {**LAYOUT_NAMES, **(names or {})}
        check_int(_key(spelt, "world"), world_size, 1)
        for key, value in (("tp", tp), ("sp", sp), ("pp", pp)):
            check_int(_key(spelt, key), value, 1)
        if world_size % pp:
            return _must_divide(spelt, "pp", pp, [("world", world_size)])
        if pp > 1:  # the ranks of one stage: the other axes split them
            world_size //= pp
            spelt = {**spelt, "world": "the {} ranks of a pipeline stage"}
        if sp_method not in SP_METHODS:
            raise ValueError(f"{_key(spelt, 'sp_method')} must be one of {', '.join(SP_METHODS)}, got {sp_method!r}")
        if tp > 1 and sp > 1 and world_size % (tp * sp):
            return (f"{spelt['tp'].format(tp)} x {spelt['sp'].format(sp)} must divide "
                    f"{spelt['world'].format(world_size)}")
        problem = _refusal(spelt, tp, sp, sp_method, world_size, gpus_per_node, pp=pp, **shape)
        if problem or shard_group is None:
            return problem
        check_int(_key(spelt, "dp_shard"), shard_group, 1)
        dp = world_size // (tp * sp)
        return _must_divide(spelt, "dp_shard", shard_group, [("world" if pp * tp * sp == 1 else "dp", dp)])

    def shape_refusal(self, *, names: Mapping[str, str] | None = None, **shape: Any) -> str | None:
        """Why this layout cannot split a model of sizes ``shape`` (``nhead``, ``kv_heads``,
        ``ffn``, ``vocab``, ``seq_len``, ``sequence_parallel``), in one line, or ``None``. A size
        left out is not checked (a model that pads its vocabulary gives none).

        - ``tp`` divides ``nhead``, ``kv_heads``, ``ffn`` and ``vocab`` (each rank holds 1/tp of
          them), and ``seq_len`` with ``sequence_parallel`` (Megatron's: the norms' activations
          split by sequence over the tensor-parallel group);
        - ``sp`` divides ``seq_len``, and with ``ulysses`` ``nhead`` and ``kv_heads`` (its
          all-to-all trades the sequence split for a split of the heads);
        - both at once: ``tp × sp`` divides ``nhead`` and ``kv_heads`` with ``ulysses`` (it splits
          each tensor rank's heads again), and ``seq_len`` with ``sequence_parallel`` (the
          tensor group splits each rank's part of the sequence again).
        """
        return _refusal({**LAYOUT_NAMES, **(names or {})}, self.tp, self.sp, self.sp_method, None, None,
                        pp=self.pp, **shape)

    def check_shape(self, *, names: Mapping[str, str] | None = None, **shape: Any) -> ParallelLayout:
        """This layout, if it splits a model of these sizes (:meth:`shape_refusal`).

        Raises:
            ValueError: the refusal's one line.
        """
        problem = self.shape_refusal(names=names, **shape)
        if problem:
            raise ValueError(problem)
        return self

    def padded_vocab(self, vocab: int) -> int:
        """The vocabulary a tensor-parallel model holds: ``vocab`` rounded up to a multiple of
        ``tp`` (Megatron pads the same way, to a multiple of ``make_vocab_size_divisible_by``
        times the degree), so that each rank holds ``padded / tp`` rows of the embedding and
        the head. The padded rows are never a token id; ``vocab`` itself when ``tp`` divides it.

        Raises:
            ValueError: for a vocabulary below 1.
        """
        check_int("vocab", vocab, 1)
        return -(-vocab // self.tp) * self.tp

    @classmethod
    def allows(cls, world_size: int, **degrees_and_shape: int | bool | str | None) -> bool:
        """Whether :meth:`refusal` accepts these degrees and sizes (for a search over layouts)."""
        return cls.refusal(world_size, **degrees_and_shape) is None  # type: ignore[arg-type]
