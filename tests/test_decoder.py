"""handbook_lib.runtime.decoder and the memory model's operator-by-operator count of a gated
decoder (models.activations.gated_decoder_tensors), against Transformers' own modules.

Three measurements, none computed from the model under test: Transformers' ``LlamaForCausalLM``
(and Qwen2's, Mistral's) built from a config and loaded into :class:`Decoder` gives the same
logits; the bytes autograd saves in Transformers' forward and loss equal the count; and what is
alive after :class:`Decoder`'s forward under each checkpointing policy equals the layout's
activations.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from handbook_lib.models import decoder_shape_from_hf, get_shape, model_layout  # noqa: E402
from handbook_lib.models.activations import gated_decoder_tensors  # noqa: E402
from handbook_lib.runtime.decoder import Decoder, measure_activation_bytes  # noqa: E402
from handbook_lib.runtime.recompute import apply_activation_checkpointing  # noqa: E402
from tests.storage_tracker import saved_bytes  # noqa: E402

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4)
CONFIGS = {
    "llama, grouped-query": dict(model_type="llama", **SMALL, num_key_value_heads=2),
    "llama, all heads, biases, tied": dict(model_type="llama", **SMALL, attention_bias=True, mlp_bias=True,
                                           tie_word_embeddings=True),
    "llama, head_dim 8": dict(model_type="llama", **SMALL, num_key_value_heads=1, head_dim=8),
    "mistral": dict(model_type="mistral", **SMALL, num_key_value_heads=2),
    "qwen2": dict(model_type="qwen2", **SMALL, num_key_value_heads=2),
}


def hf_model(config: dict, dtype: torch.dtype) -> torch.nn.Module:
    family = config["model_type"]
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    cfg = transformers.AutoConfig.for_model(family, **kwargs, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)


@pytest.mark.parametrize("name", CONFIGS)
def test_transformers_state_dict_loads_and_gives_the_same_logits(name):
    config = CONFIGS[name]
    hf = hf_model(config, torch.float32)
    ours = Decoder(decoder_shape_from_hf(config))
    ours.load_state_dict(hf.state_dict(), strict=True)  # the same names
    assert sum(p.numel() for p in ours.parameters()) == decoder_shape_from_hf(config).num_params
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(hf(input_ids=tokens).logits, ours(tokens))


@pytest.mark.parametrize("dtype, name", [("fp32", "llama, grouped-query"), ("bf16", "llama, grouped-query"),
                                         ("bf16", "llama, all heads, biases, tied"), ("fp32", "llama, head_dim 8"),
                                         ("bf16", "mistral"), ("bf16", "qwen2")])
@pytest.mark.parametrize("micro_batch, seq_len", [(2, 16), (1, 24)])
def test_transformers_saves_what_the_count_says(dtype, name, micro_batch, seq_len):
    config = CONFIGS[name]
    hf = hf_model(config, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    gen = torch.Generator().manual_seed(2)
    tokens, targets = (torch.randint(0, 300, (micro_batch, seq_len), generator=gen) for _ in range(2))
    # the loss as a training loop takes it (Transformers' labels= pads a copy of the labels by one)
    measured = saved_bytes(hf, lambda: F.cross_entropy(hf(input_ids=tokens).logits.float().flatten(0, 1),
                                                       targets.flatten()))
    layout = model_layout(decoder_shape_from_hf(config))
    assert layout.activations(micro_batch, seq_len, dtype).total == measured


def test_one_layer_by_hand():
    # 2 x 16 tokens, d 64, q 64, k 32 (2 of 4 heads), f 160, bf16: 2 norms of 32·64·(4+2+2) + 32·4,
    # Q + K + V + output = 32·(64+32+32+64)·2, log-sum-exp 4·4·32, four 32·160·2 of the feed-forward
    saved = gated_decoder_tensors(decoder_shape_from_hf(CONFIGS["llama, grouped-query"]), 2, 16, "bf16",
                                  q_width=64, kv_width=32)
    assert saved.per_layer == 2 * (32 * 64 * 8 + 128) + 32 * 192 * 2 + 512 + 4 * 32 * 160 * 2 == 86_784
    assert dict(saved.head)["RoPE cos and sin"] == 2 * 16 * 16 * 2
    # the widths a shape or a layout states are the defaults: grouped-query K and V are not d wide
    shape = decoder_shape_from_hf(CONFIGS["llama, grouped-query"])
    assert gated_decoder_tensors(shape, 2, 16, "bf16") == saved
    assert gated_decoder_tensors(model_layout(shape), 2, 16, "bf16") == saved


def test_llama2_70b_layer_is_48_5_sbh_in_bf16_where_korthikanti_counts_34():
    shape = get_shape("llama2-70b")
    s, h = 4096, shape.d_model
    layout = model_layout(shape)
    # 16·sbh of norms, (2·8192 + 2·1024)·2 / 8192 = 4.5 of attention, 4·28,672·2 / 8192 = 28 of SwiGLU
    assert layout.activations(1, s, "bf16").per_layer == s * h * (16 + 4.5 + 28) + s * (8 + 4 * 64)


@pytest.mark.parametrize("mode, every, matmul_every", [
    ("none", 1, 1), ("full", 1, 1), ("full", 2, 1), ("selective", 1, 1), ("selective", 1, 2), ("selective", 2, 2),
    ("selective", 1, 3), (True, 3, 1)])
@pytest.mark.parametrize("ac_save", ["matmul+attention", "matmul", "attention"])
def test_alive_after_forward_under_each_policy(mode, every, matmul_every, ac_save):
    if ac_save != "matmul+attention" and (mode != "selective" or (matmul_every > 1 and ac_save == "attention")):
        return  # a policy only selective checkpointing has, and a thinning of products it keeps
    shape = decoder_shape_from_hf(CONFIGS["llama, grouped-query"] | {"num_hidden_layers": 3})
    alive = measure_activation_bytes(shape, 2, 16, "bf16", activation_checkpointing=mode, every=every,
                                     matmul_every=matmul_every, ac_save=ac_save)
    expected = model_layout(shape).activations(2, 16, "bf16", activation_checkpointing=mode, every=every,
                                               matmul_every=matmul_every, ac_save=ac_save)
    assert alive == expected.total


def test_keeping_the_attention_only_keeps_its_output_and_log_sum_exp_beside_the_inputs():
    shape = decoder_shape_from_hf(CONFIGS["llama, grouped-query"] | {"num_hidden_layers": 3})
    full, attention = (measure_activation_bytes(shape, 2, 16, "bf16", activation_checkpointing=mode, ac_save=save)
                       for mode, save in (("full", "matmul+attention"), ("selective", "attention")))
    assert attention - full == 3 * (32 * 64 * 2 + 4 * 4 * 32)  # 3 layers: T·q·2 and 4·a·T


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_what_is_alive_is_what_transformers_saves(dtype):
    """Two measurements by different means agree: what :class:`Decoder`'s forward leaves alive, and
    the storages autograd saves in Transformers' forward."""
    config = CONFIGS["mistral"]
    hf = hf_model(config, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    gen = torch.Generator().manual_seed(5)
    tokens, targets = (torch.randint(0, 300, (3, 8), generator=gen) for _ in range(2))
    saved = saved_bytes(hf, lambda: F.cross_entropy(hf(input_ids=tokens).logits.float().flatten(0, 1),
                                                    targets.flatten()))
    assert measure_activation_bytes(decoder_shape_from_hf(config), 3, 8, dtype) == saved


def test_decoder_refuses_a_gpt_shape():
    with pytest.raises(ValueError, match="Llama family"):
        Decoder(get_shape("gpt3-175b"))


def test_decoder_is_checkpointable_and_trains_the_same():
    shape = decoder_shape_from_hf(CONFIGS["llama, grouped-query"])
    torch.manual_seed(0)
    plain = Decoder(shape)
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, "selective", 1, 2)
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(4))
    for model in (plain, wrapped):
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    grads = [(a.grad, b.grad) for a, b in zip(plain.parameters(), wrapped.parameters())]
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in grads)
