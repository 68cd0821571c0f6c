"""handbook_lib.models.presets: decoder shapes whose counts match the published ones."""

import pytest

from handbook_lib.models import DECODER_SHAPES, DecoderShape, get_shape


@pytest.mark.parametrize("name", ["llama2-7b", "llama2-13b", "llama2-70b", "gpt3-175b"])
def test_counts_within_one_percent_of_published(name):
    shape = DECODER_SHAPES[name]
    assert abs(shape.num_params - shape.published_params) / shape.published_params < 0.01
    assert shape.source


def test_llama2_7b_by_hand():
    # 32 layers of: q,k,v,o 4·4096², SwiGLU 3·4096·11008, two RMSNorms 2·4096;
    # untied embedding and head 2·32000·4096; final norm 4096.
    layer = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    assert get_shape("llama2-7b").num_params == 32 * layer + 2 * 32000 * 4096 + 4096


def test_grouped_query_attention_shrinks_k_and_v():
    mha = DecoderShape("a", 1, 64, 8, 10, dim_feedforward=128, gated_mlp=True)
    gqa = DecoderShape("b", 1, 64, 8, 10, dim_feedforward=128, gated_mlp=True, num_kv_heads=2)
    assert mha.layer_params - gqa.layer_params == 2 * 64 * (64 - 16)


def test_gpt_style_defaults_follow_the_12_d_squared_rule():
    shape = DecoderShape("g", 2, 32, 4, 100, bias=True)
    d = 32
    assert shape.layer_params == 12 * d * d + 13 * d  # weights 12d², biases 4d + 5d, two LayerNorms 4d
    assert shape.num_params == 2 * shape.layer_params + 100 * d + 2 * d


def test_aliases_and_errors():
    assert get_shape("7b") is get_shape("llama2-7b")
    with pytest.raises(ValueError, match="llama2-7b"):
        get_shape("llama3")
    with pytest.raises(ValueError, match="divide"):
        DecoderShape("x", 1, 10, 3)
    with pytest.raises(ValueError, match=r"^DecoderShape.num_layers must be an int >= 1, got 0$"):
        DecoderShape("x", 0, 8, 2)


def test_head_dim_and_the_bias_flags_by_hand():
    # d = 10, 3 heads of width 8 (q = 24), 1 key/value head (k = 8), gated f = 16:
    # Q, K, V, O weights 2·10·24 + 2·10·8; biases on Q, K, V 24 + 2·8, on O 10;
    # gate, up, down 3·10·16 plus biases 2·16 + 10; two RMSNorms 2·10.
    shape = DecoderShape("h", 1, 10, 3, 5, dim_feedforward=16, gated_mlp=True, num_kv_heads=1, head_dim=8,
                         qkv_bias=True, out_bias=True, mlp_bias=True)
    assert shape.head_width == 8
    assert shape.layer_params == 2 * 10 * 24 + 2 * 10 * 8 + 24 + 16 + 10 + 3 * 10 * 16 + 2 * 16 + 10 + 2 * 10
    plain = DecoderShape("p", 1, 10, 3, 5, dim_feedforward=16, gated_mlp=True, num_kv_heads=1, head_dim=8)
    assert shape.layer_params - plain.layer_params == 24 + 16 + 10 + 2 * 16 + 10
    with pytest.raises(ValueError, match=r"^DecoderShape.head_dim must be an int >= 0, got -1$"):
        DecoderShape("x", 1, 12, 3, head_dim=-1)
