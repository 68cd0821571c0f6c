"""handbook_lib.training: synthetic data, batch slicing, and single-process training."""

import math

import pytest
import torch

from handbook_lib.config import RunConfig
from handbook_lib.distributed import RankContext
from handbook_lib.model import build_model
from handbook_lib.parallelize import build_mp_policy
from handbook_lib.training import build_optimizer, local_slice, make_batch, train


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
    from handbook_lib.parallelize import parallelize
    from handbook_lib.sharding import wrap_units

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ctx = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
        for min_params in (5_000, 20_000, 10**9):
            config = RunConfig(vocab_size=1001, d_model=64, nhead=2, dim_feedforward=96, num_layers=2,
                               api="fsdp1", wrap="size", wrap_min_params=min_params)
            predicted = [u.name for u in wrap_units(config.model_config(), "size", min_params) if u.numel]
            assert measure_fsdp_units(parallelize(config, ctx)) == predicted
        with pytest.raises(ValueError, match="pins host memory"):
            parallelize(RunConfig(api="fsdp1", cpu_offload=True), ctx)
    finally:
        dist.destroy_process_group()


def test_clip_norm_is_summed_in_float64_and_clips_like_pytorch():
    """clip_grad_norm's norm is the float64 norm of the gradient (1e-12); PyTorch's fp32 sums
    drift from it by more than that on the default model's 2.56M-element head (the reason
    chapter 5 gives for summing in float64). Scaling follows clip_grad_norm_: max / (norm + 1e-6)."""
    from handbook_lib.training import clip_grad_norm

    config = RunConfig()
    model = build_model(config.model_config(), seed=0)
    inputs, targets = make_batch(config, 0)
    torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    exact = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    fp32 = float(torch.nn.utils.get_total_norm(grads))
    drift = abs(fp32 - exact) / exact
    print(f"fp32 norm drift on this CPU: {drift:.1e} relative")
    assert drift > 1e-9  # fp32 sums do drift (here ~1e-4); float64 ones below do not
    norm = clip_grad_norm(model, 0.5)
    assert abs(norm - exact) / exact < 1e-12
    scale = 0.5 / (exact + 1e-6)
    assert all(torch.allclose(p.grad, g * scale, rtol=1e-6, atol=0) for p, g in zip(model.parameters(), grads))
    assert clip_grad_norm(model, 10.0) == pytest.approx(0.5, rel=1e-5)  # below the threshold: untouched


def test_one_thread_restores_the_thread_count():
    import torch

    from handbook_lib.training import one_thread

    before = torch.get_num_threads()
    with one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
