"""handbook_lib.runtime.parallel_model: the split-attention model computes the book's model."""

import pytest
import torch

from handbook_lib.core.architecture import ModelConfig, param_count
from handbook_lib.runtime.model import build_model
from handbook_lib.runtime.parallel_model import (
    ParallelTransformer,
    SplitAttention,
    causal_attention,
    from_simple,
)


@pytest.mark.parametrize("config", [ModelConfig(vocab_size=50, d_model=32, nhead=4, dim_feedforward=48,
                                                num_layers=2),
                                    ModelConfig(vocab_size=17, d_model=24, nhead=3, dim_feedforward=40,
                                                num_layers=1)])
def test_from_simple_gives_the_same_logits_and_gradients(config):
    torch.manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (3, 7))
    simple = build_model(config, seed=0)
    split = from_simple(simple)
    assert sum(p.numel() for p in split.parameters()) == param_count(config)
    a, b = simple(tokens), split(tokens)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    a.square().mean().backward()
    b.square().mean().backward()
    in_proj = simple.layers[0].self_attn.in_proj_weight.grad
    q, k, v = (getattr(split.layers[0].self_attn, n).weight.grad for n in ("q_proj", "k_proj", "v_proj"))
    torch.testing.assert_close(torch.cat([q, k, v]), in_proj, rtol=1e-4, atol=1e-6)


def test_the_core_is_causal_and_replaceable():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 5, 3, 4) for _ in range(3))
    out = causal_attention(q, k, v)
    # position 0 attends only to itself: its output is its own value
    torch.testing.assert_close(out[:, 0], v[:, 0])
    attn = SplitAttention(12, 3)
    seen = []
    attn.core = lambda q, k, v: seen.append(q.shape) or v
    attn(torch.randn(2, 5, 12))
    assert seen == [torch.Size([2, 5, 3, 4])]
    model = ParallelTransformer(ModelConfig(vocab_size=9, d_model=12, nhead=3, dim_feedforward=8, num_layers=2))
    model.set_core(attn.core)
    assert all(layer.self_attn.core is attn.core for layer in model.layers)


def test_refusals():
    with pytest.raises(ValueError, match="nhead=5 must divide d_model=12"):
        SplitAttention(12, 5)
    with pytest.raises(ValueError, match="causal"):
        from_simple(build_model(ModelConfig(vocab_size=9, d_model=12, nhead=3, dim_feedforward=8,
                                            num_layers=1), causal=False))


def test_a_padded_vocabulary_adds_rows_the_loss_never_sees():
    from handbook_lib.runtime.parallel_model import PAD_LOGIT_BIAS

    config = ModelConfig(vocab_size=51, d_model=16, nhead=2, dim_feedforward=24, num_layers=1)
    torch.manual_seed(2)
    tokens, targets = torch.randint(0, 51, (2, 6)), torch.randint(0, 51, (2, 6))
    simple = build_model(config, seed=0, causal=True)
    padded = from_simple(simple, vocab_size=54)
    assert padded.embedding.weight.shape == (54, 16) and padded.output.weight.shape == (54, 16)
    assert not padded.embedding.weight[51:].any() and not padded.output.weight[51:].any()
    logits = padded(tokens)
    torch.testing.assert_close(logits[..., :51], simple(tokens), rtol=1e-5, atol=1e-6)
    assert (logits[..., 51:] == PAD_LOGIT_BIAS).all()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    want = torch.nn.functional.cross_entropy(simple(tokens).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0.0)
    loss.backward()
    # the padded rows' softmax is exactly 0 in fp32: their gradients are 0, they stay as built
    assert not padded.output.weight.grad[51:].any() and not padded.output.bias.grad[51:].any()
    assert not padded.embedding.weight.grad[51:].any()
    with pytest.raises(ValueError, match="vocab_size=50 is below the model's vocabulary"):
        from_simple(simple, vocab_size=50)
