"""handbook_lib.models.sharding: FSDP's units, matching how parallelize.apply_fsdp2 wraps the model."""

import pytest

from handbook_lib.core import ModelConfig, check_world, param_count
from handbook_lib.models import Unit, shard_rows, wrap_units
from handbook_lib.runtime import SimpleTransformer, TransformerLayer


def test_units_partition_the_parameters_like_the_module():
    config = ModelConfig(vocab_size=101, d_model=16, nhead=2, dim_feedforward=24, num_layers=3)
    units = wrap_units(config)
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


def test_shard_rows_refuses_a_negative_dim0():
    with pytest.raises(ValueError, match=r"^dim0 must be an int >= 0, got -1$"):
        shard_rows(-1, 2, 0)


def test_check_world():
    check_world(3, 2)
    with pytest.raises(ValueError, match="world_size"):
        check_world(0)
    with pytest.raises(ValueError, match="rank"):
        check_world(2, 2)


SMALL = ModelConfig(vocab_size=1001, d_model=64, nhead=2, dim_feedforward=96, num_layers=2)


def test_layer_wrapping_is_the_default_units_and_model_wrapping_is_one_unit():
    from handbook_lib.models import wrap_units

    assert wrap_units(SMALL, "layer") == wrap_units(SMALL)
    (root,) = wrap_units(SMALL, "model")
    assert root.root and root.numel == param_count(SMALL)


@pytest.mark.parametrize("min_params", [5_000, 20_000, 30_000, 100_000, 10**9])
def test_size_wrapping_partitions_the_parameters(min_params):
    from handbook_lib.models import wrap_units

    units = wrap_units(SMALL, "size", min_params)
    assert units[0].root and sum(u.numel for u in units) == param_count(SMALL)
    assert all(u.numel >= min_params for u in units[1:])  # only big enough modules become units
    model = SimpleTransformer(SMALL)
    for unit in units[1:]:  # a unit holds its module's parameters minus those of nested units
        inside = sum(p.numel() for p in model.get_submodule(unit.name).parameters())
        nested = sum(u.numel for u in units[1:] if u.name.startswith(unit.name + "."))
        assert unit.numel == inside - nested
        assert "self_attn" not in unit.name  # attention is never a unit of its own


def test_size_wrapping_rejects_bad_arguments():
    from handbook_lib.models import wrap_units

    with pytest.raises(ValueError, match="wrap"):
        wrap_units(SMALL, "block")
    with pytest.raises(ValueError, match="min_params"):
        wrap_units(SMALL, "size", 0)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_flat_shards_pad_each_unit_once(world):
    from handbook_lib.models import estimate_flat_shard_bytes

    units = wrap_units(SMALL)
    shards = [estimate_flat_shard_bytes(units, world, r) for r in range(world)]
    assert sum(s.shard_bytes for s in shards) == 4 * param_count(SMALL)
    assert len({s.padded_bytes for s in shards}) == 1  # equal storage on every rank
    assert shards[0].padded_bytes == 4 * sum(u.flat_padded_numel(world) for u in units) // world
    assert all(u.flat_padded_numel(world) - u.numel < world for u in units)  # at most N-1 per unit
