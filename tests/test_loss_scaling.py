"""handbook_lib.lessons.loss_scaling: fp16 without a scaler loses its gradients when they are small."""

import pytest
import torch

from handbook_lib.core import RunConfig
from handbook_lib.lessons import (
    GLOBAL_BATCH_TOKENS,
    UNDERFLOW_SETUP,
    measure_loss_scaling,
)
from handbook_lib.runtime import (
    build_model,
    build_optimizer,
    grad_zero_fraction,
    make_batch,
    one_thread,
)

MICRO_BATCH_TOKENS = UNDERFLOW_SETUP["batch_size"] * UNDERFLOW_SETUP["seq_len"]


@pytest.fixture(scope="module")
def result():
    return measure_loss_scaling()


def test_the_regime_is_below_fp16s_reach():
    # Each token's loss weighs 2**-22: its gradients start there, and fp16's smallest
    # positive value is 2**-24; half of it rounds to zero.
    weight = 1 / GLOBAL_BATCH_TOKENS
    assert torch.tensor(weight, dtype=torch.float16).item() == weight
    assert torch.tensor(2.0**-26, dtype=torch.float16).item() == 0.0
    assert torch.finfo(torch.float16).smallest_normal == 2.0**-14


def test_fp16_without_scaler_zeroes_every_gradient_below_the_head(result):
    run = result.runs["fp16, no scaler"]
    assert run.body_zero_fraction[0] == 1.0
    assert run.grad_zero_fraction[0] > 0.8
    for label in ("fp32", "fp16 + scaler"):
        assert result.runs[label].grad_zero_fraction[0] < 0.05


def test_fp16_without_scaler_stalls_while_the_others_learn(result):
    fp32, bare = result.runs["fp32"].losses, result.runs["fp16, no scaler"].losses
    assert fp32[0] - fp32[-1] > 4.0  # from ln(128) = 4.85 to below 1
    assert result.max_loss_difference("fp16 + scaler") < 1e-3  # the scaler recovers fp32
    assert result.max_loss_difference("fp16, no scaler") == max(abs(a - b) for a, b in zip(fp32, bare)) > 2
    assert bare[0] - bare[-1] < 0.5 * (fp32[0] - fp32[-1])
    assert min(bare[-10:]) > fp32[-1] + 2.0  # stuck: the last ten steps all far above fp32's end


def test_the_scaler_kept_its_first_factor(result):
    run = result.runs["fp16 + scaler"]
    assert run.grad_scale == [2.0**16] * UNDERFLOW_SETUP["steps"] and run.skipped_steps == []
    assert result.runs["fp16, no scaler"].grad_scale == []


def test_with_a_plain_mean_the_underflow_disappears():
    plain = measure_loss_scaling({"steps": 1}, global_batch_tokens=MICRO_BATCH_TOKENS)
    fp32, bare = plain.runs["fp32"], plain.runs["fp16, no scaler"]
    assert bare.body_zero_fraction[0] - fp32.body_zero_fraction[0] < 0.01


def test_table_rows(result):
    rows = result.table_rows()
    assert [r[0] for r in rows] == ["fp32", "fp16, no scaler", "fp16 + scaler"]
    assert rows[1][4] == "100 %" and rows[2][5] == "2^16" and rows[0][5] == "-"
    assert [r[1] for r in rows] == ["5.0"] * 3 and rows[0][2] == rows[2][2] != rows[1][2]


@pytest.mark.parametrize("setup, kwargs, match", [
    ({}, {"global_batch_tokens": MICRO_BATCH_TOKENS - 1}, "global_batch_tokens must be at least one micro-batch"),
    ({"optimiser": "adam"}, {}, "optimiser"),
    ({"grad_accum_steps": 2}, {}, "config key 'grad_accum_steps' must be 1 here"),
])
def test_bad_arguments_are_named(setup, kwargs, match):
    with pytest.raises(ValueError, match=match):
        measure_loss_scaling(setup, **kwargs)



def _plain_loop(config: RunConfig, label: str, global_batch_tokens: int) -> dict:
    """The lesson's own loop as it was written before it trained through runtime.training.train:
    its scaler steps, its skip detection (1-based), its freed gradients."""
    from torch.func import functional_call
    from torch.nn import functional as F

    model = build_model(config.model_config(), seed=config.seed)
    optimizer = build_optimizer(model.parameters(), config.optimizer, config.lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=config.grad_scale_init) if label == "fp16 + scaler" else None
    body = [p for name, p in model.named_parameters() if not name.startswith("output.")]
    out = {"losses": [], "grad_zero_fraction": [], "body_zero_fraction": [], "grad_scale": [], "skipped_steps": []}
    head_inputs = []
    hook = model.output.register_forward_hook(lambda _m, args, _out: head_inputs.append(args[0]))
    for step in range(config.steps):
        inputs, targets = make_batch(config, step)
        if label == "fp32":
            logits = model(inputs)
        else:
            logits = functional_call(model, {n: p.to(torch.float16) for n, p in model.named_parameters()}, (inputs,))
        if step == 0:
            hook.remove()
            head_inputs[0].retain_grad()
        token_losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
        out["losses"].append(token_losses.mean().item())
        loss = token_losses.sum() / global_batch_tokens
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if step == 0:
            out["head_input_grad_max"] = float(head_inputs.pop().grad.abs().max())
        out["grad_zero_fraction"].append(grad_zero_fraction(model))
        out["body_zero_fraction"].append(sum(int((p.grad == 0).sum()) for p in body) / sum(p.numel() for p in body))
        if scaler is not None:
            out["grad_scale"].append(float(scaler.get_scale()))
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() < out["grad_scale"][-1]:
                out["skipped_steps"].append(step + 1)
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


OVERFLOW = {"steps": 8, "grad_scale_init": 2.0**40}
"""A first factor that overflows fp16's gradients for six steps: the scaler skips them."""


@pytest.fixture(scope="module")
def overflowing():
    return measure_loss_scaling(OVERFLOW)


@pytest.mark.parametrize("setup, tokens", [
    ({"steps": 3}, GLOBAL_BATCH_TOKENS),
    (OVERFLOW, GLOBAL_BATCH_TOKENS),  # overflows: skipped steps
    ({"steps": 2}, MICRO_BATCH_TOKENS),
])
def test_every_number_is_the_plain_loops(setup, tokens, overflowing):
    """The lesson trains through runtime.training.train (fp16 forward, loss share, after_backward
    hook); every loss, zero fraction, scale, skipped step and head gradient is, to the bit, what
    the hand-written loop computes."""
    result = overflowing if setup is OVERFLOW else measure_loss_scaling(setup, global_batch_tokens=tokens)
    for label, run in result.runs.items():
        with one_thread():
            expected = _plain_loop(result.config, label, tokens)
        assert {key: getattr(run, key) for key in expected} == expected, label


def test_skipped_steps_are_1_based_and_are_the_steps_whose_scale_dropped(overflowing):
    """PrecisionRun.skipped_steps, now runtime.training.TrainLog's, stay 1-based: step s is
    skipped when the factor used in step s + 1 is below step s's."""
    run = overflowing.runs["fp16 + scaler"]
    scales = run.grad_scale
    # 2**40 overflows fp16's gradients for six steps, halving each time; at 2**34 they fit
    assert run.skipped_steps == [s for s in range(1, 8) if scales[s] < scales[s - 1]] == [1, 2, 3, 4, 5, 6]
    assert scales == [2.0 ** (40 - min(s, 6)) for s in range(8)]
