"""A Transformers config.json read as a decoder's shape (handbook_lib.models.hf_config).

The expected counts are not written here: each config is built by Transformers itself on the
meta device (no weights, nothing downloaded) and its parameters are counted there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from handbook_lib.face.cli import main
from handbook_lib.models import (
    HF_DEFAULTS,
    decoder_shape_from_hf,
    estimate_memory,
    get_shape,
    model_layout,
    read_hf_config,
)

CONFIGS = Path(__file__).parent / "data" / "hf_configs"
GOOD = sorted(p for p in CONFIGS.glob("*.json") if not p.name.startswith("bad-"))


def _transformers_count(config: dict) -> int:
    """Parameters of Transformers' own causal LM for ``config``, built on the meta device
    (tied weights counted once, as ``parameters()`` yields them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    keys = {k: v for k, v in config.items() if not k.startswith("_") and k != "architectures"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**keys))
    return sum(p.numel() for p in model.parameters())


def test_there_is_a_config_of_every_family():
    families = {json.loads(p.read_text())["model_type"] for p in GOOD}
    assert families == set(HF_DEFAULTS)
    assert len(GOOD) >= 10


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.stem)
def test_count_equals_transformers_own_to_the_parameter(path):
    config = json.loads(path.read_text())
    assert read_hf_config(path).num_params == _transformers_count(config)


@pytest.mark.parametrize("family", sorted(HF_DEFAULTS))
def test_defaults_are_transformers_defaults(family):
    """A key the file leaves out means what Transformers' config class gives it."""
    from transformers import AutoConfig

    reference = AutoConfig.for_model(family)
    for key, ours in HF_DEFAULTS[family].items():
        if ours is None:  # derived: key/value heads = heads, head width = hidden_size / heads
            derived = {"num_key_value_heads": reference.num_attention_heads, "n_inner": None,
                       "head_dim": reference.hidden_size // reference.num_attention_heads}[key]
            assert getattr(reference, key, None) in (None, derived), key
        else:
            assert getattr(reference, key) == ours, key
    assert decoder_shape_from_hf({"model_type": family}).num_params == _transformers_count({"model_type": family})


def test_a_published_config_gives_the_preset_it_matches():
    """Llama-2 7B's config.json and the book's preset are one model: same count, same units,
    same memory prediction."""
    shape, preset = read_hf_config(CONFIGS / "llama2-7b.json"), get_shape("llama2-7b")
    assert shape.num_params == preset.num_params == preset.published_params == 6_738_415_616
    assert shape.name == "meta-llama/Llama-2-7b-hf"
    ours, theirs = model_layout(shape), model_layout(preset)
    assert ours.units() == theirs.units() and ours.breakdown == theirs.breakdown
    kwargs = dict(micro_batch=1, seq_len=4096, activation_checkpointing=True)
    assert estimate_memory(shape, 8, "FULL_SHARD", "bf16-mixed", **kwargs).peak == \
        estimate_memory(preset, 8, "FULL_SHARD", "bf16-mixed", **kwargs).peak


def test_what_each_family_holds():
    qwen = read_hf_config(CONFIGS / "qwen2-7b.json")
    assert qwen.qkv_bias and not qwen.out_bias and not qwen.mlp_bias and qwen.kv_heads == 4
    gpt2 = read_hf_config(CONFIGS / "gpt2.json")
    assert gpt2.bias and gpt2.tied_embeddings and gpt2.max_positions == 1024 and gpt2.ffn == 4 * 768
    nemo = read_hf_config(CONFIGS / "mistral-nemo-12b.json")
    assert nemo.head_width == 128 != nemo.d_model // nemo.nhead
    tiny = read_hf_config(CONFIGS / "llama-biases-tiny.json")
    assert tiny.qkv_bias and tiny.out_bias and tiny.mlp_bias


@pytest.mark.parametrize("name, fragment", [
    ("bad-mixtral", "model_type 'mixtral' is not covered; accepted: llama, mistral, qwen2, gpt2"),
    ("bad-heads", "num_attention_heads=3 must divide hidden_size=100"),
    ("bad-kv-heads", "num_key_value_heads=3 must divide num_attention_heads=8"),
    ("bad-layers-text", "n_layer must be a whole number >= 1, got '12'"),
    ("bad-list", "a JSON list, not an object"),
    ("bad-not-json", "not JSON (line 1"),
    ("missing", "cannot read it"),
])
def test_a_bad_file_is_one_line_naming_it(name, fragment, capsys):
    path = CONFIGS / f"{name}.json"
    with pytest.raises(ValueError) as err:
        read_hf_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and fragment in message and "\n" not in message
    assert main(["params", "--hf-config", str(path)]) == 2
    assert " ".join(capsys.readouterr().err.split()) == f"error: --hf-config {message}"  # wrapped to 100 columns


def test_params_json_prints_the_total(capsys):
    path = CONFIGS / "llama3-8b.json"
    assert main(["params", "--hf-config", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["total"] == read_hf_config(path).num_params == sum(data["components"].values())
    assert data["model"].startswith("meta-llama/Meta-Llama-3-8B")


@pytest.mark.parametrize("command", [["memory", "--micro-batch", "1", "--seq-len", "2048"],
                                     ["comm", "--world-size", "8"],
                                     ["plan", "--gpu", "h100-80gb", "--gpus", "8"]])
def test_planning_commands_take_a_config(command, capsys):
    path = CONFIGS / "qwen2-7b.json"
    assert main([command[0], "--hf-config", str(path), *command[1:]]) == 0
    named = f"model: Qwen/Qwen2-7B, {read_hf_config(path).num_params:,} parameters (--hf-config {path})"
    assert " ".join(capsys.readouterr().out.split()).startswith(named)  # wrapped to 100 columns


def test_plan_of_a_published_config_is_the_plan_of_its_preset(capsys):
    common = ["--gpu", "a100-80gb", "--gpus", "16", "--seq-len", "4096", "--json"]
    assert main(["plan", "--hf-config", str(CONFIGS / "llama2-7b.json"), *common]) == 0
    by_file = json.loads(capsys.readouterr().out)
    assert main(["plan", "--model", "llama2-7b", *common]) == 0
    by_preset = json.loads(capsys.readouterr().out)
    assert by_file.pop("model") == "meta-llama/Llama-2-7b-hf" and by_preset.pop("model") == "Llama-2 7B"
    assert by_file == by_preset
