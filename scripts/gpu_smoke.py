#!/usr/bin/env python3
"""The ten-minute GPU smoke check: each CUDA-only path of the course run once, on one GPU.

    make gpu-smoke                       # or: .venv/bin/python scripts/gpu_smoke.py
    python scripts/gpu_smoke.py --budget-s 300 --out results/gpu/smoke-mine.json

Runs :func:`handbook_lib.launch.gpu_smoke.smoke_plan` through ``handbook_lib.launch.torchrun``
on one rank (GPU 0): fsdp_train in fp32, bf16, with accumulation, with CPU offload and clipping,
trainer_deepspeed, and the ~1B model's MFU with synchronized step times. It prints every failed
check and every failed run, one line each, and writes ``results/gpu/smoke-<gpu-slug>.json``
beside gpu-check's (again after each run, so a stopped check keeps what it measured). Exit
status: 0 when everything passed, 1 when something failed, 2 without a GPU (one line).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from handbook_lib.core import param_count  # noqa: E402
from handbook_lib.launch.gpu_check import (  # noqa: E402
    BILLION_MODEL,
    error_line,
    estimate_mfu,
    gpu_present,
    match_accelerator,
    no_gpu_message,
    steady_step_time_s,
    write_result_set,
)
from handbook_lib.launch.gpu_smoke import (  # noqa: E402
    SMOKE_SCHEMA,
    SMOKE_WRITER,
    SmokeRun,
    smoke_failures,
    smoke_path,
    smoke_plan,
    smoke_summary,
)

RUN_TIMEOUT_S = 180.0
"""The longest any one run may take (less when less of the budget is left)."""
MEMORY_METRICS = ("peak_bytes", "predicted_peak_bytes", "allocator_peak_bytes", "init_bytes",
                  "held_between_micro_steps", "step_time_s")
"""Rank metrics kept in the result set beside the checks (the allocator's peak against the model's)."""


def record(spec: SmokeRun, result: Any, accelerators: dict[str, Any], gpu_name: str) -> dict[str, Any]:
    """What the result set keeps of one finished run: its checks, the memory metrics of each
    rank, and for the MFU run the steady step time and MFU."""
    ranks = [{k: r[k] for k in MEMORY_METRICS if k in r} for r in result.ranks]
    out: dict[str, Any] = {"run": spec.run, "config": spec.config, "exercises": spec.exercises,
                           "checks": [c.to_dict() for c in result.checks], "ranks": ranks}
    if spec.label == "mfu":
        step = steady_step_time_s([r["step_time_s"] for r in result.ranks])
        tokens = spec.config["batch_size"] * spec.config["seq_len"]
        preset = match_accelerator(gpu_name)
        peak = accelerators[preset].peak_flops_bf16 if preset else None
        out.update(step_time_s=step, tokens_per_step=tokens, preset=preset, peak_flops_bf16=peak,
                   mfu=estimate_mfu(param_count(BILLION_MODEL), tokens, step, 1, peak) if peak else None)
    return out


def run_smoke(out: Path, budget_s: float, launch: Callable[..., Any], env: dict[str, Any],
              accelerators: dict[str, Any], trainer_dir: str) -> dict[str, Any]:
    """Run the plan within ``budget_s``, writing the result set to ``out`` after each run."""
    deadline = time.monotonic() + budget_s
    data: dict[str, Any] = {**env, "budget_s": budget_s, "runs": {}}
    write_result_set(out, data, schema=SMOKE_SCHEMA, writer=SMOKE_WRITER)  # refuses a foreign file first
    for spec in smoke_plan(trainer_dir):
        left = deadline - time.monotonic()
        begin = time.monotonic()
        print(f"gpu-smoke: {spec.label} ({spec.run})", flush=True)
        if left < 10:
            entry: dict[str, Any] = {"run": spec.run, "error": f"not run: the {budget_s:.0f} s budget is spent"}
        else:
            try:
                result = launch(spec.run, 1, spec.config, timeout_s=min(RUN_TIMEOUT_S, left), stream=False,
                                allow_failed_checks=True)
                entry = record(spec, result, accelerators, env.get("gpu_name", ""))
            except Exception as err:  # noqa: BLE001 - one run failing must not stop the others
                entry = {"run": spec.run, "config": spec.config, "error": error_line(err)}
        entry["wall_s"] = round(time.monotonic() - begin, 1)
        data["runs"][spec.label] = entry
        data["failures"] = smoke_failures(data["runs"])
        data["total_wall_s"] = round(budget_s - (deadline - time.monotonic()), 1)
        write_result_set(out, data, schema=SMOKE_SCHEMA, writer=SMOKE_WRITER)
    return data


def main(argv: list[str] | None = None, *, launch: Callable[..., Any] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="result set file (default results/gpu/smoke-<gpu-slug>.json)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="seconds the whole check may take")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(no_gpu_message(torch.version.cuda, gpu_present(), torch.__version__, tool="gpu-smoke"),
              file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_check import environment  # the probe in a child: no CUDA context in this process

    from handbook_lib.models import ACCELERATORS

    env = environment()
    out = args.out or smoke_path(ROOT, env["gpu_name"])
    if launch is None:
        from handbook_lib.launch import torchrun as launch
    with tempfile.TemporaryDirectory(prefix="gpu-smoke-trainer-") as trainer_dir:
        data = run_smoke(out, args.budget_s, launch, env, dict(ACCELERATORS), trainer_dir)
    for line in data["failures"]:  # cut to the CLI's 100 columns; the result set has them whole
        line = f"FAILED {line}"
        print(line if len(line) <= 100 else line[:99] + "…")
    print(smoke_summary(data["runs"], out))
    return 1 if data["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
