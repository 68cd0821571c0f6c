"""handbook_lib.models.budget: a GPU's memory from nvidia-smi's total to a step's budget."""

import json

import pytest

from handbook_lib.face.cli import main
from handbook_lib.models import ACCELERATORS, memory_budget, plan, usable_memory_bytes
from handbook_lib.models.axes import estimate_axes


def test_the_terms_by_hand_for_an_a100_80gb():
    b = memory_budget("a100-80gb", headroom=0.10)
    total = 81_920 * 2**20                     # nvidia-smi
    cuda = round(79.25 * 2**30)                # PyTorch's OOM messages
    usable = cuda - 1_457_521_152              # less the training context measured on an H200
    assert (b.total_bytes, b.driver_bytes, b.context_bytes) == (total, total - cuda, 1_457_521_152)
    assert b.usable_bytes == usable == usable_memory_bytes("a100-80gb")
    assert b.budget_bytes == int(usable * 0.9) and b.headroom_bytes == usable - int(usable * 0.9)
    assert b.total_bytes - b.driver_bytes - b.context_bytes == b.usable_bytes


def test_a_card_without_a_published_runtime_total_keeps_its_whole_total():
    b = memory_budget(ACCELERATORS["l4-24gb"])
    assert b.driver_bytes == 0 and b.usable_bytes == 24 * 2**30 - 1_457_521_152


@pytest.mark.parametrize("headroom", [-0.1, 1.0, float("nan")])
def test_headroom_outside_its_range_is_refused(headroom):
    with pytest.raises(ValueError, match=r"headroom must be in \[0, 1\)"):
        memory_budget("h100-80gb", headroom)


def test_the_planner_and_the_axes_budget_from_it():
    for h in (0.0, 0.15):
        want = memory_budget("h100-80gb", h).budget_bytes
        assert {o.budget_bytes for o in plan("llama2-7b", "h100-80gb", 8, headroom=h).options} == {want}
        assert estimate_axes("llama2-70b", "h100-80gb", 64, seq_len=4096, headroom=h).budget_bytes == want


def test_plan_prints_the_breakdown_and_its_json_holds_it(capsys):
    args = ["plan", "--model", "llama2-7b", "--gpu", "h100-80gb", "--gpus", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    b = memory_budget("h100-80gb")
    assert (f"budget per GPU: {b.total_bytes / 1e9:.2f} GB (nvidia-smi) - {b.driver_bytes / 1e9:.2f} GB "
            "kept by the driver") in " ".join(out.split())
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["budget"]["usable_bytes"] == b.usable_bytes
    assert all(o["budget_bytes"] == b.budget_bytes for o in data["options"])
