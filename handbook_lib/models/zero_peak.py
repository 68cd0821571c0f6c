"""DeepSpeed ZeRO's peak on one rank: the state at rest, DeepSpeed's gradient buckets, and what
a training step adds on top. Pure: no ``torch``, no DeepSpeed.

:mod:`handbook_lib.models.zero` lays out the state (checked byte for byte by chapter 7's runs);
this module prices a whole step, as :func:`handbook_lib.models.memory.estimate_memory` does for
PyTorch's strategies. Three moments, each read from DeepSpeed's source (release 0.19) and
measured on CPU ranks by the ``deepspeed_zero`` run:

- **forward and backward**: the activations, the loss's buffers and the gradients of one
  module, as the same model computes them without sharding (:func:`estimate_memory` with
  ``NONE``); ZeRO-3 adds a module's gradient (``c·U``, U the largest module) and the most it
  holds gathered at once: for the handbook's model, known tensor by tensor, the replayed
  step's (:func:`~handbook_lib.models.zero.zero3_replay`: one module with prefetch and reuse
  off); for a model known by its sizes, a module and the prefetch bucket
  (``stage3_prefetch_bucket_size`` elements). This moment is the approximate one: DeepSpeed's
  own hooks keep a few more tensors than the unsharded model (measured, below).
- **the gradient buckets** (ZeRO-1/2): with ``contiguous_gradients`` (on by default) every
  backward allocates a flat bucket of ``reduce_bucket_size`` elements in the compute dtype,
  two with ``overlap_comm``; at its fullest the gradients it collects are alive in the
  compute dtype, and in the reduce dtype as well when the two differ:
  ``buckets + c·M (+ r·M)``, M the parameters or a bucket's elements, the fewer. (The runs'
  models fit in one bucket, M = P; a bucket's worth for a larger model is read from the
  source, not measured.)
  ZeRO-3 allocates its bucket once, when the engine is built, in the reduce dtype, and keeps
  it: it is part of the state at rest.
- **the optimizer step**: ZeRO-1/2 first copy each piece of the partition to float64 for the
  gradient norm (computed even without clipping). DeepSpeed flattens the rank's gradient
  partition into a new tensor of the master's dtype (``e·partition``, in fp32 too; ZeRO-3 one
  sub-group of at most ``sub_group_size`` elements at a time), frees the gradients it copied
  (ZeRO-1/2: the whole tensors that overlap the partition) and steps the optimizer on that flat
  partition, whose temporaries are PyTorch's for one tensor of that size
  (:func:`~handbook_lib.models.model_state.optimizer_temporary_bytes`; DeepSpeed's own fused
  Adam on a GPU holds none). :func:`zero_step_bytes` gives the moments.

Measured (``deepspeed_zero``, CPU ranks): the buckets at rest exactly; the step within DeepSpeed's
few scalars (8 to 28 B); the ZeRO-1/2 bucket moment within one gradient tensor (0.001 % to
0.013 %). ZeRO-3's forward and backward is the approximate moment: 25 % high in fp32 and 1 % low
in bf16 on the book's 9.9-million-parameter model, from 24 % low to 45 % high on the tests'
0.2-million-parameter one, whose output head is half of it. A real model's modules are small
beside its activations, and the error shrinks with them; the runs report it, not check it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from handbook_lib.core.checks import check_int, lookup
from handbook_lib.core.config import DTYPES, PRECISIONS, optimizer_impl_on, state_dtype
from handbook_lib.models.collectives import estimate_collective
from handbook_lib.models.layout import ModelLike, model_layout
from handbook_lib.models.memory import estimate_memory
from handbook_lib.models.model_state import RankState, optimizer_temporary_bytes
from handbook_lib.models.traffic import CollectiveRecord, StepTraffic, estimate_step_traffic
from handbook_lib.models.zero import (
    estimate_zero_rank_bytes,
    flat_partition,
    gather_units,
    largest_module_params,
    partition_overlaps,
    zero3_replay,
    zero_stage,
)

__all__ = ["ZeroKnobs", "DEEPSPEED_DEFAULTS", "BOOK_RUNS", "ZeroPeak", "estimate_zero_peak",
           "zero_step_bytes", "zero_optimizer_impl", "ZERO_PHASES", "ZERO_PHASE_WORDS",
           "zero_plan_traffic"]


@dataclass(frozen=True)
class ZeroKnobs:
    """The ``zero_optimization`` keys that decide DeepSpeed's transient bytes, elements unless
    a field says otherwise; DeepSpeed's defaults (``deepspeed/runtime/zero/config.py``)."""

    reduce_bucket_size: int = 500_000_000
    """Elements of a gradient bucket (Accelerate's and the Trainer's ``auto``: hidden²)."""
    overlap_comm: bool | None = None
    """Reduce while backward runs, with a second bucket; ``None``: DeepSpeed's default, on
    for ZeRO-3 only."""
    prefetch_bucket_size: int = 50_000_000
    """ZeRO-3: elements of the modules gathered ahead of their use."""
    persistence_threshold: int = 100_000
    """ZeRO-3: tensors of at most this many elements stay whole on every rank."""
    max_reuse_distance: int = 1_000_000_000
    """ZeRO-3: a module's tensors stay gathered if the step's trace uses them again within this
    many elements (:func:`~handbook_lib.models.zero.zero3_gathers`)."""
    sub_group_size: int = 1_000_000_000
    """ZeRO-3: the optimizer steps its partition in sub-groups of at most this many elements."""

    def __post_init__(self) -> None:
        for name in ("reduce_bucket_size", "prefetch_bucket_size", "persistence_threshold", "max_reuse_distance",
                     "sub_group_size"):
            check_int(name, getattr(self, name), 1 if name in ("reduce_bucket_size", "sub_group_size") else 0)

    def overlaps(self, stage: int) -> bool:
        """Whether ``overlap_comm`` is on for ``stage`` (DeepSpeed's default where unset)."""
        return stage == 3 if self.overlap_comm is None else self.overlap_comm


DEEPSPEED_DEFAULTS = ZeroKnobs()
"""A config that names none of the keys: what ``plan`` and ``memory`` price."""

BOOK_RUNS = ZeroKnobs(prefetch_bucket_size=0, persistence_threshold=0, max_reuse_distance=0)
"""The ``deepspeed_zero`` runs' measurement config (:func:`handbook_lib.integrations.frameworks.deepspeed_config`):
no prefetching, no reuse, every tensor sharded (the run's ``persistence_threshold``, 0 by default)."""

ZERO_PHASES = ("forward_backward", "gradient_buckets", "optimizer_step")
"""The moments :func:`estimate_zero_peak` prices, in step order."""

ZERO_PHASE_WORDS: dict[str, tuple[str, str]] = {
    "forward_backward": ("in forward and backward",
                         "the activations and the loss's buffers (ZeRO-3: with a module gathered and its "
                         "gradient)"),
    "gradient_buckets": ("when DeepSpeed's gradient bucket is full",
                         "DeepSpeed's gradient bucket(s) full, its gradients in the compute and reduce dtypes"),
    "optimizer_step": ("in the optimizer step",
                       "DeepSpeed's flat gradient partition, the norm's float64 copy or the optimizer's "
                       "temporaries"),
}
"""Each ZeRO moment in words: where the peak falls, and what is alive then (as
:data:`~handbook_lib.models.memory.PHASE_WORDS` for PyTorch's phases)."""


@dataclass(frozen=True)
class ZeroPeak:
    """One rank's bytes under DeepSpeed ZeRO: the state at rest and each moment of a step."""

    state: RankState
    """The model state as the optimizer step finds it (:func:`estimate_zero_rank_bytes`)."""
    at_rest: int
    """Bytes held between steps: the state (ZeRO-1/2 free their gradients after the step) and
    ZeRO-3's gradient bucket."""
    phases: dict[str, int]
    """Bytes alive at each of :data:`ZERO_PHASES` (ZeRO-3 has no separate bucket moment)."""
    activations: int
    """Bytes of activations and loss buffers at the forward-and-backward moment."""
    buckets: int
    """DeepSpeed's gradient buckets, bytes (ZeRO-3: held at rest)."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def model_state(self) -> int:
        """Parameters, master, gradients and optimizer state held between steps, bytes (the
        state at rest without ZeRO-3's bucket)."""
        return self.at_rest - (self.buckets if "gradient_buckets" not in self.phases else 0)

    @property
    def peak_phase(self) -> str:
        """The moment with the most bytes alive."""
        return max(self.phases, key=self.phases.__getitem__)

    @property
    def peak(self) -> int:
        """The step's peak, bytes (``torch.cuda.max_memory_allocated``'s counter)."""
        return self.phases[self.peak_phase]


def zero_optimizer_impl(optimizer_impl: str, backend: str = "nccl") -> str:
    """The implementation of the optimizer DeepSpeed steps: ``default`` is its own choice, its
    fused Adam on a GPU (``backend`` ``nccl``) and PyTorch's optimizer, one tensor at a time, on
    the CPU (``torch_adam``, as the book's runs configure it); else ``optimizer_impl`` itself.

    Raises:
        ValueError: for an implementation outside ``for-loop``, ``foreach``, ``fused``, ``default``.
    """
    lookup(dict.fromkeys(("nccl", "gloo")), backend, "backend")
    if optimizer_impl == "default":
        return "fused" if backend == "nccl" else "for-loop"
    return optimizer_impl_on(optimizer_impl, "cpu")


def zero_step_bytes(model: ModelLike, world_size: int, strategy: str, precision: str = "bf16-mixed",
                    optimizer: str = "adamw", optimizer_impl: str = "fused", *, rank: int = 0,
                    sub_group_size: int = DEEPSPEED_DEFAULTS.sub_group_size) -> int:
    """The most bytes DeepSpeed's optimizer step holds beyond the state at rest (ZeRO-1/2's
    gradients, made in backward, counted here), read from its source (0.19) and measured by
    every ``deepspeed_zero`` run (``step_peak_bytes``):

    - ZeRO-1/2 hold G bytes of gradients (the whole tensors that overlap the rank's partition,
      :func:`estimate_zero_rank_bytes`). The gradient norm copies each piece of the partition
      to float64 in turn (``get_grad_norm_direct``, computed even without clipping):
      ``G + 8·n_i + 8·i`` at piece i (the norms of the pieces before it kept). The pieces are then flattened
      (``c·partition`` in the compute dtype; a view when the partition is one piece) and cast
      to the master's dtype (``e·partition``; none when the two dtypes agree), the gradients
      freed: ``G + c·partition + e·partition`` at most, then the flat partition and the
      optimizer's temporaries.
    - ZeRO-3 keeps its gradient partition at rest; each sub-group of at most
      ``sub_group_size`` elements is flattened into the master's dtype and stepped in turn:
      ``e·sub-group + temporaries``.

    The temporaries are the optimizer's for one flat tensor
    (:func:`~handbook_lib.models.model_state.optimizer_temporary_bytes`, ``optimizer_impl``
    already resolved: ``for-loop``, ``foreach`` or ``fused``)."""
    stage = zero_stage(strategy)
    layout = model_layout(model)
    compute, e = DTYPES[PRECISIONS[precision].compute].bytes, DTYPES[state_dtype(precision)].bytes
    if stage == 3:
        part = min(-(-layout.num_params // world_size), check_int("sub_group_size", sub_group_size, 1))
        return e * part + optimizer_temporary_bytes([part], optimizer, optimizer_impl, e)
    padded, part = flat_partition(layout.num_params, world_size)
    held = estimate_zero_rank_bytes(layout, world_size, strategy, precision, optimizer, rank=rank).grads
    numels = [prod(shape) for _, shape in layout.tensors] if layout.exact else None
    pieces = [inside for _, inside in partition_overlaps(numels, world_size, rank)] if numels else None
    padding = padded - layout.num_params if rank == world_size - 1 else 0
    if pieces is None:
        norm = 8 * min(part, largest_module_params(layout))
    else:  # piece i in float64, beside the i norms (float64 scalars) computed before it; not the padding
        norm = max(8 * n + 8 * i for i, n in enumerate(pieces))
    one_piece = pieces is not None and len(pieces) + (padding > 0) == 1
    flattened, cast = (0 if one_piece else compute * part), (e * part if compute != e else 0)
    flat = cast or flattened  # what the optimizer steps on: a new tensor, or a view of the gradients
    temporaries = optimizer_temporary_bytes([part], optimizer, optimizer_impl, e)
    return max(held + norm, held + flattened + cast, (flat or held) + temporaries)


def estimate_zero_peak(
    model: ModelLike,
    world_size: int,
    strategy: str,
    precision: str = "fp32",
    optimizer: str = "adamw",
    *,
    micro_batch: int,
    seq_len: int,
    optimizer_impl: str = "default",
    backend: str = "nccl",
    knobs: ZeroKnobs = DEEPSPEED_DEFAULTS,
    reduce_dtype: str | None = None,
    rank: int = 0,
    activation_checkpointing: bool | str = False,
    ac_every: int = 1,
    ac_matmul_every: int = 1,
    ac_save: str = "matmul+attention",
    loss_chunks: int = 1,
) -> ZeroPeak:
    """Predict one rank's peak under DeepSpeed ZeRO ``strategy`` for a step of ``micro_batch`` ×
    ``seq_len`` tokens (the module docstring gives each moment's formula and how well the
    ``deepspeed_zero`` runs confirm it).

    Args:
        model, world_size, precision, optimizer: As for :func:`estimate_zero_rank_bytes`.
        strategy: ``ZERO1``, ``ZERO2`` or ``ZERO3``.
        micro_batch, seq_len: Sequences per rank and tokens per sequence (both >= 1).
        optimizer_impl: ``default`` is DeepSpeed's own choice: its fused Adam on a GPU
            (``backend`` ``nccl``), PyTorch's optimizer (``torch_adam``, one tensor at a time)
            on the CPU; or ``for-loop``, ``foreach``, ``fused`` for PyTorch's optimizer.
        knobs: The ``zero_optimization`` keys (:class:`ZeroKnobs`); DeepSpeed's defaults.
        reduce_dtype: The dtype gradients are reduced in (``communication_data_type``); ``None``:
            the precision's (fp32 for the mixed precisions, as the book's runs write it).
        activation_checkpointing, ac_every, ac_matmul_every, ac_save, loss_chunks: As for
            :func:`~handbook_lib.models.memory.estimate_memory`.

    Raises:
        ValueError: for a strategy that is not a ZeRO row, ``micro_batch`` or ``seq_len`` < 1,
            or any value :func:`estimate_memory` refuses.
    """
    stage = zero_stage(strategy)
    check_int("micro_batch", micro_batch, 1)
    check_int("seq_len", seq_len, 1)
    layout = model_layout(model)
    compute, reduce = lookup(PRECISIONS, precision, "precision")
    c, r = DTYPES[compute].bytes, DTYPES[reduce_dtype or reduce].bytes
    impl = zero_optimizer_impl(optimizer_impl, backend)
    state = estimate_zero_rank_bytes(layout, world_size, strategy, precision, optimizer, rank=rank,
                                     persistence_threshold=knobs.persistence_threshold)
    unsharded = estimate_memory(layout, 1, "NONE", precision, optimizer, micro_batch=micro_batch, seq_len=seq_len,
                                backend=backend, activation_checkpointing=activation_checkpointing,
                                ac_every=ac_every, ac_matmul_every=ac_matmul_every, ac_save=ac_save,
                                loss_chunks=loss_chunks)
    activations = max(total - unsharded.model_state for name, total in unsharded.phases.items()
                      if name != "optimizer_step")
    moving = activations
    padded = flat_partition(layout.num_params, world_size)[0]
    notes = []
    if stage == 3:
        if layout.exact:  # a module's gradient, and what the replayed step holds gathered
            module = max(sum(sizes) for _, sizes in gather_units(layout))
            gathered = zero3_replay(layout, persistence_threshold=knobs.persistence_threshold,
                                    prefetch_bucket_size=knobs.prefetch_bucket_size,
                                    max_reuse_distance=knobs.max_reuse_distance)[1]
            moving += c * module + c * gathered
        else:  # a module gathered, its gradient, and the prefetch bucket
            module = largest_module_params(layout)
            moving += 2 * c * module + c * min(knobs.prefetch_bucket_size, layout.num_params)
        buckets = r * knobs.reduce_bucket_size
        at_rest = state.total + buckets
        phases = {"forward_backward": at_rest + moving}
    else:
        buckets = c * knobs.reduce_bucket_size * (2 if knobs.overlaps(stage) else 1)
        at_rest = state.total - state.grads
        pending = min(padded, knobs.reduce_bucket_size)  # all of a model smaller than a bucket (the runs')
        whole_grads = c * pending + (r * pending if r != c else 0)
        phases = {"forward_backward": at_rest + moving, "gradient_buckets": at_rest + buckets + whole_grads}
        notes.append("the gradient buckets are a backward's own: allocated as it starts, freed as it ends")
    phases["optimizer_step"] = at_rest + zero_step_bytes(layout, world_size, strategy, precision, optimizer, impl,
                                                         rank=rank, sub_group_size=knobs.sub_group_size)
    return ZeroPeak(state, at_rest, phases, activations, buckets, tuple(notes))


def zero_plan_traffic(model: ModelLike, world_size: int, strategy: str, precision: str = "bf16-mixed",
                      reduce_dtype: str | None = None) -> StepTraffic:
    """The collectives of one ZeRO step as the planner prices them, for any layout (a preset's
    too): ZeRO-3 gathers each layer in forward and again in backward and reduce-scatters the
    gradients, FULL_SHARD's collectives
    (:func:`~handbook_lib.models.traffic.estimate_step_traffic`); ZeRO-1/2 all-reduce every
    gradient (DeepSpeed's ``use_multi_rank_bucket_allreduce``, DDP's bytes) and all-gather the
    updated flat parameters after the step. For a model known tensor by tensor,
    :func:`~handbook_lib.models.zero.estimate_zero_step_traffic` lists them exactly (the runs
    check it)."""
    stage = zero_stage(strategy)
    layout = model_layout(model)
    compute, reduce = lookup(PRECISIONS, precision, "precision")
    reduce = reduce_dtype or reduce
    if stage == 3:
        return estimate_step_traffic(layout.units(), world_size, "FULL_SHARD", param_dtype=compute,
                                     reduce_dtype=reduce)
    grads = estimate_step_traffic(layout.units(), world_size, "DDP", param_dtype=compute, reduce_dtype=reduce)
    padded = flat_partition(layout.num_params, world_size)[0]
    gather = estimate_collective("all_gather", DTYPES[compute].bytes * padded, world_size)
    record = CollectiveRecord(**vars(gather), unit="flat parameters", phase="step", dtype=compute, micro_step=0)
    return StepTraffic(strategy, world_size, 1, (*grads.records, record))
