"""Layer 5, starting runs: :func:`torchrun` on one or many nodes of this machine or a cluster,
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
        estimate_mfu,
        error_line,
        estimate_prefetch_extra_bytes,
        gpu_slug,
        match_accelerator,
        memory_figures,
        steady_step_time_s,
        write_result_set,
    )
    from handbook_lib.launch.gpu_sweep import (
        Sweep,
        SweepTry,
        is_cuda_oom,
        predict_max_micro_batch,
        sweep_micro_batch,
        sweep_peak_bytes,
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
        SEQ_CHECKPOINTING,
        SEQ_LENS,
        SEQ_TOKENS,
        seq_len_configs,
        WIDTH_MODELS,
        width_configs,
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


__getattr__, __dir__, __all__ = lazy_exports(__name__)
