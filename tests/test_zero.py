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
    estimate_zero_step_traffic,
    flat_partition,
    gather_units,
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


@pytest.mark.parametrize("call, match", [
    (lambda: estimate_zero_rank_bytes(SMALL, 0, "ZERO3"), "world_size must be an int >= 1"),
    (lambda: estimate_zero_rank_bytes(SMALL, 2, "ZERO3", rank=2), r"rank must be in \[0, 2\), got 2"),
    (lambda: estimate_zero_rank_bytes(SMALL, 2, "ZERO3", persistence_threshold=-1), "persistence_threshold"),
    (lambda: estimate_zero_rank_bytes(SMALL, 2, "ZERO3", "fp8"), "precision must be one of"),
    (lambda: estimate_zero_rank_bytes(SMALL, 2, "ZERO3", optimizer="lion"), "optimizer must be one of"),
    (lambda: estimate_zero_step_traffic(SMALL, 2, "DDP"), "must be a DeepSpeed ZeRO row"),
])
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()
