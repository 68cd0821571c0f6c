"""handbook_lib.core.parallel_config: chapter 9's keys, and every shape refused in one line."""

import pytest

from handbook_lib.core.parallel_config import ParallelConfig


def test_parallel_config_splits_the_world_into_data_parallel_ranks():
    assert ParallelConfig(tp_size=2).data_parallel_size(4) == 2
    assert ParallelConfig(sp_size=4, sp_method="ring").data_parallel_size(4) == 1
    assert ParallelConfig().data_parallel_size(2) == 2
    assert ParallelConfig(tp_size=2, sequence_parallel=True).inner_size == 2


@pytest.mark.parametrize("keys, match", [
    ({"tp_size": 3}, "config key 'tp_size'=3 must divide 'nhead'=4 and 'dim_feedforward'=1024$"),
    ({"tp_size": 2, "nhead": 2, "d_model": 256, "dim_feedforward": 1023}, "'dim_feedforward'=1023"),
    ({"tp_size": 2, "sequence_parallel": True, "seq_len": 63}, "config key 'tp_size'=2 with 'sequence_parallel'=True must divide 'seq_len'=63$"),
    ({"sequence_parallel": True}, "'sequence_parallel'=True .* needs tp_size >= 2"),
    ({"sp_size": 3}, "config key 'sp_size'=3 must divide 'seq_len'=64$"),
    ({"sp_size": 8}, "config key 'sp_size'=8 with 'sp_method'=ulysses must divide 'nhead'=4 .*'sp_method'=ring needs neither"),
    ({"tp_size": 2, "sp_size": 2}, "set the other to 1"),
    ({"tp_size": 0}, "tp_size"),
    ({"sp_method": "rings"}, "accepted values: ulysses, ring"),
])
def test_parallel_config_refuses_each_shape_in_one_line_naming_the_key(keys, match):
    with pytest.raises(ValueError, match=match) as err:
        ParallelConfig(**keys)
    assert "\n" not in str(err.value)


def test_parallel_config_refuses_a_world_its_axes_do_not_divide():
    with pytest.raises(ValueError, match="config key 'tp_size'=2 must divide the number of ranks 3"):
        ParallelConfig(tp_size=2).data_parallel_size(3)
    with pytest.raises(ValueError, match="batch_size=6 must be divisible by the 4 data-parallel"):
        ParallelConfig(batch_size=6, sp_size=2, sp_method="ring").data_parallel_size(8)
    # a ring splits any sequence the heads do not divide
    assert ParallelConfig(sp_size=8, sp_method="ring").data_parallel_size(8) == 1


@pytest.mark.parametrize("keys, world, match", [
    ({"tp_size": 2, "strategy": "HYBRID_SHARD"}, 4, "tensor_parallel shards over dp with api='fsdp2', "
                                                    "strategy='FULL_SHARD' only; got api='fsdp2', strategy='HYBRID_SHARD'"),
    ({"tp_size": 2, "precision": "bf16-mixed"}, 4, "config key 'precision'='bf16-mixed' is not supported by "
                                                   "tensor_parallel \\(it runs precision='fp32'\\)"),
    ({"tp_size": 2, "steps": 1}, 4, "config key 'steps'=1: tensor_parallel measures its last step"),
    ({"tp_size": 2}, 3, "config key 'tp_size'=2 must divide the number of ranks 3"),
])
def test_check_runnable_refuses_what_chapter_9s_runs_do_not_do(keys, world, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**keys).check_runnable("tensor_parallel", world, shards_over="over dp")


def test_check_runnable_returns_the_data_parallel_size_and_checks_the_extra_keys():
    assert ParallelConfig(tp_size=2).check_runnable("tensor_parallel", 4, shards_over="over dp") == 2
    with pytest.raises(ValueError, match="config key 'sp_size'=2 is not supported by tensor_parallel"):
        ParallelConfig(sp_size=2).check_runnable("tensor_parallel", 4, shards_over="over dp",
                                                 also_default=("sp_size",))


@pytest.mark.parametrize("tp, vocab, padded", [(1, 10_001, 10_001), (2, 10_000, 10_000), (2, 10_001, 10_002),
                                               (2, 50_257, 50_258), (4, 50_257, 50_260), (8, 32_000, 32_000)])
def test_a_vocabulary_tp_does_not_divide_is_padded_not_refused(tp, vocab, padded):
    heads = {"nhead": 8, "d_model": 256, "dim_feedforward": 1024}
    config = ParallelConfig(tp_size=tp, vocab_size=vocab, **heads)
    assert config.padded_vocab_size == padded
    assert padded % tp == 0 and 0 <= padded - vocab < tp   # the smallest multiple of tp at or above vocab
