"""handbook_lib.runtime.checkpoint_verify: a checksum per item, hashed by the rank that wrote it and
verified by the rank that reads it; another model refused by name.

All in one process (DCP without a process group); ``test_runs_checkpoint_cost`` does the same with
2 ranks, where each rank hashes and verifies only its share.
"""

import hashlib
import json
import time

import pytest
import torch

from handbook_lib.core import ModelConfig, param_shapes
from handbook_lib.models import CHECKSUM, MANIFEST
from handbook_lib.models.checkpoint import cost_fraction, scale_model_width
from handbook_lib.models.layout import model_layout
from handbook_lib.runtime import (
    CheckpointError,
    build_model,
    check_model_shapes,
    file_checksum,
    load_checkpoint,
    read_metadata,
    save_checkpoint,
    validate_checkpoint,
)
from handbook_lib.runtime import checkpoint_verify

SMALL = ModelConfig(vocab_size=101, d_model=16, nhead=2, dim_feedforward=24, num_layers=2)
CHAPTER_6 = ModelConfig(vocab_size=2003, d_model=128, nhead=4, dim_feedforward=256, num_layers=3)
"""Chapter 6's model: its checkpoints (weights + AdamW state) are about 11.5 MB."""


def _trained(config: ModelConfig = SMALL, seed: int = 0):
    model = build_model(config, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1]).sum().backward()
    opt.step()  # creates the optimizer state
    return model, opt


def _saved(root, config: ModelConfig = SMALL, step: int = 1, **kwargs):
    return save_checkpoint(root, step, *_trained(config), **kwargs)


def _items(path, prefix: str) -> list:
    """DCP's storage records (file, offset, length) of the items whose key starts with ``prefix``."""
    return [info for index, info in read_metadata(path).storage_data.items() if index.fqn.startswith(prefix)]


def _overwrite(path, offset: int, size: int = 4096) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(1),
                              dtype=torch.uint8).numpy().tobytes())


def test_manifest_records_a_sha256_per_item_covering_every_file(tmp_path):
    saved = _saved(tmp_path)
    manifest = json.loads((saved.path / MANIFEST).read_text())
    assert set(manifest[CHECKSUM]) == set(manifest["files"]) == {".metadata", "__0_0.distcp"}
    for name, digests in manifest[CHECKSUM].items():
        data = (saved.path / name).read_bytes()
        assert [o for o, _, _ in digests] == sorted(o for o, _, _ in digests)
        assert sum(n for _, n, _ in digests) == len(data) == manifest["files"][name]  # they tile the file
        for offset, length, digest in digests:  # each hashed independently here
            assert digest == hashlib.sha256(data[offset:offset + length]).hexdigest()
    # the shard's items are DCP's: the byte ranges its index records, one digest each
    spans = sorted((i.offset, i.length) for i in read_metadata(saved.path).storage_data.values())
    assert [(o, n) for o, n, _ in manifest[CHECKSUM]["__0_0.distcp"]] == spans
    assert manifest[CHECKSUM][".metadata"] == [[0, len((saved.path / ".metadata").read_bytes()),
                                                 file_checksum(saved.path / ".metadata")]]
    # one process wrote everything, so it hashed everything
    assert saved.hashed == {k: v for k, v in saved.files.items() if k != MANIFEST}
    assert 0 < saved.checksum_s < saved.seconds


def test_4_kib_overwritten_mid_item_is_refused_by_name_by_a_load_that_reads_it(tmp_path):
    """Only the load that reads the damaged bytes refuses them: a model-only load never reads the
    optimizer's items, so it loads, and verified exactly what it read."""
    saved = _saved(tmp_path)
    shard = saved.path / "__0_0.distcp"
    size = shard.stat().st_size
    moment = max(_items(saved.path, "optim.state."), key=lambda i: i.length)  # an Adam moment
    _overwrite(shard, moment.offset + moment.length // 2)
    assert shard.stat().st_size == size
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp does not match its sha256 checksum \(bytes "
                       rf"{moment.offset}-{moment.offset + moment.length - 1}: they changed after the save"):
        validate_checkpoint(tmp_path)  # one process: every item of every file
    model, opt = _trained(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"^corrupt checkpoint .*step_000001: __0_0\.distcp does not match"):
        load_checkpoint(tmp_path, model, opt)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing loaded
    loaded = load_checkpoint(tmp_path, model)  # the model's items only: intact
    read = sum(i.length for i in _items(saved.path, "model.")) + sum(i.length for i in _items(saved.path, "rng."))
    assert loaded.read == {"__0_0.distcp": read} and read < size
    assert loaded.verified == {".metadata": saved.files[".metadata"], "__0_0.distcp": read}
    assert validate_checkpoint(tmp_path, verify_checksums=False)["step"] == 1  # sizes alone: fooled


def test_a_damaged_index_is_refused_before_anything_is_read(tmp_path):
    saved = _saved(tmp_path)
    _overwrite(saved.path / ".metadata", 100, 8)
    with pytest.raises(CheckpointError, match=r"\.metadata does not match its sha256 checksum \(bytes 0-"):
        load_checkpoint(tmp_path, *_trained(seed=1), verify_checksums=True)


def test_a_manifest_without_checksums_is_refused(tmp_path):
    saved = _saved(tmp_path)
    manifest = json.loads((saved.path / MANIFEST).read_text())
    del manifest[CHECKSUM]
    (saved.path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="no sha256 checksum for every file"):
        validate_checkpoint(tmp_path)
    manifest[CHECKSUM] = {name: [[0, size - 1, "0" * 64]] for name, size in manifest["files"].items()}
    (saved.path / MANIFEST).write_text(json.dumps(manifest))  # digests that leave a byte uncovered
    with pytest.raises(CheckpointError, match="no sha256 checksum for every file"):
        validate_checkpoint(tmp_path)


def test_a_save_without_checksums_records_sizes_and_loads_only_unverified(tmp_path):
    saved = _saved(tmp_path, checksums=False)
    manifest = json.loads((saved.path / MANIFEST).read_text())
    assert CHECKSUM not in manifest and saved.hashed == {} and saved.checksum_s == 0
    assert manifest["files"] == {k: v for k, v in saved.files.items() if k != MANIFEST}
    with pytest.raises(CheckpointError, match="no sha256 checksum for every file"):
        load_checkpoint(tmp_path, *_trained(seed=1))
    loaded = load_checkpoint(tmp_path, *_trained(seed=1), verify_checksums=False)
    assert loaded.step == 1 and loaded.verified == {} and loaded.verify_s == 0
    assert loaded.read == {"__0_0.distcp": manifest["files"]["__0_0.distcp"]}


def test_a_stray_file_in_a_save_is_refused(tmp_path):
    """A file in ``step_K.tmp`` that no rank reports writing (another job writing there) fails
    the commit rather than entering a manifest unverified; so does a file two ranks report."""
    (tmp_path / ".metadata").write_bytes(b"x")
    (tmp_path / "stray.bin").write_bytes(b"y")
    with pytest.raises(CheckpointError, match=r"no rank reports writing stray\.bin"):
        checkpoint_verify.manifest_files(tmp_path, [({}, {})], checksums=True)
    with pytest.raises(CheckpointError, match=r"two ranks report writing stray\.bin"):
        checkpoint_verify.manifest_files(tmp_path, [({"stray.bin": 1}, {}), ({"stray.bin": 1}, {})], checksums=False)


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
    """Hashing a chapter-6 checkpoint (~11.5 MB) costs milliseconds: measured, printed, bounded."""
    saved = _saved(tmp_path, CHAPTER_6)
    size = sum(saved.files.values())
    assert 10e6 < size < 13e6
    begin = time.perf_counter()
    validate_checkpoint(tmp_path)
    verify_s = time.perf_counter() - begin
    print(f"{size / 1e6:.1f} MB: checksums at save {saved.checksum_s:.4f} s, verified at load {verify_s:.4f} s, "
          f"whole save {saved.seconds:.3f} s")
    assert saved.checksum_s < 1.0 and verify_s < 1.0  # ~0.01 s here; a loose bound for busy CI machines


def test_the_model_is_widened_to_about_scale_times_its_parameters():
    for scale in (2, 10):
        wide = scale_model_width(CHAPTER_6, scale)
        ratio = model_layout(wide).num_params / model_layout(CHAPTER_6).num_params
        assert abs(ratio - scale) < 0.1 * scale and wide.d_model % wide.nhead == 0
        assert (wide.vocab_size, wide.num_layers, wide.nhead) == (2003, 3, 4)
        assert wide.dim_feedforward == round(256 * wide.d_model / 128)
        # no other width of the same shape is nearer to the target
        for d in (wide.d_model - 4, wide.d_model + 4):
            other = ModelConfig(vocab_size=2003, d_model=d, nhead=4, dim_feedforward=round(256 * d / 128),
                                num_layers=3)
            assert abs(model_layout(other).num_params - scale * 912_211) >= abs(
                model_layout(wide).num_params - scale * 912_211)
    assert scale_model_width(CHAPTER_6, 1) == CHAPTER_6
    assert model_layout(CHAPTER_6).num_params == 912_211
    with pytest.raises(ValueError, match="scale must be an int >= 1"):
        scale_model_width(CHAPTER_6, 0)


def test_cost_fraction_is_the_ratio_of_the_medians():
    assert cost_fraction([0.1, 0.9, 0.2], [1.0, 2.0, 100.0]) == pytest.approx(0.2 / 2.0)
    assert cost_fraction([3.0], [4.0]) == 0.75
    with pytest.raises(ValueError, match="median > 0"):
        cost_fraction([1.0], [0.0])
    with pytest.raises(ValueError, match="at least one time"):
        cost_fraction([], [1.0])
