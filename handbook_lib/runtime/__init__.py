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
    from handbook_lib.runtime.build import (
        APPLY,
        InitMode,
        apply_activation_checkpointing,
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
        RankContext,
        init_distributed,
        pick_device,
        shutdown_distributed,
    )
    from handbook_lib.runtime.grads import (
        clip_grad_norm,
        full_grad_norm,
        grad_zero_fraction,
        is_fsdp1,
    )
    from handbook_lib.runtime.measure import (
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
    )
    from handbook_lib.runtime.training import (
        ForwardFn,
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
        AttentionCore,
        causal_attention,
        SplitAttention,
        ParallelLayer,
        ParallelTransformer,
        from_simple,
    )
    from handbook_lib.runtime.tensor_parallel import (
        TPTrainLog,
        apply_fsdp_over_dp,
        apply_tensor_parallel,
        build_tp_mesh,
        build_tp_model,
        dp_batch,
        tp_loss,
        train_tensor_parallel,
    )
    from handbook_lib.runtime.sequence_parallel import (
        AttentionError,
        SequenceMesh,
        build_sequence_mesh,
        build_sequence_model,
        measure_attention_error,
        sequence_batches,
    )
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

_HOMES = {
    "InitMode": "build",
    "torch_dtype": "build",
    "shard_group": "build",
    "build_mesh": "build",
    "build_mp_policy": "build",
    "apply_activation_checkpointing": "build",
    "apply_fsdp2": "build",
    "apply_explicit_prefetch": "build",
    "check_runnable": "build",
    "parallelize": "build",
    "APPLY": "build",
    "measure_init_bytes": "build",
    "CheckpointError": "checkpoint_verify",
    "SavedCheckpoint": "checkpoint",
    "LoadedCheckpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "resolve_checkpoint": "checkpoint_verify",
    "validate_checkpoint": "checkpoint_verify",
    "load_checkpoint": "checkpoint",
    "export_full_state_dict": "checkpoint",
    "load_exported": "checkpoint",
    "file_checksum": "checkpoint_verify",
    "check_model_shapes": "checkpoint_verify",
    "read_metadata": "checkpoint_verify",
    "checkpoint_files": "checkpoint_inspect",
    "checkpoint_items": "checkpoint_inspect",
    "count_state_tensors": "checkpoint_inspect",
    "count_checkpoint": "checkpoint_inspect",
    "BatchSource": "data",
    "data_seed": "data",
    "make_batch": "data",
    "local_slice": "data",
    "local_batch": "data",
    "RankContext": "distributed",
    "pick_device": "distributed",
    "init_distributed": "distributed",
    "shutdown_distributed": "distributed",
    "grad_zero_fraction": "grads",
    "clip_grad_norm": "grads",
    "full_grad_norm": "grads",
    "is_fsdp1": "grads",
    "ParamBytes": "measure",
    "local_tensor": "measure",
    "measure_param_bytes": "measure",
    "measure_grad_bytes": "measure",
    "measure_optimizer_bytes": "measure",
    "measure_fsdp_units": "measure",
    "StepMemory": "measure",
    "StepMemoryTracker": "measure",
    "CollectiveCall": "collectives",
    "CollectiveCounter": "collectives",
    "collective_totals": "collectives",
    "tensors_in": "collectives",
    "measure_cpu_adam": "measure",
    "nbytes": "measure",
    "TransformerLayer": "model",
    "SimpleTransformer": "model",
    "model_parts": "model",
    "build_model": "model",
    "count_parameters": "model",
    "seeded_parts": "seeded_init",
    "SeededInit": "seeded_init",
    "ForwardFn": "training",
    "GatheredProbe": "probe",
    "GatheredSnapshot": "probe",
    "LossFn": "training",
    "next_token_loss": "training",
    "TrainLog": "training",
    "StepEnd": "training",
    "build_optimizer": "optimization",
    "build_grad_scaler": "optimization",
    "build_lr_scheduler": "optimization",
    "train_step": "training",
    "train": "training",
    "train_one_process": "training",
    "one_thread": "training",
    "NonFiniteLoss": "training",
    "check_loss_finite": "training",
    "AttentionCore": "parallel_model",
    "causal_attention": "parallel_model",
    "SplitAttention": "parallel_model",
    "ParallelLayer": "parallel_model",
    "ParallelTransformer": "parallel_model",
    "from_simple": "parallel_model",
    "TPTrainLog": "tensor_parallel",
    "apply_fsdp_over_dp": "tensor_parallel",
    "apply_tensor_parallel": "tensor_parallel",
    "build_tp_mesh": "tensor_parallel",
    "build_tp_model": "tensor_parallel",
    "dp_batch": "tensor_parallel",
    "tp_loss": "tensor_parallel",
    "train_tensor_parallel": "tensor_parallel",
    "AttentionError": "sequence_parallel",
    "SequenceMesh": "sequence_parallel",
    "build_sequence_mesh": "sequence_parallel",
    "build_sequence_model": "sequence_parallel",
    "measure_attention_error": "sequence_parallel",
    "sequence_batches": "sequence_parallel",
    "RingAttention": "ring_attention",
    "causal_ring_attention": "ring_attention",
    "ring_core": "ring_attention",
    "rng_state": "random_state",
    "set_rng_state": "random_state",
    "RESERVED_KEYS": "checkpoint",
    "sequences_from": "data",
    "SequenceDataset": "data_loader",
    "LoaderBatches": "data_loader",
    "Preempted": "preemption",
    "PreemptionWatch": "preemption",
    "PendingCheckpoint": "checkpoint",
    "seed_generators": "random_state",
    "Finding": "diagnosis",
    "diagnose_wrapping": "diagnosis",
    "diagnose_tied_weights": "diagnosis",
    "diagnose_grad_norm": "diagnosis",
    "diagnose_accumulation": "diagnosis",
    "repeated_block": "diagnosis",
}
"""Each exported name and the module of this package it is defined in."""

__all__ = [
    "InitMode", "torch_dtype", "shard_group", "build_mesh", "build_mp_policy",
    "apply_activation_checkpointing", "apply_fsdp2", "check_runnable", "parallelize", "APPLY",
    "measure_init_bytes", "CheckpointError", "SavedCheckpoint", "LoadedCheckpoint",
    "save_checkpoint", "resolve_checkpoint", "validate_checkpoint", "load_checkpoint",
    "export_full_state_dict", "load_exported", "file_checksum", "check_model_shapes",
    "read_metadata", "checkpoint_files", "checkpoint_items", "count_state_tensors",
    "count_checkpoint", "BatchSource", "data_seed", "make_batch", "local_slice", "local_batch",
    "RankContext", "pick_device", "init_distributed", "shutdown_distributed", "grad_zero_fraction",
    "clip_grad_norm", "full_grad_norm", "is_fsdp1", "ParamBytes", "local_tensor", "nbytes",
    "measure_param_bytes", "measure_grad_bytes", "measure_optimizer_bytes", "measure_fsdp_units",
    "StepMemory", "StepMemoryTracker", "CollectiveCall", "CollectiveCounter", "collective_totals",
    "tensors_in", "measure_cpu_adam", "TransformerLayer", "SimpleTransformer", "model_parts",
    "build_model", "count_parameters", "seeded_parts", "SeededInit", "ForwardFn", "LossFn",
    "next_token_loss", "TrainLog", "StepEnd", "build_optimizer", "build_grad_scaler", "build_lr_scheduler",
    "train_step",
    "train", "train_one_process", "one_thread", "NonFiniteLoss", "check_loss_finite",
    "GatheredProbe", "GatheredSnapshot", "apply_explicit_prefetch",
    "AttentionCore", "causal_attention", "SplitAttention", "ParallelLayer", "ParallelTransformer",
    "from_simple",
    "TPTrainLog", "apply_fsdp_over_dp", "apply_tensor_parallel",
    "build_tp_mesh", "build_tp_model", "dp_batch", "tp_loss", "train_tensor_parallel",
    "AttentionError", "SequenceMesh", "build_sequence_mesh", "build_sequence_model",
    "measure_attention_error", "sequence_batches",
    "RingAttention", "causal_ring_attention", "ring_core",
    "rng_state", "set_rng_state",
    "RESERVED_KEYS",
    "sequences_from",
    "SequenceDataset", "LoaderBatches",
    "Preempted", "PreemptionWatch",
    "PendingCheckpoint",
    "seed_generators",
    "Finding", "diagnose_wrapping", "diagnose_tied_weights", "diagnose_grad_norm", "diagnose_accumulation", "repeated_block",
]

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
