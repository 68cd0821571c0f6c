#!/usr/bin/env python3
"""Run the course's experiments on this machine's GPUs (CUDA + NCCL) and write a result set.

    make gpu-check                      # or: .venv/bin/python scripts/gpu_check.py
    python scripts/gpu_check.py --out results/gpu/mine.json --budget-s 300

On every visible GPU (world size = the GPU count), through ``handbook_lib.launch.torchrun``:

(a) memory — fsdp_train (FULL_SHARD, fp32 and bf16-mixed, the book's model; and the ~1B model
    of (c)): the tracker's and the allocator's peaks beside the memory model's, and the excess
    beside the gathered unit FSDP2's prefetch keeps alive on a GPU;
(b) step time — the FSDP/DDP step-time ratio (the step_time run; on one GPU, which step_time
    refuses, two fsdp_train jobs, DDP and FULL_SHARD, timed one after the other: on one rank
    neither exchanges anything, so that ratio is the wrappers' overhead only, and says so);
(c) MFU — FSDP2 bf16 on a ~1.04e9-parameter config: 6·P·tokens / (step · world · peak bf16),
    the peak from the hardware preset matching the GPU's name ("unknown GPU": no MFU);
(d) the largest micro-batch — doubling until a run fails with CUDA out-of-memory, beside the
    memory model's largest for the memory a rank found usable (``mem_get_info`` inside the MFU
    or memory run's ranks, after NCCL's set-up: the CUDA context and NCCL's buffers are in no
    peak), and for ``total_memory``, with the gap between the two;
(e) chapter 9's runs (with 2 or more GPUs): tensor_parallel with and without sequence
    parallelism, sequence_parallel with Ulysses and the ring, every check of each on NCCL;
(f) seq_len — the run of (c) at 32,768 tokens per rank in sequences of 1,024 to 32,768 tokens,
    then with full and selective checkpointing: each step's FLOPs (6PT, attention's 12·L·w·s
    per token, the recomputed forward) and its 6PT, MFU and HFU utilizations;
(g) width — the same at 1,024-token sequences through layers 1,024, 4,096 and 8,192 wide.

The result set goes to ``results/gpu/<gpu-name-slug>.json`` (written again after each part, so
a stopped check keeps what it measured); a file there that gpu-check did not write is never
replaced. The whole check keeps to ``--budget-s`` (default 540 s): each run's timeout is the
time left, and the sweep (doubling, then bisection to the exact largest fit) stops when the next
size would not fit in it.

Without a GPU it exits with status 2 and one line. Pure parts: :mod:`handbook_lib.launch.gpu_check`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from handbook_lib.core import ModelConfig, RunConfig, param_count  # noqa: E402 - once the repository is on sys.path
from handbook_lib.launch import (  # noqa: E402
    BILLION_MODEL,
    MEMORY_CONFIGS,
    MFU_CONFIG,
    STEP_TIME_CONFIG,
    SWEEP_CONFIG,
    axes_configs,
    estimate_mfu,
    seq_len_configs,
    width_configs,
    error_line,
    estimate_prefetch_extra_bytes,
    gpu_slug,
    match_accelerator,
    memory_figures,
    predict_max_micro_batch,
    steady_step_time_s,
    sweep_micro_batch,
    sweep_peak_bytes,
    write_result_set,
)
from handbook_lib.launch.gpu_check import device_capacity, gpu_present, no_gpu_message  # noqa: E402
from handbook_lib.models import ACCELERATORS, ATTENTION_FLOPS_SOURCE, estimate_step_flops  # noqa: E402

RUN_TIMEOUT_S = 240.0
"""The longest any one run may take (less when less of the budget is left)."""
MEMORY_BATCH, STEP_TIME_BATCH, MFU_BATCH = 4, 4, 8
"""Sequences per rank of (a), (b) and (c); ``batch_size`` is this times the world size."""


class GpuCheck:
    """One gpu-check: the world size, the time budget, the result set being filled."""

    def __init__(self, out: Path, world: int, budget_s: float, launch: Callable[..., Any],
                 environment: dict[str, Any], device_memory: int, mfu_batches: tuple[int, ...] = (MFU_BATCH,)) -> None:
        self.out, self.world, self.launch = out, world, launch
        self.mfu_batches = mfu_batches
        self.deadline = time.monotonic() + budget_s
        self.device_memory = device_memory
        self.data: dict[str, Any] = {**environment, "budget_s": budget_s}

    def time_left_s(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, config: dict[str, Any], nproc: int | None = None) -> Any:
        """``torchrun(name, ...)`` with the time left as timeout; failed checks are returned, not raised."""
        left = self.time_left_s()
        if left < 10:
            raise TimeoutError(f"the {self.data['budget_s']:.0f} s budget is spent: {name} not run")
        print(f"gpu-check: {name} on {nproc or self.world} rank(s): "
              + ", ".join(f"{k}={v}" for k, v in config.items()), flush=True)
        return self.launch(name, nproc or self.world, config, timeout_s=min(RUN_TIMEOUT_S, left),
                           stream=False, allow_failed_checks=True)

    def part(self, key: str, fn: Callable[[], dict[str, Any]]) -> None:
        """Run one part, record what it gives (or its error), and write the result set."""
        begin = time.monotonic()
        try:
            self.data[key] = fn()
        except Exception as err:  # noqa: BLE001 - one part failing must not lose the others
            self.data[key] = {"error": error_line(err),
                              "traceback": traceback.format_exc()[-4000:]}
        self.data[key]["wall_s"] = round(time.monotonic() - begin, 1)
        self.data["total_wall_s"] = round(self.data["budget_s"] - self.time_left_s(), 1)
        write_result_set(self.out, self.data)
        print(f"gpu-check: {key} done in {self.data[key]['wall_s']} s -> {self.out}", flush=True)

    # (a) -------------------------------------------------------------------------------------
    def memory_run(self, config: dict[str, Any]) -> dict[str, Any]:
        result = self.run("fsdp_train", config)
        extras = {"largest_unit": estimate_prefetch_extra_bytes(config, self.world),
                  "largest_layer": estimate_prefetch_extra_bytes(config, self.world, layers_only=True)}
        return {
            "config": config,
            "ranks": memory_figures(result.ranks, extras),
            "checks": [c.to_dict() for c in result.checks if c.quantity in ("peak_bytes", "activation_bytes")],
            "failed_checks": sorted({c.quantity for c in result.failed_checks()}),
            "_result": result,
        }

    def memory(self) -> dict[str, Any]:
        out = {}
        for label, cfg in MEMORY_CONFIGS.items():
            try:
                figures = self.memory_run({**cfg, "batch_size": MEMORY_BATCH * self.world})
            except Exception as err:  # noqa: BLE001 - recorded; the next config still runs
                out[label] = {"error": error_line(err)}
                continue
            figures.pop("_result")
            out[label] = figures
        return out

    # (b) -------------------------------------------------------------------------------------
    def step_time(self) -> dict[str, Any]:
        config = {**STEP_TIME_CONFIG, "batch_size": STEP_TIME_BATCH * self.world}
        if self.world >= 2:
            result = self.run("step_time", config)
            per_rank = {r["rank"]: r["median_ratio_to_ddp"] for r in result.ranks}
            variants = result.extra.get("variants") or list(next(iter(per_rank.values())))
            return {
                "method": "step_time run: DDP and FSDP timed in one job, rotated order",
                "config": config,
                "median_ratio_to_ddp": {v: statistics.median(p[v] for p in per_rank.values()) for v in variants},
                "median_ratio_to_ddp_by_rank": per_rank,
                "fsdp_over_ddp": statistics.median(p["FULL_SHARD"] for p in per_rank.values()),
            }
        # step_time needs 2 ranks: time DDP and FULL_SHARD as two one-rank fsdp_train jobs
        keys = set(RunConfig.keys())
        base = {k: v for k, v in config.items() if k in keys} | {"steps": 7, "precision": "fp32"}
        times = {}
        for strategy in ("DDP", "FULL_SHARD"):
            result = self.run("fsdp_train", {**base, "strategy": strategy})
            times[strategy] = steady_step_time_s([r["step_time_s"] for r in result.ranks])
        return {
            "method": "two fsdp_train jobs on 1 GPU, one after the other (step_time needs >= 2 ranks); "
                      "median step after the first, of 6 timed steps",
            "config": base,
            "step_time_s": times,
            "fsdp_over_ddp": times["FULL_SHARD"] / times["DDP"],
            "measures": "wrapper overhead only: on one rank DDP and FULL_SHARD exchange nothing, so "
                        "this is not the price of sharding (that needs >= 2 GPUs)",
        }

    # (c) -------------------------------------------------------------------------------------
    def mfu_at(self, micro: int) -> dict[str, Any]:
        """One MFU run at ``micro`` sequences per rank: the step time and the memory figures."""
        config = {**MFU_CONFIG, "batch_size": micro * self.world}
        figures = self.memory_run(config)
        result = figures.pop("_result")
        step = steady_step_time_s([r["step_time_s"] for r in result.ranks])
        tokens = config["batch_size"] * config["seq_len"]
        return {"config": config, "micro_batch": micro, "tokens_per_step": tokens, "step_time_s": step,
                "step_times_s_by_rank": [r["step_time_s"] for r in result.ranks],
                "tokens_per_s": tokens / step, "memory": figures}

    def mfu(self) -> dict[str, Any]:
        name = self.data["gpu_name"]
        preset = match_accelerator(name)
        params = param_count(BILLION_MODEL)
        peak = ACCELERATORS[preset].peak_flops_bf16 if preset else None

        def with_mfu(row: dict[str, Any]) -> dict[str, Any]:
            if peak is not None:
                row["mfu"] = estimate_mfu(params, row["tokens_per_step"], row["step_time_s"], self.world, peak)
            return row

        out = {"num_params": params, "preset": preset, **with_mfu(self.mfu_at(self.mfu_batches[0]))}
        out.pop("micro_batch")
        if len(self.mfu_batches) > 1:  # the same run at more sequences per rank: MFU against batch
            rows = []
            for micro in self.mfu_batches[1:]:
                try:
                    row = with_mfu(self.mfu_at(micro))
                except Exception as err:  # noqa: BLE001 - recorded; the sweep still runs
                    rows.append({"micro_batch": micro, "error": error_line(err)})
                    continue
                row["memory"] = {k: row["memory"][k] for k in ("ranks", "failed_checks")}
                rows.append(row)
            out["by_micro_batch"] = rows
        if preset is None:
            out["mfu"] = None
            out["mfu_skipped"] = f"unknown GPU {name!r}: no preset in hardware.ACCELERATORS matches it"
        else:
            out["peak_flops_bf16"] = peak
        return out

    def largest_mfu_fit(self) -> int:
        """The largest micro-batch an MFU run ran at without error (0: none), where the sweep starts."""
        mfu = self.data.get("mfu", {})
        if "error" in mfu:
            return 0
        fits = [self.mfu_batches[0]] + [r["micro_batch"] for r in mfu.get("by_micro_batch", []) if "error" not in r]
        return max(fits)

    # (d) -------------------------------------------------------------------------------------
    def max_micro_batch(self) -> dict[str, Any]:
        def predicted_peak(micro: int) -> int:
            return sweep_peak_bytes(SWEEP_CONFIG, self.world, micro)

        prefetch = estimate_prefetch_extra_bytes(SWEEP_CONFIG, self.world, layers_only=True)[1]
        known = self.largest_mfu_fit() if "mfu" in self.data else 0

        def try_size(micro: int) -> None:
            self.run("fsdp_train", {**SWEEP_CONFIG, "batch_size": micro * self.world})

        sweep = sweep_micro_batch(try_size, start=2 * known if known else 1, known_fit=known,
                                  time_left_s=lambda: self.time_left_s() - 10)
        preset = match_accelerator(self.data["gpu_name"])
        capacity = device_capacity(self._measured_rows(), self.device_memory)
        usable = capacity["capacity_bytes"]
        return {
            "config": {k: v for k, v in SWEEP_CONFIG.items() if k != "batch_size"},
            "root_reshard_after_forward": False,  # FSDP2's default: the root kept gathered
            "sweep": sweep.to_dict(),
            "measured_largest_fit": sweep.largest_fit,
            "measured_first_oom": sweep.first_oom,
            "device_memory_bytes": self.device_memory,
            **capacity,
            "predicted_largest_fit": predict_max_micro_batch(predicted_peak, usable),
            "predicted_largest_fit_with_prefetch": predict_max_micro_batch(
                lambda m: predicted_peak(m) + prefetch, usable),
            "predicted_largest_fit_total_memory": predict_max_micro_batch(predicted_peak, self.device_memory),
            "predicted_largest_fit_reserved": predict_max_micro_batch(
                lambda m: sweep_peak_bytes(SWEEP_CONFIG, self.world, m, reserved=True), usable),
            "predicted_peak_bytes_at_measured_fit": predicted_peak(sweep.largest_fit) if sweep.largest_fit else None,
            "preset_memory_bytes": ACCELERATORS[preset].memory_bytes if preset else None,
        }

    def _measured_rows(self) -> list[dict[str, Any]]:
        """The memory rows of the runs so far that read the GPU inside a rank: the MFU run's (the
        sweep's model), else the memory runs'."""
        mfu = self.data.get("mfu", {}).get("memory", {}).get("ranks", [])
        if any("device_free_bytes" in r for r in mfu):
            return mfu
        return [r for part in self.data.get("memory", {}).values() if isinstance(part, dict)
                for r in part.get("ranks", [])]


    # (e) -------------------------------------------------------------------------------------
    def axes(self) -> dict[str, Any]:
        """Chapter 9's runs on NCCL (:func:`axes_configs`): every check of each, as on the CPU."""
        configs = axes_configs(self.world)
        if not configs:
            return {"skipped": f"chapter 9's runs need 2 or more GPUs; {self.world} visible"}
        out: dict[str, Any] = {}
        for label, (run, config) in configs.items():
            try:
                result = self.run(run, config)
            except Exception as err:  # noqa: BLE001 - recorded; the next run still goes
                out[label] = {"run": run, "config": config,
                              "error": error_line(err)}
                continue
            out[label] = {"run": run, "config": config, "checks": [c.to_dict() for c in result.checks],
                          "failed_checks": sorted({c.quantity for c in result.failed_checks()}),
                          "losses": result.ranks[0].get("losses")}
        return out

    # (f) -------------------------------------------------------------------------------------
    def utilization_row(self, config: dict[str, Any], peak: float | None) -> dict[str, Any]:
        """One fsdp_train run's step time, FLOPs (:func:`estimate_step_flops`: 6PT, attention,
        recomputation), its 6PT, MFU and HFU utilizations and memory checks; an error recorded."""
        seq, ac = config["seq_len"], config.get("activation_checkpointing", "none")
        row: dict[str, Any] = {"d_model": config["d_model"], "seq_len": seq,
                               "micro_batch": config["batch_size"] // self.world, "activation_checkpointing": ac}
        try:
            figures = self.memory_run(config)
        except Exception as err:  # noqa: BLE001 - recorded; the next run still goes
            return {**row, "error": error_line(err)}
        result = figures.pop("_result")
        step = steady_step_time_s([r["step_time_s"] for r in result.ranks])
        model = ModelConfig(**{k: config[k] for k in ModelConfig().to_dict()})
        params, tokens = param_count(model), row["micro_batch"] * seq
        flops = estimate_step_flops(params, tokens, seq_len=seq, num_layers=model.num_layers,
                                    attention_width=model.d_model, activation_checkpointing=ac == "full")
        row |= {"num_params": params, "tokens_per_rank": tokens, "step_time_s": step,
                "step_times_s_by_rank": [r["step_time_s"] for r in result.ranks],
                "tokens_per_s_per_rank": tokens / step,
                "flops": {"dense": flops.dense, "attention": flops.attention, "recompute": flops.recompute},
                "memory": {k: figures[k] for k in ("ranks", "checks", "failed_checks")}}
        if peak is not None:
            row |= {"mfu_6pt": flops.dense / (step * peak), "mfu": flops.model / (step * peak),
                    "hfu": flops.hardware / (step * peak)}
        return row

    def utilization(self, configs: list[dict[str, Any]]) -> dict[str, Any]:
        preset = match_accelerator(self.data["gpu_name"])
        peak = ACCELERATORS[preset].peak_flops_bf16 if preset else None
        return {"preset": preset, "peak_flops_bf16": peak, "attention_flops": ATTENTION_FLOPS_SOURCE,
                "rows": [self.utilization_row(c, peak) for c in configs]}

    def seq_len(self) -> dict[str, Any]:
        """The MFU run at longer sequences and the same tokens per rank (:func:`seq_len_configs`):
        dense work fixed, attention's growing; then with activation checkpointing."""
        return {"model": BILLION_MODEL.to_dict(), **self.utilization(seq_len_configs(self.world))}

    def width(self) -> dict[str, Any]:
        """The MFU run at other widths, the same tokens per rank (:func:`width_configs`)."""
        return self.utilization(width_configs(self.world))


PROBE_IN_CHILD = True
"""Ask a child process about the GPUs: a CUDA context in this process would hold some hundreds of
MB of GPU 0 for the whole check, and shift the micro-batch sweep's answer (tests set it False)."""


def probe() -> dict[str, Any]:
    """What the result set records of this machine, read in this process."""
    import torch

    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    count = torch.cuda.device_count()
    return {
        "gpu_name": torch.cuda.get_device_name(0),
        "gpu_names": sorted({torch.cuda.get_device_name(i) for i in range(count)}),
        "gpu_count": count,
        "gpu_memory_bytes": int(torch.cuda.get_device_properties(0).total_memory),
        "world_size": count,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "nccl_version": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def environment() -> dict[str, Any]:
    """:func:`probe`, in a child process (:data:`PROBE_IN_CHILD`) or here."""
    if not PROBE_IN_CHILD:
        return probe()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--probe"], capture_output=True,
                          text=True, timeout=120, check=False)
    if proc.returncode:
        raise RuntimeError(f"probing the GPUs failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None, *, launch: Callable[..., Any] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="result set file (default results/gpu/<gpu-name-slug>.json)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="seconds the whole check may take")
    parser.add_argument("--parts", default="memory,step_time,mfu,max_micro_batch,axes,seq_len,width",
                        help="comma-separated parts to run (default: all seven)")
    parser.add_argument("--mfu-micro-batches", default=str(MFU_BATCH),
                        help=f"sequences per rank of the MFU runs, comma-separated, ascending; the first is "
                             f"the headline (default {MFU_BATCH}); the sweep starts above the largest that ran")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    known = ("memory", "step_time", "mfu", "max_micro_batch", "axes", "seq_len", "width")
    if not parts or any(p not in known for p in parts):
        parser.error(f"--parts takes some of {', '.join(known)}, got {args.parts!r}")
    try:
        mfu_batches = tuple(int(m) for m in args.mfu_micro_batches.split(","))
    except ValueError:
        mfu_batches = ()
    if not mfu_batches or min(mfu_batches) < 1 or list(mfu_batches) != sorted(set(mfu_batches)):
        parser.error(f"--mfu-micro-batches takes ascending whole numbers >= 1 separated by commas, "
                     f"got {args.mfu_micro_batches!r}")

    import torch

    if not torch.cuda.is_available():
        print(no_gpu_message(torch.version.cuda, gpu_present(), torch.__version__), file=sys.stderr)
        return 2
    if args.probe:  # the child of environment(): one JSON line
        print(json.dumps(probe()))
        return 0
    env = environment()
    count, memory = env["gpu_count"], env["gpu_memory_bytes"]
    if count > 1 and len(env["gpu_names"]) > 1:
        print(f"gpu-check: the visible GPUs differ ({', '.join(env['gpu_names'])}); the result set is "
              f"named after GPU 0", file=sys.stderr)
    out = args.out or ROOT / "results" / "gpu" / f"{gpu_slug(env['gpu_name'])}.json"
    if launch is None:
        from handbook_lib.launch import torchrun as launch
    check = GpuCheck(out, count, args.budget_s, launch, env, memory, mfu_batches)
    write_result_set(out, check.data)  # refuses a file it did not write before anything runs
    for name in parts:
        check.part(name, getattr(check, name))
    print(f"gpu-check: result set written to {out} ({check.data['total_wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
