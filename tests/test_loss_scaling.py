"""handbook_lib.loss_scaling: fp16 without a scaler loses its gradients when they are small."""

import pytest
import torch

from handbook_lib.loss_scaling import GLOBAL_BATCH_TOKENS, UNDERFLOW_SETUP, measure_loss_scaling

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
])
def test_bad_arguments_are_named(setup, kwargs, match):
    with pytest.raises(ValueError, match=match):
        measure_loss_scaling(setup, **kwargs)

