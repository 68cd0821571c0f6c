"""handbook_lib.models.stage_memory: the receive buffers and a stage's activations by hand, and
the planner's stage with its buffers (the runs' checks of both are in test_runs_pipeline)."""

import pytest

from tests.test_pipeline import _first_stage


def test_receive_buffers_are_one_per_micro_batch_each_way_and_the_input_gradients_under_a_split_backward():
    from handbook_lib.models.stage_memory import recv_buffers

    # 4 stages, one a rank, 8 micro-batches of 100 B
    first = recv_buffers([0], 4, 8, 100)
    assert (first.activations, first.activation_grads, first.grads) == (0, 0, 800)
    middle = recv_buffers([1], 4, 8, 100)
    assert (middle.activations, middle.grads, middle.total) == (800, 800, 1600)
    assert recv_buffers([3], 4, 8, 100).total == 800
    # interleaved on 2 ranks: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    assert recv_buffers([0, 2], 4, 8, 100).total == 800 + 800 + 800
    # the V: rank 1 holds 1 and 2; stage 2 is fed in memory, so only stage 1 keeps its inputs' gradients
    v = recv_buffers([1, 2], 4, 8, 100, split_backward=True)
    assert (v.activations, v.activation_grads, v.grads) == (1600, 800, 1600)
    with pytest.raises(ValueError, match="microbatches"):
        recv_buffers([0], 4, 0, 100)


def test_a_stage_activations_are_priced_where_the_model_is_exact_and_refused_elsewhere():
    from handbook_lib.models.pipeline import rank_stages
    from handbook_lib.models.stage_memory import stage_activation_bytes
    from handbook_lib.runs.specs.pipeline import PipelineConfig

    cfg = PipelineConfig().replace(vocab_size=50, d_model=32, nhead=4, dim_feedforward=64, num_layers=4,
                                   batch_size=8, seq_len=8, pp_size=2, schedule="1F1B")
    # 2 stages of 2 layers, T = 2 x 8 = 16 tokens a micro-batch, fp32: by hand as in the run's test
    layer, boundary = 25_088, 2_048
    first, last = (stage_activation_bytes(cfg, 2, rank_stages(cfg, r)[0]) for r in (0, 1))
    assert first == 2 * layer + boundary
    assert last == 2 * layer - boundary + boundary + 16 * 50 * 4
    assert stage_activation_bytes(cfg.replace(pp_size=2), 4, rank_stages(cfg, 0)[0]) is None  # FSDP pairs
    assert stage_activation_bytes(cfg.replace(precision="bf16-mixed"), 2, rank_stages(cfg, 0)[0]) is None


def test_the_planner_prices_a_receive_buffer_per_micro_batch_beside_the_activations():
    """1F1B's first stage of 4 holds 4 micro-batches' activations at 4 or 8 micro-batches alike;
    what grows is torch's buffers for the gradients it receives back, one per micro-batch: 4 more
    of 1 x 4,096 tokens x 4,096 wide in bf16, 32 MiB each."""
    grown = _first_stage("1F1B", microbatches=8).components["activations"]
    assert grown - _first_stage("1F1B", microbatches=4).components["activations"] == 4 * 4096 * 4096 * 2
