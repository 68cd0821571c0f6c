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
    with pytest.raises(ValueError, match="fp16-mixed"):
        build_mp_policy("fp8")
    fp16 = build_mp_policy("fp16-mixed")
    assert (fp16.param_dtype, fp16.reduce_dtype) == (torch.float16, torch.float32)
    with pytest.raises(ValueError, match="sgd-momentum"):
        build_optimizer([torch.nn.Parameter(torch.ones(1))], "lion", 0.1)
    assert build_mp_policy("fp32") is None
    assert build_mp_policy("bf16-mixed").param_dtype == torch.bfloat16


def test_fsdp1_size_policy_makes_the_units_the_pure_rule_predicts():
    """FSDP1's own size_based_auto_wrap_policy, on the real module, against sharding.wrap_units."""
    import torch.distributed as dist

    from handbook_lib.measure import measure_fsdp_units
    from handbook_lib.sharding import wrap_units
    from handbook_lib.training import build_fsdp1_model

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ctx = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
        for min_params in (5_000, 20_000, 10**9):
            config = RunConfig(vocab_size=1001, d_model=64, nhead=2, dim_feedforward=96, num_layers=2,
                               api="fsdp1", wrap="size", wrap_min_params=min_params)
            predicted = [u.name for u in wrap_units(config.model_config(), "size", min_params) if u.numel]
            assert measure_fsdp_units(build_fsdp1_model(config, ctx)) == predicted
        with pytest.raises(ValueError, match="pins host memory"):
            build_fsdp1_model(RunConfig(api="fsdp1", cpu_offload=True), ctx)
    finally:
        dist.destroy_process_group()
