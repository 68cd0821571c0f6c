"""The FSDP clinic: one failure users met, run as they wrote it and fixed, each half checked.

Chapter 10 launches it, all cases in one job (``handbook_lib.launch.torchrun_batch``, one config
per case). The ``case`` key names one of :data:`handbook_lib.models.clinic_cases.CLINIC_CASES`;
every rank runs its *broken* half, then its *fixed* half (the cases live in
``runtime.clinic_memory``, ``clinic_correctness``, ``clinic_hangs`` and ``clinic_checkpoints``).
Each half's checks put what it measured beside the
book's model (bytes, units, collectives, norms) or beside what its symptom means (an error
raised, a timeout); two job-wide checks say that the broken half showed its symptom on some rank
(``broken.symptom`` = 1) and the fixed half on none (``fixed.symptom`` = 0). The cases run on the
CPU over a gloo group of their own, on any machine; a hang is cut short by a timeout of
``hang_timeout_s`` seconds.

Launch::

    python -m handbook_lib run clinic --nproc 2 --set case=local_grad_norm
    # or, by hand:
    torchrun --nproc-per-node 2 -m handbook_lib.runs.clinic --set case=local_grad_norm --out runs/clinic
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from handbook_lib.core.results import Check
from handbook_lib.models.clinic_cases import CLINIC_CASES
from handbook_lib.runs.entry import RankReport, main
from handbook_lib.runs.specs.clinic import CONFIG as CONFIG, ClinicConfig, validate
from handbook_lib.runtime.clinic_common import CaseFn, CaseSetup, Half
from handbook_lib.runtime.distributed import RankContext



def case_function(name: str) -> CaseFn:
    """The ``(setup) -> (broken, fixed)`` function of case ``name`` (its module imported now).

    Raises:
        ValueError: for a name that is not a case, naming the accepted ones.
    """
    from handbook_lib.runtime.clinic_checkpoints import CHECKPOINT_CASES
    from handbook_lib.runtime.clinic_correctness import CORRECTNESS_CASES
    from handbook_lib.runtime.clinic_hangs import HANG_CASES
    from handbook_lib.runtime.clinic_memory import MEMORY_CASES

    table = {**MEMORY_CASES, **CORRECTNESS_CASES, **HANG_CASES, **CHECKPOINT_CASES}
    if name not in table:
        raise ValueError(f"case must be one of {', '.join(CLINIC_CASES)}, got {name!r}")
    return table[name]


def _seen_anywhere(setup: CaseSetup, halves: tuple[Half, Half]) -> list[int]:
    """For each half, 1 if its symptom showed on some rank, else 0 (a MAX over the ranks)."""
    flags = torch.tensor([int(h.symptom) for h in halves])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=setup.group)
    return [int(f) for f in flags]


def run(config: ClinicConfig, ctx: RankContext) -> RankReport:
    """Run case ``config.case`` on this rank, broken then fixed, and report both halves."""
    validate(config, ctx.world_size)
    setup = CaseSetup(config, ctx, hang_timeout_s=config.hang_timeout_s)
    start = time.perf_counter()
    try:
        halves = case_function(config.case)(setup)
        seen = _seen_anywhere(setup, halves)
    finally:
        setup.close()
    checks = [replace(c, quantity=f"{label}.{c.quantity}") for label, half in zip(("broken", "fixed"), halves)
              for c in half.checks]
    if ctx.is_main:
        checks += [Check("broken.symptom", None, 1, seen[0], "flag"), Check("fixed.symptom", None, 0, seen[1], "flag")]
    metrics = {"case": config.case, "case_s": time.perf_counter() - start,
               **{label: {"symptom": half.symptom, "finding": half.finding, **half.metrics}
                  for label, half in zip(("broken", "fixed"), halves)}}
    case = CLINIC_CASES[config.case]
    return RankReport(metrics=metrics, checks=checks,
                      extra={"case": case.name, "group": case.group, "note": case.note, "threads": list(case.urls)})


if __name__ == "__main__":
    main(sys.modules[__name__])
