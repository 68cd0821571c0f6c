"""handbook_lib.models.sharding: FSDP's units, matching how parallelize.apply_fsdp2 wraps the model."""

import math

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


def _fsdp2_rows(dim0: int, world: int, rank: int) -> tuple[int, int]:
    """Rows of a dim 0 of ``dim0`` that FSDP2 gives ``rank``, and the rows of its padded buffer,
    computed as FSDP2 does: ``torch.chunk`` along dim 0 (which may return fewer than ``world``
    chunks: the missing ranks get empty ones), every rank's buffer as large as chunk 0."""
    import torch

    chunks = list(torch.chunk(torch.empty(dim0, 0), world, dim=0))
    chunks += [chunks[0].new_empty(0, 0)] * (world - len(chunks))
    return chunks[rank].shape[0], chunks[0].shape[0]


def test_shards_and_padding_match_fsdp2s_chunks_for_any_vocabulary_and_world():
    """The prediction FSDP2's padding check uses, for vocabularies smaller than, equal to and
    larger than the world (1 row on 2 ranks: rank 1 holds nothing and pads a whole row), against
    torch.chunk's own cut of each parameter of the real model."""
    import torch

    from handbook_lib.models import model_layout

    checked = 0
    for vocab in [*range(1, 20), 31, 32, 33, 97, 101]:
        config = ModelConfig(vocab_size=vocab, d_model=8, nhead=2, dim_feedforward=12, num_layers=1)
        with torch.device("meta"):
            shapes = [tuple(p.shape) for p in SimpleTransformer(config).parameters()]
        layout = model_layout(config)
        for world in range(1, 18):
            for rank in range(world):
                real = padded = 0
                for shape in shapes:
                    rows, chunk = _fsdp2_rows(shape[0], world, rank)
                    width = 4 * math.prod(shape[1:])
                    real += rows * width
                    padded += chunk * width
                got = layout.shard_bytes(world, rank)
                assert (got.shard_bytes, got.padding_bytes) == (real, padded - real), (vocab, world, rank)
                checked += 1
    assert checked > 3000
    one = model_layout(ModelConfig(vocab_size=1, d_model=256, nhead=4, dim_feedforward=1024, num_layers=6))
    # rank 1 of 2: the embedding's row and the head's row and bias are all on rank 0; rank 1 pads them
    assert one.shard_bytes(2, 1).padding_bytes == 4 * (256 + 256 + 1) == 2052
    assert one.shard_bytes(2, 0).padding_bytes == 0


def test_a_vocabulary_smaller_than_the_world_passes_its_padding_check():
    """One real 2-rank run with a 1-token vocabulary: rank 1 holds no row of the embedding and the
    head, and FSDP2 gives it a padded buffer of one row each (and one bias element)."""
    from handbook_lib.launch import torchrun

    result = torchrun("fsdp_train", 2, {"vocab_size": 1, "d_model": 16, "nhead": 2, "dim_feedforward": 24,
                                        "num_layers": 1, "seq_len": 8, "steps": 1}, stream=False,
                      allow_failed_checks=True)
    padding = {c.rank: (c.predicted, c.measured) for c in result.checks if c.quantity == "param_padding_bytes"}
    assert padding == {0: (0, 0), 1: (4 * (16 + 16 + 1), 4 * (16 + 16 + 1))}
    assert not result.failed_checks()
