"""handbook_lib.runtime.checkpoint: a checksum per file, verified at load; another model refused by name.

All in one process (DCP without a process group); chapter 6's runs do the same with 2 ranks.
"""

import json
import time

import pytest
import torch

from handbook_lib.core import ModelConfig, param_shapes
from handbook_lib.models import CHECKSUM, MANIFEST
from handbook_lib.runtime import (
    CheckpointError,
    build_model,
    check_model_shapes,
    file_checksum,
    load_checkpoint,
    save_checkpoint,
    validate_checkpoint,
)

SMALL = ModelConfig(vocab_size=101, d_model=16, nhead=2, dim_feedforward=24, num_layers=2)
CHAPTER_6 = ModelConfig(vocab_size=2003, d_model=128, nhead=4, dim_feedforward=256, num_layers=3)
"""Chapter 6's model: its checkpoints (weights + AdamW state) are about 11.4 MB."""


def _saved(root, config: ModelConfig = SMALL, step: int = 1):
    model = build_model(config, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1]).sum().backward()
    opt.step()  # creates the optimizer state
    return save_checkpoint(root, step, model, opt)


def test_manifest_records_a_sha256_per_file(tmp_path):
    saved = _saved(tmp_path)
    manifest = json.loads((saved.path / MANIFEST).read_text())
    assert set(manifest[CHECKSUM]) == set(manifest["files"]) == {".metadata", "__0_0.distcp"}
    for name, digest in manifest[CHECKSUM].items():
        assert len(digest) == 64 and digest == file_checksum(saved.path / name)
    assert 0 < saved.checksum_s < saved.seconds


def test_4_kib_overwritten_mid_shard_with_its_size_unchanged_is_refused_by_name(tmp_path):
    saved = _saved(tmp_path)
    shard = saved.path / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.seek(size // 2)
        f.write(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1),
                              dtype=torch.uint8).numpy().tobytes())
    assert shard.stat().st_size == size
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp does not match its sha256 checksum"):
        validate_checkpoint(tmp_path)
    model = build_model(SMALL, seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"corrupt checkpoint .*step_000001: __0_0\.distcp"):
        load_checkpoint(tmp_path, model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing loaded
    assert validate_checkpoint(tmp_path, verify_checksums=False)["step"] == 1  # sizes alone: fooled


def test_a_manifest_without_checksums_is_refused(tmp_path):
    saved = _saved(tmp_path)
    manifest = json.loads((saved.path / MANIFEST).read_text())
    del manifest[CHECKSUM]
    (saved.path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="no sha256 checksum for every file"):
        validate_checkpoint(tmp_path)


def test_a_6_layer_checkpoint_is_refused_by_a_2_layer_model_naming_the_tensors(tmp_path):
    six = ModelConfig(vocab_size=101, d_model=16, nhead=2, dim_feedforward=24, num_layers=6)
    _saved(tmp_path, six)
    with pytest.raises(CheckpointError) as info:
        check_model_shapes(tmp_path, dict(param_shapes(SMALL)))  # from the config alone, no model
    message = str(info.value)
    assert "holds another model's tensors (75 saved, 27 in the model); nothing was loaded" in message
    assert "in the checkpoint, not in the model (48): layers.2.self_attn.in_proj_weight," in message
    assert "and 43 more" in message and "missing from the checkpoint" not in message
    with pytest.raises(CheckpointError, match=r"in the checkpoint, not in the model \(48\)"):
        load_checkpoint(tmp_path, build_model(SMALL, seed=0))
    # the other way: a 2-layer checkpoint lacks what a 6-layer model needs
    _saved(tmp_path / "two", SMALL)
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \(48\): layers\.2\."):
        check_model_shapes(tmp_path / "two", dict(param_shapes(six)))
    check_model_shapes(tmp_path / "two", dict(param_shapes(SMALL)))  # the same model passes


def test_checksum_cost_on_a_chapter_6_sized_checkpoint(tmp_path):
    """Hashing a chapter-6 checkpoint (~11.4 MB) costs milliseconds: measured, printed, bounded."""
    saved = _saved(tmp_path, CHAPTER_6)
    size = sum(saved.files.values())
    assert 10e6 < size < 13e6
    begin = time.perf_counter()
    validate_checkpoint(tmp_path)
    verify_s = time.perf_counter() - begin
    print(f"{size / 1e6:.1f} MB: checksums at save {saved.checksum_s:.4f} s, verified at load {verify_s:.4f} s, "
          f"whole save {saved.seconds:.3f} s")
    assert saved.checksum_s < 1.0 and verify_s < 1.0  # ~0.01 s here; a loose bound for busy CI machines
