"""handbook_lib.runs.trace_step: one FSDP2 step profiled on 2 ranks, FSDP2's ranges read back.

The reference page "Measured on GPUs" traces FULL_SHARD with 2 layers; this run traces what it
does not: SHARD_GRAD_OP, which keeps each unit gathered from forward to backward, so the trace
holds no backward all-gather (FSDP2 still enters its backward prefetch, and finds the unit there).
"""

import pytest

from handbook_lib.launch import torchrun
from handbook_lib.runs.specs.trace_step import validate
from handbook_lib.core import RunConfig


@pytest.mark.parametrize(("change", "world", "words"), [
    ({"strategy": "HYBRID_SHARD"}, 4, "trace_step runs api='fsdp2' with strategy"),
    ({"api": "fsdp1"}, 2, "got api='fsdp1'"),
    ({}, 1, "needs >= 2 ranks"),
    ({"steps": 1}, 2, "needs steps >= 2"),
    ({"lr_schedule": "cosine"}, 2, "keeps the learning rate constant"),
])
def test_what_it_cannot_trace_is_refused_before_anything_starts(change, world, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        validate(RunConfig.from_mapping({"steps": 3, **change}), world)


def test_shard_grad_op_gathers_each_unit_once_in_forward_only(tmp_path):
    result = torchrun("trace_step", nproc=2, config={"steps": 2, "num_layers": 1, "strategy": "SHARD_GRAD_OP"},
                      out=tmp_path / "run", stream=False)
    assert not result.failed_checks() and len(result.checks) == 4
    for rank in result.ranks:
        ranges = rank["ranges"]
        first_backward = next(r["start_ms"] for r in ranges if r["kind"] == "pre_backward")
        gathers = [r for r in ranges if r["kind"] == "all_gather"]
        assert [g["unit"] for g in gathers] == ["root", "layers.0"]  # forward only, the root first
        assert all(g["start_ms"] < first_backward for g in gathers)
        reduces = [r["unit"] for r in ranges if r["kind"] == "post_backward_reduce"]
        assert reduces == ["layers.0", "root"]  # backward order: the layer, then the root
        assert 0 < ranges[-1]["start_ms"] <= rank["traced_ms"]
