"""Diagnose a user's own FSDP job: the silent mistakes a function can see, each in one line.

Chapter 10 (the FSDP clinic) calls each on the broken and the fixed half of a case; a learner
calls them on their own model or run. Each returns a :class:`Finding` (what was measured, what a
healthy job shows, and a one-line ``message`` with the symptom and the fix) or ``None`` when the
job is healthy:

- :func:`diagnose_wrapping`: one FSDP unit holds the whole model (a wrap policy that found no
  layer class): every rank gathers every parameter at once;
- :func:`diagnose_tied_weights`: a tensor shared by two modules (a tied embedding and head)
  would fall in two units, whose shards would lose the tie;
- :func:`diagnose_grad_norm`: a logged or clipped norm that is the local shard's only;
- :func:`diagnose_accumulation`: unsharded gradients held between micro-steps (sync off).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from handbook_lib.runtime.measure import local_tensor, measure_fsdp_units, measure_grad_bytes, nbytes

__all__ = ["Finding", "diagnose_wrapping", "diagnose_tied_weights", "diagnose_grad_norm",
           "diagnose_accumulation", "repeated_block"]


@dataclass(frozen=True)
class Finding:
    """A problem a diagnosis found, with the figure that shows it."""

    kind: str
    """Which problem: ``one_unit``, ``tied_weights_split``, ``local_grad_norm``,
    ``grad_norm_mismatch`` or ``unsharded_grads_held``."""
    message: str
    """One line: the symptom, measured, and the fix."""
    measured: float
    """The figure measured, in ``unit``."""
    healthy: float
    """What a healthy job shows instead, in ``unit``."""
    unit: str
    """``units``, ``norm`` (L2, the gradient's own units) or ``bytes``."""


def repeated_block(model: nn.Module) -> tuple[str, int] | None:
    """The class of the model's repeated blocks, and how many there are: the most common class
    among the children of its ``nn.ModuleList`` / ``nn.Sequential`` containers that hold
    parameters or modules (``("TransformerLayer", 2)``), or ``None`` if there is no such container.
    The unit a wrap policy should make of each (FSDP's wrappers are looked through)."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            for child in module.children():
                inner = _unwrapped(child)  # a block: parameters, or children (FSDP1 took the former)
                if any(True for _ in inner.parameters()) or any(True for _ in inner.children()):
                    name = _class_name(inner)
                    counts[name] = counts.get(name, 0) + 1
    if not counts:
        return None
    name = max(counts, key=counts.__getitem__)
    return (name, counts[name]) if counts[name] >= 2 else None


def _class_name(module: nn.Module) -> str:
    """The module's own class name: FSDP2 gives a wrapped module the class ``FSDP<Name>``."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if issubclass(cls, FSDPModule):
        cls = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
    return cls.__name__


def _unwrapped(module: nn.Module) -> nn.Module:
    """``module`` without activation-checkpointing or FSDP1 wrappers around it."""
    for attr in ("_checkpoint_wrapped_module", "_fsdp_wrapped_module"):
        while hasattr(module, attr):
            module = getattr(module, attr)
    return module


def _whole_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter: a DTensor's global shape, an FSDP1 flat parameter's
    unsharded size, else the tensor's own."""
    unsharded = getattr(param, "_unpadded_unsharded_size", None)
    return unsharded.numel() if unsharded is not None else param.numel()


def diagnose_wrapping(model: nn.Module, units: Sequence[nn.Module] | None = None) -> Finding | None:
    """One FSDP unit for the whole model: the wrap policy found no layer to make a unit of.

    A unit is all-gathered whole before it computes, so with one unit every rank holds every
    parameter unsharded during forward and backward: FSDP then saves only the state at rest.
    Call it on a wrapped model (FSDP2's ``fully_shard`` or FSDP1), or on the plain model with the
    ``units`` (modules, root excluded) a policy chose for it before wrapping.

    Returns:
        A :class:`Finding` (``one_unit``; measured 1 unit, healthy = the repeated blocks + the
        root) if one unit would hold every parameter while the model has repeated blocks
        (:func:`repeated_block`); ``None`` otherwise, or for a model FSDP did not wrap and no
        ``units`` given.
    """
    count = len(units) + 1 if units is not None else len(measure_fsdp_units(model))
    block = repeated_block(model)
    if count != 1 or block is None:
        return None
    name, blocks = block
    params = sum(_whole_numel(p) for p in model.parameters())
    return Finding(
        "one_unit",
        f"one FSDP unit holds all {params:,} parameters: every rank gathers the whole model at once, "
        f"so only the state at rest is sharded; the wrap policy found no layer class: wrap each "
        f"{name} ({blocks} of them) with fully_shard before the root",
        measured=1, healthy=blocks + 1, unit="units")


def _owner(name: str, unit_paths: Iterable[str]) -> str:
    """The unit that holds parameter ``name``: the deepest unit path it lies under, or ``root``."""
    inside = [path for path in unit_paths if name.startswith(path + ".")]
    return max(inside, key=len) if inside else "root"


def diagnose_tied_weights(model: nn.Module, units: Sequence[nn.Module | str]) -> Finding | None:
    """A tensor shared by two modules (a tied embedding and output head) that the planned units
    split: each unit would shard its own copy, the tie would be lost, and FSDP2 raises at the
    first forward (``Parameter ... is shared with a parameter already managed by another FSDP
    group``). Call it *before* wrapping: FSDP2 replaces the parameters, and the tie is gone.

    Args:
        model: The plain model, ties in place.
        units: The modules (or their qualified names) that will each be ``fully_shard``-ed,
            root excluded; what they leave belongs to the root.

    Returns:
        A :class:`Finding` (``tied_weights_split``; measured: the units the first split tensor
        falls in, healthy 1) or ``None`` when every shared tensor lies in one unit.
    """
    names = {id(m): n for n, m in model.named_modules()}
    paths = [u if isinstance(u, str) else names[id(u)] for u in units]
    sharing: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        sharing.setdefault(id(param), []).append(name)
    for group in sharing.values():
        owners = list(dict.fromkeys(_owner(n, paths) for n in group))
        if len(owners) > 1:
            modules = ", ".join(n.rsplit(".", 1)[0] for n in group)
            return Finding(
                "tied_weights_split",
                f"{' and '.join(group)} are one tensor but fall in units {' and '.join(owners)}: each "
                f"would shard its own copy and the tie is lost (FSDP2 raises at the first forward); "
                f"put them in one unit: fully_shard([{modules}]), or leave both to the root",
                measured=len(owners), healthy=1, unit="units")
    return None


def _squared_norms(model: nn.Module, grads: list[torch.Tensor]) -> tuple[float, float, int]:
    """``(local, whole, ranks)``: the squared L2 norm of this rank's gradient shards, that of the
    whole gradient (float64), and the ranks the gradients are sharded over. DTensor gradients
    (FSDP2, any mesh) are reduced by DTensor; FSDP1's flat shards over its process group;
    whole gradients are their own."""
    local = sum(float(torch.linalg.vector_norm(local_tensor(g), dtype=torch.float64)) ** 2 for g in grads)
    if hasattr(grads[0], "full_tensor"):
        norms = [torch.linalg.vector_norm(g, dtype=torch.float64).full_tensor() for g in grads]
        return local, sum(float(n) ** 2 for n in norms), grads[0].device_mesh.size()
    group = getattr(model, "process_group", None)
    if group is None:
        return local, local, 1
    total = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(total, group=group)
    return local, float(total), dist.get_world_size(group)


def diagnose_grad_norm(model: nn.Module, reported: float, *, rtol: float = 1e-4) -> Finding | None:
    """A gradient norm (logged, or used to clip) that is the local shard's only.

    With FSDP each rank holds a shard of every gradient; the norm of the whole gradient is the
    square root of the squared shard norms summed over ranks. A norm summed over one rank's
    shards is low by about sqrt(N), differs from rank to rank, and clipping by it scales each
    shard by its own factor. A collective: call it on every rank, after backward (before the
    gradients are zeroed).

    Args:
        model: The model whose ``.grad`` the norm was taken of (FSDP2, FSDP1 or unsharded).
        reported: The norm the job logged or clipped by (L2, the gradient's units).
        rtol: Relative difference within which two norms are the same.

    Returns:
        ``None`` if ``reported`` is the whole gradient's norm; a :class:`Finding`
        ``local_grad_norm`` if it is this rank's shards' norm (measured ``reported``, healthy the
        whole norm), or ``grad_norm_mismatch`` if it is neither.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return None
    local_sq, whole_sq, ranks = _squared_norms(model, grads)
    local, whole = math.sqrt(local_sq), math.sqrt(whole_sq)
    close = lambda a, b: abs(a - b) <= rtol * max(abs(b), 1e-30)  # noqa: E731
    if close(reported, whole):
        return None
    if close(reported, local):
        return Finding(
            "local_grad_norm",
            f"the norm {reported:.3g} is this rank's shards' only: the whole gradient's is {whole:.3g} "
            f"({whole / reported:.2f}x; about sqrt({ranks}) = {math.sqrt(ranks):.2f} on average); sum the "
            f"squared norms across ranks: clip_grad_norm_ on FSDP2's DTensor parameters, FSDP1's "
            f"model.clip_grad_norm_",
            measured=reported, healthy=whole, unit="norm")
    return Finding(
        "grad_norm_mismatch",
        f"the norm {reported:.3g} is neither the whole gradient's ({whole:.3g}) nor this rank's shards' "
        f"({local:.3g}): was it taken before another backward, or of other tensors?",
        measured=reported, healthy=whole, unit="norm")


def _held_fsdp2(module: nn.Module) -> int:
    """Bytes of unsharded gradients one FSDP2 unit keeps (gradient sync off): each parameter's
    gradient of the unsharded parameter, or its accumulation in the reduce dtype."""
    group = module._get_fsdp_state()._fsdp_param_group
    held = 0
    for fsdp_param in group.fsdp_params if group is not None else ():
        grad = fsdp_param.unsharded_accumulated_grad
        if grad is None and hasattr(fsdp_param, "_unsharded_param"):
            grad = fsdp_param._unsharded_param.grad
        held += nbytes(grad) if grad is not None else 0
    return held


def diagnose_accumulation(model: nn.Module) -> Finding | None:
    """Unsharded gradients held between micro-steps of gradient accumulation.

    With gradient sync off (FSDP2's ``set_requires_gradient_sync(False)``, what DDP's
    ``no_sync()`` habit becomes) FSDP does not reduce-scatter: every rank keeps every
    parameter's whole gradient until the last micro-step, P x 4 bytes in fp32 where sharded
    gradients take P x 4 / N. Call it between two micro-steps (after a backward, before the
    optimizer step), on an FSDP2 model (``fully_shard``; DDP and one process hold whole
    gradients anyway: nothing to find).

    Returns:
        A :class:`Finding` ``unsharded_grads_held`` (measured: the bytes held; healthy 0) or
        ``None`` if none is held (sync on, or nothing accumulated yet).

    Raises:
        TypeError: for an FSDP1 model (its flat gradients are not read here).
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    if any(isinstance(m, FSDP1) for m in model.modules()):
        raise TypeError("diagnose_accumulation reads FSDP2's units (fully_shard); this model is FSDP1's")
    held = sum(_held_fsdp2(m) for m in model.modules() if isinstance(m, FSDPModule))
    if not held:
        return None
    shards = measure_grad_bytes(model)
    ratio = f"{held / shards:.1f}x this rank's {shards:,} bytes of gradient shards" if shards else \
        "beside no gradient shard yet"
    return Finding(
        "unsharded_grads_held",
        f"{held:,} bytes of unsharded gradients are held between micro-steps (gradient sync off), "
        f"{ratio}, until the last micro-step reduce-scatters them; to keep them sharded, leave sync "
        f"on: one reduce-scatter per unit per micro-step",
        measured=held, healthy=0, unit="bytes")
