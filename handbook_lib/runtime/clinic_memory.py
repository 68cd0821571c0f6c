"""The FSDP clinic's memory cases: bytes a job holds that it need not, measured and fixed.

Chapter 10, "Memory". Each case is ``(setup) -> (broken, fixed)``
(:data:`handbook_lib.runtime.clinic_common.CaseFn`) and checks what it measures against the book's
models: the units of a wrapping policy and their gathered bytes
(:meth:`~handbook_lib.models.layout.ModelLayout.units`), the bytes of init
(:func:`~handbook_lib.models.init_bytes.estimate_init_bytes`), of gradient shards
(:func:`~handbook_lib.models.sharding.estimate_tensor_shards`) and of what accumulation holds
between micro-steps (:func:`~handbook_lib.models.traffic.estimate_held_between_micro_steps`).
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn
from torch.nn import functional as F

from handbook_lib.models.init_bytes import estimate_init_bytes
from handbook_lib.models.model_state import optimizer_states
from handbook_lib.models.sharding import estimate_tensor_shards, policy_units
from handbook_lib.models.traffic import estimate_held_between_micro_steps, estimate_step_traffic
from handbook_lib.runtime.build import InitMode, measure_init_bytes
from handbook_lib.runtime.clinic_common import (
    CaseFn,
    CaseSetup,
    Half,
    counted,
    first_line,
    raised,
    shard_model,
    step_loss,
    units_of_class,
)
from handbook_lib.runtime.diagnosis import diagnose_accumulation, diagnose_wrapping
from handbook_lib.runtime.measure import (
    StepMemoryTracker,
    measure_fsdp_units,
    measure_grad_bytes,
    measure_optimizer_bytes,
)
from handbook_lib.runtime.model import TransformerLayer

__all__ = ["wrap_class_missing", "init_full_copy", "frozen_params", "accumulation_unsharded_grads",
           "MEMORY_CASES", "FROZEN", "USER_LAYER_CLASS"]

USER_LAYER_CLASS = "LlamaDecoderLayer"
"""The layer class the broken wrap policy names (copied from another model's recipe)."""

FROZEN = ("embedding.", "self_attn.")
"""What ``frozen_params`` freezes: parameters whose name contains one of these (the embedding and
every attention block; the feed-forward blocks, norms and head train), a fine-tuning's choice."""


def _adamw(model: nn.Module, setup: CaseSetup) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=setup.config.lr)


def wrap_class_missing(setup: CaseSetup) -> tuple[Half, Half]:
    """A transformer wrap policy given a class name the model lacks (``LlamaDecoderLayer``):
    no layer becomes a unit, the root holds everything, and each step gathers the whole model
    in one all-gather. Fixed: the model's own class, one unit per layer. Checked: the units
    (:meth:`ModelLayout.units` of ``model`` / ``layer``) and the largest all-gather (a unit's
    padded bytes), exact; :func:`diagnose_wrapping`."""
    halves = []
    for broken in (True, False):
        half = setup.half()
        model = setup.model()
        names = (USER_LAYER_CLASS,) if broken else (TransformerLayer.__name__,)  # clinic: both
        units = units_of_class(model, names)  # clinic: both
        expected = [u for u in setup.layout.units("layer" if units else "model") if u.numel]
        shard_model(model, setup.mesh(), units)  # clinic: both
        optimizer = _adamw(model, setup)
        step_loss(model, setup.batch(0), optimizer)
        with counted() as calls:
            step_loss(model, setup.batch(1), optimizer)
        measured = measure_fsdp_units(model)
        half.check("units", len(expected), len(measured), "units")
        gathered = max(c.buffer_bytes for c in calls if c.kind == "all_gather")
        half.check("largest_all_gather_bytes", max(4 * u.padded_numel(setup.world) for u in expected),
                   gathered, "bytes")
        finding = diagnose_wrapping(model)
        half.flag("diagnosed", broken, finding is not None)
        half.symptom = len(measured) == 1
        half.metrics.update(units=measured, largest_all_gather_bytes=gathered,
                            model_bytes=4 * setup.layout.num_params,
                            diagnosis=finding.message if finding else None)
        half.finding = (f"policy for {names[0]}: {len(measured)} unit(s) ({', '.join(measured)}); the "
                        f"largest all-gather is {gathered:,} B of a {4 * setup.layout.num_params:,} B model")
        halves.append(half)
    return halves[0], halves[1]


def init_full_copy(setup: CaseSetup) -> tuple[Half, Half]:
    """Every rank builds the whole seeded model, then shards it (``init="full"``, what most
    tutorials do): the init's peak holds the full model on every rank, whatever their number.
    Fixed: ``init="meta"``: shapes first, each rank materialises its shards and fills them one
    part at a time. This case builds as the book's runs do, on the rank's own device and process
    group (:func:`~handbook_lib.runtime.build.measure_init_bytes`), and checks the peak against
    :func:`~handbook_lib.models.init_bytes.estimate_init_bytes`, exact."""
    halves = []
    full = 4 * setup.layout.num_params
    for broken in (True, False):
        half = setup.half()
        init: InitMode = "full" if broken else "meta"  # clinic: both
        config = setup.config.replace(init=init)
        _, measured = measure_init_bytes(config, setup.ctx, init)  # clinic: both
        predicted = estimate_init_bytes(setup.layout, setup.world, "FULL_SHARD", init, rank=setup.rank)
        half.check("init_bytes", predicted, measured, "bytes")
        half.symptom = measured >= full
        half.metrics.update(init_bytes=measured, model_bytes=full,
                            per_world={n: estimate_init_bytes(setup.layout, n, "FULL_SHARD", init)
                                       for n in (2, 4, 8, 64)})
        half.finding = (f"init={init}: the init peaks at {measured:,} B on rank {setup.rank} "
                        f"({measured / full:.2f}x the {full:,} B model)")
        halves.append(half)
    return halves[0], halves[1]


def _frozen(name: str) -> bool:
    return any(part in name for part in FROZEN)


def _freeze(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        param.requires_grad_(not _frozen(name))


def _mixed_units(setup: CaseSetup) -> int:
    """Units of the layer policy that mix frozen and trainable tensors (from the layout's names)."""
    tensors = setup.layout.tensors
    units = policy_units([(n, s) for n, s in tensors], "layer")
    owners: dict[str, set[bool]] = {u.name: set() for u in units}
    for name, _ in tensors:
        owner = next((u.name for u in units[1:] if name.startswith(u.name + ".")), "root")
        owners[owner].add(_frozen(name))
    return sum(len(flags) == 2 for flags in owners.values())


def frozen_params(setup: CaseSetup) -> tuple[Half, Half]:
    """Fine-tuning with part of the model frozen (:data:`FROZEN`). FSDP1 with flat parameters
    (``use_orig_params=False``) refuses a unit that mixes frozen and trainable tensors. Fixed:
    FSDP2, which shards each parameter by itself: frozen ones get no gradient and no optimizer
    state, so a rank's gradient bytes are the trainable tensors' shards
    (:func:`~handbook_lib.models.sharding.estimate_tensor_shards`), exact."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    broken = setup.half()
    model = setup.model()
    _freeze(model)
    mixed = _mixed_units(setup)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        err = raised(lambda: FSDP1(model, process_group=setup.group,  # clinic: broken
                                   auto_wrap_policy=policy, device_id=torch.device("cpu"),
                                   use_orig_params=False))
    broken.flag("raised", True, err is not None)
    broken.symptom = err is not None
    broken.metrics.update(error=first_line(err) if err else None, mixed_units=mixed)
    broken.finding = f"FSDP1, {mixed} unit(s) mixing frozen and trainable: " + \
        (first_line(err) if err else "no error")

    fixed = setup.half()
    model = setup.model()
    _freeze(model)
    shard_model(model, setup.mesh())  # clinic: fixed
    optimizer = _adamw(model, setup)
    frozen_before = [p.detach().to_local().clone() for n, p in model.named_parameters() if _frozen(n)]
    step_loss(model, setup.batch(0), optimizer)
    loss = step_loss(model, setup.batch(1))  # gradients kept for the count
    trainable = [s for n, s in setup.layout.tensors if not _frozen(n)]
    shard = estimate_tensor_shards(trainable, setup.world, setup.rank).shard_bytes
    grads = measure_grad_bytes(model)
    fixed.check("grad_shard_bytes", shard, grads, "bytes")
    fixed.check("optimizer_state_bytes", optimizer_states("adamw") * shard, measure_optimizer_bytes(optimizer)[0],
                "bytes")
    moved = sum(int((a != p.detach().to_local()).sum()) for a, p in
                zip(frozen_before, (p for n, p in model.named_parameters() if _frozen(n))))
    fixed.check("frozen_changed", 0, moved, "elements")
    all_shards = setup.layout.shard_bytes(setup.world, setup.rank).shard_bytes
    fixed.metrics.update(grad_shard_bytes=grads, all_grad_shard_bytes=all_shards, loss=loss)
    fixed.finding = (f"FSDP2: {grads:,} B of gradient shards on rank {setup.rank}, for the trainable "
                     f"tensors only ({all_shards:,} B if nothing were frozen)")
    return broken, fixed


def _micro_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    """Forward and backward of one of ``k`` micro-batches (loss divided by ``k``); nothing kept."""
    loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) / k
    loss.backward()
    del loss


def accumulation_unsharded_grads(setup: CaseSetup) -> tuple[Half, Half]:
    """Gradient accumulation over 2 micro-steps with gradient sync off in the first
    (``set_requires_gradient_sync(False)``, DDP's ``no_sync`` habit): each rank holds every
    parameter's unsharded gradient until the last micro-step. Fixed: sync on, the shards
    accumulate in place, for one reduce-scatter per unit per micro-step. Checked: the bytes
    held between micro-steps, by the memory tracker and by :func:`diagnose_accumulation`,
    against :func:`~handbook_lib.models.traffic.estimate_held_between_micro_steps`, and the
    reduce-scatters against :func:`~handbook_lib.models.traffic.estimate_step_traffic`, exact."""
    halves = []
    units = setup.layout.units("layer")
    for broken in (True, False):
        half = setup.half()
        model = shard_model(setup.model(), setup.mesh())
        optimizer = _adamw(model, setup)
        step_loss(model, setup.batch(0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients at rest, as the book's loop keeps them
        x, y = setup.batch(1)
        tracker = StepMemoryTracker(model, optimizer, torch.device("cpu"))
        with tracker, counted() as calls:
            # cut under the tracker, before the start mark: the batch's storage is not the step's
            pieces = list(zip(x.chunk(2), y.chunk(2)))
            tracker.mark_start()
            model.set_requires_gradient_sync(not broken)  # clinic: both
            _micro_step(model, *pieces[0], 2)
            tracker.mark_between_micro_steps()
            finding = diagnose_accumulation(model)
            tracker.next_micro_step()
            model.set_requires_gradient_sync(True)
            _micro_step(model, *pieces[1], 2)
        optimizer.step()
        result = tracker.result
        assert result is not None and result.held_between_micro_steps is not None  # marked between micro-steps
        held = result.held_between_micro_steps
        predicted = estimate_held_between_micro_steps(units, setup.world, "FULL_SHARD",
                                                      sync_every_micro_step=not broken)
        half.check("held_after_micro1_bytes", predicted, held, "bytes")
        half.check("unsharded_grads_bytes", predicted, finding.measured if finding else 0, "bytes")
        traffic = estimate_step_traffic(units, setup.world, "FULL_SHARD", grad_accum_steps=2,
                                        sync_every_micro_step=not broken)
        scatters = sum(c.kind == "reduce_scatter" for c in calls)
        half.check("reduce_scatters", traffic.counts.get("reduce_scatter", 0), scatters, "collectives")
        half.flag("diagnosed", broken, finding is not None)
        half.symptom = held > 0
        half.metrics.update(held_between_micro_steps=held, reduce_scatters=scatters,
                            diagnosis=finding.message if finding else None)
        half.finding = (f"sync {'off' if broken else 'on'} in micro-step 1: {held:,} B held between "
                        f"micro-steps, {scatters} reduce-scatters in the step")
        halves.append(half)
    return halves[0], halves[1]


MEMORY_CASES: dict[str, CaseFn] = {
    "wrap_class_missing": wrap_class_missing,
    "init_full_copy": init_full_copy,
    "frozen_params": frozen_params,
    "accumulation_unsharded_grads": accumulation_unsharded_grads,
}
"""The memory cases of this module, by name."""
