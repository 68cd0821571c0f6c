"""handbook_lib.models.zero: DeepSpeed ZeRO's layout and step traffic, against independent counts.

The real runs (tests/test_runs_deepspeed_zero.py, chapter 7) check the same functions against
DeepSpeed's buffers and counted collectives; here each rule is recomputed another way, from the
model's tensors laid out one element at a time.
"""

import math

import pytest

from handbook_lib.core import ModelConfig, param_count, param_shapes
from handbook_lib.models import (
    DEFAULT_PERSISTENCE_THRESHOLD,
    bookkeeping_reductions,
    estimate_collective,
    estimate_zero_rank_bytes,
    estimate_zero_redundancy_rank_bytes,
    estimate_zero_step_traffic,
    flat_partition,
    gather_units,
    zero3_gathers,
    zero_redundancy_partition,
    zero_stage,
)
from handbook_lib.runtime import build_model

SMALL = ModelConfig(vocab_size=1001, d_model=64, nhead=2, dim_feedforward=96, num_layers=2)
NUMELS = [math.prod(shape) for _, shape in param_shapes(SMALL)]


def test_stages_come_from_the_strategy_table():
    assert [zero_stage(f"ZERO{k}") for k in (1, 2, 3)] == [1, 2, 3]
    with pytest.raises(ValueError, match="must be a DeepSpeed ZeRO row .*got 'FULL_SHARD'"):
        zero_stage("FULL_SHARD")


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_flat_buffer_is_the_smallest_aligned_size(world):
    total = param_count(SMALL)
    padded, part = flat_partition(total, world)
    smallest = next(x for x in range(total, total + 2 * world) if x % (2 * world) == 0)
    assert (padded, part) == (smallest, smallest // world)


def test_gather_units_are_the_modules_that_own_parameters():
    model = build_model(SMALL, seed=0)
    owners = [name for name, m in model.named_modules()
              if any(True for _ in m.parameters(recurse=False)) and not name.endswith("out_proj")]
    units = gather_units(SMALL)
    assert [name for name, _ in units] == owners
    assert sum(sum(sizes) for _, sizes in units) == param_count(SMALL)


def _held_elements(world: int, rank: int) -> int:
    """ZeRO-1/2's gradients kept by ``rank``, counted element by element: the tensors that own
    an element of its partition, whole, plus the padding if the partition holds some."""
    padded, part = flat_partition(sum(NUMELS), world)
    owner = [i for i, n in enumerate(NUMELS) for _ in range(n)] + [None] * (padded - sum(NUMELS))
    mine = owner[rank * part:(rank + 1) * part]
    return sum(NUMELS[i] for i in set(mine) - {None}) + mine.count(None)


@pytest.mark.parametrize("strategy", ["ZERO1", "ZERO2"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("precision, size", [("fp32", 4), ("bf16-mixed", 2)])
def test_zero12_layout(strategy, world, precision, size):
    padded, part = flat_partition(sum(NUMELS), world)
    for rank in range(world):
        got = estimate_zero_rank_bytes(SMALL, world, strategy, precision, rank=rank)
        assert got.params == size * padded  # the whole flat buffer on every rank
        assert got.master == 4 * part and got.optimizer == 2 * got.master and got.optimizer_step == 4
        assert got.grads == size * _held_elements(world, rank)
    offload = estimate_zero_rank_bytes(SMALL, world, strategy, precision, cpu_offload=True)
    assert offload.grads == 4 * part  # the fp32 partition's gradient instead


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zero3_layout(world):
    part = sum(-(-n // world) for n in NUMELS)
    fp32 = estimate_zero_rank_bytes(SMALL, world, "ZERO3", "fp32")
    # 4 + 4 + 4 + 8 bytes per element of the partition: 20P/N where FSDP holds 16P/N
    assert fp32.total - fp32.optimizer_step == 20 * part
    assert fp32.params == fp32.master == fp32.grads == 4 * part
    bf16 = estimate_zero_rank_bytes(SMALL, world, "ZERO3", "bf16-mixed")
    assert (bf16.params, bf16.grads, bf16.master) == (2 * part, 2 * part, 4 * part)
    # DeepSpeed's default threshold keeps every tensor of this model whole, on top of the partition
    assert max(NUMELS) <= DEFAULT_PERSISTENCE_THRESHOLD
    kept = estimate_zero_rank_bytes(SMALL, world, "ZERO3", persistence_threshold=DEFAULT_PERSISTENCE_THRESHOLD)
    assert kept.params == 4 * part + 4 * sum(-(-n // world) * world for n in NUMELS)
    assert kept.params > estimate_zero_rank_bytes(SMALL, world, "ZERO2").params


def test_optimizer_states_follow_the_optimizer():
    for optimizer, states, step in (("adam", 2, 4), ("sgd-momentum", 1, 0), ("sgd", 0, 0)):
        got = estimate_zero_rank_bytes(SMALL, 2, "ZERO3", optimizer=optimizer)
        assert (got.optimizer, got.optimizer_step) == (states * got.master, step)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_zero12_traffic(precision):
    world, compute = 4, 4 if precision == "fp32" else 2
    traffic = estimate_zero_step_traffic(SMALL, world, "ZERO2", precision)
    gradients = [r for r in traffic.records if r.unit == "gradients"]
    assert [(r.kind, r.buffer_bytes) for r in gradients] == [("all_reduce", 4 * sum(NUMELS))]  # fp32 reduce
    gathers = [r for r in traffic.records if r.kind == "all_gather"]
    assert [r.buffer_bytes for r in gathers] == [compute * flat_partition(sum(NUMELS), world)[0]]
    small = [r.buffer_bytes for r in traffic.records if r.unit == "bookkeeping"]
    assert small == bookkeeping_reductions("ZERO2", precision)


def test_zero3_traffic_gathers_every_module_twice():
    world = 4
    padded = sum(-(-n // world) * world for n in NUMELS)
    traffic = estimate_zero_step_traffic(SMALL, world, "ZERO3")
    gathers = [r for r in traffic.records if r.kind == "all_gather"]
    assert len(gathers) == 2 * len(gather_units(SMALL))
    assert sum(r.buffer_bytes for r in gathers) == 2 * 4 * padded
    assert [r.phase for r in gathers] == ["forward"] * len(gather_units(SMALL)) + ["backward"] * len(gather_units(SMALL))
    (scatter,) = [r for r in traffic.records if r.kind == "reduce_scatter"]
    assert scatter.buffer_bytes == 4 * padded
    assert traffic.sent_bytes == sum(estimate_collective(r.kind, r.buffer_bytes, world).sent_bytes
                                     for r in traffic.records)
    # everything persistent: no gather in forward or backward, one per tensor after the step
    kept = estimate_zero_step_traffic(SMALL, world, "ZERO3", persistence_threshold=max(NUMELS))
    gathers = [r for r in kept.records if r.kind == "all_gather"]
    assert len(gathers) == len(NUMELS) and {r.phase for r in gathers} == {"step"}


WIDE = ModelConfig(vocab_size=1001, d_model=128, nhead=2, dim_feedforward=1024, num_layers=2)
"""Tensors on both sides of DeepSpeed's default persistence threshold (1e5): the embedding,
output head and linear weights above it, the attention matrices, norms and biases below."""

# (threshold, prefetch, reuse) -> the all-gathers (elements, padded for 2 ranks) DeepSpeed 0.19
# issued in the third step of a 2-rank run of WIDE (chapter 7's production run is the last row)
MEASURED_GATHERS = {
    (0, 0, 300_000): [128_128, 66_048, 256, 132_096, 131_200, 256, 66_048, 256, 132_096, 131_200, 256,
                      129_130, 132_096, 256, 66_048, 256, 131_200, 132_096, 256, 66_048, 128_128],
    (0, 100_000, 0): [128_128, 197_376, 132_096, 197_760, 132_096, 128_512, 132_074, 195_456],
    (0, 200_000, 0): [325_504, 329_856, 260_608, 129_130],
    (0, 200_000, 10**9): [325_504, 329_856, 260_608, 1_002],
    (100_000, 100_000, 0): [128_128, 131_072, 131_072, 131_072, 131_072, 128_128, 131_072, 128_128],
    (100_000, 50_000_000, 10**9): [780_544],
}


@pytest.mark.parametrize("knobs", list(MEASURED_GATHERS))
def test_zero3_gathers_replay_what_deepspeed_gathered(knobs):
    threshold, prefetch, reuse = knobs
    gathers = zero3_gathers(WIDE, persistence_threshold=threshold, prefetch_bucket_size=prefetch,
                            max_reuse_distance=reuse)
    assert [sum(-(-x // 2) * 2 for x in sizes) for _, sizes, _ in gathers] == MEASURED_GATHERS[knobs]


def test_zero3_gathers_each_tensor_once_when_every_reuse_is_near():
    """A reuse distance past the whole step keeps every tensor from its forward into its backward,
    and a prefetch bucket past the whole model takes it all in the root's fetch: one call."""
    sharded = [x for x in NUMELS if x > 0]
    reuse = zero3_gathers(SMALL, max_reuse_distance=10 * sum(NUMELS))
    assert sorted(x for _, sizes, _ in reuse for x in sizes) == sorted(sharded)
    assert {phase for *_, phase in reuse} == {"forward"} and len(reuse) == len(gather_units(SMALL))
    (whole,) = zero3_gathers(SMALL, prefetch_bucket_size=sum(NUMELS))
    assert sorted(whole[1]) == sorted(NUMELS) and whole[2] == "forward"
    kept = zero3_gathers(SMALL, persistence_threshold=max(NUMELS), prefetch_bucket_size=10)
    assert kept == []


@pytest.mark.parametrize("call, match", [
    (lambda: estimate_zero_rank_bytes(SMALL, 0, "ZERO3"), "world_size must be an int >= 1"),
    (lambda: estimate_zero_rank_bytes(SMALL, 2, "ZERO3", rank=2), r"rank must be in \[0, 2\), got 2"),
    (lambda: estimate_zero_rank_bytes(SMALL, 2, "ZERO3", persistence_threshold=-1), "persistence_threshold"),
    (lambda: estimate_zero_rank_bytes(SMALL, 2, "ZERO3", "fp8"), "precision must be one of"),
    (lambda: estimate_zero_rank_bytes(SMALL, 2, "ZERO3", optimizer="lion"), "optimizer must be one of"),
    (lambda: estimate_zero_step_traffic(SMALL, 2, "DDP"), "must be a DeepSpeed ZeRO row"),
    (lambda: zero3_gathers(SMALL, prefetch_bucket_size=-1), "prefetch_bucket_size"),
    (lambda: zero3_gathers(1000, max_reuse_distance=10), "needs the model.s tensors"),
])
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("params, world", [(6_738_415_616, 8), (68_976_648_192, 64), (1_000_003, 3)])
def test_deepspeed_own_estimate_is_deepspeeds_functions(params, world):
    """The formulas DeepSpeed publishes for a node without offload, against its own functions;
    and for ZeRO-1/2 this book's model state plus the fp32 gradient partition of the step is
    the same figure, to the step counter's 4 bytes and the flat buffer's padding."""
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    stage12 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    from handbook_lib.models.memory import estimate_rank_state
    from handbook_lib.models.zero import deepspeed_own_estimate, largest_module_params

    theirs2 = stage12.estimate_zero2_model_states_mem_needs(params, world, 1, cpu_offload=False)[1]
    assert deepspeed_own_estimate(params, world, "ZERO2") == theirs2
    largest = largest_module_params(params)
    theirs3 = stage3.estimate_zero3_model_states_mem_needs(params, largest, world, 1, cpu_offload=False)[1]
    assert deepspeed_own_estimate(params, world, "ZERO3") == theirs3
    ours = estimate_rank_state(params, world, "ZERO2", "bf16-mixed").total
    ours += 4 * flat_partition(params, world)[1]  # the step's fp32 copy of the partition's gradients
    padding = flat_partition(params, world)[0] - params
    assert 0 <= ours - 4 - theirs2 <= 2 * padding + 18 * padding / world + 1  # padding: 2 whole, 18 over N


def test_the_largest_module_of_a_decoder_is_its_embedding_or_a_projection():
    """Llama-2 7B: the embedding and head, 32,000 x 4,096; the handbook's model: its largest tensor."""
    from handbook_lib.models.zero import largest_module_params

    assert largest_module_params("llama2-7b") == 32_000 * 4_096
    assert largest_module_params(ModelConfig()) == max(math.prod(s) for _, s in param_shapes(ModelConfig()))


def test_zero3_step_copies_its_gradient_partition_in_every_precision_one_sub_group_at_a_time():
    """DeepSpeed flattens the partition into the master's dtype even in fp32 (a new tensor, which
    the CPU runs measure); with its fused Adam nothing else."""
    from handbook_lib.models.zero_peak import zero_step_bytes

    assert zero_step_bytes(8_000_000, 8, "ZERO3", "fp16-mixed") == 4 * 1_000_000
    assert zero_step_bytes(8_000_000, 8, "ZERO3", "fp32") == 4 * 1_000_000
    assert zero_step_bytes(16 * 10**9, 8, "ZERO3") == 4 * 10**9  # one sub-group of 1e9 at a time
    assert zero_step_bytes(8_000_000, 8, "ZERO3", "fp32", optimizer_impl="for-loop") == 3 * 4 * 1_000_000


def test_bf16_keeps_a_bf16_master_gradients_and_states_ten_bytes_a_parameter():
    """``precision="bf16"``: DeepSpeed's ``bf16_master_weights_and_grads`` and
    ``bf16_optimizer_states``, 2 + 2 + 2 + 4 bytes an element of the partition (18 with the fp32
    master: 2 + 4 + 4 + 8); the step's gradient copy in bf16 too."""
    from handbook_lib.models import estimate_zero_rank_bytes
    from handbook_lib.models.zero_peak import zero_step_bytes

    p, n = 6_738_415_616, 8
    part = -(-p // n)
    bf16 = estimate_zero_rank_bytes("llama2-7b", n, "ZERO3", "bf16")
    mixed = estimate_zero_rank_bytes("llama2-7b", n, "ZERO3", "bf16-mixed")
    assert (bf16.params, bf16.master, bf16.grads, bf16.optimizer) == (2 * part, 2 * part, 2 * part, 4 * part)
    assert (mixed.params, mixed.master, mixed.grads, mixed.optimizer) == (2 * part, 4 * part, 2 * part, 8 * part)
    assert zero_step_bytes("llama2-7b", n, "ZERO3", "bf16") == 2 * part
    with pytest.raises(ValueError, match="precision 'bf16'.*compiled CPU Adam"):
        estimate_zero_rank_bytes("llama2-7b", n, "ZERO3", "bf16", cpu_offload=True)


def test_zero_redundancy_partition_gives_whole_tensors_largest_first_to_the_lightest_rank():
    # sorted 10, 7, 5, 5, 3: 10 -> rank 0; 7 -> rank 1 (7 < 10); 5 -> rank 1 (12);
    # the second 5 -> rank 0 (15); 3 -> rank 1 (15): the lowest rank wins a tie
    assert zero_redundancy_partition([10, 7, 5, 5, 3], 2) == [[0, 3], [1, 2, 4]]
    assert zero_redundancy_partition([4, 4, 4], 2) == [[0, 2], [1]]
    assert zero_redundancy_partition([1], 3) == [[0], [], []]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zero_redundancy_shares_cover_the_model_once_within_its_largest_tensor(world):
    numels = [math.prod(s) for _, s in param_shapes(ModelConfig())]
    ranks = zero_redundancy_partition(numels, world)
    assert sorted(i for r in ranks for i in r) == list(range(len(numels)))
    sizes = [sum(numels[i] for i in r) for r in ranks]
    assert max(sizes) - min(sizes) <= max(numels)


def test_zero_redundancy_rank_bytes_keep_the_model_whole_and_split_the_optimizer():
    config = ModelConfig(num_layers=2)
    numels = [math.prod(s) for _, s in param_shapes(config)]
    states = [estimate_zero_redundancy_rank_bytes(config, 2, rank=r) for r in (0, 1)]
    assert all(s.params == s.grads == 4 * sum(numels) and s.master == 0 for s in states)
    assert sum(s.optimizer for s in states) == 8 * sum(numels)  # AdamW: two fp32 moments, each once
    assert sum(s.optimizer_step for s in states) == 4 * len(numels)  # one step counter a tensor
    sgd = estimate_zero_redundancy_rank_bytes(config, 2, "bf16", "sgd", rank=0)
    assert (sgd.params, sgd.optimizer, sgd.optimizer_step) == (2 * sum(numels), 0, 0)
    with pytest.raises(ValueError, match="need the model's tensors"):
        estimate_zero_redundancy_rank_bytes(1_000_000, 2)
