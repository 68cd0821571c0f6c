"""The run-config vocabulary shared by every experiment in the book.

Chapter 1 introduces it; every run of ``handbook_lib.runs`` takes a :class:`RunConfig` (or, for a
special-purpose run, another dataclass built on :class:`FlatConfig`). Keys are flat and the same
everywhere, settable from a notebook (``config={"num_layers": 2}``) and from the terminal
(``--set num_layers=2``). An unknown key or a value outside the accepted set raises
``ValueError`` listing what is accepted: nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import (
    Any,
    ClassVar,
    Literal,
    NamedTuple,
    TypeVar,
    get_args,
    get_origin,
    get_type_hints,
)

from handbook_lib.core.architecture import MODEL_KEYS, ModelConfig
from handbook_lib.core.checks import (
    BadText,
    check_int,
    lookup,
    parse_bool,
    parse_float,
    parse_int,
)
from handbook_lib.core.strategies import StrategyName

__all__ = [
    "FlatConfig",
    "RunConfig",
    "CheckpointingMode",
    "CHECKPOINTING_MODES",
    "checkpointing_mode",
    "APIS",
    "Dtype",
    "DTYPES",
    "dtype_bytes",
    "Precision",
    "PRECISIONS",
    "get_precision",
    "OPTIMIZERS",
    "LR_SCHEDULES",
    "WRAPS",
    "INITS",
    "parse_overrides",
]

ApiName = Literal["fsdp2", "fsdp1"]
APIS: tuple[str, ...] = get_args(ApiName)
"""``fsdp2`` is ``torch.distributed.fsdp.fully_shard``; ``fsdp1`` is ``FullyShardedDataParallel``."""


class Dtype(NamedTuple):
    """A floating-point element type, as the book names it."""

    bytes: int
    """Bytes per element."""
    torch_name: str
    """The ``torch`` attribute (``torch.float32`` ...): the runtime's only way to it."""


DTYPES: dict[str, Dtype] = {
    "fp32": Dtype(4, "float32"),
    "bf16": Dtype(2, "bfloat16"),
    "fp16": Dtype(2, "float16"),
}
"""The element types the book uses, by short name: the one dtype table (the pure models read
the bytes, the runtime the ``torch`` name)."""


def dtype_bytes(dtype: str, what: str = "dtype") -> int:
    """Bytes per element of ``dtype``, a key of :data:`DTYPES`; ``what`` names the argument.

    Raises:
        ValueError: ``"<what> must be one of fp32, bf16, fp16, got 'x'"``.
    """
    return lookup(DTYPES, dtype, what).bytes


class Precision(NamedTuple):
    """A ``precision`` value: the dtype parameters are computed in, and the one gradients are
    reduced in (FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``)."""

    compute: str
    """Key of :data:`DTYPES`: unsharded parameters, activations."""
    reduce: str
    """Key of :data:`DTYPES`: the gradient all-reduce / reduce-scatter."""


PrecisionName = Literal["fp32", "bf16-mixed", "fp16-mixed"]
PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", "fp32"),
    "bf16-mixed": Precision("bf16", "fp32"),
    "fp16-mixed": Precision("fp16", "fp32"),
}
"""Precision → (compute dtype, reduce dtype). The sharded parameters, the gradients handed to
the optimizer and the optimizer states stay fp32 in every case. fp16 also needs a gradient
scaler, whose state (a scale and a step counter) is a few bytes and is not counted."""


def get_precision(name: str, what: str = "precision") -> Precision:
    """The :class:`Precision` of a ``precision`` value (``fp32``, ``bf16-mixed``, ``fp16-mixed``).

    Raises:
        ValueError: ``"precision must be one of fp32, bf16-mixed, fp16-mixed, got 'x'"``.
    """
    return lookup(PRECISIONS, name, what)

OptimizerName = Literal["adamw", "adam", "sgd", "sgd-momentum"]
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)
LrScheduleName = Literal["constant", "cosine", "linear"]
LR_SCHEDULES: tuple[str, ...] = get_args(LrScheduleName)
"""The learning rate after warm-up (:func:`handbook_lib.models.lr_schedule.lr_factor`):
``constant``, the base rate; ``cosine``, half a cosine from the base rate to 0 at the last
step; ``linear``, a straight line from the base rate to 0 at the last step."""
WrapName = Literal["layer", "model", "size"]
WRAPS: tuple[str, ...] = get_args(WrapName)
"""Wrapping policies: ``layer`` — one FSDP unit per transformer layer plus the root (FSDP1's
``transformer_auto_wrap_policy``; what chapters 1–4 use); ``model`` — nothing wrapped but the
root, one unit holding every parameter; ``size`` — FSDP1's ``size_based_auto_wrap_policy``: a
submodule whose not-yet-wrapped parameters reach ``wrap_min_params`` becomes a unit (see
:func:`handbook_lib.models.layout.wrap_units`)."""

InitName = Literal["meta", "full"]
INITS: tuple[str, ...] = get_args(InitName)
"""How a rank builds the model: ``meta`` (shapes first, each rank materialises only what it holds)
or ``full`` (the whole seeded model on every rank, then wrapped)."""

if tuple(PRECISIONS) != get_args(PrecisionName):  # pragma: no cover - caught at import
    raise AssertionError("PrecisionName and PRECISIONS list different precisions")

_C = TypeVar("_C", bound="FlatConfig")


CheckpointingMode = Literal["none", "selective", "full"]
"""What activation checkpointing recomputes: nothing, the cheap operations of each layer
(``selective``: the outputs of its matrix products and of its attention are kept), or the whole
layer from its input (``full``)."""
CHECKPOINTING_MODES: tuple[str, ...] = get_args(CheckpointingMode)
_CHECKPOINTING_ALIASES = {True: "full", False: "none", "true": "full", "false": "none"}


def checkpointing_mode(value: bool | str, name: str = "activation_checkpointing") -> str:
    """``value`` as one of :data:`CHECKPOINTING_MODES`: a mode, or ``True``/``False`` (and their
    strings) for ``full``/``none``, as the book's first runs spelled it.

    Raises:
        ValueError: naming ``name`` and the accepted values.
    """
    if isinstance(value, str) and value.lower() in _CHECKPOINTING_ALIASES:
        return _CHECKPOINTING_ALIASES[value.lower()]
    if isinstance(value, bool):
        return _CHECKPOINTING_ALIASES[value]
    if value in CHECKPOINTING_MODES:
        return value
    raise ValueError(f"{name} must be one of {', '.join(CHECKPOINTING_MODES)} (or true/false), got {value!r}")


def parse_overrides(items: Iterable[str]) -> dict[str, str]:
    """Split ``["key=value", ...]`` (the CLI's ``--set`` arguments) into a dict of strings.

    Raises:
        ValueError: if an item has no ``=`` or an empty key, or a key is given twice (``"--set
            steps given twice (steps=3, steps=4): give each key once"``).
    """
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects key=value, got {item!r}")
        key = key.strip()
        if key in out:
            raise ValueError(f"--set {key} given twice ({key}={out[key]}, {key}={value.strip()}): "
                             "give each key once")
        out[key] = value.strip()
    return out


@dataclass(frozen=True)
class FlatConfig:
    """Base of every run config: a frozen dataclass of flat, typed, validated keys.

    Subclasses declare fields (``int``, ``float``, ``bool``, ``str``, or a ``Literal`` of the
    accepted strings). A ``float`` key must be finite: ``nan`` and ``inf`` are refused (an
    infinite learning rate would only train to NaN). An ``int`` key named in :attr:`MINIMUMS`
    must be at least its minimum.
    """

    MINIMUMS: ClassVar[Mapping[str, int]] = {}
    """The smallest value of each ``int`` key that has one (a subclass extends its base's)."""
    FLOAT_BOUNDS: ClassVar[Mapping[str, tuple[float, bool]]] = {}
    """The lower bound of each ``float`` key that has one, and whether the bound itself is
    refused (``(0.0, True)``: ``> 0``); what ``--set`` says the key accepts."""

    def __post_init__(self) -> None:
        hints = get_type_hints(type(self))
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            kind = hints[field.name]
            accepted = get_args(kind) if get_origin(kind) is Literal else None
            if accepted is not None:
                if value not in accepted:
                    raise ValueError(f"config key {field.name!r} got {value!r}; accepted values: "
                                     f"{', '.join(accepted)}")
                continue
            ok = (
                isinstance(value, bool) if kind is bool
                else isinstance(value, int) and not isinstance(value, bool) if kind is int
                else isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float
                else isinstance(value, kind)
            )
            if not ok:
                raise ValueError(
                    f"config key {field.name!r} must be {kind.__name__}, got {value!r}"
                )
            if kind is float and not math.isfinite(value):
                raise ValueError(f"config key {field.name!r} must be a finite number, got {value!r}")
        for key, minimum in self.MINIMUMS.items():
            check_int(f"config key {key!r}", getattr(self, key), minimum)

    @classmethod
    def choices(cls) -> dict[str, tuple[str, ...]]:
        """The accepted values of each ``Literal`` key, e.g. ``{"strategy": ("NONE", ...)}``."""
        hints = get_type_hints(cls)
        return {f.name: get_args(hints[f.name]) for f in dataclasses.fields(cls)
                if get_origin(hints[f.name]) is Literal}

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The accepted keys, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls: type[_C], mapping: Mapping[str, Any] | None = None) -> _C:
        """Build a config from a dict; values may be typed or strings (as from ``--set``).

        Raises:
            ValueError: on an unknown key (listing the accepted keys) or a bad value.
        """
        mapping = dict(mapping or {})
        unknown = sorted(set(mapping) - set(cls.keys()))
        if unknown:
            hints = [f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key) for key in unknown
                     for close in [difflib.get_close_matches(key, cls.keys(), n=1)]]
            raise ValueError(  # the first line stays short; the whole list follows
                f"unknown config key(s) {', '.join(hints)} for {cls.__name__}\n"
                f"accepted keys: {', '.join(cls.keys())}"
            )
        types = get_type_hints(cls)
        values = {}
        for key, value in mapping.items():
            if isinstance(value, str) and types[key] in (int, float, bool):
                value = cls._parse_text(key, types[key], value)
            values[key] = value
        return cls(**values)

    @classmethod
    def _parse_text(cls, key: str, kind: type, text: str) -> int | float | bool:
        """The value of ``key`` typed as ``text`` (a ``--set``), read by the one parser of its
        type with the key's accepted range.

        Raises:
            ValueError: ``"--set steps=3.0: steps takes a whole number >= 1"``.
        """
        try:
            if kind is bool:
                return parse_bool(text)
            if kind is float:
                bound, strict = cls.FLOAT_BOUNDS.get(key, (None, False))
                return parse_float(text, None if strict else bound, above=bound if strict else None)
            # a model key's least value is ModelConfig's (1); its upper bounds are its own to say
            minimum = 1 if key in MODEL_KEYS else cls.MINIMUMS.get(key)
            return parse_int(text, minimum)
        except BadText as err:
            raise ValueError(f"--set {key}={text}: {key} takes {err.accepted}") from None

    def replace(self: _C, **changes: Any) -> _C:
        """A copy with some keys changed (validated like :meth:`from_mapping`)."""
        return self.from_mapping({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain, JSON-ready dict."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RunConfig(FlatConfig):
    """One training experiment, in the book's vocabulary. Units are stated per field."""

    # model (see ModelConfig)
    vocab_size: int = 10_000
    """Tokens in the vocabulary: rows of the embedding, outputs of the head."""
    d_model: int = 256
    """Width of the hidden state (elements per token)."""
    nhead: int = 4
    """Attention heads per layer (must divide ``d_model``)."""
    dim_feedforward: int = 1024
    """Hidden width of each layer's feed-forward block."""
    num_layers: int = 6
    """Transformer layers (each one FSDP unit with ``wrap="layer"``)."""
    # data
    batch_size: int = 8
    """Global batch: sequences per step summed over all ranks (must divide by world size)."""
    seq_len: int = 64
    """Tokens per sequence."""
    steps: int = 5
    """Optimizer steps to run."""
    seed: int = 0
    """Seeds the model's initial weights and the synthetic data."""
    # sharding
    strategy: StrategyName = "FULL_SHARD"
    """How the ranks share the model: a row of :data:`handbook_lib.core.strategies.STRATEGY_TABLE`."""
    api: ApiName = "fsdp2"
    """``fsdp2`` (``fully_shard``) or ``fsdp1`` (``FullyShardedDataParallel``, flat parameters)."""
    shard_group_size: int = 0
    """Ranks that shard one model copy in the HYBRID strategies (0: the ranks of one node)."""
    wrap: WrapName = "layer"
    """Which modules become FSDP units: ``layer`` (each transformer layer, then the root),
    ``model`` (the root only: one unit) or ``size`` (FSDP1's size-based policy)."""
    wrap_min_params: int = 100_000
    """With ``wrap="size"``: parameters (elements) a module must hold to become a unit."""
    # numerics
    precision: PrecisionName = "fp32"
    """Compute and reduce dtypes: a key of :data:`PRECISIONS` (sharded state stays fp32)."""
    optimizer: OptimizerName = "adamw"
    """``adamw``, ``adam`` (two moments per parameter), ``sgd-momentum`` (one), ``sgd`` (none)."""
    lr: float = 1e-3
    """Learning rate (dimensionless): the base rate that ``lr_schedule`` multiplies."""
    lr_schedule: LrScheduleName = "constant"
    """The rate after warm-up: ``constant``, ``cosine`` or ``linear`` decay to 0 at ``steps``
    (Hugging Face's schedules of the same names; a ``torch.optim.lr_scheduler.LambdaLR``)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to ``lr`` before ``lr_schedule`` (0: none)."""
    grad_scaler: bool = True
    """With ``fp16-mixed``: scale the loss (FSDP2: ``torch.amp.GradScaler``; FSDP1:
    ``ShardedGradScaler``). Off shows what fp16 does without it."""
    grad_scale_init: float = 65536.0
    """The scaler's first factor (PyTorch's default, 2**16); a too-large one shows the scaler
    skipping overflowing steps and halving itself."""
    grad_accum_steps: int = 1
    """Micro-steps per optimizer step: each rank's share of the global batch is cut into this
    many micro-batches, and gradients are reduced across ranks only in the last one's backward."""
    max_grad_norm: float = 0.0
    """Clip the gradients to this total L2 norm before each optimizer step (0: no clipping)."""
    # memory levers
    activation_checkpointing: CheckpointingMode = "none"
    """Recompute each transformer layer's activations in backward: ``none``, ``selective`` (keep
    the outputs of its matrix products and attention, recompute the rest) or ``full`` (keep only
    its input); ``true``/``false`` mean ``full``/``none``."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and optimizer states in host memory (FSDP only)."""
    init: InitName = "meta"
    """How each rank builds the model: ``meta`` (shapes only, then each rank materialises and
    fills just what it holds) or ``full`` (the whole seeded model on every rank, then wrapped).
    The weights are the same; the host memory at init is not (chapter 5)."""

    # FSDP2's tuning knobs (chapter 5, "Tuning FSDP2"); the defaults are the book's other runs
    explicit_prefetch: int = 0
    """All-gathers issued ahead, in units (FSDP2, ``wrap`` units other than the root): 0 keeps
    FSDP2's implicit prefetching (forward: each unit gathered in its own pre-forward; backward:
    one unit ahead, in reverse post-forward order); n >= 1 makes each unit prefetch the next n
    in forward (``set_modules_to_forward_prefetch``) and the previous n in backward
    (``set_modules_to_backward_prefetch``), and each step begins with the root's ``unshard()``."""
    reshard_after_forward_size: int = 0
    """FSDP2's ``reshard_after_forward`` as an int, in ranks: 0 keeps the strategy's bool; g >= 2
    (a divisor of the shard group, smaller than it) makes every unit, root included, keep after
    forward a 1/g shard of its gathered parameters, so backward all-gathers within groups of g
    ranks (g/N of the bytes sent; more held between forward and backward)."""
    sync_every_micro_step: bool = False
    """With ``grad_accum_steps`` > 1: reduce(-scatter) the gradients in every micro-step's
    backward, so they stay sharded (torchtitan's default), instead of only in the last one's
    (``set_requires_gradient_sync(False)`` / ``no_sync()`` before it: unsharded gradients held)."""
    reshard_after_backward: bool = True
    """With ``grad_accum_steps`` > 1 (FSDP2): False calls ``set_reshard_after_backward(False)``
    for every micro-step but the last, so each unit stays gathered from one micro-step's backward
    into the next one's forward, which then all-gathers nothing (more memory, fewer bytes)."""
    count_gathered: bool = False
    """A measurement setting, not a knob: record, at each unit's compute, which FSDP2 units are
    gathered, and check it and the collectives' order of issue against FSDP2's schedule (hooks
    on every unit). On by itself whenever one of the four knobs above is set."""

    FLOAT_BOUNDS: ClassVar[Mapping[str, tuple[float, bool]]] = {
        "lr": (0.0, True), "grad_scale_init": (0.0, True), "max_grad_norm": (0.0, False),
    }
    MINIMUMS: ClassVar[Mapping[str, int]] = {
        "batch_size": 1, "seq_len": 1, "steps": 1, "seed": 0, "shard_group_size": 0, "wrap_min_params": 1,
        "grad_accum_steps": 1, "explicit_prefetch": 0, "reshard_after_forward_size": 0,
        "warmup_steps": 0,
    }

    def __post_init__(self) -> None:
        ac = self.activation_checkpointing
        if isinstance(ac, (bool, str)) and ac not in CHECKPOINTING_MODES:  # true/false: full/none
            try:
                object.__setattr__(self, "activation_checkpointing", checkpointing_mode(ac))
            except ValueError:
                pass  # the base class's check names the key and the accepted values
        super().__post_init__()
        if not self.grad_scale_init > 0:
            raise ValueError(f"config key 'grad_scale_init' must be > 0, got {self.grad_scale_init}")
        if self.max_grad_norm < 0:
            raise ValueError(f"config key 'max_grad_norm' must be >= 0 (0: no clipping), got {self.max_grad_norm}")
        if not self.lr > 0:
            raise ValueError(f"config key 'lr' must be > 0, got {self.lr}")
        if isinstance(self.warmup_steps, int) and self.warmup_steps >= self.steps:
            raise ValueError(f"config key 'warmup_steps' must be < steps={self.steps} (the steps of "
                             f"warm-up come first), got {self.warmup_steps}")
        if self.reshard_after_forward_size == 1:
            raise ValueError("config key 'reshard_after_forward_size' must be 0 (the strategy's bool) or "
                             ">= 2 ranks, got 1 (to keep the gathered parameters, use strategy SHARD_GRAD_OP)")
        for key, default in (("sync_every_micro_step", False), ("reshard_after_backward", True)):
            if getattr(self, key) != default and self.grad_accum_steps == 1:
                raise ValueError(f"config key {key!r}={getattr(self, key)} applies between micro-steps: "
                                 f"it needs grad_accum_steps >= 2, got {self.grad_accum_steps}")
        self.model_config()  # validates the model keys

    @property
    def tunes_fsdp2(self) -> bool:
        """Whether one of FSDP2's tuning knobs differs from its default, or ``count_gathered``
        is set: the run then counts the gathered units and checks the order of issue."""
        return bool(self.explicit_prefetch or self.reshard_after_forward_size or self.sync_every_micro_step
                    or not self.reshard_after_backward or self.count_gathered)

    def check_batch(self, world_size: int) -> None:
        """Refuse a global batch that ``world_size`` ranks, each cutting its share into
        ``grad_accum_steps`` micro-batches, cannot share evenly.

        Raises:
            ValueError: e.g. ``"batch_size=9 must be divisible by the number of ranks 2"``.
        """
        if self.batch_size % (world_size * self.grad_accum_steps):
            raise ValueError(
                f"batch_size={self.batch_size} must be divisible by the number of ranks {world_size}"
                + (f" times grad_accum_steps={self.grad_accum_steps}" if self.grad_accum_steps > 1 else ""))

    def check_constant_lr(self, run: str) -> None:
        """Refuse a schedule in a run that keeps the rate constant (its own loop steps none).

        Raises:
            ValueError: e.g. ``"deepspeed_zero keeps the learning rate constant: it needs
                lr_schedule='constant' and warmup_steps=0, got 'cosine' and 2"``.
        """
        if self.lr_schedule != "constant" or self.warmup_steps:
            raise ValueError(f"{run} keeps the learning rate constant: it needs lr_schedule='constant' "
                             f"and warmup_steps=0, got {self.lr_schedule!r} and {self.warmup_steps}")

    def model_config(self) -> ModelConfig:
        """The :class:`~handbook_lib.core.architecture.ModelConfig` named by this run's model keys."""
        return ModelConfig(**{key: getattr(self, key) for key in MODEL_KEYS})

