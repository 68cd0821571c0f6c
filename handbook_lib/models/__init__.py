"""Layer 1, the pure models: what a training job costs, predicted from its config alone. No
``torch``; the same inputs give the same bytes on any machine.

Parameter counts and presets, the model's layout (units, shards, activations), model state,
the memory of a step by phase, collectives and a step's traffic, step time on a cluster,
DeepSpeed ZeRO's layout, checkpoints, the seed's rule, hardware presets and the planner.
Chapters 1-4 teach them; every run checks them against a measurement.

Every name below is imported from its module on first use, so importing one module of
this layer (a rank's harness importing its process-group set-up) loads no other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from handbook_lib.core.lazy import lazy_exports

if TYPE_CHECKING:  # what a type checker sees; at run time each name is imported on first use
    from handbook_lib.models.activations import (
        SELECTIVE_SAVE, ActivationBytes, ModelSizes, checkpointed, estimate_activation_bytes,
        estimate_decoder_activation_bytes,
    )
    from handbook_lib.models.allocator import (
        RESERVE_FRACTION, RESERVE_MODEL, RESERVE_SOURCE, reserved_bytes,
    )
    from handbook_lib.models.checkpoint import (
        scale_model_width,
        cost_fraction,
        CHECKPOINT_SCHEMA, CHECKSUM, COMMIT_STEPS, FSDP1_STATE_DICT_TYPES, JOB_INTERRUPTIONS,
        LATEST, MANIFEST, NCCL_DEFAULT_TIMEOUT_S, JOB_STATE, CheckpointCost, CommitStep,
        TensorCount, checkpoint_interval_s, checkpoint_name, estimate_checkpoint_cost,
        estimate_checkpoint_count, job_mtbf_s,
    )
    from handbook_lib.models.collectives import (
        COLLECTIVES, RING_KINDS, TRANSFER_KINDS, AlphaBeta, CollectiveCost, RingTransfer,
        estimate_collective, estimate_collective_time, fit_alpha_beta, ring_schedule,
    )
    from handbook_lib.models.hardware import (
        ACCELERATORS, CUDA_CONTEXT_BYTES, GIB, LINKS, Accelerator, Host, Link, Node,
        datasheet_bytes, default_intra_link, get_accelerator, get_link, node_preset,
        usable_memory_bytes,
    )
    from handbook_lib.models.hf_config import (
        HF_DEFAULTS, HF_FAMILIES, decoder_shape_from_hf, read_hf_config,
    )
    from handbook_lib.models.init_bytes import estimate_init_bytes, model_part_numels
    from handbook_lib.models.layout import (
        ModelLayout, ModelLike, estimate_shard_bytes, model_layout, wrap_units,
    )
    from handbook_lib.models.memory import (
        COMPONENTS, PHASE_WORDS, MemoryEstimate, estimate_memory, estimate_rank_state,
        estimate_state_at_rest, min_gpus_to_fit,
    )
    from handbook_lib.models.model_state import (
        OPTIMIZER_RULES, OPTIMIZER_STATES, ModelStateBytes, OptimizerRule, RankState,
        estimate_accumulation_bytes, estimate_model_state_bytes, optimizer_states,
        optimizer_step_bytes,
    )
    from handbook_lib.models.offload import (
        CPU_ADAM_PARAMS_PER_S_PER_CORE, CPU_ADAM_SOURCE, OffloadCost, estimate_offload,
    )
    from handbook_lib.models.phases import (
        PHASES, Moment, StepShape, backward_start, backward_walk, forward_start, head_backward,
        late_free_bound, layer_backward, layer_forward, layer_recompute, layer_reduce,
        loss_backward, optimizer_step, root_reduce,
    )
    from handbook_lib.models.planner import (
        STEP_TIE, Option, Plan, check_whole_nodes, global_batch_tokens, max_data_parallel, plan,
        preference, recommend,
    )
    from handbook_lib.models.presets import DECODER_SHAPES, DecoderShape, get_shape
    from handbook_lib.models.published import (
        PUBLISHED_BUS_BANDWIDTH, PUBLISHED_MEMORY_CHANGE, PUBLISHED_SOURCES, PUBLISHED_THROUGHPUT,
        BandwidthRow, MemoryChangeRow, PublishedBandwidth, PublishedMemoryChange,
        PublishedThroughput, ThroughputRow, bus_bandwidth_rows, memory_change_rows, throughput_rows,
    )
    from handbook_lib.models.roofline import min_tokens_per_gpu, wire_bytes_per_param
    from handbook_lib.models.seed import (
        SEED_SCENARIOS, SEED_STRATEGIES, SeedScenario, estimate_seed_model_state,
        seed_recommendation,
    )
    from handbook_lib.models.sensitivity import (
        FlipPoints, Sensitivity, flip_points, plan_sensitivity,
    )
    from handbook_lib.models.sharding import (
        ShardBytes, Unit, estimate_flat_shard_bytes, estimate_tensor_shards, policy_units,
        shard_rows,
    )
    from handbook_lib.models.timing import (
        DEFAULT_UTILIZATION, UTILIZATION_SOURCE, StepTime, bytes_by_link, estimate_compute_time,
        estimate_step_time,
    )
    from handbook_lib.models.cluster import ClusterLayout, compare_cluster_layouts, hsdp_groups
    from handbook_lib.models.topology import (
        ALGORITHMS, Route, network_bandwidth, network_share, route_collective,
    )
    from handbook_lib.models.traffic import (
        CollectiveRecord, GatheredState, StepTraffic, estimate_gathered_units,
        estimate_held_between_micro_steps, estimate_step_bytes_for_params, estimate_step_traffic,
    )
    from handbook_lib.models.zero import (
        ALIGNMENT, DEFAULT_PERSISTENCE_THRESHOLD, ZERO_STAGES, bookkeeping_reductions,
        estimate_zero_memory, estimate_zero_rank_bytes, estimate_zero_step_traffic, flat_partition,
        gather_units, zero_stage,
    )
    from handbook_lib.models.tensor_parallel import (
        DecoderTPMemory, TPCollective, TPLayerTraffic, TPParam, TPStateBytes, decoder_tp_units,
        estimate_decoder_tp_activation_bytes, estimate_decoder_tp_memory,
        estimate_tp_activation_bytes, estimate_tp_collectives, estimate_tp_layer_traffic,
        estimate_tp_state_bytes, estimate_tp_step_collectives, tp_local_shapes, tp_param_placements,
        tp_units,
    )
    from handbook_lib.models.sequence_parallel import (
        SP_METHODS, LayerBytes, RingOverlap, SpCollective, SpStepTraffic,
        estimate_sp_activation_bytes, estimate_sp_collectives, estimate_sp_step_traffic,
        local_tokens, megatron_sp_layer_bytes, parallel_layout, ring_layer_bytes, ring_overlap,
        sequence_activation_bytes, ulysses_layer_bytes,
    )
    from handbook_lib.models.axes import (
        AxesVerdict, SpChoice, estimate_axes, estimate_sp_memory, estimate_tp_fsdp_memory,
        sp_candidates,
    )
    from handbook_lib.models.axes_table import (
        AxisOption, axes_reason, compare_axes, recommend_axes,
    )
    from handbook_lib.models.published import (
        PUBLISHED_AXIS_MEMORY, AxisMemoryRow, PublishedAxisMemory, axis_memory_rows,
    )
    from handbook_lib.models.lr_schedule import (
        lr_factor,
    )
    from handbook_lib.models.faults import (
        Fault,
        NODE_FAULTS,
    )
    from handbook_lib.models.clinic_cases import (
        ClinicCase,
        CLINIC_GROUPS,
        FIELD_NOTES,
        CLINIC_CASES,
        get_case,
        cases_in,
        notes_left_out,
        thread_url,
    )
    from handbook_lib.models.init_bytes import (
        CUDA_ALLOCATION_BYTES,
        DDP_BUCKET_CAPS,
        device_storage_bytes,
    )

_HOMES = {
    "SELECTIVE_SAVE": "activations",
    "ModelSizes": "activations",
    "ActivationBytes": "activations",
    "estimate_activation_bytes": "activations",
    "estimate_decoder_activation_bytes": "activations",
    "checkpointed": "activations",
    "RESERVE_FRACTION": "allocator",
    "RESERVE_SOURCE": "allocator",
    "RESERVE_MODEL": "allocator",
    "reserved_bytes": "allocator",
    "CHECKPOINT_SCHEMA": "checkpoint",
    "NCCL_DEFAULT_TIMEOUT_S": "checkpoint",
    "JOB_INTERRUPTIONS": "checkpoint",
    "JOB_STATE": "checkpoint",
    "CheckpointCost": "checkpoint",
    "estimate_checkpoint_cost": "checkpoint",
    "job_mtbf_s": "checkpoint",
    "checkpoint_interval_s": "checkpoint",
    "CHECKSUM": "checkpoint",
    "MANIFEST": "checkpoint",
    "LATEST": "checkpoint",
    "CommitStep": "checkpoint",
    "COMMIT_STEPS": "checkpoint",
    "FSDP1_STATE_DICT_TYPES": "checkpoint",
    "TensorCount": "checkpoint",
    "checkpoint_name": "checkpoint",
    "estimate_checkpoint_count": "checkpoint",
    "COLLECTIVES": "collectives",
    "TRANSFER_KINDS": "collectives",
    "CollectiveCost": "collectives",
    "estimate_collective": "collectives",
    "RING_KINDS": "collectives",
    "RingTransfer": "collectives",
    "ring_schedule": "collectives",
    "estimate_collective_time": "collectives",
    "AlphaBeta": "collectives",
    "fit_alpha_beta": "collectives",
    "Link": "hardware",
    "Host": "hardware",
    "Accelerator": "hardware",
    "Node": "hardware",
    "LINKS": "hardware",
    "ACCELERATORS": "hardware",
    "get_link": "hardware",
    "get_accelerator": "hardware",
    "default_intra_link": "hardware",
    "node_preset": "hardware",
    "usable_memory_bytes": "hardware",
    "datasheet_bytes": "hardware",
    "CUDA_CONTEXT_BYTES": "hardware",
    "GIB": "hardware",
    "HF_FAMILIES": "hf_config",
    "HF_DEFAULTS": "hf_config",
    "decoder_shape_from_hf": "hf_config",
    "read_hf_config": "hf_config",
    "model_part_numels": "init_bytes",
    "estimate_init_bytes": "init_bytes",
    "ModelLayout": "layout",
    "ModelLike": "layout",
    "model_layout": "layout",
    "wrap_units": "layout",
    "estimate_shard_bytes": "layout",
    "COMPONENTS": "memory",
    "PHASE_WORDS": "memory",
    "MemoryEstimate": "memory",
    "estimate_state_at_rest": "memory",
    "estimate_memory": "memory",
    "min_gpus_to_fit": "memory",
    "estimate_rank_state": "memory",
    "OptimizerRule": "model_state",
    "OPTIMIZER_RULES": "model_state",
    "OPTIMIZER_STATES": "model_state",
    "optimizer_states": "model_state",
    "optimizer_step_bytes": "model_state",
    "ModelStateBytes": "model_state",
    "estimate_model_state_bytes": "model_state",
    "estimate_accumulation_bytes": "model_state",
    "RankState": "model_state",
    "OffloadCost": "offload",
    "CPU_ADAM_PARAMS_PER_S_PER_CORE": "offload",
    "CPU_ADAM_SOURCE": "offload",
    "estimate_offload": "offload",
    "StepShape": "phases",
    "Moment": "phases",
    "backward_walk": "phases",
    "forward_start": "phases",
    "layer_forward": "phases",
    "loss_backward": "phases",
    "backward_start": "phases",
    "head_backward": "phases",
    "layer_backward": "phases",
    "layer_reduce": "phases",
    "root_reduce": "phases",
    "layer_recompute": "phases",
    "optimizer_step": "phases",
    "PHASES": "phases",
    "late_free_bound": "phases",
    "Option": "planner",
    "Plan": "planner",
    "plan": "planner",
    "preference": "planner",
    "recommend": "planner",
    "STEP_TIE": "planner",
    "check_whole_nodes": "planner",
    "global_batch_tokens": "planner",
    "max_data_parallel": "planner",
    "min_tokens_per_gpu": "roofline",
    "wire_bytes_per_param": "roofline",
    "DecoderShape": "presets",
    "DECODER_SHAPES": "presets",
    "get_shape": "presets",
    "PublishedBandwidth": "published",
    "PUBLISHED_BUS_BANDWIDTH": "published",
    "BandwidthRow": "published",
    "bus_bandwidth_rows": "published",
    "PublishedThroughput": "published",
    "PUBLISHED_THROUGHPUT": "published",
    "ThroughputRow": "published",
    "throughput_rows": "published",
    "PublishedMemoryChange": "published",
    "PUBLISHED_MEMORY_CHANGE": "published",
    "MemoryChangeRow": "published",
    "memory_change_rows": "published",
    "PUBLISHED_SOURCES": "published",
    "SEED_STRATEGIES": "seed",
    "estimate_seed_model_state": "seed",
    "seed_recommendation": "seed",
    "SeedScenario": "seed",
    "SEED_SCENARIOS": "seed",
    "Sensitivity": "sensitivity",
    "plan_sensitivity": "sensitivity",
    "flip_points": "sensitivity",
    "FlipPoints": "sensitivity",
    "ShardBytes": "sharding",
    "Unit": "sharding",
    "shard_rows": "sharding",
    "estimate_tensor_shards": "sharding",
    "policy_units": "sharding",
    "estimate_flat_shard_bytes": "sharding",
    "StepTime": "timing",
    "bytes_by_link": "timing",
    "estimate_step_time": "timing",
    "estimate_compute_time": "timing",
    "DEFAULT_UTILIZATION": "timing",
    "UTILIZATION_SOURCE": "timing",
    "ALGORITHMS": "topology",
    "Route": "topology",
    "route_collective": "topology",
    "network_bandwidth": "topology",
    "network_share": "topology",
    "ClusterLayout": "cluster",
    "compare_cluster_layouts": "cluster",
    "hsdp_groups": "cluster",
    "CollectiveRecord": "traffic",
    "StepTraffic": "traffic",
    "estimate_step_traffic": "traffic",
    "GatheredState": "traffic",
    "estimate_gathered_units": "traffic",
    "estimate_held_between_micro_steps": "traffic",
    "estimate_step_bytes_for_params": "traffic",
    "ZERO_STAGES": "zero",
    "estimate_zero_memory": "zero",
    "ALIGNMENT": "zero",
    "DEFAULT_PERSISTENCE_THRESHOLD": "zero",
    "zero_stage": "zero",
    "flat_partition": "zero",
    "gather_units": "zero",
    "estimate_zero_rank_bytes": "zero",
    "bookkeeping_reductions": "zero",
    "estimate_zero_step_traffic": "zero",
    "DecoderTPMemory": "tensor_parallel",
    "TPCollective": "tensor_parallel",
    "TPLayerTraffic": "tensor_parallel",
    "TPParam": "tensor_parallel",
    "TPStateBytes": "tensor_parallel",
    "decoder_tp_units": "tensor_parallel",
    "estimate_decoder_tp_activation_bytes": "tensor_parallel",
    "estimate_decoder_tp_memory": "tensor_parallel",
    "estimate_tp_activation_bytes": "tensor_parallel",
    "estimate_tp_collectives": "tensor_parallel",
    "estimate_tp_layer_traffic": "tensor_parallel",
    "estimate_tp_state_bytes": "tensor_parallel",
    "estimate_tp_step_collectives": "tensor_parallel",
    "tp_local_shapes": "tensor_parallel",
    "tp_param_placements": "tensor_parallel",
    "tp_units": "tensor_parallel",
    "SP_METHODS": "sequence_parallel",
    "LayerBytes": "sequence_parallel",
    "RingOverlap": "sequence_parallel",
    "SpCollective": "sequence_parallel",
    "SpStepTraffic": "sequence_parallel",
    "estimate_sp_activation_bytes": "sequence_parallel",
    "estimate_sp_collectives": "sequence_parallel",
    "estimate_sp_step_traffic": "sequence_parallel",
    "local_tokens": "sequence_parallel",
    "megatron_sp_layer_bytes": "sequence_parallel",
    "parallel_layout": "sequence_parallel",
    "ring_layer_bytes": "sequence_parallel",
    "ring_overlap": "sequence_parallel",
    "sequence_activation_bytes": "sequence_parallel",
    "ulysses_layer_bytes": "sequence_parallel",
    "AxesVerdict": "axes",
    "SpChoice": "axes",
    "estimate_axes": "axes",
    "estimate_sp_memory": "axes",
    "estimate_tp_fsdp_memory": "axes",
    "sp_candidates": "axes",
    "AxisOption": "axes_table",
    "axes_reason": "axes_table",
    "compare_axes": "axes_table",
    "recommend_axes": "axes_table",
    "PUBLISHED_AXIS_MEMORY": "published",
    "AxisMemoryRow": "published",
    "PublishedAxisMemory": "published",
    "axis_memory_rows": "published",
    "lr_factor": "lr_schedule",
    "Fault": "faults",
    "NODE_FAULTS": "faults",
    "scale_model_width": "checkpoint",
    "cost_fraction": "checkpoint",
    "ClinicCase": "clinic_cases",
    "CLINIC_GROUPS": "clinic_cases",
    "FIELD_NOTES": "clinic_cases",
    "CLINIC_CASES": "clinic_cases",
    "get_case": "clinic_cases",
    "cases_in": "clinic_cases",
    "notes_left_out": "clinic_cases",
    "thread_url": "clinic_cases",
    "CUDA_ALLOCATION_BYTES": "init_bytes",
    "DDP_BUCKET_CAPS": "init_bytes",
    "device_storage_bytes": "init_bytes",
}
"""Each exported name and the module of this package it is defined in."""

__all__ = [
    "SELECTIVE_SAVE", "ModelSizes", "ActivationBytes", "estimate_activation_bytes",
    "estimate_decoder_activation_bytes", "checkpointed", "RESERVE_FRACTION", "RESERVE_SOURCE",
    "RESERVE_MODEL", "reserved_bytes", "CHECKPOINT_SCHEMA", "CHECKSUM", "MANIFEST", "LATEST",
    "CommitStep", "COMMIT_STEPS", "FSDP1_STATE_DICT_TYPES", "TensorCount", "checkpoint_name",
    "estimate_checkpoint_count", "COLLECTIVES", "TRANSFER_KINDS", "CollectiveCost", "estimate_collective",
    "RING_KINDS", "RingTransfer", "ring_schedule", "estimate_collective_time", "AlphaBeta",
    "fit_alpha_beta", "Link", "Host", "Accelerator", "Node", "LINKS", "ACCELERATORS", "get_link",
    "get_accelerator", "default_intra_link", "node_preset", "usable_memory_bytes",
    "datasheet_bytes", "CUDA_CONTEXT_BYTES", "GIB", "HF_FAMILIES", "HF_DEFAULTS",
    "decoder_shape_from_hf", "read_hf_config", "model_part_numels", "estimate_init_bytes",
    "ModelLayout", "ModelLike", "model_layout", "wrap_units", "estimate_shard_bytes", "COMPONENTS",
    "PHASE_WORDS", "MemoryEstimate", "estimate_state_at_rest", "estimate_memory", "min_gpus_to_fit",
    "estimate_rank_state", "OptimizerRule", "OPTIMIZER_RULES", "OPTIMIZER_STATES",
    "optimizer_states", "optimizer_step_bytes", "ModelStateBytes", "estimate_model_state_bytes",
    "estimate_accumulation_bytes", "RankState", "OffloadCost", "CPU_ADAM_PARAMS_PER_S_PER_CORE",
    "CPU_ADAM_SOURCE", "estimate_offload", "StepShape", "Moment", "backward_walk", "forward_start",
    "layer_forward", "loss_backward", "backward_start", "head_backward", "layer_backward",
    "layer_reduce", "root_reduce", "layer_recompute", "optimizer_step", "PHASES", "late_free_bound",
    "Option", "Plan", "plan", "preference", "recommend", "STEP_TIE", "check_whole_nodes",
    "DecoderShape", "DECODER_SHAPES", "get_shape", "PublishedBandwidth", "PUBLISHED_BUS_BANDWIDTH",
    "BandwidthRow", "bus_bandwidth_rows", "PublishedThroughput", "PUBLISHED_THROUGHPUT",
    "ThroughputRow", "throughput_rows", "PublishedMemoryChange", "PUBLISHED_MEMORY_CHANGE",
    "MemoryChangeRow", "memory_change_rows", "PUBLISHED_SOURCES", "SEED_STRATEGIES",
    "estimate_seed_model_state", "seed_recommendation", "SeedScenario", "SEED_SCENARIOS",
    "Sensitivity", "plan_sensitivity", "flip_points", "FlipPoints", "ShardBytes", "Unit",
    "shard_rows", "estimate_tensor_shards", "policy_units", "estimate_flat_shard_bytes", "StepTime",
    "bytes_by_link", "estimate_step_time", "estimate_compute_time", "DEFAULT_UTILIZATION",
    "UTILIZATION_SOURCE", "ALGORITHMS", "Route", "route_collective", "network_bandwidth",
    "CollectiveRecord", "StepTraffic", "estimate_step_traffic", "estimate_step_bytes_for_params",
    "ZERO_STAGES", "estimate_zero_memory", "ALIGNMENT", "DEFAULT_PERSISTENCE_THRESHOLD",
    "zero_stage", "flat_partition", "gather_units", "estimate_zero_rank_bytes",
    "bookkeeping_reductions", "estimate_zero_step_traffic",
    "GatheredState", "estimate_gathered_units", "estimate_held_between_micro_steps", "global_batch_tokens", "max_data_parallel", "min_tokens_per_gpu", "network_share", "ClusterLayout", "compare_cluster_layouts", "hsdp_groups", "wire_bytes_per_param",
    "NCCL_DEFAULT_TIMEOUT_S", "JOB_INTERRUPTIONS", "JOB_STATE", "CheckpointCost", "estimate_checkpoint_cost", "job_mtbf_s", "checkpoint_interval_s",
    "DecoderTPMemory", "TPCollective", "TPLayerTraffic", "TPParam", "TPStateBytes",
    "decoder_tp_units", "estimate_decoder_tp_activation_bytes", "estimate_decoder_tp_memory",
    "estimate_tp_activation_bytes", "estimate_tp_collectives", "estimate_tp_layer_traffic",
    "estimate_tp_state_bytes", "estimate_tp_step_collectives", "tp_local_shapes",
    "tp_param_placements", "tp_units",
    "SP_METHODS", "LayerBytes", "RingOverlap", "SpCollective", "SpStepTraffic",
    "estimate_sp_activation_bytes", "estimate_sp_collectives", "estimate_sp_step_traffic",
    "local_tokens", "megatron_sp_layer_bytes", "parallel_layout", "ring_layer_bytes",
    "ring_overlap", "sequence_activation_bytes", "ulysses_layer_bytes",
    "AxesVerdict", "SpChoice", "estimate_axes", "estimate_sp_memory", "estimate_tp_fsdp_memory",
    "sp_candidates",
    "AxisOption", "axes_reason", "compare_axes", "recommend_axes",
    "PUBLISHED_AXIS_MEMORY", "AxisMemoryRow", "PublishedAxisMemory", "axis_memory_rows",
    "lr_factor",
    "Fault", "NODE_FAULTS",
    "scale_model_width", "cost_fraction",
    "ClinicCase", "CLINIC_GROUPS", "FIELD_NOTES", "CLINIC_CASES", "get_case", "cases_in", "notes_left_out", "thread_url",
    "CUDA_ALLOCATION_BYTES", "DDP_BUCKET_CAPS", "device_storage_bytes",
]

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
