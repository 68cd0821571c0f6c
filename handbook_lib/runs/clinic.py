"""The FSDP clinic: one failure users met, run as they wrote it and fixed, each half checked.

Chapter 10 launches it, all cases in one job (``handbook_lib.launch.torchrun_batch``, one config
per case). The ``case`` key names one of :data:`handbook_lib.models.clinic_cases.CLINIC_CASES`;
every rank runs its *broken* half, then its *fixed* half (the cases live in
``runtime.clinic_memory``, ``clinic_correctness``, ``clinic_hangs``, ``clinic_checkpoints`` and,
for DeepSpeed, ``integrations.clinic_zero``). Each half's checks put what it measured beside the
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
from dataclasses import dataclass, replace
from typing import Literal, get_args

import torch
import torch.distributed as dist

from handbook_lib.core.architecture import MODEL_KEYS
from handbook_lib.core.config import RunConfig
from handbook_lib.core.results import Check
from handbook_lib.models.clinic_cases import CLINIC_CASES
from handbook_lib.runs.entry import RankReport, main
from handbook_lib.runtime.clinic_common import CaseFn, CaseSetup, Half
from handbook_lib.runtime.distributed import RankContext

CaseName = Literal[
    "wrap_class_missing", "init_full_copy", "frozen_params", "accumulation_unsharded_grads",
    "zero3_small_model", "tied_weights_split", "local_grad_norm", "meta_buffer_uninit",
    "optimizer_before_wrap", "ac_nondeterministic", "mixed_dtype", "rank0_only_forward",
    "rank0_only_state_dict", "full_state_dict_every_rank", "resume_other_world_size",
]
if get_args(CaseName) != tuple(CLINIC_CASES):  # pragma: no cover - caught at import and by a test
    raise AssertionError("CaseName and models.clinic_cases.CLINIC_CASES list different cases")


@dataclass(frozen=True)
class ClinicConfig(RunConfig):
    """One case of the clinic, on a tiny model (each half takes well under a second, a hang
    its timeout). The cases choose their own strategy, wrapping, precision and steps: only the
    model's keys, the batch, the seed, the learning rate and the two keys below may change."""

    vocab_size: int = 96
    """Tokens (rows of the embedding and of the tied head)."""
    d_model: int = 32
    """Width of the hidden state."""
    nhead: int = 2
    """Attention heads per layer."""
    dim_feedforward: int = 64
    """Feed-forward width."""
    num_layers: int = 2
    """Transformer layers (one FSDP unit each, when the wrapping is right)."""
    batch_size: int = 4
    """Global batch, sequences; divisible by 2 x the ranks (the accumulation case's micro-steps)."""
    seq_len: int = 16
    """Tokens per sequence."""
    case: CaseName = "wrap_class_missing"
    """Which failure: a key of :data:`handbook_lib.models.clinic_cases.CLINIC_CASES`."""
    hang_timeout_s: float = 1.0
    """Seconds a hang case's collective waits before it raises (0.5 to 60): its symptom. Only
    the collective that hangs runs under it (the group is made, and met in, with a long one)."""


CONFIG = ClinicConfig

FREE_KEYS = (*MODEL_KEYS, "batch_size", "seq_len", "seed", "lr", "case", "hang_timeout_s")
"""The keys a clinic config may set; every other key stays at its default (the cases set theirs)."""


def validate(config: ClinicConfig, world_size: int) -> None:
    """Refuse, before any process starts, what the clinic cannot run.

    Raises:
        ValueError: one line naming the key and what is accepted.
    """
    if world_size < 2:
        raise ValueError(f"clinic needs >= 2 ranks (its cases shard, and hang, between ranks), got {world_size}")
    default = ClinicConfig()
    for key in ClinicConfig.keys():
        if key not in FREE_KEYS and getattr(config, key) != getattr(default, key):
            raise ValueError(f"config key {key!r}={getattr(config, key)!r} is set by each clinic case itself; "
                             f"a clinic config sets {', '.join(FREE_KEYS)}")
    if not 0.5 <= config.hang_timeout_s <= 60:
        raise ValueError(f"config key 'hang_timeout_s' must be in [0.5, 60] seconds, got {config.hang_timeout_s}")
    if config.batch_size % (2 * world_size):
        raise ValueError(f"config key 'batch_size'={config.batch_size} must be divisible by 2 x {world_size} "
                         "ranks (the accumulation case cuts each rank's share into 2 micro-batches)")


def case_function(name: str) -> CaseFn:
    """The ``(setup) -> (broken, fixed)`` function of case ``name`` (its module imported now).

    Raises:
        ValueError: for a name that is not a case, naming the accepted ones.
    """
    from handbook_lib.integrations.clinic_zero import ZERO_CASES
    from handbook_lib.runtime.clinic_checkpoints import CHECKPOINT_CASES
    from handbook_lib.runtime.clinic_correctness import CORRECTNESS_CASES
    from handbook_lib.runtime.clinic_hangs import HANG_CASES
    from handbook_lib.runtime.clinic_memory import MEMORY_CASES

    table = {**MEMORY_CASES, **ZERO_CASES, **CORRECTNESS_CASES, **HANG_CASES, **CHECKPOINT_CASES}
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
