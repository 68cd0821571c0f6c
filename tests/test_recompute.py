"""handbook_lib.models.recompute: what each checkpointing policy recomputes, in FLOPs."""

import pytest

from handbook_lib.models import (
    FULL,
    CheckpointPolicy,
    estimate_step_flops,
    gated_decoder_tensors,
    get_shape,
    model_layout,
    product_weights,
    recompute_flops,
)
from handbook_lib.core.architecture import ModelConfig

TOKENS, SEQ = 2 * 4096, 4096


def _flops(name, policy, tokens=TOKENS, seq=SEQ):
    return recompute_flops(model_layout(name), tokens, seq, policy)


@pytest.mark.parametrize("name", ["llama2-7b", "llama2-70b", "gpt3-175b", "llama3-405b"])
def test_full_recomputation_of_every_layer_is_the_step_flops_own(name):
    lay = model_layout(name)
    step = estimate_step_flops(lay.num_params, TOKENS, seq_len=SEQ, num_layers=lay.num_layers,
                               attention_width=lay.attention_width, activation_checkpointing=True)
    assert _flops(name, FULL) == step.recompute == 2 * lay.num_params * TOKENS + step.attention // 3


def test_every_kth_layer_recomputes_the_checkpointed_layers_share():
    lay = model_layout("llama2-7b")  # 32 layers: every 3rd checkpoints 0, 3, ..., 30, 11 of them
    whole = _flops("llama2-7b", FULL)
    assert _flops("llama2-7b", CheckpointPolicy(every=3)) == whole * 11 // 32
    assert _flops("llama2-7b", CheckpointPolicy(every=2)) == whole // 2
    assert _flops("llama2-7b", CheckpointPolicy(every=32)) == whole // 32
    assert lay.num_layers == 32


def test_product_weights_are_a_layer_s_matrices():
    # Llama-2 7B: d 4,096, f 11,008, MHA; a layer's parameters less its two RMSNorm weights
    d, f = 4096, 11008
    assert product_weights(model_layout("llama2-7b")) == (d * d, d * d, d * d, d * d, d * f, d * f, f * d)
    for name in ("llama2-70b", "llama3-405b"):  # GQA: the layout's layer, counted from the shape, less 2 norms
        lay, shape = model_layout(name), get_shape(name)
        assert sum(product_weights(lay)) == dict(lay.tensors)["layers.0"][0] - 2 * shape.d_model
        assert len(product_weights(lay)) == len(gated_decoder_tensors(shape, 1, 8, "bf16").products)
    # a GPT's fused QKV, output, up, down; the handbook's model the same
    d = 12288
    assert product_weights(model_layout("gpt3-175b")) == (3 * d * d, d * d, 4 * d * d, 4 * d * d)
    c = ModelConfig()
    assert product_weights(model_layout(c)) == (3 * c.d_model**2, c.d_model**2, c.d_model * c.dim_feedforward,
                                                c.dim_feedforward * c.d_model)


def test_selective_policies_recompute_what_they_do_not_keep():
    d, f, layers = 4096, 11008, 32
    # keeping every product and the attention: pointwise operators only, no FLOPs in this count
    assert _flops("llama2-7b", CheckpointPolicy("selective")) == 0
    # torchtitan's every 2nd product keeps Q, V, gate, down: K, output and up run again
    assert _flops("llama2-7b", CheckpointPolicy("selective", matmul_every=2)) == \
        layers * 2 * TOKENS * (d * d + d * d + d * f)
    # every 3rd keeps Q, output, down: K, V, gate, up again
    assert _flops("llama2-7b", CheckpointPolicy("selective", matmul_every=3)) == \
        layers * 2 * TOKENS * (2 * d * d + 2 * d * f)
    # products kept, attention's core again: 4·w·s FLOPs per token and layer
    assert _flops("llama2-7b", CheckpointPolicy("selective", save="matmul")) == layers * 4 * d * SEQ * TOKENS
    # attention kept, every product again: the layer's matrices, 2 FLOPs per weight per token
    assert _flops("llama2-7b", CheckpointPolicy("selective", save="attention")) == \
        layers * 2 * TOKENS * (4 * d * d + 3 * d * f)
    # and thinned to every 2nd layer
    assert _flops("llama2-7b", CheckpointPolicy("selective", matmul_every=2, every=2)) == \
        16 * 2 * TOKENS * (2 * d * d + d * f)


def test_labels_name_the_policy():
    assert FULL.label == "full"
    assert CheckpointPolicy(every=2).label == "full, every 2nd layer"
    assert CheckpointPolicy("selective", matmul_every=2).label == "selective, every 2nd product"
    assert CheckpointPolicy("selective", save="matmul", every=3).label == "selective (matmul), every 3rd layer"
    assert CheckpointPolicy("selective", matmul_every=11).label == "selective, every 11th product"
    assert CheckpointPolicy().memory_args() == {"activation_checkpointing": "full", "ac_every": 1,
                                                "ac_matmul_every": 1, "ac_save": "matmul+attention"}


@pytest.mark.parametrize("kwargs, words", [
    ({"mode": "none"}, "activation_checkpointing must be full or selective"),
    ({"every": 0}, "ac_every"),
    ({"save": "matmul"}, "ac_save='matmul'"),
    ({"save": "everything", "mode": "selective"}, "ac_save must be one of"),
    ({"matmul_every": 2}, "matmul_every=2"),
    ({"mode": "selective", "save": "attention", "matmul_every": 2}, "keeps none"),
])
def test_a_policy_that_cannot_be_is_refused(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        CheckpointPolicy(**kwargs)


def test_negative_counts_are_refused():
    with pytest.raises(ValueError, match="tokens"):
        recompute_flops(model_layout("llama2-7b"), -1, SEQ)
