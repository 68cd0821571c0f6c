"""Layer 3, other frameworks in the book's vocabulary: the configs of Accelerate, the
Transformers Trainer and DeepSpeed written from a run config (:mod:`.frameworks`, pure), and what
a rank does to train through each (:mod:`.zero_engine`, :mod:`.accelerate_job`,
:mod:`.hf_trainer`, each importing its own framework). Names are imported on first use, so
importing this package loads no framework.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from handbook_lib.core.lazy import lazy_exports

if TYPE_CHECKING:  # what a type checker sees; at run time each name is imported on first use
    from handbook_lib.integrations.accelerate_job import (
        AccelerateJob,
        accelerate_launch_env,
        fsdp_plugin,
        launch_env,
        train_with_accelerate,
        what_accelerate_did,
    )
    from handbook_lib.integrations.frameworks import (
        DEEPSPEED_STAGE3_DEFAULTS,
        LAYER_CLASS,
        MACHINE_RANK_FLAG,
        MEASUREMENT_OVERRIDES,
        accelerate_config,
        deepspeed_config,
        fsdp_strategies,
        production_configs,
        trainer_deepspeed_args,
        trainer_fsdp_args,
    )
    from handbook_lib.integrations.hf_trainer import (
        probe_logits_on_cpu,
        RecordingTrainer,
        SyntheticLM,
        build_gpt2,
        deepspeed_state_over_gloo,
        gpt2_config,
        probe_batch,
        probe_logits,
        training_arguments,
        zero3_partition_elements,
    )
    from handbook_lib.integrations.zero_engine import (
        set_ds_accelerator,
        EngineOptimizer,
        build_engine,
        deepspeed_estimates,
        import_deepspeed,
        measure_zero_bytes,
        measure_zero_grad_bytes,
        parse_deepspeed_config,
    )
    from handbook_lib.integrations.ulysses import (
        ulysses_core,
    )


__getattr__, __dir__, __all__ = lazy_exports(__name__)
