"""handbook_lib.models.activations: the per-tensor count against what autograd really saves."""

import pytest
import torch
import torch.nn.functional as F

from handbook_lib.core import ModelConfig
from handbook_lib.models import (
    DECODER_SHAPES,
    DecoderShape,
    estimate_activation_bytes,
    estimate_decoder_activation_bytes,
)
from handbook_lib.models import model_layout
from handbook_lib.runtime import build_model
from tests.storage_tracker import saved_bytes


def saved_activation_bytes(config: ModelConfig, micro_batch: int, seq_len: int) -> int:
    """Measure: bytes of the distinct storages autograd saves in one forward + loss, parameters excluded."""
    model = build_model(config, seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (micro_batch, seq_len), generator=gen)
    targets = torch.randint(0, config.vocab_size, (micro_batch, seq_len), generator=gen)
    return saved_bytes(model, lambda: F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten()))


@pytest.mark.parametrize("config, micro_batch, seq_len", [
    (ModelConfig(vocab_size=300, d_model=32, nhead=2, dim_feedforward=64, num_layers=2), 2, 16),
    (ModelConfig(vocab_size=1001, d_model=64, nhead=4, dim_feedforward=96, num_layers=3), 4, 24),
    (ModelConfig(vocab_size=50, d_model=48, nhead=3, dim_feedforward=200, num_layers=1), 3, 7),
])
def test_fp32_count_equals_saved_tensors(config, micro_batch, seq_len):
    measured = saved_activation_bytes(config, micro_batch, seq_len)
    assert estimate_activation_bytes(config, micro_batch, seq_len).total == measured


def test_checkpointing_keeps_layer_inputs_and_recomputes_one_layer():
    config = ModelConfig(vocab_size=100, d_model=32, nhead=2, dim_feedforward=64, num_layers=4)
    full = estimate_activation_bytes(config, 2, 8)
    ac = estimate_activation_bytes(config, 2, 8, activation_checkpointing=True)
    tokens = 2 * 8
    assert ac.layers == 4 * tokens * 32 * 4 and ac.head == full.head + 8 * 8  # and the s² bool mask
    assert ac.recompute == full.per_layer and full.recompute == 0
    assert ac.total < full.total


def test_selective_keeps_the_matrix_products_and_attention_outputs():
    config = ModelConfig(vocab_size=100, d_model=32, nhead=2, dim_feedforward=64, num_layers=4)
    none = estimate_activation_bytes(config, 2, 8, activation_checkpointing="none")
    full = estimate_activation_bytes(config, 2, 8, activation_checkpointing="full")
    sel = estimate_activation_bytes(config, 2, 8, activation_checkpointing="selective")
    t, d, f, h = 16, 32, 64, 2
    kept = t * (3 * d + d + d + f + d) * 4 + 4 * h * t  # QKV, attention out + lse, out proj, linear1, linear2
    assert sel.layers == full.layers + 4 * kept and sel.head == full.head == none.head + 8 * 8
    assert sel.recompute == none.per_layer - kept  # the recomputed layer holds the rest
    assert full.total < sel.total < none.total
    assert none == estimate_activation_bytes(config, 2, 8)  # False, "none": the same


def test_selective_decoder_is_22_sbh_for_gpt3():
    from handbook_lib.models import model_layout

    layout = model_layout("gpt3-175b")
    s, b, hdim = 2048, 1, 12288
    sel = layout.activations(b, s, "bf16", activation_checkpointing="selective")
    none = layout.activations(b, s, "bf16")
    # input 2, QKV 6, attention 2, out proj 2, fc1 8, fc2 2: 22·s·b·h, plus the fp32 lse (4·a·s·b)
    assert sel.layers == 96 * (22 * s * b * hdim + 4 * 96 * s * b)
    assert none.per_layer == 34 * s * b * hdim and sel.recompute == none.per_layer - (sel.layers // 96 - 2 * s * b * hdim)


def test_bf16_halves_the_compute_tensors_not_the_fp32_ones():
    config = ModelConfig()
    fp32 = estimate_activation_bytes(config, 4, 64, "fp32")
    bf16 = estimate_activation_bytes(config, 4, 64, "bf16")
    tokens, d, f = 4 * 64, config.d_model, config.dim_feedforward
    assert fp32.per_layer - bf16.per_layer == tokens * (8 * d + 2 * f) * 2 + 64**2 * 2  # and the mask
    assert fp32.head - bf16.head == tokens * d * 2  # the log-softmax output stays fp32


def test_decoder_formula_matches_the_paper_by_hand():
    shape = DecoderShape("t", num_layers=2, d_model=8, nhead=2, vocab_size=10)
    s, b, h, a = 16, 3, 8, 2
    assert estimate_decoder_activation_bytes(shape, b, s, fused_attention=False) == 2 * (s * b * h * 34 + 5 * a * s * s * b)
    assert estimate_decoder_activation_bytes(shape, b, s) == 2 * 34 * s * b * h
    assert estimate_decoder_activation_bytes(shape, b, s, recompute="attention") == 2 * 34 * s * b * h
    assert estimate_decoder_activation_bytes(shape, b, s, recompute="full") == 2 * 2 * s * b * h


@pytest.mark.parametrize("call, match", [
    (lambda: estimate_activation_bytes(ModelConfig(), 0, 8), "micro_batch"),
    (lambda: estimate_activation_bytes(ModelConfig(), 2, -1), "seq_len"),
    (lambda: estimate_activation_bytes(ModelConfig(), 2, 8, "int8"), "fp32, bf16, fp16"),
    (lambda: estimate_decoder_activation_bytes(DECODER_SHAPES["7b"], 1, 8, recompute="some"), "none, attention, full"),
])
def test_bad_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_checkpointing_every_kth_layer_keeps_the_others_whole():
    """``every`` k: layers 0, k, 2k, ... keep their input (and the policy's tensors), the others
    their whole share; 5 layers every 2nd: 3 checkpointed, 2 whole, by hand."""
    from handbook_lib.models.activations import checkpointed

    acts = checkpointed(100, 10, {"selective": 30, "full": 0}, 5, 7, "full", every=2)
    assert acts.by_layer == (10, 100, 10, 100, 10) and acts.layers == 230 and acts.total == 237
    assert acts.checkpointed_layers == (True, False, True, False, True) and acts.recompute == 100
    sel = checkpointed(100, 10, {"selective": 30, "full": 0}, 5, 7, "selective", every=3)
    assert sel.by_layer == (40, 100, 100, 40, 100) and sel.recompute == 70
    assert checkpointed(100, 10, {"full": 0}, 3, 0, "full").by_layer == (10, 10, 10)
    with pytest.raises(ValueError, match="needs activation checkpointing"):
        checkpointed(100, 10, {"full": 0}, 3, 0, "none", every=2)
    with pytest.raises(ValueError, match="every"):
        checkpointed(100, 10, {"full": 0}, 3, 0, "full", every=0)


def test_every_second_product_keeps_the_odd_ones_in_forward_order():
    from handbook_lib.models.activations import kept_products

    assert kept_products((3, 5, 7, 11)) == 26 and kept_products((3, 5, 7, 11), 2) == 10
    assert kept_products((3, 5, 7, 11), 3) == 14 and kept_products((3, 5, 7, 11), 9) == 3
    with pytest.raises(ValueError, match="matmul_every=2 .* needs activation checkpointing 'selective', got 'full'"):
        kept_products((3, 5), 2, "full")
    with pytest.raises(ValueError, match="matmul_every"):
        kept_products((3, 5), 0)


def test_torchtitans_op_policy_on_llama_keeps_q_v_gate_and_down():
    layout = model_layout("llama2-7b")
    b, s, d, f, a = 1, 4096, 4096, 11_008, 32
    t = b * s
    whole = layout.activations(b, s, "bf16", activation_checkpointing="selective")
    thinned = layout.activations(b, s, "bf16", activation_checkpointing="selective", matmul_every=2)
    # every product: Q, K, V, O, gate, up, down and the attention's output; every 2nd: Q, V, gate, down
    assert whole.by_layer[0] == t * d * 2 + t * (d + d + d + d + f + f + d + d) * 2 + 4 * a * t
    assert thinned.by_layer[0] == t * d * 2 + t * (d + d + f + d + d) * 2 + 4 * a * t
    gpt = model_layout("gpt3-175b")  # fused QKV, output, up, down: keeps QKV and up
    h = gpt.d_model
    kept = gpt.activations(1, 2048, "bf16", activation_checkpointing="selective", matmul_every=2).by_layer[0]
    assert kept == 2048 * h * 2 + 2048 * (3 * h + 4 * h + h) * 2 + 4 * gpt.nhead * 2048


@pytest.mark.parametrize("ac_save", ["matmul+attention", "matmul", "attention"])
def test_each_selective_policy_leaves_alive_what_the_count_says(ac_save):
    """The handbook's model checkpointed with each policy: what its forward and loss leave alive,
    measured by the storages its operators create (parameters and inputs excluded)."""
    from handbook_lib.runtime.measure import NewBytesPeak
    from handbook_lib.runtime.recompute import apply_activation_checkpointing

    config = ModelConfig(vocab_size=300, d_model=32, nhead=2, dim_feedforward=64, num_layers=3)
    model = build_model(config, seed=0)
    apply_activation_checkpointing(model, "selective", 1, 1, ac_save)
    gen = torch.Generator().manual_seed(0)
    with NewBytesPeak() as made:
        tokens, targets = (torch.randint(0, 300, (2, 16), generator=gen) for _ in range(2))
        loss = F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
        alive = made.live - loss.nbytes
    loss.backward()
    assert alive == estimate_activation_bytes(config, 2, 16, activation_checkpointing="selective",
                                              ac_save=ac_save).total


def test_a_thinned_policy_needs_the_selective_mode_by_its_config_key():
    from handbook_lib.core import RunConfig

    with pytest.raises(ValueError, match="config key 'ac_save'='matmul' chooses what the selective policy keeps"):
        RunConfig(activation_checkpointing="full", ac_save="matmul")
    with pytest.raises(ValueError, match="'ac_matmul_every'=2 thins the kept matrix products, and ac_save="
                                         "'attention' keeps none"):
        RunConfig(activation_checkpointing="selective", ac_save="attention", ac_matmul_every=2)
    with pytest.raises(ValueError, match="ac_save"):
        RunConfig(activation_checkpointing="selective", ac_save="products")

    with pytest.raises(ValueError, match="config key 'ac_matmul_every'=2 .* needs activation_checkpointing "
                                         "'selective', got 'full'"):
        RunConfig(activation_checkpointing="full", ac_matmul_every=2)
    with pytest.raises(ValueError, match="ac_matmul_every"):
        RunConfig(activation_checkpointing="selective", ac_matmul_every=0)
