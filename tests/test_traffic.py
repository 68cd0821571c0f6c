"""FSDP2's tuning knobs in the communication model (chapter 5): the order of issue under
prefetching, ``reshard_after_forward`` as an int, ``set_reshard_after_backward(False)``, the
gathered units at each compute and the bytes held between micro-steps. Each expectation is
derived here from the units' sizes, not from the functions under test."""

from collections import Counter

import pytest

from handbook_lib.core import RunConfig
from handbook_lib.models import (
    estimate_accumulation_bytes,
    estimate_gathered_units,
    estimate_held_between_micro_steps,
    estimate_step_traffic,
    wrap_units,
)

MODEL = RunConfig.from_mapping({"vocab_size": 1001, "d_model": 64, "nhead": 2, "dim_feedforward": 96,
                                "num_layers": 4}).model_config()
UNITS = wrap_units(MODEL, "layer")
LAYERS = [u.name for u in UNITS if not u.root]


def _key(records):
    return [(r.kind, r.unit, r.phase, r.buffer_bytes, r.group_size) for r in records]


@pytest.mark.parametrize("ahead", [0, 1, 2, 5])
def test_issue_order_is_a_permutation_of_the_unit_by_unit_schedule(ahead):
    plain = estimate_step_traffic(UNITS, 4, "FULL_SHARD")
    ordered = estimate_step_traffic(UNITS, 4, "FULL_SHARD", issue_order=ahead)
    assert Counter(_key(plain.records)) == Counter(_key(ordered.records))
    assert ordered.sent_bytes == plain.sent_bytes


def test_implicit_order_prefetches_one_unit_in_backward():
    """The root stays gathered into backward (FSDP2's default): backward opens with the last
    layer's all-gather and the one before it, prefetched."""
    order = [(r.kind[:2], r.unit, r.phase[0]) for r in estimate_step_traffic(
        UNITS, 2, "FULL_SHARD", issue_order=0).records]
    last, third, second, first = LAYERS[::-1]
    assert order == [("al", "root", "f"), *[("al", n, "f") for n in LAYERS],
                     ("al", last, "b"), ("al", third, "b"), ("re", last, "b"),
                     ("al", second, "b"), ("re", third, "b"), ("al", first, "b"), ("re", second, "b"),
                     ("re", first, "b"), ("re", "root", "b")]


def test_explicit_forward_prefetch_issues_the_next_units_before_they_run():
    order = [(r.kind, r.unit) for r in estimate_step_traffic(
        UNITS, 2, "FULL_SHARD", issue_order=2).records if r.phase == "forward"]
    # all of them issued once, in forward order: prefetching moves when, not what
    assert order == [("all_gather", "root"), *[("all_gather", n) for n in LAYERS]]
    back = [(r.kind[:2], r.unit) for r in estimate_step_traffic(
        UNITS, 2, "FULL_SHARD", issue_order=2).records if r.phase == "backward"]
    # the last layer's pre-backward gathers the two before it: three gathered before a reduce-scatter
    assert back[:4] == [("al", LAYERS[3]), ("al", LAYERS[2]), ("al", LAYERS[1]), ("re", LAYERS[3])]


def test_int_reshard_gathers_backward_within_the_smaller_group():
    full = estimate_step_traffic(UNITS, 4, "FULL_SHARD")
    pairs = estimate_step_traffic(UNITS, 4, "FULL_SHARD", reshard_after_forward_size=2)
    back = [r for r in pairs.records if r.kind == "all_gather" and r.phase == "backward"]
    assert {r.group_size for r in back} == {2} and len(back) == len(LAYERS)  # the root stays gathered
    assert all(r.sent_bytes == r.buffer_bytes // 2 for r in back)  # (g-1)/g of the buffer, g = 2
    forward = [r for r in pairs.records if r.kind == "all_gather" and r.phase == "forward"]
    assert {r.group_size for r in forward} == {4}
    saved = sum(r.buffer_bytes for r in back) * (3 / 4 - 1 / 2)
    assert full.sent_bytes - pairs.sent_bytes == pytest.approx(saved)


@pytest.mark.parametrize("size, strategy", [(1, "FULL_SHARD"), (3, "FULL_SHARD"), (4, "FULL_SHARD"),
                                            (2, "SHARD_GRAD_OP")])
def test_int_reshard_must_divide_a_resharding_group(size, strategy):
    with pytest.raises(ValueError, match="reshard_after_forward_size"):
        estimate_step_traffic(UNITS, 4, strategy, reshard_after_forward_size=size)


@pytest.mark.parametrize("strategy, per_unit", [("FULL_SHARD", 2), ("SHARD_GRAD_OP", 1)])
def test_keeping_units_after_backward_skips_the_next_forward_gathers(strategy, per_unit):
    k = 3
    counts = {keep: Counter((r.kind, r.phase) for r in estimate_step_traffic(
        UNITS, 2, strategy, grad_accum_steps=k, sync_every_micro_step=False,
        reshard_after_backward=not keep).records) for keep in (False, True)}
    assert counts[False][("all_gather", "forward")] == k * len(UNITS)
    assert counts[True][("all_gather", "forward")] == len(UNITS)  # only the first micro-step's
    assert counts[True][("all_gather", "backward")] == counts[False][("all_gather", "backward")] \
        == (k * len(LAYERS) if per_unit == 2 else 0)
    assert counts[True][("reduce_scatter", "backward")] == len(UNITS)


def test_reduce_scatter_every_micro_step_sends_k_times_the_gradients():
    k = 4
    once, every = (estimate_step_traffic(UNITS, 2, "FULL_SHARD", grad_accum_steps=k, sync_every_micro_step=s)
                   for s in (False, True))
    rs = [sum(r.sent_bytes for r in t.records if r.kind == "reduce_scatter") for t in (once, every)]
    assert rs[1] == k * rs[0]


def test_gathered_units_implicit_and_explicit():
    size = {u.name: u.padded_numel(2) * 4 for u in UNITS}
    implicit = estimate_gathered_units(UNITS, 2, "FULL_SHARD")
    forward = [s for s in implicit if s.phase == "forward"]
    assert [s.gathered for s in forward] == [("root", n) for n in LAYERS]  # one layer at a time
    backward = [s for s in implicit if s.phase == "backward"]
    assert [s.unit for s in backward] == LAYERS[::-1]
    assert backward[0].gathered == ("root", LAYERS[2], LAYERS[3])  # the prefetched one too
    assert backward[-1].gathered == ("root", LAYERS[0])
    assert backward[0].gathered_bytes == size["root"] + size[LAYERS[2]] + size[LAYERS[3]]
    two = [s for s in estimate_gathered_units(UNITS, 2, "FULL_SHARD", explicit_prefetch=2) if s.phase == "forward"]
    assert [len(s.gathered) for s in two] == [4, 4, 3, 2]  # root + this + the next two, fewer at the end
    kept = [s for s in estimate_gathered_units(UNITS, 2, "SHARD_GRAD_OP") if s.phase == "forward"]
    assert [len(s.gathered) for s in kept] == [2, 3, 4, 5]  # nothing freed before backward
    bf16 = estimate_gathered_units(UNITS, 2, "FULL_SHARD", param_dtype="bf16")
    assert [s.gathered_bytes * 2 for s in bf16] == [s.gathered_bytes for s in implicit]


def test_gathered_units_need_sharded_parameters():
    with pytest.raises(ValueError, match="shards parameters"):
        estimate_gathered_units(UNITS, 2, "NO_SHARD")


def test_held_between_micro_steps_per_mode():
    grads = estimate_accumulation_bytes(MODEL, "FULL_SHARD")
    gathered = sum(u.padded_numel(2) for u in UNITS) * 4
    held = {(s, r): estimate_held_between_micro_steps(UNITS, 2, "FULL_SHARD", sync_every_micro_step=s,
                                                      reshard_after_backward=r)
            for s in (False, True) for r in (False, True)}
    assert held == {(False, True): grads, (True, True): 0, (False, False): grads + gathered,
                    (True, False): gathered}
    assert estimate_held_between_micro_steps(UNITS, 2, "DDP") == 0
