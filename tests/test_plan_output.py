"""handbook_lib.models.plan_output: one plan, whole, as ``plan --json`` prints it and as the book's
planner page asks for it."""

import json
from pathlib import Path

import pytest

from handbook_lib.face import main
from handbook_lib.models import get_shape
from handbook_lib.models.plan_output import plan_page

CONFIGS = Path(__file__).parent / "data" / "hf_configs"


def _strict(text: str):
    """JSON as a browser parses it: ``NaN`` and ``Infinity`` refused."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _cli(capsys, argv):
    assert main(["plan", *argv, "--json"]) == 0
    return _strict(capsys.readouterr().out)


def _page(**fields):
    return _strict(plan_page(json.dumps(fields)))


@pytest.mark.parametrize("argv, fields", [
    (["--model", "llama2-70b", "--gpu", "h100-80gb", "--gpus", "32", "--seq-len", "4096"],
     {"model": "llama2-70b", "gpu": "h100-80gb", "gpus": "32", "seq_len": "4096"}),
    (["--model", "llama3-405b", "--gpu", "h100-80gb", "--gpus", "1024", "--seq-len", "8192"],
     {"model": "llama3-405b", "gpu": "h100-80gb", "gpus": "1024", "seq_len": "8192"}),
    (["--model", "llama2-7b", "--gpu", "a100-80gb", "--gpus", "16", "--headroom", "0.1", "--sensitivity"],
     {"model": "llama2-7b", "gpu": "a100-80gb", "gpus": "16", "sensitivity": True, "headroom": "0.1"}),
    (["--model", "llama2-13b", "--gpu", "h100-80gb", "--gpus", "8", "--optimizer", "sgd"],
     {"model": "llama2-13b", "gpu": "h100-80gb", "gpus": "8", "optimizer": "sgd"}),
    (["--model", "llama2-70b", "--gpu", "h100-80gb", "--gpus", "64", "--seq-len", "131072", "--tp-size", "8",
      "--sp-size", "8", "--sp-method", "ring"],
     {"model": "llama2-70b", "gpu": "h100-80gb", "gpus": "64", "seq_len": "131072", "tp_size": "8",
      "sp_size": "8", "sp_method": "ring"}),
    (["--model", "llama2-70b", "--gpu", "h100-80gb", "--gpus", "64", "--seq-len", "4096", "--ac-matmul-every", "2",
      "--shard-group-size", "0", "--activation-checkpointing", "selective"],
     {"model": "llama2-70b", "gpu": "h100-80gb", "gpus": "64", "seq_len": "4096", "shard_group_size": "0",
      "activation_checkpointing": "selective", "ac_matmul_every": "2"}),
    (["--model", "llama2-13b", "--gpu", "a100-80gb", "--gpus", "32", "--ac-every", "2", "--shard-group-size", "16"],
     {"model": "llama2-13b", "gpu": "a100-80gb", "gpus": "32", "ac_every": "2", "shard_group_size": "16"}),
])
def test_the_page_prices_what_the_command_line_prices(capsys, argv, fields):
    page = _page(**fields)
    assert page["report"] == _cli(capsys, argv)
    assert page["command"].split() == ["python", "-m", "handbook_lib", "plan", *argv]


def test_a_pasted_config_is_the_config_file(capsys):
    text = (CONFIGS / "llama3-8b.json").read_text()
    page = _page(config=text, gpu="h100-80gb", gpus="16", seq_len="8192")
    assert page["report"] == _cli(capsys, ["--hf-config", str(CONFIGS / "llama3-8b.json"), "--gpu", "h100-80gb",
                                           "--gpus", "16", "--seq-len", "8192"])
    assert page["shape"].startswith("shape: 32 layers, hidden 4,096, 32 heads and 8 KV heads of 128")


@pytest.mark.parametrize("fields, field, message", [
    ({"gpus": "0"}, "gpus", "argument --gpus: must be a whole number >= 1, got 0"),
    ({"gpus": "eight"}, "gpus", "argument --gpus: must be a whole number >= 1, got 'eight'"),
    ({"gpus": "12"}, "gpus", "--gpus 12 is not a whole number of nodes of --gpus-per-node 8"),
    ({"gpus": "16", "tp_size": "3"}, "tp_size", "--tp-size 3 must divide the GPUs per node (8), --gpus (16)"),
    ({"gpus": "8", "headroom": "1.5"}, "headroom", "argument --headroom:"),
    ({"gpus": "8", "sp_method": "ring"}, "sp_method", "--sp-method ring applies to the sequence split"),
    ({"gpus": "8", "config": "{oops"}, "config", "--hf-config config.json: not JSON (line 1"),
    ({"gpus": "8", "config": "[1, 2]"}, "config", "--hf-config config.json: a JSON list, not an object"),
    ({"gpus": "16", "optimizer": "sgd", "tp_size": "8"}, None, "--optimizer sgd: the layouts beyond FSDP"),
    ({"gpus": "64", "shard_group_size": "12"}, "shard_group_size", "--shard-group-size 12 must divide the 64 GPUs"),
    ({"gpus": "64", "shard_group_size": "x"}, "shard_group_size", "argument --shard-group-size: must be a whole"),
    ({"gpus": "8", "ac_save": "matmul"}, "ac_save", "--ac-save matmul chooses what the selective policy keeps"),
    ({"gpus": "8", "ac_every": "0"}, "ac_every", "argument --ac-every: must be a whole number >= 1"),
])
def test_bad_input_gets_the_command_line_s_one_line(capsys, fields, field, message):
    page = _page(model="llama2-70b", gpu="h100-80gb", **fields)
    assert page["field"] == field and page["error"].startswith(message) and "\n" not in page["error"]
    if "config" not in fields and not message.startswith("argument"):  # the same line the command line prints
        argv = ["--model", "llama2-70b", "--gpu", "h100-80gb", "--gpus", fields["gpus"]]
        for key in ("tp_size", "optimizer", "shard_group_size", "ac_save", "sp_method"):
            argv += ["--" + key.replace("_", "-"), fields[key]] if key in fields else []
        assert main(["plan", *argv]) == 2
        assert " ".join(capsys.readouterr().err.split()).startswith(f"error: {message}")


def test_the_page_draws_every_option_s_peak_both_ways_and_its_budget():
    page = _page(model="llama2-70b", gpu="h100-80gb", gpus="64", seq_len="4096", shard_group_size="0")
    options, rows = page["report"]["options"], page["view"]["options"]
    assert [r["name"] for r in rows] == [o["name"] for o in options]
    for o, r in zip(options, rows):
        assert (r["allocated"], r["reserved"], r["budget"]) == (o["peak_bytes"], o["peak_reserved_bytes"],
                                                               o["budget_bytes"])
        assert r["margin"] == (o["budget_bytes"] - o["peak_reserved_bytes"]) / o["budget_bytes"]
        assert r["allocated"] < r["reserved"]  # the allocator's reserve over what the tensors hold
    assert len({r["budget"] for r in rows}) > 1  # each option's NCCL buffers differ


def test_the_plan_says_what_it_does_not_model():
    from handbook_lib.models import plan_report

    plain = plan_report("llama2-70b", "h100-80gb", 64, seq_len=4096).not_modelled
    assert any("set_to_none" in line for line in plain) and any("torch.compile" in line for line in plain)
    assert not any("pointwise" in line or "1F1B" in line for line in plain)
    selective = plan_report("llama2-70b", "h100-80gb", 64, seq_len=4096,
                            activation_checkpointing="selective").not_modelled
    assert any("pointwise" in line for line in selective)
    shape = get_shape("llama2-70b")
    axes = plan_report(shape, "h100-80gb", 64, decoder=shape, seq_len=4096, tp_size=8).not_modelled
    assert any("1F1B" in line for line in axes)
    assert _page(model="llama2-70b", gpu="h100-80gb", gpus="64")["report"]["not_modelled"] == list(
        plan_report(shape, "h100-80gb", 64, decoder=shape).not_modelled)


@pytest.mark.parametrize("chunks, words", [(0, "--loss-chunks must be a whole number >= 1, got 0"),
                                           (3, "--loss-chunks 3 must divide --seq-len 2048")])
def test_loss_chunks_are_refused_by_the_flag_s_name(chunks, words):
    from handbook_lib.models import plan_report

    with pytest.raises(ValueError, match=words):
        plan_report("llama2-7b", "h100-80gb", 8, loss_chunks=chunks)


def test_the_search_reaches_the_page_as_strict_json():
    """A layout with no collective to hide has an infinite compute margin, a TP row none (NaN):
    both are written as null, which a browser's JSON parser takes."""
    page = _page(model="llama2-70b", gpu="h100-80gb", gpus="512", seq_len="4096")
    search = page["report"]["search"]
    assert search["verdict"].startswith("Fastest of the ") and len(page["view"]["search"]) == 8
    assert {c["compute_margin"] for c in search["candidates"] if c["tp_size"] > 1} == {None}
    assert page["view"]["search"][0]["vs_best"] == 0 and page["view"]["search"][1]["tie"] is True
    one = _page(model="llama2-7b", gpu="h100-80gb", gpus="1")  # one GPU: nothing to hide
    assert any(o["compute_margin"] is None for o in one["report"]["options"])


def test_the_cpu_preset_and_one_strategy_are_not_searched():
    """The search ranks GPU layouts: the nominal cpu preset (this machine's gloo ranks) and a
    strategy asked alone get their table and no search."""
    assert _page(model="llama2-7b", gpu="cpu", gpus="2")["report"].get("search") is None
    assert _page(model="llama2-7b", gpu="h100-80gb", gpus="8")["report"]["search"]["candidates"]
