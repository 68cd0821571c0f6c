"""handbook_lib.models.pipeline: stages, what a pipeline rank holds and sends, and the bubble,
against counts made by hand."""

import pytest

from handbook_lib.models.pipeline import (
    bubble_fraction,
    estimate_pipeline_fsdp_calls,
    estimate_pipeline_p2p,
    estimate_pipeline_tp_calls,
    estimate_pipeline_state_bytes,
    rank_stages,
    stage_layers,
)
from handbook_lib.runs.specs.pipeline import PipelineConfig, validate

SHAPE = {"vocab_size": 50, "d_model": 32, "nhead": 4, "dim_feedforward": 64, "num_layers": 4,
         "batch_size": 8, "seq_len": 8, "steps": 3}
LAYER = 4 * (32 * 32 + 32) + (64 * 32 + 64) + (32 * 64 + 32) + 4 * 32   # Q, K, V, out; FFN; 2 norms
EMBEDDING, HEAD = 50 * 32, 32 * 50 + 50


def test_stages_hold_whole_layers_the_first_ones_one_more():
    assert [(s.first_layer, s.last_layer) for s in stage_layers(5, 2)] == [(0, 3), (3, 5)]
    spans = stage_layers(4, 4)
    assert [s.layers for s in spans] == [1, 1, 1, 1] and spans[0].embedding and spans[-1].head
    with pytest.raises(ValueError, match="5 stages must be at most num_layers=4"):
        stage_layers(4, 5)


def test_an_interleaved_rank_holds_every_pp_th_stage():
    config = PipelineConfig(**SHAPE, pp_size=2, schedule="Interleaved1F1B", pp_stages_per_rank=2)
    assert [s.index for s in rank_stages(config, 0)] == [0, 2]
    assert [s.index for s in rank_stages(config, 1)] == [1, 3]


def test_the_first_and_last_ranks_hold_the_embedding_and_the_head():
    config = PipelineConfig(**SHAPE, pp_size=2)
    first, last = (estimate_pipeline_state_bytes(config, 2, r) for r in (0, 1))
    assert first.param_shard_bytes == 4 * (EMBEDDING + 2 * LAYER)
    assert last.param_shard_bytes == 4 * (2 * LAYER + HEAD)
    assert first.optimizer_state_bytes == 2 * first.param_shard_bytes   # AdamW's two moments


def test_each_micro_batch_crosses_each_boundary_twice():
    # 8 sequences over 4 micro-batches: 2 x 8 tokens x 32 wide x 4 B = 2,048 B each way
    config = PipelineConfig(**SHAPE, pp_size=4)
    ends, middle = estimate_pipeline_p2p(config, 4, 0), estimate_pipeline_p2p(config, 4, 1)
    assert sorted(c.kind for c in ends) == ["recv"] * 4 + ["send"] * 4
    assert sorted(c.kind for c in middle) == ["recv"] * 8 + ["send"] * 8
    assert {(c.buffer_bytes, c.group_size) for c in ends + middle} == {(2048, 4)}


def test_fsdp_gathers_each_unit_once_per_micro_batch_and_once_for_the_backwards():
    config = PipelineConfig(**SHAPE, pp_size=2)
    calls = estimate_pipeline_fsdp_calls(config, 4, 0)   # 2 layers and the embedding, over 2 ranks
    # each layer: 4 micro-batches' forwards and once for the backwards; the stage's root (the
    # embedding) once, kept gathered
    assert sum(c.kind == "all_gather" for c in calls) == 2 * (4 + 1) + 1
    assert sum(c.kind == "reduce_scatter" for c in calls) == 3
    once = estimate_pipeline_fsdp_calls(PipelineConfig(**SHAPE, pp_size=2, strategy="SHARD_GRAD_OP"), 4, 0)
    assert sum(c.kind == "all_gather" for c in once) == 3
    assert estimate_pipeline_fsdp_calls(config, 2, 0) == []   # one rank per stage: no FSDP traffic


def test_each_stage_issues_the_tensor_parallel_collectives_of_what_it_holds():
    # pp 2 x tp 2, 4 micro-batches of 2 x 8 tokens: stage 0 holds the embedding and 2 layers,
    # 1 + 2 x 2 all-reduces forward and 2 x 2 backward per micro-batch; the last stage, 2 layers
    # and the head: 2 x 2 forward, 2 x 2 + 1 backward; each T·d·4 = 2,048 B over 2 ranks
    config = PipelineConfig(**SHAPE, pp_size=2, tp_size=2)
    for rank in (0, 1):
        calls = estimate_pipeline_tp_calls(config, 4, rank)
        assert len(calls) == 4 * 9 and {(c.kind, c.buffer_bytes, c.group_size) for c in calls} == {
            ("all_reduce", 2048, 2)}
    # with the tensor rank's share of each parameter: Q's rows halved, the vocabulary padded
    state = estimate_pipeline_state_bytes(PipelineConfig(**{**SHAPE, "vocab_size": 51}, pp_size=2, tp_size=2), 4, 0)
    # Q, K, V: 16 of 32 rows and biases; out_proj: 16 of 32 columns, its bias whole; linear1:
    # 32 of 64 rows and biases; linear2: 32 of 64 columns, its bias whole; the norms whole
    layer = 3 * (16 * 32 + 16) + (32 * 16 + 32) + (32 * 32 + 32) + (32 * 32 + 32) + 4 * 32
    assert state.param_shard_bytes == 4 * (26 * 32 + 2 * layer) == 38_272   # 52 rows / 2: 26
    assert estimate_pipeline_tp_calls(PipelineConfig(**SHAPE, pp_size=2), 2, 0) == []


def test_the_bubble_shrinks_with_micro_batches_and_interleaving():
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(4, 32) == pytest.approx(3 / 35)
    assert bubble_fraction(4, 4, 2) == pytest.approx(3 / 11)
    assert bubble_fraction(1, 8) == 0


@pytest.mark.parametrize("changes, world, match", [
    ({"pp_size": 8}, 8, "config key 'pp_size'=8 x 'pp_stages_per_rank'=1: 8 stages must be at most 'num_layers'=4"),
    ({"pp_size": 4, "pp_microbatches": 2}, 4, "config key 'pp_microbatches'=2: 1F1B needs at least one per"),
    ({"pp_size": 2, "batch_size": 6}, 4, "batch_size=6 must be divisible by the 2 data-parallel .* times "
                                         "pp_microbatches=4"),
    ({"pp_size": 2, "schedule": "Interleaved1F1B"}, 2, "'pp_stages_per_rank'=1 with schedule='Interleaved1F1B'"),
    ({"pp_size": 2, "schedule": "Interleaved1F1B", "pp_stages_per_rank": 2, "pp_microbatches": 3}, 2,
     "Interleaved1F1B runs them in rounds of pp_size=2"),
    ({"schedule": "ZeroBubble"}, 2, "config key 'schedule' got 'ZeroBubble'; accepted values: GPipe, 1F1B, "
                                    "Interleaved1F1B"),
    ({"pp_size": 2, "grad_accum_steps": 2}, 2, "the schedule's micro-batches are the accumulation"),
    ({"pp_size": 2, "sp_size": 2, "sp_method": "ring"}, 4, "'sp_size'=2 with pipeline: the pipeline is not composed"),
    ({"pp_size": 2, "max_grad_norm": 1.0}, 2, "'max_grad_norm'=1.0 with pipeline: clipping needs"),
    ({"pp_size": 2, "strategy": "HYBRID_SHARD", "shard_group_size": 1}, 4, "'strategy'='HYBRID_SHARD' with pipeline"),
    ({}, 1, "'pp_size'=1 cuts no pipeline"),
])
def test_bad_pipelines_are_refused_in_one_line_before_launch(changes, world, match):
    with pytest.raises(ValueError, match=match) as err:
        validate(PipelineConfig.from_mapping({**SHAPE, **changes}), world)
    assert "\n" not in str(err.value)


# --- a decoder's pipeline at scale: the planner's pricing -----------------------------------------

def test_in_flight_gpipe_holds_every_micro_batch_1f1b_at_most_p_minus_the_stage():
    from handbook_lib.models.pipeline import in_flight

    assert [in_flight("GPipe", 4, 8, i) for i in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1F1B", 4, 8, i) for i in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1F1B", 4, 2, i) for i in range(4)] == [2, 2, 2, 1]  # fewer micro-batches than stages
    with pytest.raises(ValueError, match="pp_schedule must be GPipe or 1F1B"):
        in_flight("Interleaved1F1B", 4, 8, 0)


def _first_stage(schedule, activation_checkpointing="none", microbatches=8):
    from handbook_lib.core.parallel_layout import ParallelLayout
    from handbook_lib.models.axes import estimate_job_memory
    from handbook_lib.models.presets import get_shape

    layout = ParallelLayout.for_world(16, pp=4)  # 4 stages of 8 layers, FSDP over 4 ranks each
    return estimate_job_memory(get_shape("llama2-7b"), layout, micro_batch=1, seq_len=4096,
                               activation_checkpointing=activation_checkpointing, pp_microbatches=microbatches,
                               pp_schedule=schedule)


def test_gpipe_holds_m_micro_batches_where_1f1b_holds_p_per_layer():
    """GPipe's first stage keeps 8 micro-batches' activations, 1F1B's 4: the difference is 4 micro-
    batches of its 8 layers, each saving per token (bf16) two RMSNorms of 8·h + 4, Q, K, V and
    the output of 2·h each, 32 heads' fp32 log-sum-exp and the SwiGLU's four 2·f (no
    checkpointing), or its 2·h input (full)."""
    s, h, f = 4096, 4096, 11_008
    for mode, per_layer in (("none", s * (2 * (8 * h + 4) + 8 * h + 4 * 32 + 8 * f)), ("full", s * 2 * h)):
        gpipe, one_f_one_b = _first_stage("GPipe", mode), _first_stage("1F1B", mode)
        assert gpipe.peak - one_f_one_b.peak == 4 * 8 * per_layer
        assert gpipe.components["activations"] - one_f_one_b.components["activations"] == 4 * 8 * per_layer


def test_a_stage_holds_its_layers_and_one_vocabulary_matrix_sharded_over_its_ranks():
    """The first stage of Llama-2 7B cut in 4: 8 layers, the embedding and a final norm, fp32,
    over the 4 data-parallel ranks of the stage (no padding: every count divides by 4)."""
    from handbook_lib.models.presets import get_shape

    shape = get_shape("llama2-7b")
    elements = 8 * shape.layer_params + 32_000 * 4096 + 4096
    assert elements % 4 == 0
    first = _first_stage("1F1B")
    assert first.components["params"] == 4 * elements // 4
    # its units stay gathered (bf16) with their gradients unsharded (fp32) through the micro-batches
    assert first.components["unsharded_params"] + first.components["grad_buffers"] >= 6 * elements
    assert any("pipeline stage 0 of 4 (8 layers, 1F1B, 8 micro-batches): 4 in flight" in n for n in first.notes)


def test_a_pipeline_is_priced_for_a_decoder_without_offload_or_accumulation():
    from handbook_lib.core.architecture import ModelConfig
    from handbook_lib.core.parallel_layout import ParallelLayout
    from handbook_lib.models.axes import estimate_job_memory

    layout = ParallelLayout.for_world(4, pp=2)
    with pytest.raises(ValueError, match="a pipeline is priced for a decoder's shape"):
        estimate_job_memory(ModelConfig(), layout, micro_batch=1, seq_len=64)
    with pytest.raises(ValueError, match=r"a pipeline \(pp 2\) is priced without offload or accumulation"):
        estimate_job_memory("llama2-7b", layout, micro_batch=1, seq_len=64, grad_accum_steps=2)


# --- a schedule's order, what it keeps in flight, and its bubble on a grid of unit times ----------

def test_1f1b_warms_up_with_p_minus_s_forwards_then_alternates():
    from handbook_lib.models.pipeline import schedule_actions

    assert schedule_actions("1F1B", 4, 6, 0) == [
        ("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("F", 0, 3), ("B", 0, 0), ("F", 0, 4), ("B", 0, 1), ("F", 0, 5),
        ("B", 0, 2), ("B", 0, 3), ("B", 0, 4), ("B", 0, 5)]
    assert schedule_actions("1F1B", 4, 3, 3) == [("F", 3, 0), ("B", 3, 0), ("F", 3, 1), ("B", 3, 1), ("F", 3, 2),
                                                ("B", 3, 2)]
    assert schedule_actions("GPipe", 2, 2, 1) == [("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("B", 1, 1)]
    with pytest.raises(ValueError, match="GPipe and 1F1B"):
        schedule_actions("Interleaved1F1B", 2, 4, 0)


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("pp, m", [(2, 2), (2, 5), (4, 4), (4, 8), (3, 7)])
def test_the_grid_bubble_of_every_rank_is_p_minus_1_over_m_plus_p_minus_1(schedule, pp, m):
    """Forward 1, backward 2, sends free: every rank idles (p − 1)/(m + p − 1) of the step, and
    the step lasts (m + p − 1)·3 units; GPipe's stages hold all m micro-batches, 1F1B's p − s."""
    from handbook_lib.models.pipeline import idle_fraction, most_in_flight, schedule_actions, simulate_schedule

    orders = {s: schedule_actions(schedule, pp, m, s) for s in range(pp)}
    grid = simulate_schedule(orders, pp)
    span = max(end for line in grid.values() for _, _, end in line)
    assert span == 3 * (m + pp - 1)
    for s in range(pp):
        assert idle_fraction(grid[s], span) == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
        assert most_in_flight(orders[s]) == {s: m if schedule == "GPipe" else min(m, pp - s)}


def test_orders_that_wait_on_each_other_are_refused():
    from handbook_lib.models.pipeline import simulate_schedule

    orders = {0: [("B", 0, 0), ("F", 0, 0)], 1: [("F", 1, 0), ("B", 1, 0)]}  # stage 0's backward first
    with pytest.raises(ValueError, match="deadlock"):
        simulate_schedule(orders, 2)


def test_the_v_places_stages_r_and_2p_minus_1_minus_r():
    from handbook_lib.models.pipeline import stage_rank

    assert [stage_rank("ZBVZeroBubble", 4, s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [stage_rank("Interleaved1F1B", 4, s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    config = PipelineConfig(**{**SHAPE, "num_layers": 4}, pp_size=2, schedule="ZBVZeroBubble", pp_stages_per_rank=2)
    assert [s.index for s in rank_stages(config, 1)] == [1, 2]
    # stages 1 and 2 share rank 1: only stage 1's receive from 0 and stage 2's send to 3 cross ranks
    calls = estimate_pipeline_p2p(config, 2, 1)
    assert sorted({c.site for c in calls}) == ["stage 1", "stage 2"] and len(calls) == 2 * 2 * config.pp_microbatches


def test_a_split_backward_frees_its_micro_batch_with_the_weights_half():
    from handbook_lib.models.pipeline import most_in_flight, simulate_schedule

    order = [("F", 0, 0), ("F", 0, 1), ("I", 0, 0), ("W", 0, 0), ("I", 0, 1), ("W", 0, 1)]
    assert most_in_flight(order) == {0: 2}
    grid = simulate_schedule({0: order}, 1)[0]
    # one stage: F 1 unit each, I after its own F, W after its I, 1 unit each
    assert [(a[0], start, end) for a, start, end in grid] == [("F", 0, 1), ("F", 1, 2), ("I", 2, 3), ("W", 3, 4),
                                                               ("I", 4, 5), ("W", 5, 6)]


ZBV = {**SHAPE, "num_layers": 8, "schedule": "ZBVZeroBubble", "pp_stages_per_rank": 2}


@pytest.mark.parametrize("change, words", [
    ({"pp_size": 2}, "leaves 2 data-parallel ranks"),
    ({"precision": "bf16-mixed"}, "accepted: fp32"),
    ({"tp_size": 2}, "not modelled here"),
])
def test_the_zero_bubble_v_refuses_what_its_unsharded_stages_cannot_run(change, words):
    with pytest.raises(ValueError, match=words):
        validate(PipelineConfig.from_mapping({**ZBV, **change}), 4)
    validate(PipelineConfig.from_mapping(ZBV), 4)  # every rank a stage pair, fp32: runs


def test_the_zero_bubble_v_takes_two_stages_a_rank():
    with pytest.raises(ValueError, match="ZBVZeroBubble 2"):
        PipelineConfig.from_mapping({**ZBV, "pp_size": 2, "pp_stages_per_rank": 3})


def test_interleaved_in_flight_counts_warm_up_chunks_as_torch_schedules_them():
    """(v − 1)·m_r + 2(p − 1 − r) + 1 chunks, at most v·m. On 4 ranks of 2 stages with 8
    micro-batches (2 rounds of 4) a real run's orders held 11, 9, 7, 5 (this book's pipeline
    run, torch 2.13's ScheduleInterleaved1F1B); with 4 micro-batches rank 0 is capped at 8."""
    from handbook_lib.models.pipeline import interleaved_in_flight

    assert [interleaved_in_flight(4, 8, r, 2) for r in range(4)] == [11, 9, 7, 5]
    assert interleaved_in_flight(4, 4, 0, 2) == 8 and interleaved_in_flight(4, 4, 3, 2) == 5
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\)"):
        interleaved_in_flight(4, 8, 4, 2)
    with pytest.raises(ValueError, match="stages_per_rank"):
        interleaved_in_flight(4, 8, 0, 0)
