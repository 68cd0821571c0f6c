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
        SELECTIVE_SAVE, ActivationBytes, GatedDecoderTensors, ModelSizes, checkpointed, estimate_activation_bytes,
        estimate_decoder_activation_bytes, gated_decoder_tensors,
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
    from handbook_lib.models.budget import MemoryBudget, layout_budget, memory_budget
    from handbook_lib.models.nccl_buffers import (
        NCCL_CHANNELS, NCCL_MEASURED, Communicator, CommunicatorBytes, NcclBuffers, NcclChannels, channel_bytes,
        layout_communicators, nccl_buffer_bytes, nvls_bytes, strategy_nccl,
    )
    from handbook_lib.models.hardware import (
        ACCELERATORS, CUDA_CONTEXT_BYTES, GIB, TRAINING_CONTEXT_BYTES, LINKS, Accelerator, Host, Link, Node,
        datasheet_bytes, default_intra_link, get_accelerator, get_link, node_preset,
        usable_memory_bytes, NVLINK_RING_STEP_S,
    )
    from handbook_lib.models.hf_config import (
        HF_BOUNDS, HF_DEFAULTS, HF_FAMILIES, MAX_CONFIG_BYTES, decoder_shape_from_hf, read_hf_config,
        read_hf_config_keys, unused_hf_keys,
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
        estimate_offload_gather_bytes,
        ADAM_BYTES_PER_PARAM, CPU_ADAM_PARAMS_PER_S_PER_CORE, CPU_ADAM_SOURCE, OffloadCost, estimate_offload,
    )
    from handbook_lib.models.phases import (
        PHASES, Moment, StepShape, backward_start, backward_walk, forward_end, forward_start, head_backward,
        late_free_bound, layer_backward, layer_forward, layer_recompute, layer_reduce,
        loss_backward, optimizer_step, root_reduce,
    )
    from handbook_lib.models.planner import (
        STEP_TIE, Option, Plan, check_whole_nodes, plan, preference, recommend, shard_groups,
    )
    from handbook_lib.models.recompute import (
        FULL, CheckpointPolicy, check_policy_flags, product_weights, recompute_flops,
    )
    from handbook_lib.models.batch import global_batch_tokens, max_data_parallel
    from handbook_lib.models.presets import DECODER_SHAPES, DecoderShape, describe_shape, get_shape
    from handbook_lib.models.published import (
        PUBLISHED_BUS_BANDWIDTH, PUBLISHED_SOURCES, PUBLISHED_THROUGHPUT, BandwidthRow, PublishedBandwidth,
        PublishedThroughput, ThroughputRow, bus_bandwidth_rows, published_model, throughput_rows,
    )
    from handbook_lib.models.published_memory import (
        PUBLISHED_MEMORY_CHANGE, PUBLISHED_PEAKS, PUBLISHED_ZERO_STATE, TORCHTITAN_OP_POLICY, MemoryChangeRow,
        PeakRow, PublishedMemoryChange, PublishedPeak, PublishedZeroState, memory_change_rows, peak_rows,
        published_peak_rows, zero_state_rows,
    )
    from handbook_lib.models.roofline import (
        min_tokens_by_phase, min_tokens_per_gpu, phase_wire_bytes, wire_bytes_per_param,
    )
    from handbook_lib.models.seed import (
        SEED_SCENARIOS, SEED_STRATEGIES, SeedScenario, estimate_seed_model_state,
        seed_recommendation,
    )
    from handbook_lib.models.sensitivity import (
        FlipPoints, Sensitivity, flip_points, plan_sensitivity,
    )
    from handbook_lib.models.sharding import (
        ShardBytes, Unit, estimate_flat_shard_bytes, estimate_tensor_shards, policy_units,
        post_forward_shard_bytes, shard_rows,
    )
    from handbook_lib.models.pipeline import (
        Action, StageSpan, bubble_fraction, estimate_pipeline_fsdp_calls, estimate_pipeline_p2p,
        estimate_pipeline_state_bytes, idle_fraction, in_flight, most_in_flight, rank_stages,
        schedule_actions, simulate_schedule, stage_layers, stage_param_shapes,
    )
    from handbook_lib.models.stage_memory import pipeline_memory
    from handbook_lib.models.axes_run import (
        AxesCall, axes_micro_batch, axes_units, estimate_axes_activation_bytes, estimate_axes_collectives,
        estimate_axes_state_bytes, per_step_calls, tp_step_calls,
    )
    from handbook_lib.models.timing import (
        ATTENTION_FLOPS_SOURCE, DEFAULT_UTILIZATION, UTILIZATION_SOURCE, PhaseTime, StepFlops, StepTime,
        UTILIZATION_HALF_WIDTH, UTILIZATION_MAX, bytes_by_link, compute_forward_share, estimate_compute_time,
        estimate_step_flops,
        estimate_step_time, expected_utilization, fit_utilization, fit_utilizations, width_utilization,
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
        estimate_zero_memory, estimate_zero_rank_bytes, estimate_zero_redundancy_rank_bytes,
        estimate_zero_step_traffic, flat_partition, gather_units, zero3_gathers, zero3_replay,
        zero_redundancy_partition,
        zero_stage,
    )
    from handbook_lib.models.zero_peak import (
        BOOK_RUNS, DEEPSPEED_DEFAULTS, ZeroKnobs, ZeroPeak, estimate_zero_peak, zero_plan_traffic, zero_step_bytes,
    )
    from handbook_lib.models.tensor_parallel import (
        DecoderTPMemory, TPCollective, TPLayerTraffic, TPParam, TPStateBytes, decoder_tp_units,
        estimate_decoder_tp_activation_bytes, estimate_decoder_tp_memory,
        estimate_tp_activation_bytes, estimate_tp_collectives, estimate_tp_layer_traffic,
        estimate_tp_state_bytes, estimate_tp_step_collectives, tp_local_shapes, tp_padded, tp_param_placements,
        tp_units, state_from_shapes,
    )
    from handbook_lib.models.sequence_parallel import (
        SP_METHODS, LayerBytes, RingOverlap, SpCollective, SpStepTraffic,
        estimate_sp_activation_bytes, estimate_sp_collectives, estimate_sp_step_traffic,
        local_tokens, megatron_sp_layer_bytes, parallel_layout, ring_layer_bytes, ring_overlap,
        sequence_activation_bytes, ulysses_layer_bytes,
    )
    from handbook_lib.models.axes import (
        AxesVerdict, SpChoice, estimate_axes, estimate_job_memory, estimate_sp_memory, estimate_tp_fsdp_memory,
        sp_candidates,
    )
    from handbook_lib.models.axes_table import (
        AxisOption, axes_reason, compare_axes, pipeline_microbatches, price_layout, recommend_axes,
    )
    from handbook_lib.models.plan_output import PLAN_NAMES, PlanReport, plan_page, plan_report
    from handbook_lib.models.plan_search import SEARCH_POLICIES, Candidate, PlanSearch, search_plan
    from handbook_lib.models.published_async_tp import (
        ASYNC_TP_BENCHMARK, PUBLISHED_ASYNC_TP, AsyncTPRow, PublishedAsyncTP, async_tp_rows,
    )
    from handbook_lib.models.published_pipeline import (
        PUBLISHED_PIPELINES, PipelineRow, PublishedPipeline, pipeline_rows,
    )
    from handbook_lib.models.published_memory import (
        PUBLISHED_AXIS_MEMORY, AxisMemoryRow, PublishedAxisMemory, axis_memory_rows,
    )
    from handbook_lib.models.published import utilization_points
    from handbook_lib.models.bands import StepTimeBand, step_time_band
    from handbook_lib.models.foundry_runs import FOUNDRY_RUNS, FOUNDRY_SOURCE, MPT_SHAPES
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


__getattr__, __dir__, __all__ = lazy_exports(__name__)
