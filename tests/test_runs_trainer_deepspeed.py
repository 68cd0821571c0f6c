"""handbook_lib.runs.trainer_deepspeed: the Trainer with DeepSpeed, saved whole, loaded back, resumed.

Chapter 7 runs ZeRO-3 on 2 ranks (4 steps, a checkpoint every 2); this run covers ZeRO-2 on 2
ranks with a checkpoint after the first step. On CPU ranks the Trainer gets a DeepSpeed state over
gloo (see the run's docstring).
"""

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from handbook_lib.core import param_count  # noqa: E402
from handbook_lib.integrations import SyntheticLM, build_gpt2, gpt2_config  # noqa: E402
from handbook_lib.launch import torchrun  # noqa: E402
from handbook_lib.runs.trainer_deepspeed import TrainerRunConfig, validate  # noqa: E402
from handbook_lib.runtime import make_batch  # noqa: E402

TINY = {"vocab_size": 1001, "d_model": 64, "nhead": 2, "dim_feedforward": 96, "num_layers": 2,
        "batch_size": 8, "seq_len": 16, "steps": 3}


def test_zero2_saves_a_whole_model_and_resumes_exactly(tmp_path):
    config = {**TINY, "strategy": "ZERO2", "save_every": 1, "trainer_dir": str(tmp_path / "trainer")}
    result = torchrun("trainer_deepspeed", 2, config, out=tmp_path / "run", timeout_s=300, stream=False)
    assert not result.failed_checks()
    assert [c.measured for c in result.checks if c.quantity == "trainer_world_size"] == [2, 2]
    rank0 = result.ranks[0]
    assert rank0["resumed_losses"] == rank0["losses"][1:]  # steps 2 and 3, bit for bit
    checks = {c.quantity: c for c in result.checks}
    assert checks["from_pretrained_logits_max_abs_diff"].measured == 0.0
    assert "model.safetensors" in rank0["saved_files"]
    assert rank0["distributed_type"] == "DistributedType.DEEPSPEED"
    assert (tmp_path / "trainer" / "checkpoint-1").is_dir() and (tmp_path / "trainer" / "checkpoint-3").is_dir()


def test_the_model_and_data_follow_the_run_config():
    config = TrainerRunConfig.from_mapping(TINY)
    gpt2 = gpt2_config(config)
    assert (gpt2.n_embd, gpt2.n_head, gpt2.n_inner, gpt2.n_layer, gpt2.n_positions, gpt2.vocab_size) == (
        64, 2, 96, 2, 16, 1001)
    assert gpt2.resid_pdrop == gpt2.embd_pdrop == gpt2.attn_pdrop == 0.0
    a, b = build_gpt2(config), build_gpt2(config)  # seeded: the same weights twice
    assert all((p == q).all() for p, q in zip(a.parameters(), b.parameters()))
    assert sum(p.numel() for p in a.parameters()) != param_count(config.model_config())  # another model
    data = SyntheticLM(config)
    assert len(data) == 3 * 8
    assert (data[11]["input_ids"] == make_batch(config, 1)[0][3]).all()


@pytest.mark.parametrize("changes, world, match", [
    ({"strategy": "FULL_SHARD"}, 1, "runs strategy ZERO1, ZERO2, ZERO3"),
    ({}, 1, "needs trainer_dir"),
    ({"trainer_dir": "TMP", "save_every": 3}, 1, "'save_every' must be in 1..steps-1"),
    ({"trainer_dir": "TMP", "precision": "bf16-mixed"}, 1, "runs precision 'fp32'"),
    ({"trainer_dir": "TMP", "init": "meta"}, 1, "init='full' only"),
    ({"trainer_dir": "FILE"}, 1, "exists and is not an empty folder"),
])
def test_validate_refuses(tmp_path, changes, world, match):
    (tmp_path / "file").write_text("not the Trainer's")
    changes = {k: {"TMP": str(tmp_path / "new"), "FILE": str(tmp_path)}.get(v, v) if k == "trainer_dir" else v
               for k, v in changes.items()}
    with pytest.raises(ValueError, match=match):
        validate(TrainerRunConfig.from_mapping({**TINY, **changes}), world)


def test_the_trained_model_is_probed_on_the_cpu_like_its_saved_copy():
    """gpu-path.md S1-4: a GPU model's logits against a CPU process's differ by ~1e-6; the run
    probes a CPU copy instead, which gives the model's own CPU logits bit for bit."""
    from handbook_lib.core import RunConfig
    from handbook_lib.integrations.hf_trainer import build_gpt2, probe_logits, probe_logits_on_cpu

    config = RunConfig.from_mapping({"vocab_size": 64, "d_model": 32, "nhead": 2, "dim_feedforward": 48,
                                     "num_layers": 1, "seq_len": 8})
    model = build_gpt2(config)
    with torch.no_grad():
        for p in model.parameters():  # a trained model, not the seeded one a copy would rebuild
            p.add_(0.01)
        assert torch.equal(probe_logits_on_cpu(model, config), probe_logits(model, config))


def test_a_zero3_rank_holds_each_partition_or_the_whole_tensor():
    from handbook_lib.integrations.hf_trainer import zero3_partition_elements

    model = torch.nn.Linear(3, 5)  # weight 15 elements, bias 5
    model.weight.ds_tensor = torch.empty(8)  # ZeRO-3's partition on 2 ranks: ceil(15 / 2)
    assert zero3_partition_elements(model) == 8 + 5  # the bias kept whole (no ds_tensor)
