"""handbook_lib.sharding: FSDP's units, matching how training.apply_fsdp2 wraps the model."""

import pytest

from handbook_lib.model import ModelConfig, SimpleTransformer, TransformerLayer, param_count
from handbook_lib.sharding import Unit, check_world, fsdp_units


def test_units_partition_the_parameters_like_the_module():
    config = ModelConfig(vocab_size=101, d_model=16, nhead=2, dim_feedforward=24, num_layers=3)
    units = fsdp_units(config)
    assert [u.name for u in units] == ["root", "layers.0", "layers.1", "layers.2"]
    assert [u.root for u in units] == [True, False, False, False]
    model = SimpleTransformer(config)
    for i, layer in enumerate(model.layers):
        assert units[i + 1].numel == sum(p.numel() for p in layer.parameters())
        assert isinstance(layer, TransformerLayer)
    assert units[0].numel == model.embedding.weight.numel() + sum(p.numel() for p in model.output.parameters())
    assert sum(u.numel for u in units) == param_count(config)


def test_padded_numel_rounds_each_first_dimension_up():
    unit = Unit("u", ((5, 3), (4,)))
    assert unit.numel == 19
    assert unit.padded_numel(2) == 6 * 3 + 4       # 5 rows -> 6; 4 stays 4
    assert unit.padded_numel(4) == 8 * 3 + 4       # 5 rows -> 8
    assert unit.padded_numel(1) == unit.numel


def test_unit_rejects_bad_shapes():
    with pytest.raises(ValueError, match="shapes of unit"):
        Unit("u", ((3, -1),))


def test_check_world():
    check_world(3, 2)
    with pytest.raises(ValueError, match="world_size"):
        check_world(0)
    with pytest.raises(ValueError, match="rank"):
        check_world(2, 2)
