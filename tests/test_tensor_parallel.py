"""Tests of handbook_lib.models.tensor_parallel: placements, bytes per rank, collectives,
activations of chapter 9's run, and the decoder formulas for the planner."""

from __future__ import annotations

from math import prod

import pytest

from handbook_lib.core.architecture import ModelConfig, param_count
from handbook_lib.models.presets import get_shape
from handbook_lib.models.tensor_parallel import (
    estimate_decoder_tp_activation_bytes,
    estimate_decoder_tp_memory,
    estimate_tp_activation_bytes,
    estimate_tp_collectives,
    estimate_tp_layer_traffic,
    estimate_tp_state_bytes,
    estimate_tp_step_collectives,
    tp_local_shapes,
    tp_param_placements,
    tp_units,
)

CHAPTER = ModelConfig(vocab_size=96, d_model=64, nhead=4, dim_feedforward=128, num_layers=2)


def test_placements_name_every_parameter_of_the_parallel_model() -> None:
    from handbook_lib.runtime.model import build_model
    from handbook_lib.runtime.parallel_model import from_simple

    model = from_simple(build_model(CHAPTER, seed=0))
    built = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert [(p.name, p.shape) for p in tp_param_placements(CHAPTER)] == built
    assert sum(prod(s) for _, s in built) == param_count(CHAPTER)


def test_placements_split_rows_columns_or_replicate() -> None:
    dims = {p.name: p.tp_dim for p in tp_param_placements(CHAPTER)}
    assert dims["embedding.weight"] == 0 and dims["output.weight"] == 0 and dims["output.bias"] == 0
    assert dims["layers.0.self_attn.q_proj.weight"] == 0 and dims["layers.1.linear1.bias"] == 0
    assert dims["layers.0.self_attn.out_proj.weight"] == 1 and dims["layers.0.linear2.weight"] == 1
    assert dims["layers.0.self_attn.out_proj.bias"] is None and dims["layers.1.norm2.weight"] is None


def test_local_shapes_and_uneven_split_refused() -> None:
    local = dict(tp_local_shapes(CHAPTER, 2))
    assert local["layers.0.self_attn.out_proj.weight"] == (64, 32)
    assert local["layers.0.linear1.weight"] == (64, 64)
    assert local["embedding.weight"] == (48, 64)
    with pytest.raises(ValueError, match="tp_size=5 must divide"):
        tp_local_shapes(CHAPTER, 5)


def test_state_bytes_by_hand() -> None:
    # per layer TP-local: q,k,v 3·(32·64+32)=6240, out_proj 64·32+64=2112, linear1 64·64+64=4160,
    # linear2 64·64+64=4160, norms 4·64=256 -> 16928; root: 48·64 + 48·64 + 48 = 6192.
    # 2 layers + root = 40048 elements, halved by dp=2 (every dim 0 even): 20024 · 4 B = 80096.
    state = estimate_tp_state_bytes(CHAPTER, 2, 2, 0, "adamw")
    assert (state.param_shard_bytes, state.param_padding_bytes) == (80096, 0)
    assert state.optimizer_state_bytes == 2 * 80096
    assert state.optimizer_step_bytes == 4 * 35  # 35 tensors
    assert [u.numel for u in tp_units(CHAPTER, 2)] == [6192, 16928, 16928]


def test_state_padding_on_an_odd_dim() -> None:
    # vocab 48 over tp=2 -> 24 rows; over dp=... choose d=36 nhead=4 -> q rows 18 over dp=4: 5 rows padded
    cfg = ModelConfig(vocab_size=48, d_model=36, nhead=4, dim_feedforward=40, num_layers=1)
    last = estimate_tp_state_bytes(cfg, 2, 4, 3, "sgd")
    first = estimate_tp_state_bytes(cfg, 2, 4, 0, "sgd")
    assert first.param_padding_bytes == 0 < last.param_padding_bytes
    assert first.param_shard_bytes + first.param_padding_bytes == last.param_shard_bytes + last.param_padding_bytes
    assert last.optimizer_state_bytes == 0 and last.optimizer_step_bytes == 0


def test_tp_collectives_counts_without_and_with_sp() -> None:
    def kinds(calls, phase):
        return sorted(c.kind for c in calls if c.phase == phase)

    plain = estimate_tp_collectives(CHAPTER, 2, 32)
    assert kinds(plain, "forward") == ["all_reduce"] * 5 and kinds(plain, "backward") == ["all_reduce"] * 5
    assert {c.buffer_bytes for c in plain} == {32 * 64 * 4}
    sp = estimate_tp_collectives(CHAPTER, 2, 32, sequence_parallel=True)
    assert kinds(sp, "forward") == ["all_gather"] * 5 + ["reduce_scatter"] * 5
    assert kinds(sp, "backward") == ["all_gather"] * 5 + ["all_reduce"] * 8 + ["reduce_scatter"] * 5
    # same bytes on the wire for the activations: AG + RS = AR
    def big(calls):
        return sum(c.sent_bytes for c in calls if c.buffer_bytes == 8192)

    assert big(plain) == big(sp)


def test_step_collectives_add_fsdp_over_dp() -> None:
    calls = estimate_tp_step_collectives(CHAPTER, 2, 2, 2, 16)
    dp = [c for c in calls if c.axis == "dp"]
    assert sorted((c.kind, c.phase) for c in dp).count(("all_gather", "forward")) == 3
    assert sum(c.kind == "reduce_scatter" for c in dp) == 3
    assert {c.buffer_bytes for c in dp} == {6192 * 4, 16928 * 4}
    assert not [c for c in estimate_tp_step_collectives(CHAPTER, 2, 1, 2, 16) if c.axis == "dp"]


def test_activation_bytes_figures_measured_on_four_ranks() -> None:
    # measured by the run's StepMemoryTracker on 4 ranks (2 x 2), batch 4, seq 16, fp32
    assert estimate_tp_activation_bytes(CHAPTER, 2, 16, 2).total == 147464
    assert estimate_tp_activation_bytes(CHAPTER, 2, 16, 2, sequence_parallel=True).total == 130568


def test_activation_sp_saves_the_norm_terms() -> None:
    plain = estimate_tp_activation_bytes(CHAPTER, 2, 16, 2).per_layer
    sp = estimate_tp_activation_bytes(CHAPTER, 2, 16, 2, sequence_parallel=True).per_layer
    tokens = 32
    assert plain - sp == (2 * tokens * 64 * 4 + 16 * tokens) // 2


def test_layer_traffic_megatron_formula() -> None:
    d, tokens, t, c = 8192, 4096, 8, 2
    plain = estimate_tp_layer_traffic(d, tokens, t, c)
    assert plain.counts == {"all_reduce": 4}
    assert plain.sent_bytes == 8 * (t - 1) * tokens * d * c // t == 469_762_048
    sp = estimate_tp_layer_traffic(d, tokens, t, c, sequence_parallel=True)
    assert sp.counts == {"all_gather": 4, "reduce_scatter": 4} and sp.sent_bytes == plain.sent_bytes


def test_decoder_tp_activations_table2() -> None:
    shape = get_shape("70b")
    sbh = 4096 * 1 * 8192
    assert estimate_decoder_tp_activation_bytes(shape, 1, 4096, 1) == 80 * 34 * sbh
    assert estimate_decoder_tp_activation_bytes(shape, 1, 4096, 8) == 80 * (10 * sbh + 3 * sbh)
    assert estimate_decoder_tp_activation_bytes(shape, 1, 4096, 8, True) == 80 * 34 * sbh // 8


def test_decoder_tp_memory_shrinks_with_tp_and_refuses_bad_tp() -> None:
    shape = get_shape("70b")
    one = estimate_decoder_tp_memory(shape, 1, 64, 1, 4096)
    eight = estimate_decoder_tp_memory(shape, 8, 8, 1, 4096)
    assert abs(one.params_per_gpu - eight.params_per_gpu) / one.params_per_gpu < 0.01  # 64 GPUs either way
    assert eight.activation_bytes * 8 == one.activation_bytes
    assert eight.params_per_gpu * 64 == pytest.approx(shape.num_params, rel=0.01)
    with pytest.raises(ValueError, match="tp_size=3 must divide"):
        estimate_decoder_tp_memory(shape, 3, 1, 1, 4096)


def test_a_vocabulary_tp_does_not_divide_is_priced_padded() -> None:
    from dataclasses import replace

    from handbook_lib.models.tensor_parallel import tp_padded

    odd, even = replace(CHAPTER, vocab_size=97), replace(CHAPTER, vocab_size=98)
    assert tp_padded(odd, 2) == even and tp_padded(even, 2) is even and tp_padded(odd, 1) is odd
    local = dict(tp_local_shapes(odd, 2))
    assert local["embedding.weight"] == (49, 64) and local["output.bias"] == (49,)   # 98 rows / 2
    assert estimate_tp_state_bytes(odd, 2, 2, 1) == estimate_tp_state_bytes(even, 2, 2, 1)
    # the logits are the padded width: (98 / 2) · 4 B per token on top of 96's (96 / 2)
    acts = [estimate_tp_activation_bytes(c, 2, 8, 2).total for c in (CHAPTER, odd, even)]
    assert acts[1] == acts[2] == acts[0] + 2 * 8 * (49 - 48) * 4
