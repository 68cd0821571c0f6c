"""handbook_lib.models.axes_run: one pricing of a chapter-9 job, against the older per-axis models
it generalises (each computed by its own code) and counts made by hand."""

from collections import Counter

import pytest

from handbook_lib.core.parallel_config import ParallelConfig
from handbook_lib.models.axes_run import (
    axes_micro_batch,
    estimate_axes_activation_bytes,
    estimate_axes_collectives,
    estimate_axes_state_bytes,
)
from handbook_lib.models.sequence_parallel import (
    estimate_sp_activation_bytes,
    estimate_sp_step_traffic,
    parallel_layout,
)
from handbook_lib.models.tensor_parallel import (
    estimate_tp_activation_bytes,
    estimate_tp_state_bytes,
    estimate_tp_step_collectives,
)

SHAPE = {"vocab_size": 50, "d_model": 32, "nhead": 4, "dim_feedforward": 64, "num_layers": 2,
         "batch_size": 4, "seq_len": 8, "steps": 3}


def _calls(calls):
    return Counter((c.kind, c.buffer_bytes, c.group_size) for c in calls)


def test_micro_batch_is_the_data_parallel_share_of_one_micro_step():
    assert axes_micro_batch(ParallelConfig(**SHAPE, tp_size=2), 4) == 2
    assert axes_micro_batch(ParallelConfig(**SHAPE, tp_size=2, grad_accum_steps=2), 4) == 1
    assert axes_micro_batch(ParallelConfig(**SHAPE, tp_size=2, sp_size=2, sp_method="ring"), 8) == 2


@pytest.mark.parametrize("world, tp, sp", [(4, 2, 1), (4, 2, 2), (8, 2, 2), (2, 2, 1)])
def test_state_is_tensor_parallel_shapes_sharded_over_dp_shard_times_sp(world, tp, sp):
    config = ParallelConfig(**{**SHAPE, "batch_size": 8}, tp_size=tp, sp_size=sp, sp_method="ring")
    fsdp = world // tp
    for rank in range(fsdp):
        want = estimate_tp_state_bytes(config.model_config(), tp, fsdp, rank)
        assert estimate_axes_state_bytes(config, world, rank) == want


def test_sequence_split_state_is_the_whole_model_sharded_over_every_rank():
    config = ParallelConfig(**SHAPE, sp_size=2, sp_method="ring")
    for rank in range(4):
        shard = parallel_layout(config.model_config()).shard_bytes(4, rank)
        state = estimate_axes_state_bytes(config, 4, rank)
        assert (state.param_shard_bytes, state.param_padding_bytes) == (shard.shard_bytes, shard.padding_bytes)


def test_tensor_parallel_activations_are_the_tensor_parallel_model_in_fp32():
    for sp_flag in (False, True):
        config = ParallelConfig(**SHAPE, tp_size=2, sequence_parallel=sp_flag)
        want = estimate_tp_activation_bytes(config.model_config(), 2, 8, 2, sp_flag)
        assert estimate_axes_activation_bytes(config, 2).total == want.total


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_sequence_split_layers_are_the_sequence_model_and_the_head_keeps_the_ids(method):
    config = ParallelConfig(**{**SHAPE, "nhead": 2}, sp_size=2, sp_method=method)
    want = estimate_sp_activation_bytes(config.model_config(), 2, 8, 2, method)
    got = estimate_axes_activation_bytes(config, 2)
    assert got.per_layer == want.per_layer
    assert got.head == want.head + 4   # the same head, plus the second fp32 scalar the tracker sees


def test_bf16_halves_everything_but_the_fp32_statistics_and_the_loss():
    # by hand, T = 16, d 32, f 64, h 4, t 2: per layer T·(2d + 4d/t + 2f/t)·2 + 4·T·h/t + the norms
    # (2·T·d + 4·T)·2; the head 16·T + T·d·2 + 4·T·25 + 8
    config = ParallelConfig(**SHAPE, tp_size=2, precision="bf16-mixed")
    per_layer = 16 * (64 + 64 + 64) * 2 + 4 * 16 * 2 + (2 * 16 * 32 + 4 * 16) * 2
    head = 16 * 16 + 16 * 32 * 2 + 4 * 16 * 25 + 8
    got = estimate_axes_activation_bytes(config, 2)
    assert (got.per_layer, got.head, got.total) == (per_layer, head, 2 * per_layer + head) == (8448, 2888, 19784)


def test_full_checkpointing_keeps_each_layers_input_sequence_sharded_under_megatron_sp():
    plain = estimate_axes_activation_bytes(ParallelConfig(**SHAPE, tp_size=2, activation_checkpointing="full"), 2)
    split = estimate_axes_activation_bytes(ParallelConfig(**SHAPE, tp_size=2, activation_checkpointing="full",
                                                          sequence_parallel=True), 2)
    assert plain.layers == 2 * 16 * 32 * 4 and split.layers == plain.layers // 2


def test_the_ring_keeps_one_more_block_per_sp_rank_under_selective_checkpointing():
    config = ParallelConfig(**SHAPE, sp_size=4, sp_method="ring", activation_checkpointing="selective")
    acts = [estimate_axes_activation_bytes(config, 4, r).total for r in range(4)]
    # a block: 4 rows x 4 heads x 2 x 2 scores, and 8 tokens x 32 wide of output; fp32, 2 layers
    assert [b - a for a, b in zip(acts, acts[1:])] == [2 * (4 * 4 * 2 * 2 + 8 * 32) * 4] * 3


def test_tensor_parallel_collectives_are_the_tensor_parallel_steps():
    for sp_flag in (False, True):
        config = ParallelConfig(**SHAPE, tp_size=2, sequence_parallel=sp_flag)
        want = estimate_tp_step_collectives(config.model_config(), 2, 2, 2, 8, sp_flag)
        assert _calls(estimate_axes_collectives(config, 4)) == _calls(want)


def test_sequence_split_collectives_are_the_sequence_steps():
    config = ParallelConfig(**{**SHAPE, "nhead": 2}, sp_size=2, sp_method="ulysses")
    traffic = estimate_sp_step_traffic(config.model_config(), 4, 2, 8, 2, "ulysses")
    got: dict = {}
    for c in estimate_axes_collectives(config, 4):
        n, b = got.get((c.kind, c.group_size), (0, 0))
        got[(c.kind, c.group_size)] = (n + 1, b + c.buffer_bytes)
    want: dict = {}
    for (kind, _phase, group), (n, b) in traffic.counts().items():
        m, c = want.get((kind, group), (0, 0))
        want[(kind, group)] = (m + n, c + b)
    assert got == want


def test_levers_multiply_what_each_micro_step_issues():
    base = _calls(c for c in estimate_axes_collectives(ParallelConfig(**SHAPE, tp_size=2), 4) if c.axis == "tp")
    twice = _calls(c for c in estimate_axes_collectives(ParallelConfig(**SHAPE, tp_size=2, grad_accum_steps=2), 4)
                   if c.axis == "tp")
    assert sum(twice.values()) == 2 * sum(base.values()) == 2 * 10
    # recomputation: each layer's 2 forward all-reduces again in backward
    ac = estimate_axes_collectives(ParallelConfig(**SHAPE, tp_size=2, activation_checkpointing="full"), 4)
    assert sum(c.axis == "tp" for c in ac) == 10 + 2 * 2


def test_clipping_reduces_each_norm_over_every_mesh_dimension_that_shards_its_gradient():
    calls = [c for c in estimate_axes_collectives(ParallelConfig(**SHAPE, tp_size=2, max_grad_norm=1.0), 4)
             if c.axis == "clip"]
    # 35 parameters, all sharded by FSDP over 2 ranks; 23 split by TP too: per layer Q, K, V
    # (weights and biases), out_proj's and linear2's weights, linear1's weight and bias (10),
    # and the embedding, the head's weight and bias
    assert len(calls) == 35 + 2 * 10 + 3 == 58
    assert {(c.buffer_bytes, c.group_size) for c in calls} == {(8, 2)}


def test_megatron_sp_reduces_the_norms_gradients_with_fsdps_sync():
    def norms(**keys):
        config = ParallelConfig(**SHAPE, tp_size=2, sequence_parallel=True, **keys)
        return sum(c.axis == "tp" and c.buffer_bytes == 32 * 4 for c in estimate_axes_collectives(config, 4))
    # 2 layers x 2 norms x weight and bias: once a step, unless every micro-step syncs
    assert norms() == norms(grad_accum_steps=2) == 8
    assert norms(grad_accum_steps=2, sync_every_micro_step=True) == 16

    def sizes(**keys):
        config = ParallelConfig(**SHAPE, tp_size=2, sequence_parallel=True, precision="bf16-mixed", **keys)
        return {c.buffer_bytes for c in estimate_axes_collectives(config, 4) if c.site.endswith(".weight")}
    # bf16 as computed in each micro-step's backward (d x 2 B); fp32 as accumulated between them
    assert sizes() == sizes(grad_accum_steps=2, sync_every_micro_step=True) == {32 * 2}
    assert sizes(grad_accum_steps=2) == {32 * 4}
