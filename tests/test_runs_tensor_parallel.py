"""handbook_lib.runs.tensor_parallel: TP x FSDP2 on 4 ranks as 2 x 2 and TP over all 4, with and
without sequence parallelism, TP with the sequence split over the other axis, and the general levers (bf16-mixed,
activation checkpointing, a cosine schedule, accumulation, clipping, fp16, offload, SHARD_GRAD_OP,
HSDP), for a shape other than the chapter's; every check exact (losses 1e-5 in fp32)."""

import pytest

from handbook_lib.core.parallel_config import ParallelConfig
from handbook_lib.launch import torchrun_batch
from handbook_lib.runs.tensor_parallel import validate

# not the chapter's shape: d 32, vocab 50 (25 rows per TP rank: FSDP2 pads 13/12 over dp=2), seq 8
SHAPE = {"vocab_size": 50, "d_model": 32, "nhead": 4, "dim_feedforward": 64, "num_layers": 2,
         "batch_size": 4, "seq_len": 8, "steps": 3, "tp_size": 2}


GPT2_VOCAB = 50_257
"""GPT-2's vocabulary, which 2 tensor ranks do not divide: padded to 50,258 rows."""


LEVERS = {"precision": "bf16-mixed", "activation_checkpointing": "full", "lr_schedule": "cosine", "warmup_steps": 1}
"""The levers every layout must take: mixed precision, recomputation, a schedule."""
CONFIGS = {
    "plain": SHAPE, "sp": {**SHAPE, "sequence_parallel": True}, "gpt2_vocab": {**SHAPE, "vocab_size": GPT2_VOCAB},
    "2d_levers": {**SHAPE, **LEVERS},                                   # data 2 x tensor 2
    "tp_megatron_sp_levers": {**SHAPE, **LEVERS, "sequence_parallel": True},
    "tp_ring_levers": {**SHAPE, **LEVERS, "sp_size": 2, "sp_method": "ring", "batch_size": 2},  # tensor 2 x sequence 2
    "tp_ulysses_selective": {**SHAPE, "sp_size": 2, "sp_method": "ulysses", "batch_size": 2,
                             "activation_checkpointing": "selective"},
    "accumulate_clip": {**SHAPE, "grad_accum_steps": 2, "max_grad_norm": 1.0},
    "fp16_offload": {**SHAPE, "precision": "fp16-mixed", "cpu_offload": True},
    "shard_grad_op": {**SHAPE, "strategy": "SHARD_GRAD_OP"},
    "hsdp": {**SHAPE, "strategy": "HYBRID_SHARD", "shard_group_size": 1},
    # four tensor ranks, the whole world (at 2, 4·d/t = 2·d: only t = 4 tells the terms apart)
    "tp4": {**SHAPE, "tp_size": 4}, "tp4_sp": {**SHAPE, "tp_size": 4, "sequence_parallel": True},
    "tp4_sp_selective": {**SHAPE, "tp_size": 4, "sequence_parallel": True, "activation_checkpointing": "selective"},
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return torchrun_batch("tensor_parallel", 4, CONFIGS, out=tmp_path_factory.mktemp("tp"), timeout_s=300,
                          stream=False)


@pytest.mark.parametrize("label", list(CONFIGS))
def test_every_check_passes(results, label):
    result = results[label]
    assert not result.failed_checks()
    quantities = {c.quantity for c in result.checks}
    for name in ("vocab_padding_rows", "param_shard_bytes", "param_padding_bytes", "grad_shard_bytes", "optimizer_state_bytes",
                 "activation_bytes", "collectives_matched", "sent_bytes", "loss_step3"):
        assert name in quantities
    assert all(c.tolerance == 0 for c in result.checks
               if not c.quantity.startswith(("loss", "attention", "grad_norm")))


def test_the_levers_run_on_the_2d_mesh_as_counted_by_hand(results):
    # bf16-mixed, full checkpointing, micro-batch 2 x 8 tokens = T 16, d 32, vocabulary 25 rows
    # per TP rank: each layer keeps its input, T·d·2 = 1,024 B (x 2 layers); the head keeps the
    # ids and targets (16·T), its input (T·d·2), the fp32 log-softmax (4·T·25) and 8 B of scalars
    rank = results["2d_levers"].ranks[0]
    assert rank["activation_bytes"] == 2 * 1024 + (16 * 16 + 1024 + 4 * 16 * 25 + 8) == 4936
    # recomputation re-issues each layer's 2 forward all-reduces in backward: 5 + 2 x 2, of T·d·2 B
    tp = [c for c in rank["collectives"] if c["kind"] == "all_reduce" and c["buffer_bytes"] == 1024]
    assert sum(c["phase"] == "forward" for c in tp) == 5 and sum(c["phase"] == "backward" for c in tp) == 9
    assert rank["lr"][0] < rank["lr"][1] > rank["lr"][2]   # warm-up, then the cosine's decay


def test_tensor_and_sequence_ranks_split_one_mesh(results):
    ranks = results["tp_ring_levers"].ranks
    assert [(r["dp_rank"], r["sp_rank"], r["tp_rank"]) for r in ranks] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert {r["fsdp_size"] for r in ranks} == {2}   # FSDP2 shards over dp x sp = 1 x 2
    # the ring passes each K and V block of the rank's heads: 2 rows x 4 positions x 16 wide
    # (2 of 4 heads) x 2 B (bf16)
    sends = [c for c in ranks[0]["collectives"] if c["kind"] == "send"]
    assert {c["buffer_bytes"] for c in sends} == {2 * 4 * 16 * 2}


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
    ({"strategy": "NO_SHARD"}, 4, "'strategy'='NO_SHARD': tensor_parallel shards with FSDP2"),
    ({"api": "fsdp1"}, 4, "api='fsdp2'"),
    ({"sp_size": 2, "sp_method": "ulysses", "nhead": 2}, 4, "'tp_size'=2 x config key 'sp_size'=2 with "
                                                             "'sp_method'=ulysses must divide 'nhead'=2"),
    ({"steps": 1}, 4, "'steps'=1"),
    ({"pp_size": 2}, 4, "'pp_size'=2: tensor_parallel cuts no pipeline; the pipeline run does"),
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


def test_four_tensor_ranks_keep_what_the_terms_say_by_hand(results):
    """TP over 4 ranks, fp32, T = 4 x 8 = 32 tokens, d 32, f 64, 4 heads (1 a rank), vocabulary 50
    padded to 52 (13 rows a rank). A layer keeps its input and linear1's (T·d·4 x 2 = 8,192 B),
    the rank's Q, K, V and attention output (T·(d/4)·4 x 4 = 4,096), GELU's input and output
    (T·(f/4)·4 x 2 = 4,096), the log-sum-exp (4·T = 128) and the norms' inputs and statistics
    (2·T·d·4 + 4·T·4 = 8,704, a quarter of it under sequence parallelism); the head keeps the ids
    and targets (16·T), its input (T·d·4) and the log-softmax's 13 columns (4·T·13), and 8 B."""
    head = 16 * 32 + 32 * 32 * 4 + 4 * 32 * 13 + 8
    layer = 8192 + 4096 + 4096 + 128
    assert results["tp4"].ranks[0]["activation_bytes"] == 2 * (layer + 8704) + head == 56_712
    assert results["tp4_sp"].ranks[0]["activation_bytes"] == 2 * (layer + 8704 // 4) + head == 43_656
    # selective keeps the sequence shard of each layer's input (T·d·4/4), Q, K, V, the attention's
    # output and log-sum-exp (T·(4d/4)·4 + 4·T), linear1's output (T·(f/4)·4) and the two
    # row-parallel outputs before their reduce-scatter, whole (2·T·d·4)
    kept = 32 * 32 + 32 * 32 * 4 + 4 * 32 + 32 * 16 * 4 + 2 * 32 * 32 * 4
    assert results["tp4_sp_selective"].ranks[0]["activation_bytes"] == 2 * kept + head
