"""Layer 4, starting runs: :func:`torchrun` on one or many nodes of this machine or a cluster,
a Slurm script for a cluster, the GPU hub's policy for how many ranks a lesson gets, and the
arithmetic of ``make gpu-check``. No ``torch`` at import.

Every name below is imported from its module on first use, so importing one module of
this layer (a rank's harness importing its process-group set-up) loads no other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from handbook_lib.core.lazy import lazy_exports

if TYPE_CHECKING:  # what a type checker sees; at run time each name is imported on first use
    from handbook_lib.launch.diagnose import RankFailure, diagnose_failure
    from handbook_lib.launch.errors import (
        RunPreempted,
        ChecksFailed,
        RunFailed,
        RunInterrupted,
        RunTimeout,
        describe_failed_checks,
        killed_lines,
    )
    from handbook_lib.launch.gpu_check import (
        device_capacity,
        CUDA_WHEELS,
        gpu_present,
        no_gpu_message,
        BILLION_MODEL,
        MEMORY_CONFIGS,
        MFU_CONFIG,
        NO_GPU_MESSAGE,
        RESULT_SET_SCHEMA,
        STEP_TIME_CONFIG,
        SWEEP_CONFIG,
        WRITER,
        Sweep,
        SweepTry,
        estimate_mfu,
        estimate_prefetch_extra_bytes,
        gpu_slug,
        is_cuda_oom,
        match_accelerator,
        memory_figures,
        predict_max_micro_batch,
        steady_step_time_s,
        sweep_micro_batch,
        write_result_set,
    )
    from handbook_lib.launch.gpus import RankPlan, ranks_for, visible_gpus
    from handbook_lib.launch.runner import torchrun, torchrun_batch, torchrun_batches
    from handbook_lib.launch.show import (
        RunReport,
        config_defaults,
        describe_run,
        in_notebook,
        show_result,
    )
    from handbook_lib.launch.slurm import (
        MARKER,
        SHEBANG,
        SlurmJob,
        build_job,
        is_own_script,
        parse_time,
        render_sbatch,
        write_script,
    )
    from handbook_lib.launch.gpu_check import (
        AXES_MODEL,
        axes_configs,
    )
    from handbook_lib.launch.recipe import (
        NodeRun,
        recipe_commands,
        run_recipe,
    )
    from handbook_lib.launch.gpus import (
        DEVICE_CHOICES,
        DEVICE_ENV,
        device_setting,
        gpus_hidden,
        rank_env,
    )
    from handbook_lib.launch.planned import torchrun_planned
    from handbook_lib.launch.gpu_smoke import (
        SMOKE_SCHEMA,
        SMOKE_WRITER,
        SMOKE_MFU_BATCH,
        SmokeRun,
        smoke_plan,
        smoke_path,
        check_failures,
        mfu_failure,
        smoke_failures,
        smoke_summary,
    )
    from handbook_lib.launch.preflight import (
        SHM_MIN_BYTES,
        shm_warning,
    )

_HOMES = {
    "RankFailure": "diagnose",
    "diagnose_failure": "diagnose",
    "RunFailed": "errors",
    "killed_lines": "errors",
    "RunTimeout": "errors",
    "RunInterrupted": "errors",
    "ChecksFailed": "errors",
    "describe_failed_checks": "errors",
    "RESULT_SET_SCHEMA": "gpu_check",
    "WRITER": "gpu_check",
    "BILLION_MODEL": "gpu_check",
    "MEMORY_CONFIGS": "gpu_check",
    "STEP_TIME_CONFIG": "gpu_check",
    "MFU_CONFIG": "gpu_check",
    "SWEEP_CONFIG": "gpu_check",
    "NO_GPU_MESSAGE": "gpu_check",
    "match_accelerator": "gpu_check",
    "estimate_mfu": "gpu_check",
    "estimate_prefetch_extra_bytes": "gpu_check",
    "memory_figures": "gpu_check",
    "steady_step_time_s": "gpu_check",
    "is_cuda_oom": "gpu_check",
    "SweepTry": "gpu_check",
    "Sweep": "gpu_check",
    "sweep_micro_batch": "gpu_check",
    "predict_max_micro_batch": "gpu_check",
    "gpu_slug": "gpu_check",
    "write_result_set": "gpu_check",
    "RankPlan": "gpus",
    "ranks_for": "gpus",
    "visible_gpus": "gpus",
    "torchrun": "runner",
    "torchrun_batch": "runner",
    "torchrun_batches": "runner",
    "in_notebook": "show",
    "RunReport": "show",
    "describe_run": "show",
    "show_result": "show",
    "config_defaults": "show",
    "SlurmJob": "slurm",
    "build_job": "slurm",
    "render_sbatch": "slurm",
    "write_script": "slurm",
    "is_own_script": "slurm",
    "parse_time": "slurm",
    "SHEBANG": "slurm",
    "MARKER": "slurm",
    "AXES_MODEL": "gpu_check",
    "axes_configs": "gpu_check",
    "RunPreempted": "errors",
    "NodeRun": "recipe",
    "recipe_commands": "recipe",
    "run_recipe": "recipe",
    "DEVICE_CHOICES": "gpus",
    "DEVICE_ENV": "gpus",
    "device_setting": "gpus",
    "gpus_hidden": "gpus",
    "rank_env": "gpus",
    "torchrun_planned": "planned",
    "CUDA_WHEELS": "gpu_check",
    "gpu_present": "gpu_check",
    "no_gpu_message": "gpu_check",
    "SMOKE_SCHEMA": "gpu_smoke",
    "SMOKE_WRITER": "gpu_smoke",
    "SMOKE_MFU_BATCH": "gpu_smoke",
    "SmokeRun": "gpu_smoke",
    "smoke_plan": "gpu_smoke",
    "smoke_path": "gpu_smoke",
    "check_failures": "gpu_smoke",
    "mfu_failure": "gpu_smoke",
    "smoke_failures": "gpu_smoke",
    "smoke_summary": "gpu_smoke",
    "SHM_MIN_BYTES": "preflight",
    "shm_warning": "preflight",
    "device_capacity": "gpu_check",
}
"""Each exported name and the module of this package it is defined in."""

__all__ = [
    "RankFailure", "diagnose_failure", "RunFailed", "RunTimeout", "RunInterrupted", "ChecksFailed", "killed_lines",
    "describe_failed_checks", "RESULT_SET_SCHEMA", "WRITER", "BILLION_MODEL", "MEMORY_CONFIGS",
    "STEP_TIME_CONFIG", "MFU_CONFIG", "SWEEP_CONFIG", "NO_GPU_MESSAGE", "match_accelerator",
    "estimate_mfu", "estimate_prefetch_extra_bytes", "memory_figures", "steady_step_time_s",
    "is_cuda_oom", "SweepTry", "Sweep", "sweep_micro_batch", "predict_max_micro_batch", "gpu_slug",
    "write_result_set", "RankPlan", "ranks_for", "visible_gpus", "torchrun", "torchrun_batch",
    "torchrun_batches", "in_notebook", "RunReport", "describe_run", "show_result",
    "config_defaults", "SlurmJob", "build_job", "render_sbatch", "write_script", "is_own_script",
    "parse_time", "SHEBANG", "MARKER",
    "AXES_MODEL", "axes_configs",
    "RunPreempted",
    "NodeRun", "recipe_commands", "run_recipe",
    "DEVICE_CHOICES", "DEVICE_ENV", "device_setting", "gpus_hidden", "rank_env", "torchrun_planned",
    "CUDA_WHEELS", "gpu_present", "no_gpu_message",
    "SMOKE_SCHEMA", "SMOKE_WRITER", "SMOKE_MFU_BATCH", "SmokeRun", "smoke_plan", "smoke_path", "check_failures", "mfu_failure", "smoke_failures", "smoke_summary",
    "SHM_MIN_BYTES", "shm_warning",
    "device_capacity",
]

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
