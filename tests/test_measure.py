"""handbook_lib.measure: the helpers the runs share (the measurements themselves are checked by
the runs' own tests against the models)."""

import torch

from handbook_lib.comm import estimate_collective
from handbook_lib.measure import CollectiveCall, collective_totals, tensors_in


def test_collective_totals_sum_each_kind_with_the_ring_model():
    calls = [CollectiveCall("all_gather", "fp32", 800, 4), CollectiveCall("all_gather", "fp32", 400, 4),
             CollectiveCall("all_reduce", "fp32", 8, 2)]
    totals = collective_totals(calls)
    assert totals["all_gather"] == {"count": 2, "buffer_bytes": 1200,
                                    "sent_bytes": 3 * 800 // 4 + 3 * 400 // 4}
    assert totals["all_reduce"] == {"count": 1, "buffer_bytes": 8,
                                    "sent_bytes": estimate_collective("all_reduce", 8, 2).sent_bytes}
    assert collective_totals([]) == {}


def test_tensors_in_walks_lists_tuples_and_dicts():
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    found = tensors_in({"x": [a, (b, "not a tensor")], "y": {"z": c}, "n": 4})
    assert [t.numel() for t in found] == [1, 2, 3]
    assert tensors_in(None) == []
