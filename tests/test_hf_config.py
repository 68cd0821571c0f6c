"""A Transformers config.json read as a decoder's shape (handbook_lib.models.hf_config).

The expected counts are not written here: each config is built by Transformers itself on the
meta device (no weights, nothing downloaded) and its parameters are counted there.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from handbook_lib.core.architecture import ModelConfig
from handbook_lib.face.cli import main
from handbook_lib.models import (
    HF_DEFAULTS,
    decoder_shape_from_hf,
    estimate_memory,
    get_shape,
    model_layout,
    read_hf_config,
)
from handbook_lib.models.hf_config import HF_BOUNDS, MAX_CONFIG_BYTES, read_hf_config_keys, unused_hf_keys
from handbook_lib.models.presets import describe_shape

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
    ("bad-layers-text", "n_layer must be a whole number from 1 to 256, got '12'"),
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


# --- strict reading: the types Transformers gives its fields, bounds, the file itself ------------

QWEN25_14B = {  # Qwen/Qwen2.5-14B's published config.json, the keys that matter and a few that do not
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120,
    "intermediate_size": 13824, "num_hidden_layers": 48, "num_attention_heads": 40,
    "num_key_value_heads": 8, "vocab_size": 152064, "max_position_embeddings": 32768,
    "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "hidden_act": "silu",
}


def _write(tmp_path: Path, config: dict, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def test_qwen25_14b_counts_as_transformers_builds_it(tmp_path):
    shape, unused = read_hf_config_keys(_write(tmp_path, QWEN25_14B))
    assert shape.num_params == _transformers_count(QWEN25_14B) == 14_770_033_664
    assert unused == ("max_position_embeddings", "rms_norm_eps", "hidden_act")  # listed once, in the file's order


@pytest.mark.parametrize("key, text, truthy", [("tie_word_embeddings", "false", True), ("mlp_bias", "no", True),
                                               ("attention_bias", "0", True), ("tie_word_embeddings", "", False)])
def test_a_switch_given_as_a_string_is_refused(key, text, truthy):
    """Transformers keeps the string, and Python reads a non-empty one as true: "false" ties the
    head (778,567,680 parameters dropped from Qwen2.5-14B), "no" adds Llama's FFN biases."""
    assert bool(text) is truthy  # what a reader that casts would make of it
    config = {**QWEN25_14B, "model_type": "llama", "architectures": ["LlamaForCausalLM"], key: text}
    with pytest.raises(ValueError, match=rf"^{key} must be true or false \(a JSON boolean\), got '{text}'$"):
        decoder_shape_from_hf(config)


def test_what_a_string_switch_would_have_cost():
    """Counted by Transformers itself: what "false" and "no" would have changed, had they been cast."""
    untied = decoder_shape_from_hf(QWEN25_14B).num_params
    tied = {**QWEN25_14B, "tie_word_embeddings": True}
    assert untied - decoder_shape_from_hf(tied).num_params == untied - _transformers_count(tied) == 778_567_680
    llama = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
             "num_attention_heads": 16, "vocab_size": 1000}
    biased = {**llama, "mlp_bias": True}
    added = _transformers_count(biased) - _transformers_count(llama)
    assert decoder_shape_from_hf(biased).num_params - decoder_shape_from_hf(llama).num_params == added
    assert added == 4 * (2 * 2816 + 1024)  # gate and up biases of the FFN width, down's of the hidden


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 48.0), ("hidden_size", "5120"), ("vocab_size", True),
                                        ("num_key_value_heads", 8.5), ("intermediate_size", [13824])])
def test_a_size_must_be_a_json_whole_number(key, value):
    with pytest.raises(ValueError, match=rf"^{key} must be a whole number from 1 to "):
        decoder_shape_from_hf({**QWEN25_14B, key: value})


@pytest.mark.parametrize("typo, meant", [("num_layers", "num_hidden_layers"), ("hidden_layers", "num_hidden_layers"),
                                         ("num_kv_heads", "num_key_value_heads"), ("vocabsize", "vocab_size"),
                                         ("tie_word_embedding", "tie_word_embeddings"), ("n_layer", "num_hidden_layers")])
def test_a_misspelt_key_is_refused_naming_the_closest(typo, meant):
    config = {k: v for k, v in QWEN25_14B.items() if k != meant}
    config[typo] = QWEN25_14B.get(meant, 48)
    with pytest.raises(ValueError) as err:
        decoder_shape_from_hf(config)
    message = str(err.value)
    assert message.startswith(f"'{typo}' is not a key of qwen2 configs: did you mean {meant}? (without it, ")
    assert "\n" not in message


def test_the_misspelt_layers_would_have_been_the_default():
    """``num_layers`` for ``num_hidden_layers``: the 32-layer default, 10.37 B instead of 14.77 B."""
    config = {k: v for k, v in QWEN25_14B.items() if k != "num_hidden_layers"}
    silent = _transformers_count(config)  # what Transformers builds from the file with the typo
    assert round(silent / 1e9, 2) == 10.37 and decoder_shape_from_hf(config).num_params == silent
    with pytest.raises(ValueError, match="did you mean num_hidden_layers"):
        decoder_shape_from_hf({**config, "num_layers": 48})


def test_keys_of_transformers_are_not_taken_for_typos():
    config = {**QWEN25_14B, "max_window_layers": 28, "use_sliding_window": False, "attention_dropout": 0.0,
              "rope_theta": 1e6, "some_key_of_a_newer_release": 1}
    assert decoder_shape_from_hf(config).num_params == 14_770_033_664
    assert unused_hf_keys(config)[-2:] == ("rope_theta", "some_key_of_a_newer_release")


def test_gpt2_reads_the_usual_names_as_transformers_does():
    """GPT2Config maps num_hidden_layers to n_layer (its attribute_map): read, not ignored."""
    assert decoder_shape_from_hf({"model_type": "gpt2", "num_hidden_layers": 6}).num_layers == 6
    assert _transformers_count({"model_type": "gpt2", "num_hidden_layers": 6}) == \
        decoder_shape_from_hf({"model_type": "gpt2", "num_hidden_layers": 6}).num_params
    with pytest.raises(ValueError, match="^num_hidden_layers and n_layer name one size of GPT-2"):
        decoder_shape_from_hf({"model_type": "gpt2", "num_hidden_layers": 6, "n_layer": 12})


@pytest.mark.parametrize("extra, fragment", [
    ({"architectures": ["Qwen2MoeForCausalLM"]}, "architectures: 'Qwen2MoeForCausalLM' is not covered; covered: "),
    ({"architectures": ["Qwen2ForSequenceClassification"]}, "architectures: 'Qwen2ForSequenceClassification'"),
    ({"num_experts": 60}, "num_experts: a mixture of experts is not covered"),
    ({"model_type": "gemma2"}, "model_type 'gemma2' is not covered; accepted: llama, mistral, qwen2, gpt2"),
    ({"model_type": "qwen2_moe"}, "model_type 'qwen2_moe' is not covered"),
])
def test_a_family_outside_the_covered_ones_is_refused_naming_them(extra, fragment):
    with pytest.raises(ValueError) as err:
        decoder_shape_from_hf({**QWEN25_14B, **extra})
    assert str(err.value).startswith(fragment) and "Qwen2ForCausalLM" in str(err.value) or "llama" in str(err.value)


@pytest.mark.parametrize("key, value, top", [("num_hidden_layers", 10**12, "256"), ("hidden_size", 10**9, "131,072"),
                                             ("vocab_size", 2**40, "16,777,216"), ("num_attention_heads", 10**6, "4,096")])
def test_sizes_are_bounded(key, value, top):
    with pytest.raises(ValueError, match=rf"^{key} must be a whole number from 1 to {top}, got {value}$"):
        decoder_shape_from_hf({**QWEN25_14B, key: value})


@pytest.mark.parametrize("command", [["params"], ["plan", "--gpu", "cpu", "--gpus", "8"]])
def test_a_trillion_layers_is_refused_at_once(tmp_path, command, capsys):
    path = _write(tmp_path, {**QWEN25_14B, "num_hidden_layers": 10**12})
    start = time.perf_counter()
    assert main([command[0], "--hf-config", str(path), *command[1:]]) == 2
    assert time.perf_counter() - start < 1.0
    assert "num_hidden_layers must be a whole number from 1 to 256, got 1000000000000" in \
        " ".join(capsys.readouterr().err.split())


def test_the_deepest_accepted_model_answers_within_a_second(tmp_path, capsys):
    path = _write(tmp_path, {**QWEN25_14B, "num_hidden_layers": HF_BOUNDS["num_hidden_layers"]})
    for command in (["params"], ["memory", "--micro-batch", "1", "--seq-len", "4096"],
                    ["plan", "--gpu", "cpu", "--gpus", "8"]):
        start = time.perf_counter()
        assert main([command[0], "--hf-config", str(path), *command[1:]]) == 0
        assert time.perf_counter() - start < 1.0, command
    capsys.readouterr()


def test_a_file_of_unbounded_size_is_refused_unread(tmp_path):
    for special in ("/dev/zero", "/dev/urandom"):
        if Path(special).exists():
            with pytest.raises(ValueError, match=rf"^{special}: a device, pipe or socket, not a regular file; "):
                read_hf_config(special)
    with pytest.raises(ValueError, match="a folder, not a regular file"):
        read_hf_config(tmp_path)
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    with pytest.raises(ValueError, match="not a regular file"):
        read_hf_config(fifo)
    sparse = tmp_path / "huge.json"
    with sparse.open("wb") as file:
        file.truncate(64 * 2**30)  # 64 GiB of zeros, not one byte on disk: reading it would not end soon
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"68,719,476,736 bytes, over the {MAX_CONFIG_BYTES:,} a config.json may have"):
        read_hf_config(sparse)
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("content, fragment", [
    (b'{"model_type": "llama", "_name_or_path": "Mod\xe8le"}', "not UTF-8 text (byte 45 is 0xe8)"),
    (b'{"model_type": "llama", "num_hidden_layers": 2, "num_hidden_layers": 3}',
     "key 'num_hidden_layers' given twice"),
    (b"[" * 100_000 + b"]" * 100_000, "not a config (maximum recursion depth exceeded"),
    (b'{"model_type": "llama", "vocab_size": ' + b"9" * 5000 + b"}", "Exceeds the limit (4300 digits)"),
    (b'{"model_type": "llama", "_name_or_path": "a\\u001b[31mred"}', "_name_or_path must be printable text"),
])
def test_a_file_that_is_not_a_config_is_one_line_naming_it(tmp_path, content, fragment):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        read_hf_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and fragment in message and "\n" not in message
    assert len(message) < 250 + len(str(path))


# --- the tools echo what they read ------------------------------------------------------------

@pytest.mark.parametrize("command", [["params"], ["memory"], ["comm", "--world-size", "8"],
                                     ["plan", "--gpu", "h100-80gb", "--gpus", "64"]])
def test_every_tool_echoes_the_shape_it_read(tmp_path, command, capsys):
    path = _write(tmp_path, QWEN25_14B)
    assert main([command[0], "--hf-config", str(path), *command[1:]]) == 0
    out = " ".join(capsys.readouterr().out.split())  # wrapped to 100 columns
    shape = ("shape: 48 layers, hidden 5,120, 40 heads and 8 KV heads of 128, FFN 13,824 (gated), "
             "vocabulary 152,064, biases on Q/K/V, head untied")
    assert f"(--hf-config {path}) {shape} not read (no effect on the count): max_position_embeddings, " \
           "rms_norm_eps, hidden_act assumes" in out or f"(--hf-config {path}) {shape} not read (no effect on " \
           "the count): max_position_embeddings, rms_norm_eps, hidden_act component" in out


def test_describe_shape_of_each_kind():
    assert describe_shape(get_shape("llama2-70b")) == (
        "shape: 80 layers, hidden 8,192, 64 heads and 8 KV heads of 128, FFN 28,672 (gated), "
        "vocabulary 32,000, no biases, head untied")
    assert describe_shape(read_hf_config(CONFIGS / "gpt2.json")) == (
        "shape: 12 layers, hidden 768, 12 heads and 12 KV heads of 64, FFN 3,072, vocabulary 50,257, "
        "1,024 learned positions, biases everywhere, head tied")
    assert describe_shape(ModelConfig()) == ("shape: 6 layers, hidden 256, 4 heads of 64, FFN 1,024, "
                                             "vocabulary 10,000, biases everywhere, head untied")
