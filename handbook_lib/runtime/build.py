"""Build the model once and apply a strategy to it: the ``parallelize`` step of every run.

Chapter 1 uses it for the first FSDP2 run; chapter 5 for every strategy, API and lever. The
steps, as large-model trainers (torchtitan, Accelerate's ``cpu_ram_efficient_loading``) take
them:

1. **Build on the meta device**: the modules and their shapes, no storage at all.
2. **Activation checkpointing**, once, on each transformer layer.
3. **Apply the strategy's wrapper** from :data:`handbook_lib.core.strategies.STRATEGY_TABLE`: nothing
   (``NONE``), DDP, or FSDP (FSDP2's ``fully_shard`` or FSDP1's ``FullyShardedDataParallel``).
4. **Materialise**: ``to_empty`` gives each rank storage for what it holds — its shards, with
   FSDP — and :class:`SeededInit` fills it with the weights ``build_model(config, seed)`` would
   have drawn, one top-level part at a time, so no rank ever holds the whole model.

Chapter 9's layouts (tensor and sequence ranks) take the same entry, :func:`parallelize`, and
:func:`apply_axes` lays the split-attention model out over the job's mesh: the tensor-parallel
plan, the sequence split's attention, checkpointing, then FSDP2, in torchtitan's order.

``init="full"`` builds the whole seeded model on every rank first and then wraps it (what the
seed and most tutorials do): the same weights, and every rank's host memory at init holds the
full model. :func:`measure_init_bytes` measures the difference.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from handbook_lib.core.config import (
    DTYPES,
    InitName,
    RunConfig,
    state_dtype,
    get_precision,
)
from handbook_lib.core.parallel_config import ParallelConfig
from handbook_lib.core.strategies import Strategy, get_strategy, run_shard_group, runnable_strategy
from handbook_lib.models.layout import wrap_units
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.mesh import LayoutMesh, build_layout_mesh
from handbook_lib.runtime.model import SimpleTransformer, TransformerLayer, build_model
from handbook_lib.runtime.parallel_model import AttentionCore, ParallelTransformer, from_simple
from handbook_lib.runtime.recompute import apply_activation_checkpointing
from handbook_lib.runtime.ring_attention import ring_core
from handbook_lib.runtime.seeded_init import SeededInit

__all__ = [
    "InitMode",
    "torch_dtype",
    "shard_group",
    "build_mesh",
    "build_mp_policy",
    "apply_fsdp2",
    "check_runnable",
    "parallelize",
    "apply_axes",
    "apply_pipeline",
    "CoreFactory",
    "APPLY",
    "measure_init_bytes",
    "apply_explicit_prefetch",
]

InitMode = InitName
"""How :func:`parallelize` builds the model: ``meta`` (shapes first, each rank materialises only
what it holds) or ``full`` (every rank builds the whole model on the CPU, then wraps it)."""


def torch_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` of a :data:`handbook_lib.core.config.DTYPES` name (``fp32``, ``bf16``, ``fp16``)."""
    return getattr(torch, DTYPES[name].torch_name)


def shard_group(config: RunConfig, world_size: int) -> int:
    """Ranks that shard one copy of the model (the strategy table's rule): for the hybrid
    strategies ``shard_group_size``, where 0 means the ranks of one node (torchrun's
    ``LOCAL_WORLD_SIZE``).

    Raises:
        ValueError: if the group does not divide the world size.
    """
    return run_shard_group(config.strategy, world_size, config.shard_group_size)


def build_mesh(config: RunConfig, ctx: RankContext) -> DeviceMesh:
    """The device mesh FSDP shards over, from the strategy's layout on this job
    (:meth:`~handbook_lib.core.strategies.Strategy.layout`, :func:`~handbook_lib.runtime.mesh.build_layout_mesh`):
    1-D over all ranks, or 2-D (``dp_replicate``, ``dp_shard``) for HSDP."""
    row = get_strategy(config.strategy)
    group = shard_group(config, ctx.world_size) if row.hybrid else None
    return build_layout_mesh(row.layout(ctx.world_size, group), ctx.device.type).fsdp


def build_mp_policy(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP2 mixed-precision policy for a ``precision`` value (``None`` for fp32).

    ``bf16-mixed`` / ``fp16-mixed`` compute in bf16 / fp16 (parameters all-gathered
    in that dtype) and reduce gradients in fp32; the sharded parameters and the
    optimizer stay fp32. fp16 also needs a gradient scaler
    (:func:`handbook_lib.runtime.training.build_grad_scaler`).
    """
    compute, reduce = get_precision(precision)
    if compute == reduce:
        return None
    return MixedPrecisionPolicy(param_dtype=torch_dtype(compute),
                                reduce_dtype=torch_dtype(reduce))


def apply_fsdp2(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    units: list[nn.Module] | None = None,
) -> None:
    """Shard ``model`` in place: ``fully_shard`` each unit's module, then the root.

    By default every transformer layer becomes one FSDP unit (all-gathered just before
    it runs, freed after) and the root unit holds what is left, the embedding and the
    output head. ``units`` names other modules instead (children before parents, as
    :func:`handbook_lib.models.layout.wrap_units` lists them in forward order): ``[]``
    leaves one unit, the root, holding every parameter. Works on a model on the meta
    device too.

    ``reshard_after_forward`` goes to every unit but the root: ``True`` frees each
    layer's gathered parameters after its forward (all-gathered again in backward),
    ``False`` keeps them to backward, an ``int`` g reshards them to groups of g ranks.
    The root gets ``fully_shard``'s own default (``None``): kept gathered from forward
    into backward, which needs it first (one all-gather fewer), unless ``False`` keeps
    everything.
    """
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    if units is None:
        units = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    # fully_shard a child before its parent: the parent's unit skips the child's
    # parameters
    depth = {id(m): name.count(".") for name, m in model.named_modules() if name}
    for module in sorted(units, key=lambda m: -depth[id(m)]):
        fully_shard(module, **kwargs)
    # the root: fully_shard's default (None) keeps it gathered into backward
    root_reshard = False if reshard_after_forward is False else None
    fully_shard(model, **{**kwargs, "reshard_after_forward": root_reshard})


def check_runnable(config: RunConfig, world_size: int) -> Strategy:
    """The strategy's row, if this runtime can apply it with ``config.api`` on ``world_size``.

    Raises:
        ValueError: naming the strategy and what is accepted (``NONE`` on several ranks, an
            FSDP strategy the chosen API lacks).
    """
    return runnable_strategy(config.strategy, config.api, world_size)


def _unit_modules(model: SimpleTransformer, config: RunConfig) -> list[nn.Module]:
    """The modules the run's wrapping policy makes units of (root excluded), found by name
    before any activation-checkpointing wrapper changes the paths."""
    names = [u.name for u in wrap_units(config.model_config(), config.wrap, config.wrap_min_params)
             if not u.root]
    return [model.get_submodule(name) for name in names]


def _materialise(model: nn.Module, device: torch.device, seeded: SeededInit | None) -> None:
    if seeded is None:
        model.to(device)
    else:
        model.to_empty(device=device)
        seeded.fill(model)


def _apply_none(model, config, ctx, row, units, seeded) -> nn.Module:
    """``NONE``: the plain module on the rank's device."""
    _materialise(model, ctx.device, seeded)
    return model


def _apply_ddp(model, config, ctx, row, units, seeded) -> nn.Module:
    """``DDP``: materialise the full replica, then ``DistributedDataParallel`` (which
    broadcasts rank 0's weights; they are equal already).

    DDP's default all-reduce runs through a comm hook that also keeps a reference to each
    gradient bucket (``ddp_bucket_buffers``): the buckets live from the wrap on, and a memory
    tracker started later sees a bucket only once backward writes into it, unless told of it
    (:class:`handbook_lib.runtime.measure.StepMemoryTracker` is). The arithmetic is DDP's own
    ``allreduce_hook``: divide by the world size, all-reduce.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    _materialise(model, ctx.device, seeded)
    ddp = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                                  init_sync=False)
    buffers: dict[int, torch.Tensor] = {}

    def keep_and_allreduce(state, bucket):
        buffers[bucket.index()] = bucket.buffer()
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, keep_and_allreduce)
    ddp.ddp_bucket_buffers = buffers
    return ddp


def _apply_fsdp(model, config, ctx, row, units, seeded) -> nn.Module:
    """FSDP: FSDP2's ``fully_shard`` per unit and root, or FSDP1's wrapper. A model
    built on the meta device (``seeded``) is sharded first, then given memory and its
    seeded weights: each rank only ever allocates its shards."""
    if config.api == "fsdp1":
        return _apply_fsdp1(model, config, ctx, row, seeded)
    # The output head returns a view (nn.Linear on a 3-D input), so FSDP2 warns that
    # an in-place op on it would skip a hook; nothing here alters the logits in place.
    view = r"FSDP2-wrapped module .* returned a view tensor"
    warnings.filterwarnings("ignore", message=view)
    offload = None
    if config.cpu_offload:  # shards, gradients and the optimizer step on the CPU
        offload = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
    home = torch.device("cpu") if offload is not None else ctx.device
    if seeded is None and offload is None:
        model.to(ctx.device)
    # True, False, or an int: reshard after forward to groups of that many ranks
    reshard = config.reshard_after_forward_size or row.reshard_after_forward
    apply_fsdp2(model, build_mesh(config, ctx), reshard_after_forward=reshard,
                mp_policy=build_mp_policy(config.precision), offload_policy=offload,
                units=units)
    apply_explicit_prefetch(units, config.explicit_prefetch)
    if seeded is not None:
        _materialise(model, home, seeded)
    return model


def _apply_fsdp1(model, config, ctx, row, seeded) -> nn.Module:
    """FSDP1's ``FullyShardedDataParallel``, as the seed wraps it, made device-aware.

    ``device_id`` is the rank's device (FSDP1 refuses a CPU model without it), the hybrid
    strategies get an explicit 2-D mesh (without one, FSDP1 builds its groups from the devices
    one process sees, ``device_count()``: right on an 8-GPU node where every rank sees all 8,
    degenerate where each rank sees one device, on a CPU or with Slurm's
    ``--gpus-per-task=1`` / a per-rank ``CUDA_VISIBLE_DEVICES``: shard groups of one rank,
    clamped to ``NO_SHARD``, whose gradients are never synced), the wrapping policy follows ``wrap`` and
    parameters are flattened per unit (``use_orig_params=False``). On the meta device, FSDP1
    calls ``param_init_fn`` on each module as it wraps it: that is where the seeded weights go.
    """
    import functools

    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import (
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    if config.cpu_offload and ctx.device.type == "cpu":
        raise ValueError("FSDP1's CPUOffload pins host memory, which needs an accelerator: on a "
                         "CPU-only machine use api='fsdp2' (CPUOffloadPolicy(pin_memory=False))")
    policy = {
        "layer": functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer}),
        "model": None,
        "size": functools.partial(size_based_auto_wrap_policy, min_num_params=config.wrap_min_params),
    }[config.wrap]
    mixed = None
    mp = build_mp_policy(config.precision)
    if mp is not None:
        mixed = MixedPrecision(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                               buffer_dtype=mp.param_dtype)
    init_fn = None
    if seeded is not None:
        names = {id(m): n for n, m in model.named_modules()}

        def init_fn(module: nn.Module) -> None:
            module.to_empty(device=ctx.device, recurse=False)
            seeded.fill_module(names[id(module)], module)
    warnings.filterwarnings("ignore", message=r".*NO_SHARD.* is deprecated")  # said in chapter 5
    wrapped = FSDP(
        model,
        sharding_strategy=ShardingStrategy[row.fsdp1],
        auto_wrap_policy=policy,
        mixed_precision=mixed,
        cpu_offload=CPUOffload(offload_params=True) if config.cpu_offload else None,
        device_id=ctx.device,
        device_mesh=build_mesh(config, ctx) if row.hybrid else None,
        use_orig_params=False,
        param_init_fn=init_fn,
    )
    if seeded is not None:
        seeded.close()
    return wrapped


APPLY: dict[str, Callable[..., nn.Module]] = {"none": _apply_none, "ddp": _apply_ddp, "fsdp": _apply_fsdp}
"""One apply function per wrapper of :data:`handbook_lib.core.strategies.WRAPPERS`:
``(model, config, ctx, row, units, seeded) -> model``."""


CoreFactory = Callable[[dist.ProcessGroup], AttentionCore]
"""``factory(sp_group) -> core``: the distributed attention of a sequence split over ``sp_group``."""


def parallelize(config: RunConfig, ctx: RankContext, *, init: InitMode = "meta", mesh: LayoutMesh | None = None,
                sp_core: CoreFactory | None = None) -> nn.Module:
    """The model the run config asks for, built once, checkpointed once, wrapped once: the one
    entry point of every PyTorch run.

    A :class:`~handbook_lib.core.parallel_config.ParallelConfig` with tensor or sequence ranks
    gets the split-attention model laid out over its axes (:func:`apply_axes`, on ``mesh``,
    built from the config's layout when not given; ``sp_core`` as there); any other config the
    book's model with its strategy's wrapper.

    Args:
        config: The run; its ``strategy`` row says which wrapper applies.
        ctx: This rank (device, world size).
        init: ``meta`` (default) or ``full`` (see :data:`InitMode`); the weights are the same.
            The axes' model is built whole on the CPU, then split (``init`` unused).

    Raises:
        ValueError: for a strategy this API or world size cannot run (:func:`check_runnable`).
    """
    if isinstance(config, ParallelConfig) and config.pp_size * config.inner_size > 1:
        for key, value, usual in (("precision", state_dtype(config.precision), "fp32"),
                                  ("ac_every", config.ac_every, 1), ("ac_matmul_every", config.ac_matmul_every, 1),
                                  ("ac_save", config.ac_save, "matmul+attention")):
            if value != usual:  # pure bf16, every k-th layer or product: fsdp_train's only
                raise ValueError(f"config key {key!r}={getattr(config, key)!r} runs with fsdp_train; the tensor, "
                                 "sequence and pipeline runs keep an fp32 state and checkpoint every layer")
        if mesh is None:
            mesh = build_layout_mesh(config.parallel_layout(ctx.world_size), ctx.device.type)
        return apply_axes(config, ctx, mesh, sp_core)
    row = check_runnable(config, ctx.world_size)
    if init not in ("meta", "full"):
        raise ValueError(f"init must be 'meta' or 'full', got {init!r}")
    if init == "meta":
        with torch.device("meta"):
            model = SimpleTransformer(config.model_config())
        seeded = SeededInit(config)
    else:
        torch.manual_seed(config.seed)
        model, seeded = SimpleTransformer(config.model_config()), None
    dtype = state_dtype(config.precision)
    if dtype != "fp32":  # pure bf16: built, filled, sharded and stepped in bf16, no fp32 copy
        model.to(torch_dtype(dtype))
    units = _unit_modules(model, config)
    apply_activation_checkpointing(model, config.activation_checkpointing, config.ac_every, config.ac_matmul_every,
                                   config.ac_save)
    return APPLY[row.wrapper](model, config, ctx, row, units, seeded)


def apply_axes(config: ParallelConfig, ctx: RankContext, mesh: LayoutMesh,
               sp_core: CoreFactory | None = None) -> nn.Module:
    """The book's seeded model laid out over ``config``'s axes on ``mesh``, in
    torchtitan's order (chapter 9).

    Args:
        config: The run: its layout on ``ctx.world_size`` ranks, and FSDP2's levers as
            :func:`parallelize` applies them: the strategy's resharding (or
            ``reshard_after_forward_size``), the ``precision``'s policy,
            ``cpu_offload``, the ``wrap`` policy's units, ``explicit_prefetch`` and
            ``activation_checkpointing``.
        ctx: This rank.
        mesh: The job's mesh (:func:`~handbook_lib.runtime.mesh.build_layout_mesh`).
        sp_core: The sequence split's attention (default the book's ring; a run
            passes DeepSpeed's Ulysses for ``sp_method='ulysses'``).

    With a pipeline (``pp_size`` > 1) the model is cut into this rank's stages
    first, each checkpointed and sharded as a model would be (:func:`apply_pipeline`).

    Chapter 9 shows this function: lines fit its column (86 characters).
    """
    layout = mesh.layout
    seeded = build_model(config.model_config(), seed=config.seed, causal=True)
    model = from_simple(seeded, vocab_size=config.padded_vocab_size).to(ctx.device)
    if layout.pp > 1:  # 0. this rank's stages of the pipeline
        return apply_pipeline(model, config, ctx, mesh)
    if layout.tp_enabled:  # 1. the tensor-parallel plan
        from handbook_lib.runtime.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh.tp, config.sequence_parallel)
    if layout.sp_enabled:  # 2. the sequence split: attention that sees the others
        model.set_core((sp_core or ring_core)(mesh.sp_group))
    wrapped = wrap_units(config.model_config(), config.wrap, config.wrap_min_params)
    units = [model.get_submodule(u.name) for u in wrapped if not u.root]
    # 3. checkpointing, after the units are found by name
    apply_activation_checkpointing(model, config.activation_checkpointing)
    row = get_strategy(config.strategy)  # 4. FSDP2 over dp_shard x sp
    offload = None
    if config.cpu_offload:
        offload = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
    apply_fsdp2(model, mesh.fsdp, units=units,
                reshard_after_forward=config.reshard_after_forward_size
                or row.reshard_after_forward,
                mp_policy=build_mp_policy(config.precision), offload_policy=offload)
    apply_explicit_prefetch(units, config.explicit_prefetch)
    return model


def apply_pipeline(model: ParallelTransformer, config: ParallelConfig,
                   ctx: RankContext, mesh: LayoutMesh) -> nn.Module:
    """This rank's stages of ``model``, each split over the tensor ranks (if any),
    checkpointed and sharded by FSDP2 over its data-parallel group (its layers, then
    the stage; over one rank FSDP2 only casts for mixed precision), run by the
    schedule of a :class:`~handbook_lib.runtime.pipeline.PipelinedModel`.

    Chapter 9 shows this function: lines fit its column (86 characters).
    """
    from handbook_lib.runtime.pipeline import PipelinedModel, cut_stages

    stages = cut_stages(model, config, mesh.pp_rank)  # whole layers, in order
    reshard = get_strategy(config.strategy).reshard_after_forward
    for stage in stages:
        if mesh.layout.tp_enabled:  # each stage: the tensor-parallel plan
            from handbook_lib.runtime.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(stage, mesh.tp, config.sequence_parallel)
        units = list(stage.layers)
        apply_activation_checkpointing(stage, config.activation_checkpointing)
        if config.schedule == "ZBVZeroBubble":  # one dp rank, fp32: nothing to shard
            continue                             # or cast (the run's spec says why)
        apply_fsdp2(stage, mesh.fsdp, units=units, reshard_after_forward=reshard,
                    mp_policy=build_mp_policy(config.precision))
    return PipelinedModel(stages, config, mesh.pp_group, ctx.device)


def measure_init_bytes(config: RunConfig, ctx: RankContext, init: InitMode = "meta") -> tuple[nn.Module, int]:
    """``parallelize`` under a memory tracker: the model, and the peak bytes of tensors alive on
    the rank's device (on a CPU run: host memory) while it was built, wrapped and initialised.

    Meta tensors hold no storage and are not counted; with ``init="full"`` the whole seeded
    model is counted, with ``meta`` the rank's shards plus the largest part being copied. On
    CUDA only the GPU is read (the seeded part, the mesh and offloaded shards are host memory),
    every storage rounded up to 512 B as the caching allocator takes it: predict it with
    ``estimate_init_bytes(..., device="cuda")``.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        model = parallelize(config, ctx, init=init)
    peak = tracker.get_tracker_snapshot("peak").get(ctx.device, {})
    total = next((int(v) for k, v in peak.items() if str(getattr(k, "value", k)) == "Total"), 0)
    return model, total


def apply_explicit_prefetch(units: list[nn.Module], ahead: int) -> None:
    """Make each FSDP2 unit of ``units`` (in forward order, root excluded) prefetch the next
    ``ahead`` units' all-gathers in forward and the previous ``ahead`` in backward, as
    PyTorch's FSDP2 example does (``set_modules_to_forward_prefetch`` /
    ``set_modules_to_backward_prefetch``). ``ahead=0`` leaves FSDP2's implicit prefetching:
    forward gathers each unit in its own pre-forward hook (on a GPU the CPU runs ahead, so the
    next all-gather is issued while this unit computes); backward prefetches one unit, in
    reverse post-forward order. The step's ``root.unshard()`` is the training loop's
    (:func:`handbook_lib.runtime.training.train_step`, ``unshard_first``).
    """
    if ahead <= 0:
        return
    for i, unit in enumerate(units):
        later = units[i + 1:i + 1 + ahead]
        earlier = units[max(0, i - ahead):i][::-1]
        if later:
            unit.set_modules_to_forward_prefetch(later)
        if earlier:
            unit.set_modules_to_backward_prefetch(earlier)
