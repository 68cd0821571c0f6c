"""What ``make gpu-smoke`` runs on one GPU, and how it reads the results: the pure half of
``scripts/gpu_smoke.py``, tested without a GPU.

The smoke check is the short list of the GPU-path review (issue 29): the runs that exercise each
CUDA-only branch once, on one GPU, in a few minutes — ``fsdp_train`` in fp32, in bf16, with
gradient accumulation, with CPU offload and clipping (gloo beside NCCL), ``trainer_deepspeed``
(DeepSpeed's CUDA accelerator, the saved model's logits), and an MFU measurement of the ~1B model
with synchronized step times. Every failed check and every failed run is one line
(:func:`smoke_failures`); the result set goes beside gpu-check's,
``results/gpu/smoke-<gpu-slug>.json`` (:func:`smoke_path`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from handbook_lib.core.results import Check
from handbook_lib.launch.gpu_check import MFU_CONFIG, gpu_slug

__all__ = ["SMOKE_SCHEMA", "SMOKE_WRITER", "SMOKE_MFU_BATCH", "SmokeRun", "smoke_plan", "smoke_path",
           "check_failures", "mfu_failure", "smoke_failures", "smoke_summary"]

SMOKE_SCHEMA = "handbook.gpu-smoke/1"
"""Version tag of a smoke result set."""
SMOKE_WRITER = "scripts/gpu_smoke.py"
"""Recorded in every smoke result set; a file without it is never replaced."""
SMOKE_MFU_BATCH = 8
"""Sequences per step of the MFU run (one GPU), as gpu-check's."""


@dataclass(frozen=True)
class SmokeRun:
    """One run of the smoke check, on one rank."""

    label: str
    """Its key in the result set, e.g. ``"bf16"``."""
    run: str
    """The run module (``fsdp_train``, ``trainer_deepspeed``)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The run's config keys."""
    exercises: str = ""
    """The CUDA path it checks, in words (the review's item)."""


def smoke_plan(trainer_dir: str | Path) -> list[SmokeRun]:
    """The smoke check's runs, in order; ``trainer_dir`` is an empty folder for the Trainer.

    Raises:
        ValueError: if ``trainer_dir`` is empty.
    """
    if not str(trainer_dir):
        raise ValueError("trainer_dir must name an empty folder for trainer_deepspeed, got ''")
    return [
        SmokeRun("fp32", "fsdp_train", {"steps": 3}, "init_bytes and the byte checks on CUDA (S1-1)"),
        SmokeRun("bf16", "fsdp_train", {"steps": 3, "precision": "bf16-mixed"}, "FSDP2 mixed precision on CUDA"),
        SmokeRun("accumulation", "fsdp_train", {"steps": 3, "grad_accum_steps": 2, "batch_size": 8},
                 "held_between_micro_steps with 512-B rounding (S1-5)"),
        SmokeRun("offload_clip", "fsdp_train", {"steps": 3, "cpu_offload": True, "max_grad_norm": 1.0},
                 "CPU gradients on an NCCL rank: gloo beside NCCL (S1-7)"),
        SmokeRun("trainer_deepspeed", "trainer_deepspeed", {"steps": 4, "trainer_dir": str(trainer_dir)},
                 "DeepSpeed's CUDA accelerator and the saved model's logits (S1-3, S1-4)"),
        SmokeRun("mfu", "fsdp_train", {**MFU_CONFIG, "batch_size": SMOKE_MFU_BATCH},
                 "step times synchronized before the timer (S2-1): MFU below 1"),
    ]


def smoke_path(root: str | Path, device_name: str) -> Path:
    """``<root>/results/gpu/smoke-<gpu-slug>.json``, beside gpu-check's result set."""
    return Path(root) / "results" / "gpu" / f"smoke-{gpu_slug(device_name)}.json"


def check_failures(label: str, checks: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per failed check of run ``label`` (checks as ``Check.to_dict()`` writes them)."""
    lines = []
    for raw in checks:
        check = Check(**raw)
        if not check.ok:
            where = "job" if check.rank is None else f"rank {check.rank}"
            lines.append(f"{label}: {check.quantity} ({where}) predicted {check.predicted:g} measured "
                         f"{check.measured:g} {check.unit} (tolerance {check.tolerance:g})")
    return lines


def mfu_failure(mfu: float | None, step_time_s: float | None) -> str | None:
    """The line for an MFU that cannot be right, else ``None``: no step time, or an MFU outside
    (0, 1) (above 1 means the timer stopped before the GPU finished). ``None`` MFU (an unknown
    GPU, no preset) is not a failure."""
    if step_time_s is None or not step_time_s > 0:
        return f"mfu: no positive step time (got {step_time_s})"
    if mfu is not None and not 0 < mfu < 1:
        return f"mfu: {mfu:.3f} is outside (0, 1): step times not synchronized with the GPU?"
    return None


def smoke_failures(runs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every failure of a smoke result set's ``runs``, one line each: a run that raised
    (``error``), each failed check, and an impossible MFU (the ``mfu`` run's ``mfu`` and
    ``step_time_s``)."""
    lines = []
    for label, run in runs.items():
        if run.get("error"):
            lines.append(f"{label}: {run['error']}")
            continue
        lines.extend(check_failures(label, run.get("checks", [])))
        if label == "mfu":
            line = mfu_failure(run.get("mfu"), run.get("step_time_s"))
            if line:
                lines.append(line)
    return lines


def smoke_summary(runs: Mapping[str, Mapping[str, Any]], path: str | Path) -> str:
    """The last line gpu-smoke prints: how many runs passed, and where the result set is."""
    failed = {line.split(":", 1)[0] for line in smoke_failures(runs)}
    if not failed:
        return f"gpu-smoke: all {len(runs)} runs passed every check -> {path}"
    return f"gpu-smoke: {len(failed)} of {len(runs)} runs failed ({', '.join(sorted(failed))}) -> {path}"
