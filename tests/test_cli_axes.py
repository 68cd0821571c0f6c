"""``memory`` and ``plan`` with ``--tp-size`` / ``--sp-size`` (chapter 9): the axes beyond FSDP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from handbook_lib.face import main
from handbook_lib.models.axes import estimate_sp_memory, estimate_tp_fsdp_memory
from handbook_lib.models.memory import estimate_memory
from handbook_lib.models.hf_config import read_hf_config
from handbook_lib.models.presets import get_shape

LLAMA3_8B = Path(__file__).parent / "data" / "hf_configs" / "llama3-8b.json"
LONG = ["--model", "llama2-70b", "--world-size", "64", "--micro-batch", "1", "--seq-len", "131072",
        "--activation-checkpointing"]


def test_memory_with_the_sequence_split_prints_fsdp_at_the_shorter_length(capsys):
    assert main(["memory", *LONG, "--sp-size", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    est = estimate_sp_memory(get_shape("llama2-70b"), 64, 131072, 8)
    assert data["components"] == est.components and data["peak_reserved"] == est.peak_reserved
    assert "the sequence split over 8 ranks (16384 tokens per GPU), FSDP over all 64" in data["assumptions"]
    assert main(["memory", *LONG, "--sp-size", "8"]) == 0
    out = capsys.readouterr().out
    assert f"activations  {est.components['activations']:,}" in out


def test_memory_with_tp_prints_params_grads_optimizer_and_activations(capsys):
    assert main(["memory", *LONG, "--tp-size", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    est = estimate_tp_fsdp_memory(get_shape("llama2-70b"), 64, 8, micro_batch=1, seq_len=131072)
    assert data["components"] == est.components
    assert {"params", "grads", "optimizer", "activations", "loss_buffers"} <= set(data["components"])
    assert "TP 8 x FSDP 8" in data["assumptions"]
    # an HF config works the same way
    assert main(["memory", "--hf-config", str(LLAMA3_8B), "--world-size", "16", "--micro-batch", "2",
                 "--seq-len", "8192", "--tp-size", "4", "--json"]) == 0
    hf = estimate_tp_fsdp_memory(read_hf_config(LLAMA3_8B), 16, 4, micro_batch=2, seq_len=8192,
                                 activation_checkpointing="none")
    assert json.loads(capsys.readouterr().out)["peak"] == hf.peak


def test_memory_with_tensor_and_sequence_axes_is_tp_at_the_split_length(capsys):
    """TP 8 x a sequence split of 4 x FSDP 2: the TP pricing at 131,072 / 4 tokens per GPU."""
    assert main(["memory", *LONG, "--tp-size", "8", "--sp-size", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    est = estimate_tp_fsdp_memory(get_shape("llama2-70b"), 64, 8, micro_batch=1, seq_len=131072 // 4)
    assert data["components"] == est.components and data["peak_reserved"] == est.peak_reserved
    assert "TP 8 x FSDP 8 (sequence parallel on the norms), micro-batch per TP group; the sequence split " \
        "over 4 ranks (32768 tokens per GPU), inside the FSDP ranks" in data["assumptions"]


def test_memory_with_the_sequence_split_prices_any_strategy_at_the_shorter_length(capsys):
    assert main(["memory", *LONG, "--sp-size", "8", "--strategy", "HYBRID_SHARD", "--shard-group-size", "2",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # shard groups of 2 data-parallel ranks x the 8 ranks of a split: 16 GPUs shard one copy
    est = estimate_memory(get_shape("llama2-70b"), 64, "HYBRID_SHARD", "bf16-mixed", micro_batch=1,
                          seq_len=131072 // 8, shard_group_size=16, activation_checkpointing="full")
    assert data["components"] == est.components


@pytest.mark.parametrize("argv,fragment", [
    (["memory", *LONG, "--tp-size", "3"], "--tp-size 3 must divide the GPUs (64) and the heads (64)"),
    (["memory", *LONG, "--sp-size", "3"], "--sp-size 3 must divide the GPUs (64) and --seq-len (131072)"),
    (["memory", "--model", "70b", "--tp-size", "8"], "--tp-size divides activations: give --micro-batch"),
    (["memory", *LONG, "--sp-size", "8", "--tp-size", "8", "--strategy", "HYBRID_SHARD", "--shard-group-size", "1"],
     "tensor parallelism (tp 8) is priced beside FSDP's FULL_SHARD"),
    (["memory", "--world-size", "4", "--micro-batch", "1", "--seq-len", "16", "--tp-size", "2"],
     "--tp-size prices a decoder at scale: give --model"),
    (["plan", "--model", "llama2-70b", "--gpu", "h100-80gb", "--gpus", "64", "--tp-size", "16"],
     "--tp-size 16 must divide the GPUs per node (8) and the KV heads (8)"),
    (["plan", "--model", "llama2-70b", "--gpu", "h100-80gb", "--gpus", "64", "--sp-size", "16"],
     "--sp-size 16 with --sp-method ulysses must divide the KV heads (8) (its all-to-all splits the"),
    (["plan", "--model", "llama2-70b", "--gpu", "h100-80gb", "--gpus", "64", "--sp-size", "3"],
     "--sp-size 3 must divide --gpus (64) and --seq-len (2048)"),
    (["plan", "--model", "llama2-70b", "--gpu", "h100-80gb", "--gpus", "64", "--tp-size", "0"],
     "--tp-size: must be a whole number >= 1"),
])
def test_bad_axes_are_refused_in_one_line_naming_the_flag(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) <= 3, err


PLAN_8K = ["plan", "--model", "llama2-70b", "--gpu", "h100-80gb", "--gpus", "64", "--seq-len", "8192"]
PLAN_128K = ["plan", "--model", "llama2-70b", "--gpu", "h100-80gb", "--gpus", "64", "--seq-len", "131072"]


@pytest.mark.parametrize("argv", [[*PLAN_8K, "--tp-size", "8"], [*PLAN_128K, "--tp-size", "8", "--sp-size", "1"],
                                  [*PLAN_128K, "--sp-size", "8"], [*PLAN_8K, "--batch-tokens", "262144"],
                                  ["memory", *LONG, "--tp-size", "8"], ["memory", *LONG, "--sp-size", "8"]],
                         ids=["tp-8k", "tp-128k", "sp-128k", "batch", "mem-tp", "mem-sp"])
def test_axes_outputs_fit_100_columns(argv, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100


def test_plan_prices_tp_beside_full_shard_and_hsdp_and_says_why(capsys):
    assert main([*PLAN_8K, "--tp-size", "8"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("beyond FSDP"):]
    for name in ("FULL_SHARD + AC", "HYBRID_SHARD + AC", "TP 8 x FSDP 8", "TP 8 x FSDP 8 + AC"):
        assert name in table
    joined = " ".join(table.split())  # the lines wrapped at 100 columns, joined
    assert "- Picks FULL_SHARD + AC:" in joined and "Best other: TP 8 x FSDP 8" in joined
    # a 2 % lead on an H100, whose published runs the model misses by a median 8.9 %: a tie
    assert "less than the model's median error on this GPU (8.9 %): time both" in joined
    assert "- Step times: the model's median error on NVIDIA H100 SXM 80GB is 8.9 %" in " ".join(out.split())
    assert "is FSDP enough? FSDP 64" in joined and "FSDP is enough to fit: FSDP 64." in joined
    assert main([*PLAN_128K, "--tp-size", "8"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the lines wrapped at 100 columns, joined
    # the verdict calls for the sequence split: the table prices it beside TP, so the two agree
    assert "- Picks SP 8 (ulysses) x FSDP 8 + AC:" in out and "Best other: TP 8 x FSDP 8 + AC" in out
    assert "is FSDP enough? SP 8 (ulysses) x FSDP 8" in out


def test_plan_json_carries_the_layouts_and_the_verdict(capsys):
    assert main([*PLAN_8K, "--batch-tokens", "262144", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    axes = data["axes"]
    assert data["step_time_band"]["gpu"] == "NVIDIA H100 SXM 80GB" and data["step_time_band"]["runs"] == 69
    assert axes["verdict"]["tp_size"] == 2 and axes["verdict"]["max_dp"] == 32
    assert [o["name"] for o in axes["options"]][:2] == ["FULL_SHARD", "FULL_SHARD + AC"]
    assert axes["why"].startswith("Picks TP 2 x FSDP 32 + AC") and "past the batch" in axes["why"]
    names = {o["name"]: o for o in axes["options"]}
    assert "TP 2 x FSDP 32 + AC" in names  # --batch-tokens alone: the TP the batch calls for
    assert names["FULL_SHARD + AC"]["within_batch"] is False


def test_plan_without_the_axes_flags_prints_no_axes(capsys):
    assert main(PLAN_8K) == 0
    assert "beyond FSDP" not in capsys.readouterr().out


PLAN_405B = ["plan", "--model", "llama3-405b", "--gpu", "h100-80gb", "--gpus", "1024", "--seq-len", "8192"]


def test_plan_offers_a_pipeline_for_405b_on_1024_h100_and_says_why(capsys, monkeypatch):
    """No FSDP option fits one 8,192-token sequence of Llama 3 405B with AdamW on an H100: the plan
    goes beyond FSDP by itself, pipelines priced beside TP and the sequence split."""
    monkeypatch.setenv("COLUMNS", "100")
    assert main(PLAN_405B) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    table = out[out.index("beyond FSDP"):]
    assert "TP 8 x PP 8x2 (m 32) x FSDP 16 + AC" in table and "bubble" in table  # interleaved, 2 a GPU
    joined = " ".join(table.split())
    assert "A pipeline of 8 stages (TP 8 x PP 8x2 (m 32) x FSDP 16 + AC) shards each stage over 16 GPUs" in joined
    assert main([*PLAN_405B, "--json"]) == 0
    options = json.loads(capsys.readouterr().out)["axes"]["options"]
    piped = [o for o in options if o["pp_size"] > 1]
    assert [o["microbatches"] for o in piped] == [256, 32] and all(o["bubble_s"] > 0 for o in piped)


def test_plan_prices_pipelines_only_where_fsdp_and_tp_fall_short(capsys):
    """Llama-2 70B on 64 H100 at 4,096 tokens: FULL_SHARD + AC fits and hides its communication,
    so no pipeline is priced unless asked; --pp-size 2 asks, --pp-size 1 refuses them."""
    plan_8k = ["plan", "--model", "llama2-70b", "--gpu", "h100-80gb", "--gpus", "64", "--seq-len", "4096"]
    assert main([*plan_8k, "--tp-size", "8"]) == 0
    assert " PP " not in capsys.readouterr().out
    assert main([*plan_8k, "--tp-size", "8", "--pp-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "TP 8 x PP 2 (m 8) x FSDP 4 + AC" in out
    assert main([*PLAN_405B, "--pp-size", "1"]) == 0
    assert " PP " not in capsys.readouterr().out
    assert main([*PLAN_405B, "--pp-size", "3"]) == 2
    assert "the pipeline stages (3) must divide" in capsys.readouterr().err
