"""handbook_lib.runtime.model: the analytic parameter count must equal the module's, for every config."""

import itertools

import pytest
import torch

from handbook_lib.core import (
    ModelConfig,
    forward_modules,
    param_count,
    param_count_breakdown,
    param_shapes,
)
from handbook_lib.runtime import SimpleTransformer, build_model, count_parameters

CONFIGS = [
    ModelConfig(vocab_size=v, d_model=d, nhead=h, dim_feedforward=f, num_layers=n)
    for v, (d, h), f, n in itertools.product(
        (7, 100, 1001), ((8, 1), (12, 3), (64, 8)), (1, 17, 256), (1, 2, 5)
    )
]


def test_default_config_has_the_books_parameter_count():
    model = SimpleTransformer()
    total, trainable = count_parameters(model)
    # 9,868,560 is the figure the book (and its seed) states for the default config.
    assert total == trainable == 9_868_560
    assert param_count(ModelConfig()) == total


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_param_count_matches_module(config):
    model = SimpleTransformer(config)
    assert param_count(config) == count_parameters(model)[0]


@pytest.mark.parametrize("config", CONFIGS[::7], ids=str)
def test_param_shapes_match_named_parameters(config):
    model = SimpleTransformer(config)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == param_shapes(config)


@pytest.mark.parametrize("num_layers", [1, 3])
def test_forward_modules_is_the_order_hooks_see(num_layers):
    model = SimpleTransformer(ModelConfig(vocab_size=50, d_model=16, nhead=2, dim_feedforward=40,
                                          num_layers=num_layers))
    seen = []
    for name, module in model.named_modules():
        module.register_forward_pre_hook(lambda *_, name=name: seen.append(name))
    model(torch.zeros(2, 5, dtype=torch.long))
    assert seen == forward_modules(num_layers)


def test_breakdown_components_sum_to_total_and_match_submodules():
    config = ModelConfig(vocab_size=50, d_model=16, nhead=2, dim_feedforward=40, num_layers=3)
    model = SimpleTransformer(config)
    parts = param_count_breakdown(config)
    assert parts["embedding"] == count_parameters(model.embedding)[0]
    assert parts["output"] == count_parameters(model.output)[0]
    assert parts["attention"] == sum(count_parameters(layer.self_attn)[0] for layer in model.layers)
    ff = sum(count_parameters(layer.linear1)[0] + count_parameters(layer.linear2)[0] for layer in model.layers)
    assert parts["feed_forward"] == ff
    norms = sum(count_parameters(layer.norm1)[0] + count_parameters(layer.norm2)[0] for layer in model.layers)
    assert parts["norms"] == norms


def test_frozen_parameters_are_not_trainable():
    model = SimpleTransformer(ModelConfig(vocab_size=10, d_model=8, nhead=2, dim_feedforward=8, num_layers=1))
    model.embedding.weight.requires_grad_(False)
    total, trainable = count_parameters(model)
    assert total - trainable == 10 * 8


def test_forward_shape_and_causality():
    config = ModelConfig(vocab_size=20, d_model=16, nhead=2, dim_feedforward=32, num_layers=2)
    model = build_model(config, seed=0).eval()
    tokens = torch.randint(0, 20, (3, 6), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    assert logits.shape == (3, 6, 20)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 20
    # Changing the last token must not change the logits of earlier positions (causal mask)...
    torch.testing.assert_close(model(changed)[:, :-1], logits[:, :-1])
    # ...but does change the last position's.
    assert not torch.allclose(model(changed)[:, -1], logits[:, -1])


def test_build_model_is_deterministic_in_seed():
    config = ModelConfig(vocab_size=30, d_model=8, nhead=2, dim_feedforward=8, num_layers=1)
    a, b, c = build_model(config, seed=3), build_model(config, seed=3), build_model(config, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embedding.weight, c.embedding.weight)


@pytest.mark.parametrize("kwargs, match", [
    ({"d_model": 10, "nhead": 3}, "nhead=3 must divide d_model=10"),
    ({"num_layers": 0}, "num_layers"),
    ({"vocab_size": -1}, "vocab_size"),
    ({"d_model": 2.5}, "d_model"),
])
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kwargs)


def test_unmasked_model_has_the_same_weights_and_sees_later_tokens():
    config = ModelConfig(vocab_size=20, d_model=16, nhead=2, dim_feedforward=32, num_layers=2)
    causal, unmasked = build_model(config, seed=0).eval(), build_model(config, seed=0, causal=False).eval()
    assert causal.causal and not unmasked.causal
    # The flag adds no parameter and changes no weight.
    assert count_parameters(unmasked)[0] == param_count(config)
    assert all(torch.equal(a, b) for a, b in zip(causal.state_dict().values(), unmasked.state_dict().values()))
    tokens = torch.randint(0, 20, (3, 6), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 20
    # Without the mask, changing the last token changes the first position's logits.
    assert (unmasked(changed)[:, 0] - unmasked(tokens)[:, 0]).abs().max() > 1e-3
    # With one token, nothing lies ahead to see: the two models compute the same thing.
    torch.testing.assert_close(unmasked(tokens[:, :1]), causal(tokens[:, :1]))


@pytest.mark.parametrize("causal", [1, "no", None])
def test_causal_flag_must_be_bool(causal):
    with pytest.raises(ValueError, match="causal must be True or False"):
        SimpleTransformer(ModelConfig(vocab_size=5, d_model=4, nhead=1, dim_feedforward=4, num_layers=1),
                          causal=causal)


# --- every model form of the package, or a one-line refusal -----------------------------------

def test_param_count_of_a_decoder_shape_is_its_own_count():
    """A DecoderShape is not read as the handbook's model: Llama-2 7B is 6,738,415,616 (its
    paper's count), where the handbook's formula over the same fields gives 5,296,872,704."""
    from handbook_lib.models import get_shape, model_layout

    shape = get_shape("llama2-7b")
    assert param_count(shape) == shape.published_params == 6_738_415_616
    assert param_count(model_layout("llama2-7b")) == 6_738_415_616
    assert param_count_breakdown(shape) == shape.param_breakdown()
    assert sum(param_count_breakdown(shape).values()) == 6_738_415_616
    as_toy = ModelConfig(vocab_size=32_000, d_model=4096, nhead=32, dim_feedforward=11_008, num_layers=32)
    assert param_count(as_toy) == 5_296_872_704  # the wrong answer, for the record
    assert param_count(7_000_000_000) == 7_000_000_000


@pytest.mark.parametrize("model, fragment", [
    ("llama2-7b", "not the name 'llama2-7b': read a preset with handbook_lib.models.get_shape(name) first"),
    ({"model_type": "llama"}, "not a Transformers config: read it with handbook_lib.models.decoder_shape_from_hf"),
    (3.5, "not a float"),
    (True, "not a bool"),
    (-1, "param_count's model (a count) must be an int >= 0"),
])
def test_param_count_refuses_other_forms_in_one_line(model, fragment):
    with pytest.raises(ValueError) as err:
        param_count(model)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_param_shapes_needs_the_handbooks_model():
    from handbook_lib.models import get_shape

    with pytest.raises(ValueError, match="^param_shapes takes a ModelConfig, not a DecoderShape$"):
        param_shapes(get_shape("7b"))


def test_layers_are_bounded():
    from handbook_lib.core.architecture import MAX_LAYERS
    from handbook_lib.models import DecoderShape

    assert ModelConfig(num_layers=MAX_LAYERS).num_layers == MAX_LAYERS == 256
    with pytest.raises(ValueError, match=r"^ModelConfig.num_layers must be an int in \[1, 257\), got 10{12}$"):
        ModelConfig(num_layers=10**12)
    with pytest.raises(ValueError, match=r"^DecoderShape.num_layers must be an int in \[1, 257\)"):
        DecoderShape("deep", 10**12, 4096, 32)
    with pytest.raises(ValueError, match=r"^DecoderShape.tied_embeddings must be True or False, got 'false'$"):
        DecoderShape("x", 2, 64, 4, tied_embeddings="false")
