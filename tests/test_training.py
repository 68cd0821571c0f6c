"""handbook_lib.runtime.training: synthetic data, batch slicing, and single-process training."""

import math

import pytest
import torch

from handbook_lib.core import RunConfig
from handbook_lib.runtime import (
    RankContext,
    build_model,
    build_mp_policy,
    build_optimizer,
    local_slice,
    make_batch,
    train,
)


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

    from handbook_lib.models import wrap_units
    from handbook_lib.runtime import measure_fsdp_units, parallelize

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
    from handbook_lib.runtime import clip_grad_norm

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

    from handbook_lib.runtime import one_thread

    before = torch.get_num_threads()
    with one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def _tiny(**changes) -> RunConfig:
    return RunConfig(vocab_size=50, d_model=32, nhead=2, dim_feedforward=64, num_layers=1,
                     batch_size=4, seq_len=8, lr=1e-2, **changes)


ONE = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none")


def test_default_loop_is_the_plain_next_token_loop():
    """train's defaults (make_batch, model(x), next_token_loss) are exactly the hand-written loop:
    the same losses to the bit, and next_token_loss reports the tensor it backpropagates."""
    from torch.nn import functional as F

    from handbook_lib.runtime.training import next_token_loss

    config = _tiny(steps=4)
    model = build_model(config.model_config(), seed=0)
    log = train(model, build_optimizer(model.parameters(), "adamw", config.lr), config, ONE, progress=False)
    twin = build_model(config.model_config(), seed=0)
    optimizer = build_optimizer(twin.parameters(), "adamw", config.lr)
    losses = []
    for step in range(config.steps):
        inputs, targets = make_batch(config, step)
        loss = F.cross_entropy(twin(inputs).float().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # freed, not zeroed: the numbers are the same
        losses.append(loss.item())
    assert log.losses == losses and log.steps == [1, 2, 3, 4]
    logits, targets = torch.randn(2, 3, 5, dtype=torch.float16), torch.randint(0, 5, (2, 3))
    backward, reported = next_token_loss(logits, targets)
    assert backward is reported and backward.dtype == torch.float32
    assert backward == F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def test_batch_source_forward_loss_and_after_backward_reach_train():
    """Each hook is called where train's docstring says: the batch source with 0-based steps,
    the forward once per micro-step, the loss's reported half logged, after_backward with the
    1-based step once the gradients exist and before the parameters move."""
    from torch.nn import functional as F

    config = _tiny(steps=3, seed=4)
    asked, forwards, seen, params_at = [], [], [], {}

    def batches(cfg: RunConfig, step: int):
        asked.append(step)
        return make_batch(cfg.replace(seed=9), step)  # not the default data

    def forward(model, inputs):
        forwards.append(inputs.shape[0])
        return model(inputs)

    def loss_fn(logits, targets):
        token_losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        return token_losses.sum() / 1000, token_losses.mean()

    def after_backward(model, step):
        seen.append((step, all(p.grad is not None and p.grad.any() for p in model.parameters())))
        params_at[step] = model.output.weight.detach().clone()

    model = build_model(config.model_config(), seed=0)
    ends = {0: model.output.weight.detach().clone()}
    log = train(model, build_optimizer(model.parameters(), "adamw", config.lr), config, ONE, progress=False,
                batches=batches, forward=forward, loss_fn=loss_fn, after_backward=after_backward,
                on_step=lambda end: ends.__setitem__(end.step, end.model.output.weight.detach().clone()))
    assert asked == [0, 1, 2] and forwards == [4, 4, 4] and seen == [(1, True), (2, True), (3, True)]
    assert all(torch.equal(params_at[s], ends[s - 1]) and not torch.equal(params_at[s], ends[s]) for s in (1, 2, 3))
    twin = build_model(config.model_config(), seed=0)
    optimizer = build_optimizer(twin.parameters(), "adamw", config.lr)
    losses = []
    for step in range(config.steps):
        inputs, targets = make_batch(config.replace(seed=9), step)
        backward, reported = loss_fn(twin(inputs), targets)
        backward.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(reported.item())
    assert log.losses == losses and len(log.grad_zero_fraction) == 3


def test_accumulation_divides_a_custom_loss_by_k():
    """With grad_accum_steps = 2 both halves of the loss are divided by 2: a reported constant
    sums back to itself, and a summed loss's gradient is half the one-micro-batch gradient."""
    grads = {}
    for k in (1, 2):
        config = _tiny(steps=1, grad_accum_steps=k)
        model = build_model(config.model_config(), seed=0)
        log = train(model, build_optimizer(model.parameters(), "sgd", config.lr), config, ONE, progress=False,
                    loss_fn=lambda logits, y: (torch.nn.functional.cross_entropy(
                        logits.flatten(0, 1), y.flatten(), reduction="sum"), torch.tensor(3.0)),
                    after_backward=lambda m, step, k=k: grads.__setitem__(k, m.output.weight.grad.clone()))
        assert log.losses == [3.0]
    assert torch.allclose(grads[2], grads[1] / 2, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("start_step", [0, 2])
def test_skipped_steps_are_1_based_and_are_the_steps_whose_scale_dropped(start_step):
    """An fp16 forward with a first factor of 2**24 overflows: the scaler skips those steps (the
    weights do not move) and halves itself. TrainLog.skipped_steps names them 1-based from the
    job's start, like TrainLog.steps."""
    from torch.func import functional_call

    def fp16(model, inputs):
        return functional_call(model, {n: p.to(torch.float16) for n, p in model.named_parameters()}, (inputs,))

    config = _tiny(steps=10)
    model = build_model(config.model_config(), seed=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    weights = [model.output.weight.detach().clone()]
    log = train(model, build_optimizer(model.parameters(), "adamw", config.lr), config, ONE, progress=False,
                start_step=start_step, scaler=scaler, forward=fp16,
                on_step=lambda end: weights.append(end.model.output.weight.detach().clone()))
    assert log.steps == list(range(start_step + 1, 11))
    dropped = [s for s, a, b in zip(log.steps, log.grad_scale, log.grad_scale[1:] + [scaler.get_scale()]) if b < a]
    assert log.skipped_steps == dropped
    assert log.skipped_steps == list(range(start_step + 1, start_step + 1 + len(dropped)))  # the first steps
    assert 0 < len(log.skipped_steps) < len(log.steps)  # and then it trains
    for i, step in enumerate(log.steps):
        assert torch.equal(weights[i + 1], weights[i]) == (step in log.skipped_steps)


def test_on_a_gpu_the_inspection_waits_for_the_backward_before_its_timer(monkeypatch):
    """gpu-path.md S2-1: the time kept out of step_time_s must not hold the queued backward."""
    import time as clock

    from handbook_lib.runtime.training import _Recorder

    calls = []

    def synchronize(device):  # stands in for the rest of a backward still running on the GPU
        calls.append(("sync", str(device)))
        clock.sleep(0.2)

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    record = _Recorder()
    hook = record.after_backward(lambda model, step: calls.append(("hook", step)), 3, count_zeros=False,
                                 device=torch.device("cuda", 0))
    hook(torch.nn.Linear(2, 2))
    assert calls == [("sync", "cuda:0"), ("hook", 3)]
    assert record.hook_s < 0.1  # the 0.2 s wait is the step's, not the inspection's
    cpu = _Recorder().after_backward(lambda model, step: None, 1, count_zeros=False, device=torch.device("cpu"))
    cpu(torch.nn.Linear(2, 2))
    assert len(calls) == 2  # no synchronize on the CPU


def test_the_one_process_reference_trains_where_it_is_told(monkeypatch):
    """gpu-path.md S2-2: a GPU job is compared with a reference on its own kind of device."""
    from handbook_lib.runtime import train_one_process
    from handbook_lib.runtime import resolve_device

    config = RunConfig(vocab_size=50, d_model=32, nhead=2, dim_feedforward=64, num_layers=1,
                       batch_size=4, seq_len=8, steps=2)
    default, on_cpu = train_one_process(config), train_one_process(config, device="cpu")
    assert default.losses == on_cpu.losses and len(default.losses) == 2
    for bad, says in (("meta", "use 'cpu' or 'cuda"), ("nowhere", "not a device"),
                      ("cuda", "no CUDA device is visible")):
        with pytest.raises(ValueError, match=f"^device='{bad}': .*{says}"):
            train_one_process(config, device=bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a faked 2-GPU machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"^device='cuda:2': 2 CUDA device\(s\) are visible"):
        resolve_device("cuda:2")


def test_a_run_checks_its_losses_against_a_reference_on_its_own_device(monkeypatch):
    from handbook_lib.runs import entry
    from handbook_lib.runtime import training

    seen = []

    def reference(config, device="cpu"):
        seen.append(device)
        return training.TrainLog(losses=[2.0, 1.0], step_time_s=[])

    monkeypatch.setattr(training, "train_one_process", reference)
    want, checks = entry.one_process_loss_checks(RunConfig(steps=2), [2.0, 1.5], 1e-5, "cuda:0")
    assert seen == ["cuda:0"] and want == [2.0, 1.0]
    assert [(c.quantity, c.predicted, c.measured) for c in checks] == [
        ("loss_step1", 2.0, 2.0), ("loss_step2", 1.0, 1.5)]
