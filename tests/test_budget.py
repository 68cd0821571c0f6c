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
    b = memory_budget(ACCELERATORS["b200-180gb"])
    assert b.driver_bytes == 0 and b.usable_bytes == 180 * 2**30 - 1_457_521_152


@pytest.mark.parametrize("headroom", [-0.1, 1.0, float("nan")])
def test_headroom_outside_its_range_is_refused(headroom):
    with pytest.raises(ValueError, match=r"headroom must be in \[0, 1\)"):
        memory_budget("h100-80gb", headroom)


def test_the_planner_and_the_axes_budget_from_it_less_each_layouts_nccl_buffers():
    mib = 2**20
    # one H100 node: a ring of 24 channels, 12 MiB each; DDP adds a tree as large and NVLS's 258 MiB
    nccl = {"DDP": 2 * 24 * 12 * mib + 258 * mib, "SHARD_GRAD_OP": 24 * 12 * mib, "FULL_SHARD": 24 * 12 * mib}
    usable = usable_memory_bytes("h100-80gb")
    for h in (0.0, 0.15):
        for o in plan("llama2-7b", "h100-80gb", 8, headroom=h).options:
            left = usable - nccl[o.strategy]
            assert o.budget_bytes == int(left * (1 - h)) and o.nccl_bytes == nccl[o.strategy]
        # 8 nodes, FSDP's ring leaves them: 16 channels (2 per NIC) of 20 MiB
        verdict = estimate_axes("llama2-70b", "h100-80gb", 64, seq_len=4096, headroom=h)
        assert (verdict.tp_size, verdict.sp_size) == (1, 1)
        assert verdict.budget_bytes == int((usable - 16 * 20 * mib) * (1 - h))


def test_nccl_buffers_come_off_the_usable_memory_and_say_by_whom():
    from handbook_lib.models import node_preset, strategy_nccl

    nccl = strategy_nccl(node_preset("h100-80gb"), "FULL_SHARD", 8)
    b = memory_budget("h100-80gb", 0.1, nccl)
    assert b.nccl_bytes == 24 * 12 * 2**20 == nccl.total
    assert b.usable_bytes == usable_memory_bytes("h100-80gb") - b.nccl_bytes
    assert "0.30 GB NCCL buffers" in b.text() and "dp_shard (8 ranks, ring) 302 MB" in b.text()
    assert "not priced" in memory_budget("h100-80gb").text()


def test_plan_prints_the_breakdown_and_its_json_holds_it(capsys):
    args = ["plan", "--model", "llama2-7b", "--gpu", "h100-80gb", "--gpus", "8"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    b = memory_budget("h100-80gb")
    ring = 24 * 12 * 2**20  # the recommended SHARD_GRAD_OP's ring, one node
    assert (f"budget per GPU (SHARD_GRAD_OP): {b.total_bytes / 1e9:.2f} GB (nvidia-smi) - "
            f"{b.driver_bytes / 1e9:.2f} GB kept by the driver - 1.46 GB training context - "
            f"{ring / 1e9:.2f} GB NCCL buffers") in out
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["budget"]["usable_bytes"] == b.usable_bytes - ring and data["budget"]["nccl_bytes"] == ring
    assert {o["budget_bytes"] for o in data["options"] if o["strategy"] != "DDP"} == {b.budget_bytes - ring}


def test_memory_with_a_gpu_prints_the_layouts_budget_and_the_verdict(capsys):
    from handbook_lib.models import estimate_memory

    args = ["memory", "--model", "llama2-70b", "--world-size", "64", "--micro-batch", "1", "--seq-len", "4096",
            "--gpu", "h100-80gb"]
    usable = usable_memory_bytes("h100-80gb") - 16 * 20 * 2**20  # the ring leaves the node: 16 channels, 20 MiB
    for ac, verdict in ((["--activation-checkpointing"], "fits"), ([], "does NOT fit")):
        assert main([*args, *ac]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "0.34 GB NCCL buffers" in out and f"{usable / 1e9:.2f} GB usable" in out
        assert out.endswith(f"the peak reserved {verdict}")
        est = estimate_memory("llama2-70b", 64, "FULL_SHARD", "bf16-mixed", micro_batch=1, seq_len=4096,
                              activation_checkpointing="full" if ac else "none")
        assert (est.peak_reserved <= usable) == (verdict == "fits")
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["budget"]["nccl_bytes"] == 16 * 20 * 2**20 and data["budget"]["usable_bytes"] == usable
    assert main(args[:-2] + ["--json"]) == 0 and json.loads(capsys.readouterr().out)["budget"] is None


def test_memory_refuses_an_unknown_gpu_by_its_flag(capsys):
    assert main(["memory", "--gpu", "h900"]) == 2
    assert "argument --gpu: invalid choice: 'h900'" in capsys.readouterr().err


def test_memory_of_a_zero_stage_takes_the_gpu_too(capsys):
    """``memory --strategy ZERO3 --gpu``: DeepSpeed's model state at the step against the budget
    (8 GPUs of a node: NCCL's ring of 24 channels, 12 MiB each), not a flag silently dropped."""
    from handbook_lib.models import estimate_rank_state
    from handbook_lib.models.zero_peak import zero_step_bytes

    args = ["memory", "--model", "llama2-70b", "--strategy", "ZERO3", "--world-size", "8", "--gpu", "h100-80gb"]
    usable = usable_memory_bytes("h100-80gb") - 24 * 12 * 2**20
    at_step = (estimate_rank_state("llama2-70b", 8, "ZERO3", "bf16-mixed").total
               + zero_step_bytes("llama2-70b", 8, "ZERO3", "bf16-mixed"))
    assert at_step > usable  # 70B's state over 8 GPUs: about 18 bytes x 8.6e9 parameters
    assert main(args) == 0
    assert " ".join(capsys.readouterr().out.split()).endswith(
        "the model state at the optimizer step (activations not priced) does NOT fit")
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["budget"]["usable_bytes"] == usable and data["at_step"] == at_step
