"""What ``make gpu-check`` measures on a CUDA machine, and the arithmetic it reads it with.

Chapter 8 ("Measured on GPUs") lists its result sets: the book's stored outputs come from CPU
runs, and this is how the same experiments are checked on real GPUs (CUDA + NCCL).
``scripts/gpu_check.py`` launches the runs (``launch.torchrun``) and writes one result set per
GPU model, ``results/gpu/<gpu-slug>.json``; this module holds everything in it that needs no
GPU, so that it is tested on the CPU:

- the experiments' configs (:data:`MEMORY_CONFIGS`, :data:`STEP_TIME_CONFIG`,
  :data:`BILLION_MODEL` for MFU and the micro-batch sweep);
- the memory figures: measured peak minus predicted, beside the gathered unit that FSDP2's
  prefetch keeps alive on a GPU (:func:`estimate_prefetch_extra_bytes`, :func:`memory_figures`),
  the allocator's excess over the tracker named apart (workspaces and rounding), and the
  device memory a rank found free after NCCL's set-up (:func:`device_capacity`);
- model FLOPs utilization (:func:`estimate_mfu`) and the GPU-name → preset map
  (:func:`match_accelerator`);
- the micro-batch sweep and the model's largest micro-batch are in :mod:`handbook_lib.launch.gpu_sweep`;
- the result-set file (:func:`gpu_slug`, :func:`write_result_set`), which never replaces a file
  it did not write.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from handbook_lib.core.architecture import ModelConfig
from handbook_lib.core.checks import check_int
from handbook_lib.core.config import DTYPES, PRECISIONS
from handbook_lib.core.files import write_json_atomic
from handbook_lib.models.layout import wrap_units

__all__ = [
    "RESULT_SET_SCHEMA", "WRITER", "BILLION_MODEL", "MEMORY_CONFIGS", "STEP_TIME_CONFIG", "MFU_CONFIG",
    "SWEEP_CONFIG", "NO_GPU_MESSAGE", "CUDA_WHEELS", "gpu_present", "no_gpu_message", "match_accelerator",
    "estimate_mfu",
    "estimate_prefetch_extra_bytes",
    "memory_figures", "device_capacity", "steady_step_time_s", "error_line", "gpu_slug", "write_result_set",
    "AXES_MODEL",
    "axes_configs",
    "SEQ_TOKENS", "SEQ_LENS", "SEQ_CHECKPOINTING", "seq_len_configs", "WIDTH_MODELS", "width_configs",
]

RESULT_SET_SCHEMA = "handbook.gpu-check/1"
"""Version tag of a GPU result set; bump it when a key changes meaning."""
WRITER = "scripts/gpu_check.py"
"""Recorded in every result set: a file without it was not written by gpu-check."""
NO_GPU_MESSAGE = "gpu-check needs a CUDA GPU: none is visible (torch.cuda.is_available() is False)"
CUDA_WHEELS = "download.pytorch.org/whl/cu126"
"""The index of torch's CUDA 12.6 wheels, which the drivers of current GPU hubs (>= 560) run."""


def gpu_present(dev: str | Path = "/dev/nvidia0", smi: str = "nvidia-smi") -> bool:
    """Whether this machine has an NVIDIA GPU, whatever torch says: the device node ``dev``
    exists (containers often lack ``nvidia-smi``), or ``smi -L`` lists a GPU."""
    import subprocess

    if Path(dev).exists():
        return True
    try:
        proc = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0 and "GPU" in proc.stdout


def no_gpu_message(cuda_version: str | None, present: bool, torch_version: str = "", tool: str = "gpu-check") -> str:
    """The one line to print when ``torch.cuda.is_available()`` is False, telling the cases
    apart (issue 29, S1-2): no GPU (:data:`NO_GPU_MESSAGE`); a GPU, but ``torch`` is a CPU
    build (``torch.version.cuda`` is ``None``); a GPU and a CUDA build that cannot use it (a
    driver older than the build's CUDA ``cuda_version``, or none loaded)."""
    if not present:
        return NO_GPU_MESSAGE.replace("gpu-check", tool, 1)
    version = torch_version.split("+")[0] or "X"
    if cuda_version is None:
        return f"torch is a CPU build on a GPU machine: install torch=={version} from {CUDA_WHEELS}"
    return f"torch (CUDA {cuda_version}) cannot use this GPU: update the NVIDIA driver, or use an older CUDA build"

BILLION_MODEL = ModelConfig(vocab_size=32_000, d_model=2048, nhead=16, dim_feedforward=8192, num_layers=18)
"""The handbook model at about a billion parameters (1,037,552,896): 18 layers of width 2048."""

MEMORY_CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": {"strategy": "FULL_SHARD", "precision": "fp32", "steps": 3},
    "bf16-mixed": {"strategy": "FULL_SHARD", "precision": "bf16-mixed", "steps": 3},
}
"""fsdp_train runs of the book's running model (RunConfig defaults) whose peaks are compared
with the memory model; ``batch_size`` is set to 4 sequences per rank by the script."""

STEP_TIME_CONFIG: dict[str, Any] = {
    "d_model": 1024, "nhead": 8, "dim_feedforward": 4096, "num_layers": 8, "seq_len": 512,
    "steps": 5, "repeats": 3, "warmup": 2, "variants": "DDP,FULL_SHARD,SHARD_GRAD_OP",
}
"""step_time (fp32, as it requires): a model large enough (about 120 M parameters) that a GPU
step is not all launch overhead; ``batch_size`` is 4 sequences per rank."""

MFU_CONFIG: dict[str, Any] = {
    **BILLION_MODEL.to_dict(), "strategy": "FULL_SHARD", "precision": "bf16-mixed", "seq_len": 1024,
    "steps": 6,
}
"""fsdp_train, FSDP2 bf16, of :data:`BILLION_MODEL`; ``batch_size`` is 8 sequences per rank.
Its ``step_time_s`` holds steps 1..5 (the sixth is measured for memory and not timed)."""

SWEEP_CONFIG: dict[str, Any] = {**MFU_CONFIG, "steps": 2}
"""The micro-batch sweep: :data:`MFU_CONFIG` for 2 steps (the second under the memory tracker)."""


SEQ_TOKENS = 32_768
"""Tokens per rank in each run of the sequence-length part: the micro-batch is this over the
sequence length, so every run does the same dense (6PT) work and only attention's grows."""
SEQ_LENS: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768)
"""Sequence lengths of that part, without activation checkpointing."""
SEQ_CHECKPOINTING: tuple[tuple[str, int], ...] = (("full", 1024), ("full", 4096), ("selective", 4096))
"""``(activation_checkpointing, seq_len)`` runs added to it: full recomputation's extra
forward (hardware FLOPs against model FLOPs) and the op-level selective policy's."""


def seq_len_configs(world_size: int) -> list[dict[str, Any]]:
    """The sequence-length part's fsdp_train configs: :data:`MFU_CONFIG` at each of
    :data:`SEQ_LENS`, then :data:`SEQ_CHECKPOINTING`, :data:`SEQ_TOKENS` tokens per rank."""
    check_int("world_size", world_size, 1)
    runs = [("none", s) for s in SEQ_LENS] + list(SEQ_CHECKPOINTING)
    return [{**MFU_CONFIG, "seq_len": s, "batch_size": SEQ_TOKENS // s * world_size, "activation_checkpointing": ac}
            for ac, s in runs]


WIDTH_MODELS: tuple[ModelConfig, ...] = (
    ModelConfig(vocab_size=32_000, d_model=1024, nhead=8, dim_feedforward=4096, num_layers=24),
    ModelConfig(vocab_size=32_000, d_model=4096, nhead=32, dim_feedforward=16384, num_layers=8),
    ModelConfig(vocab_size=32_000, d_model=8192, nhead=64, dim_feedforward=32768, num_layers=2),
)
"""Other widths for the width part, beside :data:`BILLION_MODEL`'s 2048: the matrix products'
size, the shape dependence of utilization (0.4 to 2.1 B parameters)."""


def width_configs(world_size: int) -> list[dict[str, Any]]:
    """The width part's fsdp_train configs: :data:`MFU_CONFIG` with each of :data:`WIDTH_MODELS`,
    1,024-token sequences, :data:`SEQ_TOKENS` tokens per rank."""
    check_int("world_size", world_size, 1)
    return [{**MFU_CONFIG, **m.to_dict(), "seq_len": 1024, "batch_size": SEQ_TOKENS // 1024 * world_size}
            for m in WIDTH_MODELS]


AXES_MODEL: dict[str, Any] = {"vocab_size": 96, "d_model": 64, "nhead": 4, "dim_feedforward": 128,
                              "num_layers": 2, "seq_len": 16, "steps": 3}
"""Chapter 9's runs' model and data, as on the CPU (the GPU check's question there is whether
every byte and collective still matches on NCCL, not speed)."""


def axes_configs(world_size: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """Chapter 9's runs for ``world_size`` GPUs, ``label -> (run, config)``: TP over 2 GPUs with
    and without sequence parallelism, Ulysses over 2 and a ring over every GPU, each with FSDP2
    over the rest and 2 sequences per data-parallel rank; a 1F1B pipeline of 2 stages, FSDP2
    over the rest, 4 micro-batches of one sequence. Empty below 2 GPUs (a group of one
    splits nothing); TP needs an even count."""
    check_int("world_size", world_size, 1)
    if world_size < 2:
        return {}
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    if world_size % 2 == 0:
        dp = world_size // 2
        tp = {**AXES_MODEL, "tp_size": 2, "batch_size": 2 * dp}
        out["tp"] = ("tensor_parallel", tp)
        out["tp_sp"] = ("tensor_parallel", {**tp, "sequence_parallel": True})
        out["ulysses"] = ("sequence_parallel", {**AXES_MODEL, "sp_size": 2, "sp_method": "ulysses",
                                                "batch_size": 2 * dp})
        out["pipeline"] = ("pipeline", {**AXES_MODEL, "pp_size": 2, "schedule": "1F1B", "batch_size": 4 * dp})
    if AXES_MODEL["seq_len"] % world_size == 0:
        out["ring"] = ("sequence_parallel", {**AXES_MODEL, "sp_size": world_size, "sp_method": "ring",
                                             "batch_size": 2})
    return out


def match_accelerator(device_name: str) -> str | None:
    """The :data:`~handbook_lib.models.hardware.ACCELERATORS` key of a ``torch.cuda.get_device_name``.

    Only names whose peak the preset states are matched: a PCIe or NVL H100/H200 has a lower
    clock than the SXM preset and is not matched, nor is an L40S taken for an L4. An A100 is
    matched by the memory in its name (``A100-SXM4-40GB``, ``A100 80GB PCIe``; same peak).

    Returns:
        The preset's key, or ``None`` for a GPU the presets do not describe ("unknown GPU").
    """
    name = device_name.upper()
    if re.search(r"\bH[12]00\b", name) and re.search(r"PCIE|\bNVL\b", name):
        return None
    if re.search(r"\bH200\b", name):
        return "h200-141gb"
    if re.search(r"\bH100\b", name):
        return "h100-80gb"
    if re.search(r"\bA100\b", name):
        return "a100-80gb" if "80GB" in name else "a100-40gb" if "40GB" in name else None
    if re.search(r"\bB200\b", name):
        return "b200-180gb"
    if re.search(r"\bL4\b", name):
        return "l4-24gb"
    if re.search(r"\bMI300X\b", name):
        return "mi300x-192gb"
    return None


def estimate_mfu(num_params: int, tokens_per_step: int, step_time_s: float, world_size: int,
                 peak_flops: float) -> float:
    """Model FLOPs utilization: ``6·P·tokens / (step time · world · peak)``.

    Args:
        num_params: P, the model's parameters.
        tokens_per_step: Tokens of one optimizer step over all ranks (global batch · seq_len).
        step_time_s: Seconds per step (the slowest rank's).
        world_size: GPUs in the job.
        peak_flops: One GPU's dense peak, FLOP/s (e.g. ``peak_flops_bf16``).

    Returns:
        A fraction (0.4 = 40 %): the training FLOPs of a dense model (forward 2·P, backward
        4·P per token; attention's own FLOPs left out) over what the GPUs could do meanwhile.
    """
    for name, value in (("num_params", num_params), ("tokens_per_step", tokens_per_step),
                        ("world_size", world_size)):
        check_int(name, value, 1)
    for name, number in (("step_time_s", step_time_s), ("peak_flops", peak_flops)):
        if not (isinstance(number, (int, float)) and math.isfinite(number) and number > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {number!r}")
    return 6 * num_params * tokens_per_step / (step_time_s * world_size * peak_flops)


def estimate_prefetch_extra_bytes(config: Mapping[str, Any], world_size: int, *,
                                  layers_only: bool = False) -> tuple[str, int]:
    """The unit FSDP2's prefetch can keep gathered on a GPU beyond the memory model's phases.

    On CUDA, FSDP2 issues the next unit's all-gather on its own stream before the current unit
    computes, so one more unit's unsharded parameters can be alive at the peak. Its size, as
    predicted: the largest unit's unsharded (padded) elements times the compute dtype's bytes.
    The root (embedding and head) is gathered first and never prefetched, and is often the
    largest unit: ``layers_only`` gives the largest of the other units, the ones prefetched.

    Args:
        config: The run's config keys (RunConfig's: model keys, ``precision``, ``wrap``,
            ``wrap_min_params``); missing keys take RunConfig's defaults.
        world_size: Ranks sharding each unit (FULL_SHARD: all of them).
        layers_only: Leave the root unit out.

    Returns:
        ``(unit name, bytes)``.
    """
    from handbook_lib.core.config import RunConfig

    cfg = RunConfig.from_mapping({k: v for k, v in config.items() if k in RunConfig.keys()})
    units = [u for u in wrap_units(cfg.model_config(), cfg.wrap, cfg.wrap_min_params)
             if u.numel and not (layers_only and u.root)]
    if not units:
        raise ValueError(f"wrap={cfg.wrap!r} makes no unit but the root: nothing is prefetched")
    compute = DTYPES[PRECISIONS[cfg.precision].compute].bytes
    largest = max(units, key=lambda u: u.padded_numel(world_size))
    return largest.name, compute * largest.padded_numel(world_size)


_DEVICE_KEYS = ("device_free_bytes", "device_reserved_bytes", "device_total_bytes")


def memory_figures(ranks: Sequence[Mapping[str, Any]], extras: Mapping[str, tuple[str, int]]) -> list[dict[str, Any]]:
    """Per rank: the measured peaks beside the memory model's, and the excess beside the prefetch.

    Args:
        ranks: A fsdp_train result's ``ranks`` (each with ``rank``, ``peak_bytes`` — the memory
            tracker's —, ``allocator_peak_bytes`` — ``torch.cuda.max_memory_allocated`` —,
            ``predicted_peak_bytes`` and, on CUDA, ``allocator_reserved_bytes`` —
            ``torch.cuda.max_memory_reserved`` — beside ``predicted_peak_reserved_bytes``, and
            the tracker's :meth:`~handbook_lib.runtime.measure.StepMemory.allocator_metrics`).
        extras: Candidate prefetch extras by label, each ``(unit name, bytes)`` from
            :func:`estimate_prefetch_extra_bytes`, e.g. ``{"largest_unit": ..., "largest_layer": ...}``.

    Returns:
        One dict per rank: the three peaks, ``excess_bytes`` (tracker − predicted),
        ``allocator_excess_bytes`` (allocator − predicted) and, per extra, ``<label>_unit``,
        ``<label>_bytes`` and ``excess_over_<label>`` (the tracker's excess ÷ extra: about 1
        when the excess is that one unit gathered early); on CUDA also the reserved peaks and
        ``reserved_over_predicted`` (measured ÷ the allocator model's, 1.0 when the 10 % reserve
        is right), and where the rank reported them the allocator's bytes the tracker cannot
        see (``untracked_bytes`` = allocator − tracker peak, split into
        ``untracked_at_enter_bytes`` and ``untracked_step_bytes``, with ``untracked_what``:
        cuBLAS workspaces and block rounding, not a prefetched unit) and the device's memory
        as the step began (``device_*_bytes``).
    """
    rows = []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        predicted = r.get("predicted_peak_bytes")
        measured = r.get("peak_bytes")
        allocator = r.get("allocator_peak_bytes")
        row: dict[str, Any] = {"rank": r["rank"], "predicted_peak_bytes": predicted, "peak_bytes": measured,
                               "allocator_peak_bytes": allocator}
        reserved, predicted_reserved = r.get("allocator_reserved_bytes"), r.get("predicted_peak_reserved_bytes")
        if reserved is not None and predicted_reserved:
            row.update(allocator_reserved_bytes=reserved, predicted_peak_reserved_bytes=predicted_reserved,
                       reserved_over_predicted=reserved / predicted_reserved)
        for label, (unit, extra) in extras.items():
            row[f"{label}_unit"], row[f"{label}_bytes"] = unit, extra
        if allocator is not None and measured is not None and r.get("untracked_step_bytes") is not None:
            row.update(untracked_bytes=allocator - measured, untracked_at_enter_bytes=r["untracked_at_enter_bytes"],
                       untracked_step_bytes=r["untracked_step_bytes"], untracked_what=r.get("untracked_what"))
        row.update({k: r[k] for k in _DEVICE_KEYS if r.get(k) is not None})
        if predicted is None or measured is None:
            row["missing"] = "the run reported no peak (memory tracking needs steps >= 2)"
        else:
            row["excess_bytes"] = measured - predicted
            if allocator is not None:
                row["allocator_excess_bytes"] = allocator - predicted
            for label, (_, extra) in extras.items():
                row[f"excess_over_{label}"] = (measured - predicted) / extra if extra else None
        rows.append(row)
    return rows


def device_capacity(rows: Sequence[Mapping[str, Any]], total_bytes: int) -> dict[str, Any]:
    """The device memory a memory model's peak may fill, from what ranks measured, bytes.

    Each rank that reported its GPU's memory as its tracked step began (after NCCL's set-up and
    the earlier steps' collectives: :func:`memory_figures`'s ``device_*_bytes``) gives
    ``free + reserved`` (what its tensors can grow into) less ``untracked_at_enter_bytes``
    (workspaces already allocated that the model does not count); the smallest over the ranks
    is the capacity. The gap to ``total_bytes`` (``total_memory``) is the CUDA context, NCCL's
    buffers, library handles and any other process.

    Returns:
        ``capacity_bytes``, ``capacity_source`` (``"mem_get_info in rank N"``, or
        ``"total_memory"`` when no rank reported it: then the capacity is ``total_bytes`` and
        optimistic), ``outside_allocator_bytes`` (``total - free - reserved`` on that rank) and
        ``gap_bytes`` (``total_bytes - capacity_bytes``).
    """
    check_int("total_bytes", total_bytes, 1)
    best: tuple[int, int, int] | None = None
    for r in rows:
        if r.get("device_free_bytes") is None or r.get("device_reserved_bytes") is None:
            continue
        usable = r["device_free_bytes"] + r["device_reserved_bytes"]
        outside = r.get("device_total_bytes", total_bytes) - usable
        capacity = usable - (r.get("untracked_at_enter_bytes") or 0)
        if best is None or capacity < best[0]:
            best = (capacity, r["rank"], outside)
    if best is None:
        return {"capacity_bytes": total_bytes, "capacity_source": "total_memory",
                "outside_allocator_bytes": None, "gap_bytes": 0}
    return {"capacity_bytes": best[0], "capacity_source": f"mem_get_info in rank {best[1]}",
            "outside_allocator_bytes": best[2], "gap_bytes": total_bytes - best[0]}


def steady_step_time_s(per_rank: Sequence[Sequence[float]], skip: int = 1) -> float:
    """One step time from every rank's per-step times: each step's slowest rank (a step ends
    when all ranks end it), the median over the steps after the first ``skip`` (warm-up:
    kernels chosen, allocator grown).

    Raises:
        ValueError: if no rank has more than ``skip`` steps.
    """
    steps = min((len(t) for t in per_rank), default=0)
    if steps <= skip:
        raise ValueError(f"need more than {skip} timed step(s) per rank, got {steps}")
    return statistics.median(max(t[i] for t in per_rank) for i in range(skip, steps))


def error_line(err: BaseException) -> str:
    """How a result set records a failure: ``Type: first line of the message``, at most 500
    characters (the scripts keep one part's or one run's failure and go on)."""
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"[:500]


def gpu_slug(device_name: str) -> str:
    """A file name for a GPU model: ``"NVIDIA H200"`` → ``"nvidia-h200"``."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    if not slug:
        raise ValueError(f"device_name must contain a letter or digit, got {device_name!r}")
    return slug


def _written_by_us(path: Path, schema: str, writer: str) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and data.get("schema") == schema and data.get("written_by") == writer


def write_result_set(path: str | Path, data: Mapping[str, Any], *, schema: str = RESULT_SET_SCHEMA,
                     writer: str = WRITER) -> Path:
    """Write a GPU result set (JSON, atomically), stamped with ``schema`` and ``writer``
    (default :data:`RESULT_SET_SCHEMA` and :data:`WRITER`; gpu-smoke passes its own).

    A file already at ``path`` is replaced only if the same writer wrote it (its ``schema`` and
    ``written_by`` say so); anything else is left alone.

    Raises:
        FileExistsError: if ``path`` holds a file that writer did not write (or is not a file).
    """
    target = Path(path)
    if target.exists() and not (target.is_file() and _written_by_us(target, schema, writer)):
        tool = Path(writer).stem.replace("_", "-")
        raise FileExistsError(f"{target} exists and was not written by {tool}: not replaced; "
                              "move it away or pass another --out")
    target.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(target, {"schema": schema, "written_by": writer, **data})
    return target
