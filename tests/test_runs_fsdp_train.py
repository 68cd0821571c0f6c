"""handbook_lib.runs.fsdp_train: a real 2-rank FSDP2 run whose shards must match the model.

The notebook of chapter 1 runs the default model with FULL_SHARD and AdamW; this test covers a
different configuration (an odd vocabulary that forces padding, SHARD_GRAD_OP, SGD with
momentum), so CI does not run the same experiment twice.
"""

import pytest

from handbook_lib.launch import torchrun
from handbook_lib.memory import estimate_shard_bytes
from handbook_lib.model import param_count
from handbook_lib.results import SCHEMA

CONFIG = {
    "vocab_size": 1001, "d_model": 64, "nhead": 2, "dim_feedforward": 96, "num_layers": 2,
    "batch_size": 4, "seq_len": 16, "steps": 2, "strategy": "SHARD_GRAD_OP",
    "optimizer": "sgd-momentum", "lr": 0.1,
}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return torchrun("fsdp_train", 2, CONFIG, out=tmp_path_factory.mktemp("fsdp"), timeout_s=300)


def test_result_has_the_documented_shape(result):
    assert result.schema == SCHEMA and result.run == "fsdp_train"
    assert result.world_size == 2 and len(result.ranks) == 2
    assert (result.backend, result.device) == ("gloo", "cpu")
    assert {k: result.config[k] for k in CONFIG} == CONFIG
    assert result.torch_version


def test_shards_sum_to_the_model_plus_reported_padding(result):
    config = result.config
    model_bytes = 4 * param_count(_model_config(config))
    shards = result.metric("param_shard_bytes")
    padding = result.metric("param_padding_bytes")
    assert sum(shards) == model_bytes
    assert padding[0] == 0 and padding[1] > 0  # vocab 1001 does not split evenly
    assert shards[0] + padding[0] == shards[1] + padding[1]  # equal storage on every rank
    assert result.metric("grad_shard_bytes") == shards
    assert result.metric("optimizer_state_bytes") == shards  # one momentum buffer per parameter


def test_every_check_is_exact_and_matches_an_independent_estimate(result):
    assert len(result.checks) == 8 and not result.failed_checks()
    model_config = _model_config(result.config)
    for check in result.checks:
        if check.quantity == "param_padding_bytes":
            assert check.predicted == estimate_shard_bytes(model_config, 2, check.rank).padding_bytes


def test_ranks_agree_on_the_loss_and_it_is_finite(result):
    losses = result.metric("losses")
    assert losses[0] == losses[1] and len(losses[0]) == 2
    assert all(0 < x < 20 for x in losses[0])


def _model_config(config):
    from handbook_lib.config import RunConfig

    return RunConfig.from_mapping(config).model_config()
