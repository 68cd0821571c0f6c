"""Layer 2, what one rank does: build the model once (meta device, then the seeded weights),
apply checkpointing and the strategy's wrapper once, train in the one loop, measure, checkpoint.
Imports ``torch``; imports the models only to name what it measures.

Every name below is imported from its module on first use, so importing one module of
this layer (a rank's harness importing its process-group set-up) loads no other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from handbook_lib.core.lazy import lazy_exports

if TYPE_CHECKING:  # what a type checker sees; at run time each name is imported on first use
    from handbook_lib.runtime.recompute import apply_activation_checkpointing, selective_policy
    from handbook_lib.runtime.decoder import Decoder, DecoderLayer, RMSNorm, ROPE_THETA, measure_activation_bytes
    from handbook_lib.runtime.hf_weights import (
        SHARDED_DIR, load_safetensors, safetensors_files, save_safetensors, transformers_config,
    )
    from handbook_lib.runtime.build import (
        APPLY,
        InitMode,
        CoreFactory,
        apply_axes,
        apply_pipeline,
        apply_explicit_prefetch,
        apply_fsdp2,
        build_mesh,
        build_mp_policy,
        check_runnable,
        measure_init_bytes,
        parallelize,
        shard_group,
        torch_dtype,
    )
    from handbook_lib.runtime.checkpoint import (
        PendingCheckpoint,
        RESERVED_KEYS,
        LoadedCheckpoint,
        SavedCheckpoint,
        export_full_state_dict,
        load_checkpoint,
        load_exported,
        save_checkpoint,
    )
    from handbook_lib.runtime.checkpoint_verify import (
        CheckpointError,
        check_model_shapes,
        file_checksum,
        read_metadata,
        resolve_checkpoint,
        validate_checkpoint,
    )
    from handbook_lib.runtime.checkpoint_inspect import (
        reproduces_probe,
        checkpoint_files,
        checkpoint_items,
        count_checkpoint,
        count_state_tensors,
    )
    from handbook_lib.runtime.collectives import (
        CollectiveCall,
        CollectiveCounter,
        collective_totals,
        tensors_in,
    )
    from handbook_lib.runtime.data import (
        sequences_from,
        BatchSource,
        data_seed,
        local_batch,
        local_slice,
        make_batch,
    )
    from handbook_lib.runtime.distributed import (
        resolve_device,
        RankContext,
        init_distributed,
        pick_device,
        shared_temp_dir,
        shutdown_distributed,
    )
    from handbook_lib.runtime.grads import (
        clip_grad_norm,
        full_grad_norm,
        grad_zero_fraction,
        is_fsdp1,
    )
    from handbook_lib.runtime.measure import (
        DeviceMemory,
        measure_device_memory,
        UNTRACKED_WORDS,
        ParamBytes,
        StepMemory,
        StepMemoryTracker,
        local_tensor,
        measure_cpu_adam,
        measure_fsdp_units,
        measure_grad_bytes,
        measure_optimizer_bytes,
        measure_param_bytes,
        nbytes,
    )
    from handbook_lib.runtime.model import (
        SimpleTransformer,
        TransformerLayer,
        build_model,
        count_parameters,
        model_parts,
    )
    from handbook_lib.runtime.probe import GatheredProbe, GatheredSnapshot
    from handbook_lib.runtime.seeded_init import SeededInit, seeded_parts
    from handbook_lib.runtime.optimization import (
        build_grad_scaler,
        build_lr_scheduler,
        build_optimizer,
        build_zero_redundancy_optimizer,
    )
    from handbook_lib.runtime.training import (
        ForwardFn,
        LossContext,
        LossFn,
        NonFiniteLoss,
        StepEnd,
        TrainLog,
        check_loss_finite,
        next_token_loss,
        one_thread,
        train,
        train_one_process,
        train_step,
    )
    from handbook_lib.runtime.parallel_model import (
        PAD_LOGIT_BIAS,
        AttentionCore,
        causal_attention,
        SplitAttention,
        ParallelLayer,
        ParallelTransformer,
        from_simple,
    )
    from handbook_lib.runtime.tensor_parallel import apply_tensor_parallel, tp_loss
    from handbook_lib.runtime.sequence_parallel import AttentionError, measure_attention_error
    from handbook_lib.runtime.mesh import MESH_NAMES, LayoutMesh, build_layout_mesh
    from handbook_lib.runtime.axes import axes_step, layout_batches
    from handbook_lib.runtime.pipeline import PipelinedModel, PipelineStageModule, cut_stages, pipeline_step
    from handbook_lib.runtime.ring_attention import (
        RingAttention,
        causal_ring_attention,
        ring_core,
    )
    from handbook_lib.runtime.random_state import (
        seed_generators,
        rng_state,
        set_rng_state,
    )
    from handbook_lib.runtime.data_loader import (
        SequenceDataset,
        LoaderBatches,
    )
    from handbook_lib.runtime.preemption import (
        Preempted,
        PreemptionWatch,
    )
    from handbook_lib.runtime.diagnosis import (
        Finding,
        diagnose_wrapping,
        diagnose_tied_weights,
        diagnose_grad_norm,
        diagnose_accumulation,
        repeated_block,
    )


__getattr__, __dir__, __all__ = lazy_exports(__name__)
