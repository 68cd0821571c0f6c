"""handbook_lib.runs.tensor_parallel: TP x FSDP2 on 4 ranks as 2 x 2, with and without sequence
parallelism, for a shape other than the chapter's; every check exact (losses 1e-5)."""

import pytest

from handbook_lib.core.parallel_config import ParallelConfig
from handbook_lib.launch import torchrun_batch
from handbook_lib.runs.tensor_parallel import validate

# not the chapter's shape: d 32, vocab 50 (25 rows per TP rank: FSDP2 pads 13/12 over dp=2), seq 8
SHAPE = {"vocab_size": 50, "d_model": 32, "nhead": 4, "dim_feedforward": 64, "num_layers": 2,
         "batch_size": 4, "seq_len": 8, "steps": 3, "tp_size": 2}


GPT2_VOCAB = 50_257
"""GPT-2's vocabulary, which 2 tensor ranks do not divide: padded to 50,258 rows."""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    configs = {"plain": SHAPE, "sp": {**SHAPE, "sequence_parallel": True},
               "gpt2_vocab": {**SHAPE, "vocab_size": GPT2_VOCAB}}
    return torchrun_batch("tensor_parallel", 4, configs, out=tmp_path_factory.mktemp("tp"), timeout_s=300,
                          stream=False)


@pytest.mark.parametrize("label", ["plain", "sp", "gpt2_vocab"])
def test_every_check_passes(results, label):
    result = results[label]
    assert not result.failed_checks()
    quantities = {c.quantity for c in result.checks}
    for name in ("vocab_padding_rows", "param_shard_bytes", "param_padding_bytes", "grad_shard_bytes", "optimizer_state_bytes",
                 "activation_bytes", "collectives_matched", "sent_bytes", "loss_step3"):
        assert name in quantities
    assert all(c.tolerance == 0 for c in result.checks if not c.quantity.startswith("loss"))


def test_padding_appears_on_the_last_dp_rank(results):
    # vocabulary rows 25 per TP rank over dp=2: 13 and 12, padded to 13 (embedding and head:
    # 32 + 32 + 1 elements of one row -> 65 · 4 B = 260 B of padding on dp rank 1, ranks 2 and 3)
    ranks = results["plain"].ranks
    assert [ranks[r]["param_padding_bytes"] for r in range(4)] == [0, 0, 260, 260]


def test_gpt2_vocabulary_is_padded_by_one_row_and_trains_as_the_unpadded_model(results):
    result = results["gpt2_vocab"]
    rank = result.ranks[0]
    assert (rank["vocab_size"], rank["padded_vocab_size"]) == (GPT2_VOCAB, GPT2_VOCAB + 1)
    padding = [c for c in result.checks if c.quantity == "vocab_padding_rows"]
    assert [(c.predicted, c.measured) for c in padding] == [(1, 1)] * 4
    # one process trains the unpadded model on the whole batch: the padded logits never count
    losses = [c for c in result.checks if c.quantity.startswith("loss_step")]
    assert len(losses) == 3 and all(c.ok for c in losses)
    # each TP rank holds 25,129 rows of the embedding and the head (+ the head's bias), before
    # FSDP2 halves them over dp=2 (12,565 and 12,564 rows, padded to 12,565)
    plain = results["plain"].ranks[0]["param_shard_bytes"]
    rows = 12_565 - 13   # 50 vocabulary rows gave 13 per dp shard
    assert rank["param_shard_bytes"] - plain == rows * (32 + 32 + 1) * 4


def test_collectives_per_layer_with_and_without_sp(results):
    def tp_calls(label):  # TP's activation collectives: buffers of T·d·4 = 16 · 32 · 4 bytes
        return sorted((c["kind"], c["phase"]) for c in results[label].ranks[0]["collectives"]
                      if c["buffer_bytes"] == 2048)
    plain, sp = tp_calls("plain"), tp_calls("sp")
    assert plain.count(("all_reduce", "forward")) == 5 and plain.count(("all_reduce", "backward")) == 5
    assert sp.count(("reduce_scatter", "forward")) == 5 and sp.count(("all_gather", "forward")) == 5
    assert not [k for k, _ in sp if k == "all_reduce"]


def test_sp_shrinks_the_activations_and_keeps_the_losses(results):
    plain, sp = results["plain"].ranks[0], results["sp"].ranks[0]
    # per layer the norms' inputs and statistics halve: (2 · 16 · 32 · 4 + 16 · 16) / 2 = 2,176 B
    assert plain["activation_per_layer"] - sp["activation_per_layer"] == 2176
    assert plain["losses"] == pytest.approx(sp["losses"], rel=1e-5)


@pytest.mark.parametrize("changes, world, match", [
    ({"tp_size": 1}, 4, "'tp_size'=1"),
    ({"tp_size": 2}, 3, "'tp_size'=2 must divide the number of ranks 3"),
    ({"strategy": "HYBRID_SHARD"}, 4, "strategy='FULL_SHARD' only"),
    ({"api": "fsdp1"}, 4, "api='fsdp2'"),
    ({"cpu_offload": True}, 4, "'cpu_offload'=True is not supported"),
    ({"grad_accum_steps": 2}, 4, "'grad_accum_steps'=2 is not supported"),
    ({"activation_checkpointing": "full"}, 4, "'activation_checkpointing'='full' is not supported"),
    ({"precision": "bf16-mixed"}, 4, "'precision'='bf16-mixed' is not supported"),
    ({"steps": 1}, 4, "'steps'=1"),
])
def test_bad_configs_are_refused_in_one_line(changes, world, match):
    with pytest.raises(ValueError, match=match) as info:
        validate(ParallelConfig.from_mapping({**SHAPE, **changes}), world)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("changes, match", [
    ({"nhead": 3, "d_model": 30}, "config key 'tp_size'=2 must divide 'nhead'=3$"),
    ({"seq_len": 7, "sequence_parallel": True}, "config key 'tp_size'=2 with 'sequence_parallel'=True must divide 'seq_len'=7$"),
])
def test_shapes_tp_cannot_split_are_refused_by_the_config(changes, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig.from_mapping({**SHAPE, **changes})
