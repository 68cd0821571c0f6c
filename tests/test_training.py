"""handbook_lib.training: synthetic data, batch slicing, and single-process training."""

import pytest
import torch

from handbook_lib.config import RunConfig
from handbook_lib.distributed import RankContext
from handbook_lib.model import build_model
from handbook_lib.training import build_mp_policy, build_optimizer, local_slice, make_batch, train


def test_batches_follow_the_rule_and_are_deterministic():
    config = RunConfig(vocab_size=97, batch_size=4, seq_len=10, seed=5)
    inputs, targets = make_batch(config, step=3)
    assert inputs.shape == targets.shape == (4, 10) and inputs.dtype == torch.int64
    assert torch.equal(targets, (3 * inputs + 1) % 97)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    again, _ = make_batch(config, step=3)
    other, _ = make_batch(config, step=4)
    assert torch.equal(inputs, again) and not torch.equal(inputs, other)


def test_local_slices_partition_the_global_batch():
    batch = torch.arange(12).reshape(6, 2)
    parts = [local_slice(batch, r, 3) for r in range(3)]
    assert torch.equal(torch.cat(parts), batch)
    with pytest.raises(ValueError, match="divisible"):
        local_slice(batch, 0, 4)


def test_single_process_training_lowers_the_loss():
    config = RunConfig(vocab_size=50, d_model=32, nhead=2, dim_feedforward=64, num_layers=1,
                       batch_size=8, seq_len=16, steps=30, lr=1e-2)
    model = build_model(config.model_config(), seed=0)
    ctx = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    log = train(model, build_optimizer(model.parameters(), "adamw", config.lr), config, ctx, progress=False)
    assert len(log.losses) == len(log.step_time_s) == 30
    assert log.losses[-1] < 0.5 * log.losses[0]


def test_unsupported_choices_raise():
    with pytest.raises(ValueError, match="gradient scaler"):
        build_mp_policy("fp16-mixed")
    with pytest.raises(ValueError, match="sgd-momentum"):
        build_optimizer([torch.nn.Parameter(torch.ones(1))], "lion", 0.1)
    assert build_mp_policy("fp32") is None
    assert build_mp_policy("bf16-mixed").param_dtype == torch.bfloat16
