"""The FSDP clinic's hangs: a collective that some ranks call and others never do.

Chapter 10, "Hangs". A collective completes only when every rank of its group has called it; a
rank that calls one the others skip waits until the group's timeout (NCCL's watchdog: 10 to 30
minutes) and the job looks frozen. Each broken half here runs its collective on a gloo group of
its own with a timeout of :attr:`~handbook_lib.runtime.clinic_common.CaseSetup.hang_timeout_s`
seconds (:meth:`~handbook_lib.runtime.clinic_common.CaseSetup.hang_group`), so the hang becomes an
error the case records: the waiting rank, the collectives it issued (counted), the message.
Each fixed half calls the same collectives on every rank, and checks them against the book's
models (:func:`~handbook_lib.runtime.clinic_common.forward_all_gathers`, the bytes of a full state
dict).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from handbook_lib.runtime.clinic_common import (
    CaseFn,
    CaseSetup,
    Half,
    counted,
    forward_all_gathers,
    first_line,
    raised,
    shard_model,
)
from handbook_lib.runtime.measure import nbytes

__all__ = ["rank0_only_forward", "rank0_only_state_dict", "uneven_batches", "HANG_CASES", "UNEVEN_ITEMS"]

UNEVEN_ITEMS = 5
"""Evaluation batches of the uneven case: on 2 ranks, sliced ``items[rank::2]``, 3 and 2."""


def _rank0_alone(setup: CaseSetup, half: Half, call: Callable[[nn.Module], object]) -> None:
    """The broken half of a hang case: a model sharded over a short-timeout group; rank 0 alone
    calls ``call(model)``, which waits in its first collective until the timeout; the others
    skip it. Records, per rank, the collectives issued (1 on rank 0, 0 elsewhere), whether it
    timed out (rank 0 only), how long it waited (s) and the error's first line."""
    model = shard_model(setup.model(), setup.mesh(setup.hang_group()))
    waiting = setup.rank == 0
    err, waited, calls = None, 0.0, []
    if waiting:
        start = time.perf_counter()
        with counted() as calls:
            err = raised(lambda: call(model))
        waited = time.perf_counter() - start
    half.check("collectives", int(waiting), len(calls), "collectives")
    half.flag("timed_out", waiting, err is not None and "timed out" in str(err).lower())
    half.symptom = err is not None  # seen by the rank left waiting
    half.metrics.update(waited_s=waited, error=first_line(err) if err else None, timeout_s=setup.hang_timeout_s)
    half.finding = (f"rank 0 alone: {first_line(err) if err else 'no error'}" if waiting else
                    "skipped it: rank 0 is left waiting")


def _eval_forward(setup: CaseSetup) -> Callable[[nn.Module], object]:
    x, _ = setup.batch(0)

    def forward(model: nn.Module) -> object:
        with torch.no_grad():
            return model(x)

    return forward


def rank0_only_forward(setup: CaseSetup) -> tuple[Half, Half]:
    """An evaluation (or a generation) run on rank 0 only, after training: FSDP all-gathers each
    unit before it runs, and rank 0 waits in the first all-gather for ranks that never come.
    Fixed: every rank runs the forward (each on its share of the data). Checked: the collectives
    issued (1 on the waiting rank, 0 on the others, broken; one all-gather per unit on every
    rank, fixed: :func:`~handbook_lib.models.traffic.estimate_step_traffic`'s forward), exact."""
    broken = setup.half()
    _rank0_alone(setup, broken, _eval_forward(setup))  # clinic: broken
    fixed = setup.half()
    model = shard_model(setup.model(), setup.mesh())
    with counted() as calls:
        err = raised(lambda: _eval_forward(setup)(model))  # every rank  # clinic: fixed
    fixed.check("all_gathers", forward_all_gathers(setup), sum(c.kind == "all_gather" for c in calls),
                "collectives")
    fixed.flag("timed_out", False, err is not None)
    fixed.metrics.update(all_gathers=len(calls))
    fixed.finding = f"every rank: {len(calls)} all-gathers, one per unit; done"
    return broken, fixed


def _state_dict(model: nn.Module, cpu_offload: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))


def rank0_only_state_dict(setup: CaseSetup) -> tuple[Half, Half]:
    """The full state dict asked for on rank 0 only (``if rank == 0: save(state_dict())``):
    making each tensor whole is an all-gather, and rank 0 waits in the first one. Fixed: every
    rank asks, with ``cpu_offload=True``: rank 0 keeps the whole model, the others nothing.
    Checked: the collectives issued (broken), one all-gather per parameter tensor and the bytes
    each rank keeps (4P on rank 0, 0 elsewhere; fixed), exact."""
    broken = setup.half()
    _rank0_alone(setup, broken, lambda m: _state_dict(m, cpu_offload=False))  # clinic: broken
    fixed = setup.half()
    model = shard_model(setup.model(), setup.mesh())
    with counted() as calls:
        state = _state_dict(model, cpu_offload=True)  # every rank  # clinic: fixed
    held = sum(nbytes(t) for t in state.values())
    fixed.check("all_gathers", len(setup.layout.tensors), sum(c.kind == "all_gather" for c in calls),
                "collectives")
    fixed.check("state_dict_bytes", 4 * setup.layout.num_params if setup.rank == 0 else 0, held, "bytes")
    fixed.metrics.update(state_dict_bytes=held)
    fixed.finding = f"every rank gathers, cpu_offload=True: rank {setup.rank} keeps {held:,} B"
    return broken, fixed


def _evaluate(setup: CaseSetup, model: nn.Module, items: list[int],
              in_step: int = 0) -> tuple[int, BaseException | None, list]:
    """Forwards of batches ``items`` (``setup.batch(i)``, no gradients) until one raises: the
    forwards done, the error, the collectives issued. The first ``in_step`` forwards, which
    every rank runs, start together (a barrier on the job's group), so that a short timeout
    catches the rank left alone, not a rank the machine ran late."""
    done = 0

    def loop() -> None:
        nonlocal done
        for k, i in enumerate(items):
            if k < in_step:
                dist.barrier(group=setup.group)
            with torch.no_grad():
                model(setup.batch(i)[0])
            done += 1

    with counted() as calls:
        err = raised(loop)
    return done, err, calls


def uneven_batches(setup: CaseSetup) -> tuple[Half, Half]:
    """An evaluation loop over each rank's own slice of a finite set (``items[rank::world]``):
    :data:`UNEVEN_ITEMS` batches give rank 0 one more than rank 1. Every FSDP forward
    all-gathers, so rank 0's last forward waits for a rank that has left the loop, until the
    group's timeout. Fixed: every rank gets as many batches (``DistributedSampler`` pads the
    set with its first items; a fixed step count does too). Checked: the batches each rank got
    (``ceil((n - rank) / world)`` broken, ``ceil(n / world)`` fixed), the forwards done,
    rank 0's timeout, and the fixed half's all-gathers, exact: one per layer a forward, and the
    root's once (FSDP2 keeps the root gathered after forward; without a backward, nothing
    reshards it between the forwards)."""
    from torch.utils.data import DistributedSampler

    n, world, rank = UNEVEN_ITEMS, setup.world, setup.rank
    per_forward = forward_all_gathers(setup)
    halves = []
    for broken in (True, False):
        half = setup.half()
        model = shard_model(setup.model(), setup.mesh(setup.hang_group()) if broken else setup.mesh())
        if broken:  # clinic: both
            items = list(range(n))[rank::world]
        else:
            items = list(DistributedSampler(range(n), world, rank, shuffle=False))
        done, err, calls = _evaluate(setup, model, items, in_step=n // world if broken else 0)
        given = -(-(n - rank) // world) if broken else -(-n // world)
        half.check("batches", given, len(items), "batches")
        half.check("forwards_done", n // world if broken else given, done, "forwards")
        half.flag("timed_out", broken and given > n // world, err is not None)
        if not broken:
            all_gathers = sum(c.kind == "all_gather" for c in calls)
            half.check("all_gathers", given * (per_forward - 1) + 1, all_gathers, "collectives")
        half.symptom = err is not None
        half.metrics.update(batches=len(items), forwards_done=done, error=first_line(err) if err else None)
        half.finding = (f"{len(items)} batches, {done} forwards: "
                        + (first_line(err) if err else "done"))
        halves.append(half)
    return halves[0], halves[1]


HANG_CASES: dict[str, CaseFn] = {
    "rank0_only_forward": rank0_only_forward,
    "rank0_only_state_dict": rank0_only_state_dict,
    "uneven_batches": uneven_batches,
}
"""The hang cases of this module, by name."""
