"""The roofline's threshold against the step-time model it summarises."""

import dataclasses
import math

import pytest

from handbook_lib.models import (
    DECODER_SHAPES,
    estimate_compute_time,
    estimate_step_time,
    estimate_step_traffic,
    get_accelerator,
    get_link,
    wrap_units,
)
from handbook_lib.models.roofline import (
    min_tokens_by_phase,
    min_tokens_per_gpu,
    phase_wire_bytes,
    wire_bytes_per_param,
)


def test_wire_bytes_per_param_counts_each_collective():
    assert wire_bytes_per_param() == 2 + 2 + 4
    assert wire_bytes_per_param("SHARD_GRAD_OP") == 2 + 4
    assert wire_bytes_per_param("FULL_SHARD", "fp32", "fp32") == 12
    assert wire_bytes_per_param("FULL_SHARD", "bf16", "bf16") == 6
    assert wire_bytes_per_param("DDP", "bf16", "fp32") == 8
    assert wire_bytes_per_param("NO_SHARD", "bf16", "fp32") == 8
    assert wire_bytes_per_param("HYBRID_SHARD_ZERO2") == 2 + 4
    for bad in ("NO_SUCH", "NONE", "ZERO3"):
        with pytest.raises(ValueError, match="strateg"):
            wire_bytes_per_param(bad)


def test_wire_bytes_match_the_traffic_model():
    # every unit resharded after forward (the root too): b·(N-1)/N bytes per parameter
    units = wrap_units(DECODER_SHAPES["7b"])
    n = 8
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        t = estimate_step_traffic(units, n, strategy, param_dtype="bf16", reduce_dtype="fp32",
                                  root_reshard_after_forward=True)
        params = sum(u.numel for u in units)
        per_param = t.sent_bytes / (params * (n - 1) / n)
        assert per_param == pytest.approx(wire_bytes_per_param(strategy), rel=1e-6)


def test_at_the_threshold_compute_equals_communication():
    shape, n = DECODER_SHAPES["7b"], 8
    h100 = get_accelerator("h100-80gb")
    link = dataclasses.replace(get_link("nvlink4"), latency_s=0.0)  # the bound leaves alpha out
    traffic = estimate_step_traffic(wrap_units(shape), n, "FULL_SHARD", param_dtype="bf16",
                                    reduce_dtype="fp32")
    serial = estimate_step_time(traffic, link, 0.0, overlap=False).comm_s
    rate = h100.peak_flops_bf16 * 0.41
    # the whole step's bound: 6PT of compute against every byte of the step
    b = traffic.sent_bytes / (shape.num_params * (n - 1) / n)  # the root stays gathered: < 8
    t_min = min_tokens_per_gpu(link.achievable_bytes_per_s, h100.peak_flops_bf16, 0.41, wire_bytes=b, ranks=n)
    assert 6 * shape.num_params * t_min / rate == pytest.approx(serial, rel=1e-9)
    # backward's bound: its bytes against its 4PT, higher; the model hides backward's collectives
    # but the last reduce-scatter, which nothing follows
    backward = [r for r in traffic.records if r.phase == "backward"]
    comm_b = sum(r.sent_bytes for r in backward) / link.achievable_bytes_per_s
    per_phase = min_tokens_by_phase(link.achievable_bytes_per_s, h100.peak_flops_bf16, 0.41, ranks=n,
                                    wire_bytes={"forward": 2, "backward": round(
                                        sum(r.sent_bytes for r in backward) / (shape.num_params * (n - 1) / n))})
    assert per_phase["backward"] > t_min > per_phase["forward"]
    edge = backward[-1].sent_bytes / link.achievable_bytes_per_s
    t_star = (comm_b - edge) * rate / (4 * shape.num_params)
    assert t_min < t_star < per_phase["backward"]
    for tokens, bound in ((math.ceil(t_min), "communication"), (math.floor(t_star), "communication"),
                          (math.ceil(t_star), "compute")):
        c = estimate_compute_time(shape.num_params, tokens, h100.peak_flops_bf16, 0.41)
        assert estimate_step_time(traffic, link, c, overlap=True).bound == bound, tokens


def test_backward_needs_an_eighth_more_tokens_than_the_whole_step():
    assert phase_wire_bytes() == {"forward": 2, "backward": 6}
    assert phase_wire_bytes("SHARD_GRAD_OP") == {"forward": 2, "backward": 4}
    assert phase_wire_bytes("DDP", "bf16", "fp32") == {"forward": 0, "backward": 8}
    whole = min_tokens_per_gpu(100e9, 1e15, 0.5, ranks=8)
    phases = min_tokens_by_phase(100e9, 1e15, 0.5, ranks=8)
    assert phases["backward"] == pytest.approx(whole * 9 / 8)  # 6/4 against 8/6
    assert phases["forward"] == pytest.approx(whole * 6 / 8)  # 2/2
    # with the forward recomputed in backward both phases need the whole step's 8/8
    ac = min_tokens_by_phase(100e9, 1e15, 0.5, ranks=8, activation_checkpointing=True)
    assert ac["backward"] == pytest.approx(ac["forward"]) == pytest.approx(
        min_tokens_per_gpu(100e9, 1e15, 0.5, ranks=8, activation_checkpointing=True))
    assert min_tokens_by_phase(100e9, 1e15, 0.5, wire_bytes=phase_wire_bytes("DDP"))["forward"] == 0.0


def test_threshold_scales_as_the_formula_says():
    base = min_tokens_per_gpu(100e9, 1e15, 0.5)
    assert base == pytest.approx(8 * 1e15 * 0.5 / (6 * 100e9))
    assert min_tokens_per_gpu(200e9, 1e15, 0.5) == pytest.approx(base / 2)
    assert min_tokens_per_gpu(100e9, 1e15, 0.25) == pytest.approx(base / 2)
    assert min_tokens_per_gpu(100e9, 1e15, 0.5, ranks=8) == pytest.approx(base * 7 / 8)
    assert min_tokens_per_gpu(100e9, 1e15, 0.5, activation_checkpointing=True) == (
        pytest.approx(base * 6 / 8))
    for bad in ({"utilization": 0}, {"ranks": 1}, {"wire_bytes": 0}):
        with pytest.raises(ValueError):
            min_tokens_per_gpu(100e9, 1e15, **bad)
    with pytest.raises(ValueError):
        min_tokens_per_gpu(0, 1e15)
