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
    ({"tp_size": 2, "sp_size": 2, "nhead": 2, "d_model": 32}, "config key 'tp_size'=2 x config key 'sp_size'=2 with "
     "'sp_method'=ulysses must divide 'nhead'=2 \\(each tensor rank's heads are split again"),
    ({"tp_size": 2, "sp_size": 2, "sp_method": "ring", "sequence_parallel": True, "seq_len": 6},
     "config key 'tp_size'=2 x config key 'sp_size'=2 with 'sequence_parallel'=True must divide 'seq_len'=6$"),
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


def test_tensor_and_sequence_axes_compose():
    config = ParallelConfig(tp_size=2, sp_size=2, sp_method="ring", sequence_parallel=True, seq_len=8)
    layout = config.parallel_layout(8)
    assert (layout.dp, layout.tp, layout.sp, layout.fsdp_size) == (2, 2, 2, 4)
    assert config.data_parallel_size(8) == 2 and config.inner_size == 4


@pytest.mark.parametrize("keys, world, match", [
    ({"tp_size": 2, "api": "fsdp1"}, 4, "config key 'api'='fsdp1' with tensor_parallel: the tensor and sequence axes "
                                        "compose with FSDP2 .*accepted: api='fsdp2'$"),
    ({"tp_size": 2, "count_gathered": True}, 4, "'count_gathered'=True with tensor_parallel: .*accepted: False$"),
    ({"tp_size": 2, "strategy": "DDP"}, 4, "config key 'strategy'='DDP': tensor_parallel shards with FSDP2; accepted: "
                                           "SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2$"),
    ({"tp_size": 2, "strategy": "HYBRID_SHARD"}, 4, "config key 'shard_group_size'=0: strategy 'HYBRID_SHARD' with "
                                                    "tp_size or sp_size needs"),
    ({"tp_size": 2, "steps": 1}, 4, "config key 'steps'=1: tensor_parallel measures its last step"),
    ({"tp_size": 2}, 3, "config key 'tp_size'=2 must divide the number of ranks 3"),
])
def test_check_runnable_refuses_only_what_no_layout_runs_here(keys, world, match):
    with pytest.raises(ValueError, match=match) as err:
        ParallelConfig(**keys).check_runnable("tensor_parallel", world)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("keys", [
    {"precision": "bf16-mixed"}, {"precision": "fp16-mixed"}, {"activation_checkpointing": "selective"},
    {"grad_accum_steps": 2, "sync_every_micro_step": True}, {"max_grad_norm": 1.0}, {"cpu_offload": True},
    {"lr_schedule": "cosine", "warmup_steps": 1}, {"strategy": "SHARD_GRAD_OP"}, {"wrap": "model"},
    {"strategy": "HYBRID_SHARD", "shard_group_size": 1}, {"explicit_prefetch": 1}, {"grad_accum_steps": 2, "reshard_after_backward": False},
])
def test_every_general_key_runs_with_the_axes(keys):
    """The keys chapter 9's runs once left at their defaults: each now passes, with TP and SP."""
    config = ParallelConfig(tp_size=2, sp_size=2, sp_method="ring", batch_size=4, **keys)
    assert config.check_runnable("tensor_parallel", 8) == 2


@pytest.mark.parametrize("tp, vocab, padded", [(1, 10_001, 10_001), (2, 10_000, 10_000), (2, 10_001, 10_002),
                                               (2, 50_257, 50_258), (4, 50_257, 50_260), (8, 32_000, 32_000)])
def test_a_vocabulary_tp_does_not_divide_is_padded_not_refused(tp, vocab, padded):
    heads = {"nhead": 8, "d_model": 256, "dim_feedforward": 1024}
    config = ParallelConfig(tp_size=tp, vocab_size=vocab, **heads)
    assert config.padded_vocab_size == padded
    assert padded % tp == 0 and 0 <= padded - vocab < tp   # the smallest multiple of tp at or above vocab
