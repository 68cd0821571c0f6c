"""handbook_lib.memory: FSDP's shard rule and the 16-bytes-per-parameter model state."""

import math

import pytest

from handbook_lib.memory import (
    estimate_model_state_bytes,
    estimate_shard_bytes,
    optimizer_states,
    shard_rows,
)
from handbook_lib.model import ModelConfig, param_count, param_shapes


@pytest.mark.parametrize("dim0, world, expected", [
    (10, 4, [(3, 3), (3, 3), (3, 3), (1, 3)]),   # ceil(10/4) = 3 rows a chunk, last one short
    (2, 4, [(1, 1), (1, 1), (0, 1), (0, 1)]),    # fewer rows than ranks: two ranks hold nothing
    (8, 2, [(4, 4), (4, 4)]),
    (5, 1, [(5, 5)]),
])
def test_shard_rows_hand_cases(dim0, world, expected):
    assert [shard_rows(dim0, world, r) for r in range(world)] == expected


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8])
def test_shards_add_up_to_the_model_and_padding_equalises(world):
    config = ModelConfig(vocab_size=1001, d_model=24, nhead=3, dim_feedforward=50, num_layers=2)
    shards = [estimate_shard_bytes(config, world, r) for r in range(world)]
    assert sum(s.shard_bytes for s in shards) == 4 * param_count(config)
    assert len({s.padded_bytes for s in shards}) == 1  # every rank allocates the same
    # padded storage per rank is ceil(dim0 / world) rows of every tensor
    expected = sum(math.ceil(s[0] / world) * math.prod(s[1:]) for _, s in param_shapes(config))
    assert shards[0].padded_bytes == 4 * expected


def test_padding_of_an_odd_vocabulary_by_hand():
    # vocab 1001 on 2 ranks: chunks of 501 rows; rank 1 holds 500 rows of the embedding (d=256),
    # of the head's weight (d=256) and of its bias (1): padding = 256*4 + 256*4 + 4 bytes.
    config = ModelConfig(vocab_size=1001)
    assert estimate_shard_bytes(config, 2, 0).padding_bytes == 0
    assert estimate_shard_bytes(config, 2, 1).padding_bytes == 256 * 4 + 256 * 4 + 4


def test_bf16_shards_are_half_of_fp32():
    config = ModelConfig()
    assert 2 * estimate_shard_bytes(config, 4, 1, "bf16").shard_bytes == estimate_shard_bytes(config, 4, 1).shard_bytes


def test_sixteen_bytes_per_parameter():
    state = estimate_model_state_bytes(ModelConfig())
    n = param_count(ModelConfig())
    assert (state.params, state.grads, state.optimizer) == (4 * n, 4 * n, 8 * n)
    assert state.total == 16 * n
    # the seed's figures: 39.5 MB of weights, 157.9 MB of model state (decimal MB)
    assert round(state.params / 1e6, 1) == 39.5 and round(state.total / 1e6, 1) == 157.9


def test_optimizer_states():
    assert [optimizer_states(o) for o in ("adamw", "adam", "sgd-momentum", "sgd")] == [2, 2, 1, 0]
    with pytest.raises(ValueError, match="adamw"):
        optimizer_states("lion")


@pytest.mark.parametrize("call, match", [
    (lambda: shard_rows(10, 0, 0), "world_size"),
    (lambda: shard_rows(10, 2, 2), "rank"),
    (lambda: shard_rows(-1, 2, 0), "dim0"),
    (lambda: estimate_shard_bytes(ModelConfig(), 2, 0, "fp8"), "fp32, bf16, fp16"),
    (lambda: estimate_model_state_bytes(-5), "model must be an int >= 0"),
    (lambda: estimate_model_state_bytes(10, grad_bytes=-1), "grad_bytes"),
])
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
