"""Layer 2b, other frameworks in the book's vocabulary: the configs of Accelerate, the
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
        accelerate_launch_env,
        fsdp_plugin,
        launch_env,
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
        gpt2_config,
        probe_batch,
        probe_logits,
        training_arguments,
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

_HOMES = {
    "launch_env": "accelerate_job",
    "what_accelerate_did": "accelerate_job",
    "accelerate_launch_env": "accelerate_job",
    "fsdp_plugin": "accelerate_job",
    "DEEPSPEED_STAGE3_DEFAULTS": "frameworks",
    "MEASUREMENT_OVERRIDES": "frameworks",
    "production_configs": "frameworks",
    "LAYER_CLASS": "frameworks",
    "MACHINE_RANK_FLAG": "frameworks",
    "accelerate_config": "frameworks",
    "trainer_fsdp_args": "frameworks",
    "deepspeed_config": "frameworks",
    "trainer_deepspeed_args": "frameworks",
    "fsdp_strategies": "frameworks",
    "gpt2_config": "hf_trainer",
    "build_gpt2": "hf_trainer",
    "SyntheticLM": "hf_trainer",
    "RecordingTrainer": "hf_trainer",
    "probe_batch": "hf_trainer",
    "probe_logits": "hf_trainer",
    "import_deepspeed": "zero_engine",
    "EngineOptimizer": "zero_engine",
    "build_engine": "zero_engine",
    "measure_zero_bytes": "zero_engine",
    "measure_zero_grad_bytes": "zero_engine",
    "deepspeed_estimates": "zero_engine",
    "parse_deepspeed_config": "zero_engine",
    "training_arguments": "hf_trainer",
    "ulysses_core": "ulysses",
    "probe_logits_on_cpu": "hf_trainer",
    "set_ds_accelerator": "zero_engine",
}
"""Each exported name and the module of this package it is defined in."""

__all__ = [
    "launch_env", "what_accelerate_did", "LAYER_CLASS", "accelerate_config", "trainer_fsdp_args",
    "deepspeed_config", "trainer_deepspeed_args", "fsdp_strategies", "gpt2_config", "build_gpt2",
    "SyntheticLM", "RecordingTrainer", "probe_batch", "probe_logits", "import_deepspeed",
    "EngineOptimizer", "build_engine", "measure_zero_bytes", "measure_zero_grad_bytes",
    "deepspeed_estimates", "MACHINE_RANK_FLAG", "accelerate_launch_env", "fsdp_plugin",
    "DEEPSPEED_STAGE3_DEFAULTS", "MEASUREMENT_OVERRIDES", "production_configs",
    "parse_deepspeed_config", "training_arguments",
    "ulysses_core",
    "probe_logits_on_cpu",
    "set_ds_accelerator",
]

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
