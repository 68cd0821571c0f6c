"""handbook_lib.runs.sequence_parallel: Ulysses and the ring on 4 ranks, in shapes other than
chapter 9's, every check passing; the refusals without launching.

One job runs every config (:func:`torchrun_batch`): Ulysses with sp_size=2 × dp 2 (d_model 32,
2 heads), the ring over all 4 ranks with 2 heads, and the general levers on each.
"""

import pytest

from handbook_lib.core.parallel_config import ParallelConfig
from handbook_lib.launch import torchrun_batch
from handbook_lib.runs.sequence_parallel import validate
from handbook_lib.runtime.training import train_one_process

BASE = {"vocab_size": 64, "d_model": 32, "nhead": 2, "dim_feedforward": 48, "num_layers": 2, "seq_len": 8,
        "batch_size": 4, "steps": 2}
CONFIGS = {"ulysses": {**BASE, "sp_size": 2, "sp_method": "ulysses"},
           "ring": {**BASE, "sp_size": 4, "sp_method": "ring"},
           "ulysses_levers": {**BASE, "sp_size": 2, "sp_method": "ulysses", "precision": "bf16-mixed",
                              "activation_checkpointing": "full", "lr_schedule": "cosine", "warmup_steps": 1,
                              "grad_accum_steps": 2, "max_grad_norm": 1.0},
           "ring_selective": {**BASE, "sp_size": 4, "sp_method": "ring", "activation_checkpointing": "selective"},
           "ring_hsdp_reshard": {**BASE, "sp_size": 2, "sp_method": "ring", "strategy": "HYBRID_SHARD",
                                 "shard_group_size": 1},
           "ring_reshard_to_2": {**BASE, "sp_size": 4, "sp_method": "ring", "reshard_after_forward_size": 2}}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return torchrun_batch("sequence_parallel", 4, CONFIGS, out=tmp_path_factory.mktemp("sp"), timeout_s=300,
                          stream=False)


@pytest.mark.parametrize("label", list(CONFIGS))
def test_every_check_passes(results, label):
    result = results[label]
    assert result.checks and not result.failed_checks()
    names = {c.quantity for c in result.checks}
    for quantity in ("param_shard_bytes", "grad_shard_bytes", "optimizer_state_bytes", "activation_bytes",
                     "sent_bytes", "attention_output", "attention_grads", "loss_step1", "loss_step2"):
        assert quantity in names


def test_ulysses_counts_four_all_to_alls_per_layer_each_way(results):
    # by hand: 2 layers x 4 = 8 forward and 8 backward, in groups of 2, each of one rank's
    # q, k, v or output: 2 rows x 4 positions x 32 wide x 4 bytes = 1,024 B
    calls = results["ulysses"].ranks[0]["collectives"]
    a2a = [c for c in calls if c["kind"] == "all_to_all"]
    assert [c["phase"] for c in a2a] == ["forward"] * 8 + ["backward"] * 8
    assert {c["buffer_bytes"] for c in a2a} == {1024} and {c["group_size"] for c in a2a} == {2}
    # FSDP2 over all 4 ranks: 3 units gathered in forward, the 2 layers again in backward (the
    # root stays gathered), 3 reduced
    fsdp = [c for c in calls if c["kind"] != "all_to_all"]
    assert sorted(c["kind"] for c in fsdp) == ["all_gather"] * 5 + ["reduce_scatter"] * 3
    assert {c["group_size"] for c in fsdp} == {4}


def test_ring_sends_around_four_ranks(results):
    # by hand, P = 4, 2 layers: forward 2(P-1) = 6 sends per layer, backward 4P-2 = 14; each a
    # K, V, dK or dV block of 4 rows x 2 positions x 32 wide x 4 bytes = 1,024 B
    calls = results["ring"].ranks[3]["collectives"]
    sends = [c for c in calls if c["kind"] == "send"]
    assert sum(c["phase"] == "forward" for c in sends) == 12 and sum(c["phase"] == "backward" for c in sends) == 28
    assert {c["buffer_bytes"] for c in sends} == {1024}
    assert len([c for c in calls if c["kind"] == "recv"]) == 40


def test_the_ring_keeps_its_block_products_under_selective_checkpointing(results):
    # sp 4, one sequence block is 4 rows x 2 positions; rank r attends to r + 1 blocks and the
    # policy keeps each block's scores (4 rows x 2 heads x 2 x 2 x 4 B = 128) and its share of the
    # output (8 tokens x 32 wide x 4 B = 1,024), 2 layers: each rank 2,304 B above the one before
    acts = [r["activation_bytes"] for r in results["ring_selective"].ranks]
    assert [b - a for a, b in zip(acts, acts[1:])] == [2 * (128 + 1024)] * 3


def test_losses_are_one_process_losses(results):
    for label in ("ulysses", "ring", "ring_selective", "ring_hsdp_reshard", "ring_reshard_to_2"):
        result = results[label]
        want = train_one_process(ParallelConfig.from_mapping(CONFIGS[label])).losses
        assert result.ranks[0]["losses"] == pytest.approx(want, rel=1e-5)
        assert all(r["losses"] == result.ranks[0]["losses"] for r in result.ranks)


def test_ranks_hold_their_rows_and_positions(results):
    ranks = results["ulysses"].ranks
    assert [(r["dp_rank"], r["sp_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("changes, world, match", [
    ({"sp_size": 1}, 4, "'sp_size'=1"),
    ({"sp_size": 3, "seq_len": 9, "sp_method": "ring"}, 4, "'sp_size'=3 must divide the number of ranks 4"),
    ({"sp_size": 4, "sp_method": "ulysses"}, 4, "config key 'sp_size'=4 with 'sp_method'=ulysses must divide 'nhead'=2 "),
    ({"sp_size": 2, "seq_len": 9}, 4, "config key 'sp_size'=2 must divide 'seq_len'=9$"),
    ({"sp_size": 2, "strategy": "DDP"}, 4, "'strategy'='DDP': sequence_parallel shards with FSDP2"),
    ({"sp_size": 2, "api": "fsdp1"}, 4, "api='fsdp2'"),
    ({"sp_size": 2, "steps": 1}, 4, "'steps'=1"),
    ({"tp_size": 2, "sp_size": 2, "sp_method": "ring"}, 4, "'tp_size'=2: sequence_parallel splits sequences only; tensor_parallel runs"),
])
def test_bad_configs_are_refused_in_one_line(changes, world, match):
    with pytest.raises(ValueError, match=match) as err:
        validate(ParallelConfig.from_mapping({**BASE, **changes}), world)
    assert "\n" not in str(err.value)
