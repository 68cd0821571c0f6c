"""What GPUs measured: the result sets of ``make gpu-check`` and ``make gpu-smoke`` as tables.

The result sets under ``results/gpu/`` are JSON files that ``scripts/gpu_check.py`` and
``scripts/gpu_smoke.py`` wrote (their ``schema`` and ``written_by`` say so). This module reads
them and lays their numbers beside the models' predictions, as chapter 8 shows them:

- :func:`gpu_memory_table`: each fsdp_train run's peak, predicted by the memory model on the
  rank and measured by the memory tracker, with what the caching allocator held beyond it;
- :func:`gpu_mfu_table`: step time and model FLOPs utilization against the micro-batch;
- :func:`gpu_fit_table`: the largest micro-batch the GPU ran, against the memory model's;
- :func:`gpu_smoke_table`: each CUDA-only path and how many of its checks held;
- :func:`gpu_utilization_table` and :func:`plot_utilization`: the step time against the
  sequence length and the width, the FLOPs it did, and the compute model's step beside it.

Bytes are bytes (10^9 in GB), times are seconds.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from handbook_lib.core.results import Check
from handbook_lib.face.display import Table, format_bytes
from handbook_lib.launch.gpu_check import RESULT_SET_SCHEMA, WRITER, match_accelerator
from handbook_lib.launch.gpu_smoke import SMOKE_SCHEMA, SMOKE_WRITER
from handbook_lib.launch.gpu_sweep import predict_max_micro_batch, sweep_peak_bytes
from handbook_lib.models.allocator import RESERVE_MODEL, reserved_bytes
from handbook_lib.models.hardware import ACCELERATORS, usable_memory_bytes
from handbook_lib.models.timing import estimate_compute_time, fit_utilization, width_utilization

__all__ = ["read_gpu_results", "gpu_memory_rows", "gpu_memory_table", "gpu_mfu_table", "gpu_fit_table",
           "gpu_fit_curve", "gpu_smoke_table", "gpu_sets_table", "gpu_budget_table", "gpu_utilization_rows",
           "gpu_utilization_fit", "gpu_utilization_table", "plot_utilization", "root_resharded"]

ResultSets = Mapping[str, Mapping[str, Any]]
"""Result sets by file name (without ``.json``), as :func:`read_gpu_results` returns them."""


def read_gpu_results(folder: str | Path) -> dict[str, dict[str, Any]]:
    """Every result set in ``folder`` that gpu-check or gpu-smoke wrote, by file stem, sorted.

    A JSON file there that neither wrote (another ``schema`` or ``written_by``) is skipped; a
    missing folder gives ``{}``.

    Raises:
        ValueError: if a ``*.json`` file there is not valid JSON (naming the file).
    """
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(Path(folder).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not a GPU result set ({err.msg} at line {err.lineno})") from None
        stamp = (data.get("schema"), data.get("written_by")) if isinstance(data, dict) else None
        if stamp in ((RESULT_SET_SCHEMA, WRITER), (SMOKE_SCHEMA, SMOKE_WRITER)):
            out[path.stem] = data
    return out


def gpu_sets_table(sets: ResultSets) -> Table:
    """One row per result set: what wrote it, on which GPU and software, when, and in how long."""
    rows = [[name, "gpu-check" if d.get("schema") == RESULT_SET_SCHEMA else "gpu-smoke", d.get("gpu_name", "-"),
             d.get("gpu_count", "-"), d.get("torch_version", "-"), d.get("nccl_version", "-"),
             str(d.get("date", "-"))[:10], f"{d['total_wall_s']:.0f}" if "total_wall_s" in d else "-"]
            for name, d in sets.items()]
    return Table(["result set", "script", "GPU", "GPUs", "torch", "NCCL", "date", "s"], rows,
                 "s: the script's wall time, seconds")


def _checks(sets: ResultSets) -> list[tuple[str, Mapping[str, Any]]]:
    return [(name, data) for name, data in sets.items() if data.get("schema") == RESULT_SET_SCHEMA]


def _model_label(config: Mapping[str, Any]) -> str:
    if "num_layers" in config:
        return f"{config['num_layers']}x{config['d_model']}"
    return "book's"


def gpu_memory_rows(sets: ResultSets) -> list[dict[str, Any]]:
    """Every fsdp_train run of the gpu-check result sets with its memory figures, one dict each.

    Keys: ``set`` (file stem), ``model`` (``book's`` or layers x width), ``precision``,
    ``micro_batch`` (sequences per rank), ``predicted`` and ``measured`` (the memory model's
    peak and the memory tracker's, rank 0, bytes), ``allocator`` (``max_memory_allocated``),
    ``reserved`` (``max_memory_reserved``, the caching allocator's segments at their peak) and
    ``free`` (the driver's free bytes as the tracked step began, or None). A run that another
    result set repeated with the same bytes (the first of the set it is listed under) appears once.
    """
    rows = []
    for name, data in _checks(sets):
        runs = [part for part in data.get("memory", {}).values() if isinstance(part, dict) and "ranks" in part]
        mfu = data.get("mfu", {})
        if "memory" in mfu:
            runs.append(mfu["memory"])
        runs += [row["memory"] | {"config": row["config"]} for row in mfu.get("by_micro_batch", [])
                 if "memory" in row]
        for run in runs:
            config, rank = run["config"], run["ranks"][0]
            rows.append({"set": name, "model": _model_label(config), "precision": config["precision"],
                         "micro_batch": config["batch_size"] // data["world_size"],
                         "predicted": rank["predicted_peak_bytes"], "measured": rank["peak_bytes"],
                         "allocator": rank["allocator_peak_bytes"], "reserved": rank["allocator_reserved_bytes"],
                         "free": rank.get("device_free_bytes")})
    rows.sort(key=lambda r: (r["model"] != "book's", r["micro_batch"], r["set"]))
    figures = ("model", "precision", "micro_batch", "predicted", "measured", "allocator", "reserved")
    seen: set[tuple[Any, ...]] = set()
    unique = []
    for row in rows:  # a run repeated in another result set with the same bytes is shown once
        key = tuple(row[k] for k in figures)
        if key not in seen:
            seen.add(key)
            unique.append(row)
    return unique


def gpu_memory_table(sets: ResultSets) -> Table:
    """:func:`gpu_memory_rows` as a table: the model against the tracker, then the allocator."""
    def run(r: Mapping[str, Any]) -> str:
        return f"{r['model']} {'bf16' if r['precision'] == 'bf16-mixed' else r['precision']}"

    rows = [[run(r), r["micro_batch"], format_bytes(r["predicted"]), format_bytes(r["measured"]),
             f"{r['measured'] - r['predicted']:+,}", format_bytes(r["allocator"]), format_bytes(r["reserved"]),
             f"{r['reserved'] / r['allocator']:.3f}"] for r in gpu_memory_rows(sets)]
    return Table(["model", "micro-\nbatch", "model's\npeak", "tracker\npeak", "tracker -\nmodel (B)",
                  "allocator\npeak", "reserved", "reserved\n/ alloc."], rows,
                 "rank 0 of each run; model: the book's or layers x width, in fp32 or bf16-mixed; model's "
                 "peak: the memory model, computed on the rank; tracker: torch's MemTracker over one step; "
                 "allocator: max_memory_allocated (adds cuBLAS's workspaces); reserved: "
                 "max_memory_reserved, the caching allocator's segments at their peak")


def gpu_mfu_table(sets: ResultSets) -> Table:
    """Step time and MFU (``6·P·tokens / (step · world · peak bf16)``) of every MFU run, by micro-batch."""
    rows = []
    for name, data in _checks(sets):
        mfu = data.get("mfu", {})
        if "step_time_s" not in mfu:
            continue
        head = {**mfu, "micro_batch": mfu["config"]["batch_size"] // data["world_size"]}
        for row in [head, *[r for r in mfu.get("by_micro_batch", []) if "step_time_s" in r]]:
            rows.append((row["micro_batch"], name, row["tokens_per_step"], row["step_time_s"],
                         row["tokens_per_s"], row.get("mfu")))
    rows.sort()
    return Table(["micro-\nbatch", "result set", "tokens\nper step", "step\n(ms)", "tokens/s", "MFU"],
                 [[m, name, tokens, f"{1e3 * step:.1f}", f"{rate:,.0f}", "-" if mfu is None else f"{100 * mfu:.1f}%"]
                  for m, name, tokens, step, rate, mfu in rows],
                 "step: the median of steps 2-5 (the first warms up; the sixth is tracked, not timed); "
                 "MFU against the GPU's dense bf16 peak from its hardware preset")


def gpu_fit_table(sets: ResultSets) -> Table:
    """Per result set with a micro-batch sweep: the largest micro-batch that ran, and the memory
    model's within the memory a rank found usable, from its allocated peak and from its peak
    reserved (:func:`~handbook_lib.models.allocator.reserved_bytes`, what a plan budgets)."""
    rows = []
    for name, data in _checks(sets):
        sweep = data.get("max_micro_batch", {})
        if "measured_largest_fit" not in sweep:
            continue
        config, world, usable = sweep["config"], data["world_size"], sweep["capacity_bytes"]
        bracket = (f"{sweep['measured_largest_fit']}" if sweep["sweep"].get("exact")
                   else f"[{sweep['measured_largest_fit']}, {sweep['measured_first_oom']})")
        reserved = predict_max_micro_batch(functools.partial(_reserved_peak, config, world, root_resharded(sweep)),
                                           usable)
        rows.append([name, bracket, sweep["predicted_largest_fit"], reserved, format_bytes(usable),
                     format_bytes(sweep["device_memory_bytes"]), len(sweep["sweep"]["tries"])])
    return Table(["result set", "largest\nthat ran", "model:\nallocated", "model:\nreserved", "usable\nmemory",
                  "all\nmemory", "runs"], rows,
                 "largest that ran: exact when the sweep bisected down to the first OOM, else a bracket "
                 "[fit, OOM); model: the largest micro-batch whose predicted peak, allocated or reserved "
                 f"({RESERVE_MODEL}), fits in the usable memory, what a rank found free once CUDA and NCCL "
                 "were set up; all memory: the device's total_memory")


def gpu_fit_curve(sets: ResultSets, *, step: int = 1) -> dict[str, Any] | None:
    """The arguments of :func:`~handbook_lib.face.plots.plot_micro_batch_fit` for the first
    result set whose sweep found the exact largest micro-batch (None: no set did): the model's
    lines from 1 to the first OOM + 10 % every ``step`` sequences, and every run of the same
    model, precision and world size at its micro-batch."""
    for _name, data in _checks(sets):
        sweep = data.get("max_micro_batch", {})
        if not sweep.get("sweep", {}).get("exact"):
            continue
        config, world = sweep["config"], data["world_size"]
        top = int(sweep["measured_first_oom"] * 1.1) + 1
        xs = list(range(1, top + 1, step))
        runs = [r for r in gpu_memory_rows({k: v for k, v in sets.items() if v.get("world_size") == world})
                if r["model"] == _model_label(config) and r["precision"] == config["precision"]]
        peaks = [sweep_peak_bytes(config, world, m, root_reshard_after_forward=root_resharded(sweep)) for m in xs]
        return {"micro_batches": xs, "model_peak": peaks, "model_reserved": [reserved_bytes(p) for p in peaks],
                "measured": [(r["micro_batch"], r["measured"], r["reserved"]) for r in runs],
                "capacity": sweep["capacity_bytes"], "largest_fit": sweep["measured_largest_fit"],
                "first_oom": sweep["measured_first_oom"],
                "title": f"What fits on one {data.get('gpu_name', 'GPU')}: {_model_label(config)} in "
                         f"{config['precision']}, {config['seq_len']:,}-token sequences"}
    return None


def gpu_budget_table(sets: ResultSets) -> Table:
    """The memory a rank can use, as the planner counts it and as a training process found it,
    for each result set whose sweep read the GPU inside a rank and whose GPU has a preset.

    Rows: the preset's total (nvidia-smi's), CUDA's total (``total_memory``), the planner's
    usable memory (:func:`~handbook_lib.models.hardware.usable_memory_bytes`: CUDA's total less
    a training process's context), and the usable memory measured (free plus the allocator's
    reserve, read once CUDA, cuBLAS and NCCL were set up), each with its difference from the
    measured one, bytes."""
    rows: list[list[Any]] = []
    for _name, data in _checks(sets):
        gpu = data.get("gpu_name", "")
        sweep, preset = data.get("max_micro_batch", {}), match_accelerator(gpu)
        if "capacity_bytes" not in sweep or preset is None or gpu in {r[0] for r in rows}:
            continue  # one block per GPU model: its first result set with a sweep
        measured = sweep["capacity_bytes"]
        terms = [("preset's total (nvidia-smi)", ACCELERATORS[preset].memory_bytes),
                 ("CUDA's total (total_memory)", sweep["device_memory_bytes"]),
                 (f"planner's usable (- {format_bytes(ACCELERATORS[preset].context_bytes)} context)",
                  usable_memory_bytes(preset)),
                 ("measured usable (free + reserve)", measured)]
        rows += [[gpu, term, format_bytes(b), f"{b - measured:+,}"] for term, b in terms]
    return Table(["GPU", "memory a rank can use", "bytes", "- measured (B)"], rows,
                 "measured usable: what mem_get_info found free plus what the caching allocator held, "
                 "inside a rank once CUDA, cuBLAS and NCCL were set up")


def root_resharded(sweep: Mapping[str, Any]) -> bool:
    """Whether a stored micro-batch sweep's runs resharded their root after forward: sets written
    before the runs kept FSDP2's default say nothing, and did (``fully_shard(model,
    reshard_after_forward=True)``); the model predicts each set as it was wrapped."""
    return bool(sweep.get("root_reshard_after_forward", True))


def _reserved_peak(config: Mapping[str, Any], world: int, root: bool, micro: int) -> int:
    return sweep_peak_bytes(config, world, micro, reserved=True, root_reshard_after_forward=root)


def gpu_smoke_table(sets: ResultSets) -> Table:
    """Each run of each gpu-smoke result set: what it exercises and how many of its checks held."""
    rows = []
    for name, data in sets.items():
        if data.get("schema") != SMOKE_SCHEMA:
            continue
        for label, run in data.get("runs", {}).items():
            checks = [Check(**c) for c in run.get("checks", [])]
            exact = [c for c in checks if c.tolerance == 0]
            rows.append([name, label, run.get("run", "-"), f"{sum(c.ok for c in checks)}/{len(checks)}",
                         f"{sum(c.exact for c in exact)}/{len(exact)}",
                         _first(run["error"]) if "error" in run else "ran"])
    return Table(["result set", "path", "run", "checks\nheld", "exact\nchecks", "outcome"], rows,
                 "checks held: within each check's tolerance; exact: the byte-exact checks that hold, "
                 "of all of them")


def _first(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def gpu_utilization_rows(sets: ResultSets) -> list[dict[str, Any]]:
    """Every run of the gpu-check ``seq_len`` and ``width`` parts that ran, one dict each: the
    part's row (``d_model``, ``seq_len``, ``micro_batch``, ``activation_checkpointing``,
    ``num_params``, ``tokens_per_rank``, ``step_time_s``, ``flops``, ``mfu_6pt``, ``mfu``,
    ``hfu`` ...) with ``set``, ``part``, ``num_layers`` and ``peak_flops`` added; sorted by
    checkpointing, width and sequence length. A run that failed is left out."""
    rows = []
    for name, data in _checks(sets):
        for part in ("seq_len", "width"):
            block = data.get(part, {})
            if not block.get("peak_flops_bf16"):
                continue
            model = block.get("model", {})  # the seq_len part's one model (its rows name no width)
            for row in block.get("rows", []):
                if "step_time_s" in row:
                    row = {"d_model": model.get("d_model"), "num_params": block.get("num_params"), **row}
                    rows.append({**row, "set": name, "part": part, "num_layers": _layers(row),
                                 "peak_flops": block["peak_flops_bf16"]})
    rows.sort(key=lambda r: (r["activation_checkpointing"] != "none", r["activation_checkpointing"],
                             r["d_model"], r["seq_len"]))
    return rows


def _layers(row: Mapping[str, Any]) -> int:
    """A utilization row's layer count, from its FLOPs: attention's are 12·L·w·s per token."""
    return row["flops"]["attention"] // (12 * row["d_model"] * row["seq_len"] * row["tokens_per_rank"])


def gpu_utilization_fit(rows: list[dict[str, Any]]) -> tuple[float, int]:
    """``(u_max, d_0)`` of :func:`~handbook_lib.models.timing.fit_utilization` on the runs at
    1,024-token sequences without checkpointing (the width part and the 1,024 row of the
    sequence part): the calibration rows of :func:`gpu_utilization_table`."""
    points = sorted({(r["d_model"], r["mfu"]) for r in rows if _calibration(r)})
    return fit_utilization(points)


def _calibration(row: Mapping[str, Any]) -> bool:
    return row["seq_len"] == 1024 and row["activation_checkpointing"] == "none"


def _model_step_s(row: Mapping[str, Any], u_max: float, d0: int) -> float:
    u = width_utilization(u_max, d0, row["d_model"])
    return estimate_compute_time(row["num_params"], row["tokens_per_rank"], row["peak_flops"], u,
                                 activation_checkpointing=row["activation_checkpointing"] == "full",
                                 seq_len=row["seq_len"], num_layers=row["num_layers"],
                                 attention_width=row["d_model"])


def gpu_utilization_table(sets: ResultSets) -> Table:
    """:func:`gpu_utilization_rows` as a table: each run's step, its utilization counted three
    ways (6PT, MFU with attention, HFU with the recomputed forward), and the compute model's step
    (:func:`~handbook_lib.models.timing.estimate_compute_time` at ``u_max·d/(d + d_0)`` of
    :func:`gpu_utilization_fit`) with its error; calibration rows marked ``*``."""
    rows = gpu_utilization_rows(sets)
    u_max, d0 = gpu_utilization_fit(rows)
    out = []
    for r in rows:
        model = _model_step_s(r, u_max, d0)
        out.append([f"{r['d_model']}{'*' if _calibration(r) else ''}", f"{r['seq_len']:,}", r["micro_batch"],
                    r["activation_checkpointing"], f"{1e3 * r['step_time_s']:.0f}", f"{100 * r['mfu_6pt']:.1f}%",
                    f"{100 * r['mfu']:.1f}%", f"{100 * r['hfu']:.1f}%", f"{1e3 * model:.0f}",
                    f"{100 * (model / r['step_time_s'] - 1):+.1f}%"])
    return Table(["width", "seq.\nlength", "micro-\nbatch", "AC", "step\n(ms)", "6PT\nutil.", "MFU", "HFU",
                  "model\n(ms)", "model\nerror"], out,
                 f"one GPU, 32,768 tokens per step; 6PT util.: 6·P·T over step x peak; MFU adds attention's "
                 f"12·L·w·s·T; HFU adds the recomputed forward; model: the FLOPs at u = {u_max:.3f}·d/(d + "
                 f"{d0:,}), fitted on the rows marked * (1,024-token sequences, no checkpointing)")


def plot_utilization(sets: ResultSets) -> Figure:
    """Two panels of :func:`gpu_utilization_rows`: against the sequence length (no checkpointing,
    the width-2,048 model), the utilization counted as 6PT and as MFU with attention, and the
    compute model's MFU; against the width (1,024-token sequences), the MFU and the fitted
    ``u_max·d/(d + d_0)``."""
    rows = gpu_utilization_rows(sets)
    u_max, d0 = gpu_utilization_fit(rows)
    plain = [r for r in rows if r["activation_checkpointing"] == "none"]
    seq = [r for r in plain if r["part"] == "seq_len"]
    width = sorted({r["d_model"]: r for r in plain if r["seq_len"] == 1024}.values(), key=lambda r: r["d_model"])
    fig = Figure(figsize=(7.2, 3.4), layout="constrained")
    left, right = fig.subplots(1, 2)
    s = [r["seq_len"] for r in seq]
    left.plot(s, [100 * r["mfu_6pt"] for r in seq], "o-", color="tab:gray", label="6PT only")
    left.plot(s, [100 * r["mfu"] for r in seq], "o-", color="tab:blue", label="with attention (MFU)")
    left.plot(s, [100 * r["mfu"] * r["step_time_s"] / _model_step_s(r, u_max, d0) for r in seq], "--",
              color="tab:orange", label="compute model")
    left.set_xscale("log", base=2)
    left.set_xticks(s, [f"{x // 1024}k" for x in s])
    left.set_xlabel("sequence length (tokens)")
    left.set_ylabel("utilization of the bf16 peak (%)")
    left.set_title("same tokens, longer sequences", fontsize=10)
    left.legend(fontsize=8)
    d = [r["d_model"] for r in width]
    right.plot(d, [100 * r["mfu"] for r in width], "o", color="tab:blue", label="measured MFU")
    grid = list(range(512, 8193, 128))
    right.plot(grid, [100 * width_utilization(u_max, d0, x) for x in grid], "--", color="tab:orange",
               label=f"{u_max:.2f}·d/(d + {d0:,})")
    right.set_xscale("log", base=2)
    right.set_xticks(d, [str(x) for x in d])
    right.set_xlabel("hidden width d")
    right.set_title("1,024-token sequences, wider layers", fontsize=10)
    right.legend(fontsize=8)
    return fig
