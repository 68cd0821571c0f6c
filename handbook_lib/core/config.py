"""The run-config vocabulary shared by every experiment in the book.

Chapter 1 introduces it; every run of ``handbook_lib.runs`` takes a :class:`RunConfig` (or, for a
special-purpose run, another dataclass built on :class:`FlatConfig`). A :class:`RunConfig`
composes five sections: ``model`` (:class:`~handbook_lib.core.architecture.ModelConfig`),
``data``, ``layout``, ``numerics`` and ``levers``; a run adds its own keys, or extends a section.
Each key keeps one flat name, the same everywhere, settable from a notebook
(``config={"num_layers": 2}``) and from the terminal (``--set num_layers=2``, or
``--set model.num_layers=2``). An unknown key or a value outside the accepted set raises
``ValueError`` listing what is accepted: nothing is silently ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal, NamedTuple, get_args

from handbook_lib.core.architecture import ModelConfig
from handbook_lib.core.checks import lookup
from handbook_lib.core.flat_config import FlatConfig
from handbook_lib.core.strategies import StrategyName, get_strategy

__all__ = [
    "FlatConfig",
    "RunConfig",
    "DataConfig",
    "LayoutConfig",
    "NumericsConfig",
    "LeversConfig",
    "CheckpointingMode",
    "CHECKPOINTING_MODES",
    "checkpointing_mode",
    "AC_SAVE_POLICIES",
    "APIS",
    "Dtype",
    "DTYPES",
    "dtype_bytes",
    "Precision",
    "PRECISIONS",
    "get_precision",
    "state_dtype",
    "OPTIMIZERS",
    "OPTIMIZER_IMPLS",
    "optimizer_impl_on",
    "check_optimizer_impl",
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


PrecisionName = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16"]
PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", "fp32"),
    "bf16-mixed": Precision("bf16", "fp32"),
    "fp16-mixed": Precision("fp16", "fp32"),
    "bf16": Precision("bf16", "bf16"),
}
"""Precision → (compute dtype, reduce dtype). In the mixed precisions the sharded parameters,
the gradients handed to the optimizer and the optimizer states stay fp32 (FSDP2's
``MixedPrecisionPolicy``); ``bf16`` is pure bf16: the model is built in bf16 and parameters,
gradients and the optimizer's states are all bf16, no fp32 copy anywhere (:func:`state_dtype`).
fp16 also needs a gradient scaler, whose state (a scale and a step counter) is a few bytes and is
not counted."""


def state_dtype(precision: str) -> str:
    """The dtype a ``precision`` keeps the model state in (parameters, gradients, optimizer
    states): its compute dtype where it computes and reduces in one dtype (``fp32``, pure
    ``bf16``), fp32 for the mixed precisions. Adam's ``step`` counters are fp32 scalars in every
    case.

    Raises:
        ValueError: for an unknown precision.
    """
    compute, reduce = get_precision(precision)
    return compute if compute == reduce else "fp32"


def get_precision(name: str, what: str = "precision") -> Precision:
    """The :class:`Precision` of a ``precision`` value (``fp32``, ``bf16-mixed``, ``fp16-mixed``).

    Raises:
        ValueError: ``"precision must be one of fp32, bf16-mixed, fp16-mixed, got 'x'"``.
    """
    return lookup(PRECISIONS, name, what)

OptimizerName = Literal["adamw", "adam", "sgd", "sgd-momentum"]
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)
OptimizerImplName = Literal["default", "for-loop", "foreach", "fused"]
OPTIMIZER_IMPLS: tuple[str, ...] = get_args(OptimizerImplName)
"""How ``torch.optim`` runs the step: ``for-loop`` (one tensor at a time: ``foreach=False``),
``foreach`` (every tensor at once through ``torch._foreach_*``: ``foreach=True``), ``fused``
(one kernel that updates in place: ``fused=True``), or ``default``: what torch picks for the
device (:func:`optimizer_impl_on`)."""


def optimizer_impl_on(impl: str, device: str) -> str:
    """The implementation ``impl`` means on ``device`` (``cuda`` or ``cpu``): itself, or for
    ``default`` what ``torch.optim`` picks when given neither ``foreach`` nor ``fused``
    (``torch/optim/optimizer.py: _default_to_fused_or_foreach``): ``foreach`` on CUDA, whose
    foreach kernels exist (``DTensor`` counts as a foreach type, so FSDP2's shards qualify),
    ``for-loop`` on the CPU, which has none.

    Raises:
        ValueError: naming ``optimizer_impl`` and the accepted values, or ``device``.
    """
    lookup(dict.fromkeys(OPTIMIZER_IMPLS), impl, "optimizer_impl")
    lookup(dict.fromkeys(("cuda", "cpu")), device, "device")
    if impl != "default":
        return impl
    return "foreach" if device == "cuda" else "for-loop"


def check_optimizer_impl(optimizer: str, impl: str, strategy: str, api: str = "fsdp2", *,
                         names: tuple[str, str] = ("config key 'optimizer_impl'={!r}", "{}")) -> None:
    """Refuse an implementation PyTorch cannot run for ``optimizer`` under ``strategy`` with
    ``api``: fused SGD on FSDP2's sharded parameters (``DTensor`` has no sharding rule for
    ``aten._fused_sgd_`` in torch 2.13; fused Adam and AdamW have one). ``names`` spell the
    implementation and the optimizer in the message (the run config's keys by default; the
    CLI passes its flags).

    Raises:
        ValueError: in one line, naming the key and what is accepted.
    """
    lookup(dict.fromkeys(OPTIMIZER_IMPLS), impl, "optimizer_impl")
    if impl == "fused" and optimizer.startswith("sgd") and api == "fsdp2" \
            and get_strategy(strategy).wrapper == "fsdp":
        raise ValueError(f"{names[0].format(impl)} cannot step {names[1].format(optimizer)} over FSDP2's "
                         "sharded parameters (DTensor has no rule for aten._fused_sgd_): use "
                         "default, for-loop or foreach, or adam/adamw")

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

CheckpointingMode = Literal["none", "selective", "full"]
"""What activation checkpointing recomputes: nothing, the cheap operations of each layer
(``selective``: the outputs of its matrix products and of its attention are kept), or the whole
layer from its input (``full``)."""
CHECKPOINTING_MODES: tuple[str, ...] = get_args(CheckpointingMode)
AcSave = Literal["matmul+attention", "matmul", "attention"]
"""What ``selective`` checkpointing keeps of a layer, by operator family: the matrix products'
and the fused attention's outputs (the default: only the cheap pointwise operators are
recomputed), the matrix products' only (the attention is recomputed: Korthikanti et al.'s split,
at the operators' level) or the attention's only (the products are recomputed)."""
AC_SAVE_POLICIES: tuple[str, ...] = get_args(AcSave)
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
class DataConfig(FlatConfig):
    """The ``data`` section of a run config: what each step trains on, and for how long."""

    batch_size: int = 8
    """Global batch: sequences per step summed over all ranks (must divide by world size)."""
    seq_len: int = 64
    """Tokens per sequence."""
    steps: int = 5
    """Optimizer steps to run."""
    seed: int = 0
    """Seeds the model's initial weights and the synthetic data."""

    MINIMUMS: ClassVar[Mapping[str, int]] = {"batch_size": 1, "seq_len": 1, "steps": 1, "seed": 0}


@dataclass(frozen=True)
class LayoutConfig(FlatConfig):
    """The ``layout`` section: how the ranks share the model. A run with more axes than data
    parallelism extends it (:class:`~handbook_lib.core.parallel_config.AxesLayoutConfig`)."""

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

    MINIMUMS: ClassVar[Mapping[str, int]] = {"shard_group_size": 0, "wrap_min_params": 1}


@dataclass(frozen=True)
class NumericsConfig(FlatConfig):
    """The ``numerics`` section: dtypes, the optimizer and its rate, accumulation, clipping."""

    precision: PrecisionName = "fp32"
    """Compute and reduce dtypes: a key of :data:`PRECISIONS` (the state stays fp32, except in
    pure ``bf16``)."""
    optimizer: OptimizerName = "adamw"
    """``adamw``, ``adam`` (two moments per parameter), ``sgd-momentum`` (one), ``sgd`` (none)."""
    optimizer_impl: OptimizerImplName = "default"
    """How the optimizer's step runs: ``for-loop``, ``foreach``, ``fused`` or ``default``
    (torch's choice for the device: foreach on CUDA, for-loop on the CPU); what the step
    allocates depends on it (:func:`~handbook_lib.models.model_state.optimizer_temporary_bytes`)."""
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

    FLOAT_BOUNDS: ClassVar[Mapping[str, tuple[float, bool]]] = {
        "lr": (0.0, True), "grad_scale_init": (0.0, True), "max_grad_norm": (0.0, False),
    }
    MINIMUMS: ClassVar[Mapping[str, int]] = {"grad_accum_steps": 1, "warmup_steps": 0}

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.grad_scale_init > 0:
            raise ValueError(f"config key 'grad_scale_init' must be > 0, got {self.grad_scale_init}")
        if self.max_grad_norm < 0:
            raise ValueError(f"config key 'max_grad_norm' must be >= 0 (0: no clipping), got {self.max_grad_norm}")
        if not self.lr > 0:
            raise ValueError(f"config key 'lr' must be > 0, got {self.lr}")


@dataclass(frozen=True)
class LeversConfig(FlatConfig):
    """The ``levers`` section: what trades memory for time (activation checkpointing, offload,
    how the model is built) and FSDP2's tuning knobs."""

    activation_checkpointing: CheckpointingMode = "none"
    """Recompute each transformer layer's activations in backward: ``none``, ``selective`` (keep
    the outputs of its matrix products and attention, recompute the rest) or ``full`` (keep only
    its input); ``true``/``false`` mean ``full``/``none``."""
    ac_every: int = 1
    """With activation checkpointing: checkpoint layers 0, k, 2k, ... only (k = ``ac_every``,
    torchtitan's "selective layer" checkpointing); 1 checkpoints every layer."""
    ac_matmul_every: int = 1
    """With ``selective`` checkpointing: of each layer's matrix products keep the 1st, (n+1)-th,
    ... output only (n = ``ac_matmul_every``; torchtitan's op policy is 2), recompute the
    others; the attention's output is kept either way. 1 keeps every product."""
    ac_save: AcSave = "matmul+attention"
    """With ``selective`` checkpointing: which operators' outputs the policy keeps
    (:data:`AC_SAVE_POLICIES`: ``matmul+attention``, ``matmul`` or ``attention``); the others are
    recomputed in backward."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and optimizer states in host memory (FSDP only)."""
    loss_chunks: int = 1
    """Compute the cross-entropy over the logits in this many chunks along the sequence, each
    upcast to fp32 and reduced by itself: the fp32 log-softmax's gradients exist one chunk at a
    time in backward (``2·4·T·V / k`` bytes instead of ``2·4·T·V``). Must divide ``seq_len``; 1:
    the whole logits at once."""
    set_to_none: bool = False
    """Free the gradients after each optimizer step (``optimizer.zero_grad(set_to_none=True)``,
    PyTorch's default and most training loops'), instead of zeroing them in place (the book's
    runs, whose model state at rest then holds them): until backward makes them again, none
    exist (chapter 2)."""
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

    MINIMUMS: ClassVar[Mapping[str, int]] = {"ac_every": 1, "ac_matmul_every": 1, "explicit_prefetch": 0,
                                             "reshard_after_forward_size": 0, "loss_chunks": 1}

    def __post_init__(self) -> None:
        ac = self.activation_checkpointing
        if isinstance(ac, (bool, str)) and ac not in CHECKPOINTING_MODES:  # true/false: full/none
            try:
                object.__setattr__(self, "activation_checkpointing", checkpointing_mode(ac))
            except ValueError:
                pass  # the base class's check names the key and the accepted values
        super().__post_init__()
        if self.reshard_after_forward_size == 1:
            raise ValueError("config key 'reshard_after_forward_size' must be 0 (the strategy's bool) or "
                             ">= 2 ranks, got 1 (to keep the gathered parameters, use strategy SHARD_GRAD_OP)")


@dataclass(frozen=True)
class RunConfig(FlatConfig):
    """One training experiment, in the book's vocabulary: five sections of keys, each key set by
    its flat name (``steps``) or its section's (``data.steps``). Units are stated per key."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model's shape (:class:`~handbook_lib.core.architecture.ModelConfig`)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The global batch, the sequence length, the steps and the seed."""
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    """How the ranks share the model: the strategy, the API, the shard group, the wrap units."""
    numerics: NumericsConfig = field(default_factory=NumericsConfig)
    """Precision, optimizer, learning rate and schedule, scaler, accumulation, clipping."""
    levers: LeversConfig = field(default_factory=LeversConfig)
    """Activation checkpointing, offload, initialisation, FSDP2's tuning knobs."""

    FLOAT_BOUNDS: ClassVar[Mapping[str, tuple[float, bool]]] = NumericsConfig.FLOAT_BOUNDS
    MINIMUMS: ClassVar[Mapping[str, int]] = {
        **DataConfig.MINIMUMS, **LayoutConfig.MINIMUMS,
        **NumericsConfig.MINIMUMS, **LeversConfig.MINIMUMS,
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        check_optimizer_impl(self.optimizer, self.optimizer_impl, self.strategy, self.api)
        if isinstance(self.ac_every, int) and self.ac_every > 1 and self.activation_checkpointing == "none":
            raise ValueError(f"config key 'ac_every'={self.ac_every} checkpoints every k-th layer: it needs "
                             "activation_checkpointing 'full' or 'selective', got 'none'")
        n = self.ac_matmul_every
        if isinstance(n, int) and n > 1 and self.activation_checkpointing != "selective":
            raise ValueError(f"config key 'ac_matmul_every'={n} thins the selective policy's matrix products: "
                             f"it needs activation_checkpointing 'selective', got {self.activation_checkpointing!r}")
        if self.ac_save != "matmul+attention" and self.activation_checkpointing != "selective":
            raise ValueError(f"config key 'ac_save'={self.ac_save!r} chooses what the selective policy keeps: it "
                             f"needs activation_checkpointing 'selective', got {self.activation_checkpointing!r}")
        if isinstance(n, int) and n > 1 and "matmul" not in self.ac_save:
            raise ValueError(f"config key 'ac_matmul_every'={n} thins the kept matrix products, and ac_save="
                             f"{self.ac_save!r} keeps none: give ac_save 'matmul+attention' or 'matmul'")
        zero = get_strategy(self.strategy).wrapper == "deepspeed"  # DeepSpeed keeps bf16 master and states
        if self.precision == "bf16" and not zero and (self.init != "meta" or self.api == "fsdp1"):
            raise ValueError("config key 'precision'='bf16' (the model kept in bf16) builds on the meta device "
                             "with FSDP2, DDP or one process (or ZeRO's bf16 master): it needs init='meta' and "
                             f"api='fsdp2', got init={self.init!r}, api={self.api!r}, {self.strategy}")
        if isinstance(self.loss_chunks, int) and self.seq_len % self.loss_chunks:
            raise ValueError(f"config key 'loss_chunks'={self.loss_chunks} must divide seq_len={self.seq_len} (each "
                             "chunk the same tokens of every sequence)")
        if isinstance(self.warmup_steps, int) and self.warmup_steps >= self.steps:
            raise ValueError(f"config key 'warmup_steps' must be < steps={self.steps} (the steps of "
                             f"warm-up come first), got {self.warmup_steps}")
        for key, default in (("sync_every_micro_step", False), ("reshard_after_backward", True)):
            if getattr(self, key) != default and self.grad_accum_steps == 1:
                raise ValueError(f"config key {key!r}={getattr(self, key)} applies between micro-steps: "
                                 f"it needs grad_accum_steps >= 2, got {self.grad_accum_steps}")

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
        """The :class:`~handbook_lib.core.architecture.ModelConfig` of this run: its ``model`` section."""
        return self.model

