"""handbook_lib.runs.hf_weights and runtime.hf_weights: Hugging Face safetensors out of and into
an FSDP2-sharded Llama, and into Transformers.

Chapter 6 runs the default model on 2 ranks; this test runs another on 4: a vocabulary of 257
rows, which 4 ranks do not divide (FSDP2 pads the shards and the files must not hold the
padding), three layers and one key/value head.
"""

import json

import pytest

pytest.importorskip("transformers")

from handbook_lib.launch import torchrun  # noqa: E402
from handbook_lib.models import decoder_shape_from_hf, get_shape  # noqa: E402
from handbook_lib.runs.specs.hf_weights import HFWeightsConfig, validate  # noqa: E402
from handbook_lib.runtime.hf_weights import SHARDED_DIR, safetensors_files, transformers_config  # noqa: E402

ODD = {"vocab_size": 257, "num_hidden_layers": 3, "num_key_value_heads": 1, "seed": 3}


def test_four_ranks_write_what_transformers_loads_and_read_it_back(tmp_path):
    save = tmp_path / "weights"
    result = torchrun("hf_weights", 4, {**ODD, "save_dir": str(save)}, out=tmp_path / "run", timeout_s=300,
                      stream=False)
    assert not result.failed_checks()
    checks = {(c.quantity, c.rank) for c in result.checks}
    assert {("elements_differing_after_reload", r) for r in range(4)} <= checks
    assert ("logits_max_abs_diff_vs_transformers", None) in checks
    shape = HFWeightsConfig(**ODD).shape()
    # each rank's activations of the sharded Llama (one key/value head), exact, as one process counts them
    from handbook_lib.models.layout import model_layout
    from handbook_lib.runs.hf_weights import ACTIVATION_BATCH
    from handbook_lib.runtime.decoder import measure_activation_bytes

    expected = model_layout(shape).activations(*ACTIVATION_BATCH, "fp32").total
    assert expected == measure_activation_bytes(shape, *ACTIVATION_BATCH, "fp32")
    assert [r["activation_bytes"] for r in result.ranks] == [expected] * 4
    files = safetensors_files(save)
    assert sum(t.numel() for t in files.values()) == shape.num_params  # no padding row written
    assert files["model.embed_tokens.weight"].shape == (257, 64)
    assert sorted(result.ranks[0]["files"]) == sorted(
        ["config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json",
         *(f"{SHARDED_DIR}/shard-0000{r}-model-00001-of-00001.safetensors" for r in range(1, 5))])
    written = json.loads((save / "config.json").read_text())
    assert decoder_shape_from_hf(written).num_params == shape.num_params


@pytest.mark.parametrize("name", ["llama2-7b", "llama2-70b", "llama3-405b"])
def test_the_config_json_reads_back_as_the_same_shape(name):
    shape = get_shape(name)
    back = decoder_shape_from_hf(transformers_config(shape), shape.name)
    assert (back.num_params, back.kv_heads, back.head_width, back.ffn) == (
        shape.num_params, shape.kv_heads, shape.head_width, shape.ffn)


def test_a_gpt_shape_has_no_llama_config():
    with pytest.raises(ValueError, match="not a Llama-family shape"):
        transformers_config(get_shape("gpt3-175b"))


def test_a_folder_that_holds_files_is_refused_before_anything_starts(tmp_path):
    (tmp_path / "note.txt").write_text("mine")
    with pytest.raises(ValueError, match="already holds files: give a new or empty folder"):
        validate(HFWeightsConfig(save_dir=str(tmp_path)), 2)
    assert (tmp_path / "note.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="hf_weights needs save_dir"):
        validate(HFWeightsConfig(), 2)
    with pytest.raises(ValueError, match="num_key_value_heads=3 must divide num_attention_heads=4"):
        validate(HFWeightsConfig(save_dir=str(tmp_path / "new"), num_key_value_heads=3), 2)
