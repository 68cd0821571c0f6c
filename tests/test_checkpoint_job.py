"""handbook_lib.runtime.checkpoint_job in one process: a root holds one job's checkpoints, and
``keep_last`` deletes only the saves it wrote.

DCP saves without a process group here (a world of one), as in ``test_checkpoint``; the runs'
own check, before any process starts, is called as the launcher calls it.
"""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from handbook_lib.core import ModelConfig
from handbook_lib.models import LATEST, MANIFEST
from handbook_lib.runs import checkpoint_cost, checkpoint_resume
from handbook_lib.runtime import CheckpointError, build_model, load_checkpoint, save_checkpoint
from handbook_lib.runtime.checkpoint_job import (
    JOB_FILE,
    JOB_SCHEMA,
    is_save,
    job_identity,
    job_refusal,
    read_job,
    saves_to_prune,
)

SMALL = ModelConfig(vocab_size=101, d_model=16, nhead=2, dim_feedforward=24, num_layers=2)
WIDE = ModelConfig(vocab_size=101, d_model=32, nhead=2, dim_feedforward=24, num_layers=2)


def _model(config: ModelConfig = SMALL):
    model = build_model(config, seed=0)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path → SHA-256 of its bytes), and every folder."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def _user_folders(root: Path) -> None:
    """Folders of the user's, named as saves are: one with a note, one empty, one with a copy of
    a manifest of another step, one with a name the saver never gives."""
    (root / "step_000001").mkdir(parents=True)
    (root / "step_000001" / "MY_NOTES.txt").write_text("mine\n")
    (root / "step_000099").mkdir()
    (root / "step_7").mkdir()
    (root / "step_7" / "x.bin").write_bytes(b"\0" * 10)


def test_keep_last_deletes_only_the_saves_it_wrote(tmp_path, capsys):
    _user_folders(tmp_path)
    mine = _snapshot(tmp_path)
    model, opt = _model()
    for step in (2, 3, 4):
        save_checkpoint(tmp_path, step, model, opt, keep_last=1)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [LATEST, "step_000001", "step_000004", "step_000099", "step_7"]
    assert {k: v for k, v in _snapshot(tmp_path).items() if k in mine} == mine  # every byte of the user's
    # said once, in one line, though two saves pruned around them
    lines = [line for line in capsys.readouterr().out.splitlines() if "keep_last" in line]
    assert lines == [f"keep_last=1 left step_000001, step_000099, step_7 in {tmp_path}: not saves (no "
                     f"{MANIFEST} of theirs lists all they hold), so never deleted"]
    assert load_checkpoint(tmp_path, *_model()).step == 4


def test_a_save_with_a_file_added_or_a_copied_manifest_is_not_pruned(tmp_path, capsys):
    model, opt = _model()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, opt)
    (tmp_path / "step_000001" / "MY_NOTES.txt").write_text("mine\n")  # added to a save
    shutil.copytree(tmp_path / "step_000002", tmp_path / "step_000042")  # its manifest says step 2
    assert not is_save(tmp_path / "step_000001") and not is_save(tmp_path / "step_000042")
    assert is_save(tmp_path / "step_000002")
    kept = _snapshot(tmp_path / "step_000001"), _snapshot(tmp_path / "step_000042")
    save_checkpoint(tmp_path, 3, model, opt, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_000001", "step_000003", "step_000042"]
    assert (_snapshot(tmp_path / "step_000001"), _snapshot(tmp_path / "step_000042")) == kept
    assert "left step_000001, step_000042" in capsys.readouterr().out
    # a manifest that lists a file outside its folder: the save is pruned, the file is not
    (tmp_path / "outside.txt").write_text("mine\n")
    manifest = json.loads((tmp_path / "step_000003" / MANIFEST).read_text())
    manifest["files"]["../outside.txt"] = 5
    (tmp_path / "step_000003" / MANIFEST).write_text(json.dumps(manifest))
    save_checkpoint(tmp_path, 4, model, opt, keep_last=1)
    assert not (tmp_path / "step_000003").exists() and (tmp_path / "outside.txt").read_text() == "mine\n"


def test_saves_to_prune_keeps_the_newest_saves_and_names_the_rest(tmp_path):
    model, opt = _model()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model, opt)
    for name in ("step_000000", "step_000099", "step_7"):  # the user's
        (tmp_path / name).mkdir()
    (tmp_path / "step_000005.tmp").mkdir()  # a save in progress: neither pruned nor mentioned
    old, left = saves_to_prune(tmp_path, 2, "step_000004")
    assert [p.name for p in old] == ["step_000001", "step_000002"]
    assert [p.name for p in left] == ["step_000000", "step_000099", "step_7"]


def test_a_save_never_replaces_a_folder_it_did_not_write(tmp_path):
    model, opt = _model()
    save_checkpoint(tmp_path, 1, model, opt)
    (tmp_path / "step_000002").mkdir()
    (tmp_path / "step_000002" / "MY_NOTES.txt").write_text("mine\n")
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointError) as refused:
        save_checkpoint(tmp_path, 2, model, opt)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"cannot save step_000002: {tmp_path / 'step_000002'} "
                                                      "exists and is not a save")
    assert _snapshot(tmp_path) == before  # nothing written: no .tmp, latest unchanged


def test_the_first_save_records_the_job_and_another_job_is_refused(tmp_path):
    job = job_identity("checkpoint_resume", SMALL, "adamw")
    model, opt = _model()
    save_checkpoint(tmp_path, 2, model, opt, job=job)
    recorded = json.loads((tmp_path / JOB_FILE).read_text())
    assert recorded == {"schema": JOB_SCHEMA, "job": {"run": "checkpoint_resume", "vocab_size": 101, "d_model": 16,
                                                      "nhead": 2, "dim_feedforward": 24, "num_layers": 2,
                                                      "optimizer": "adamw"}}
    before = _snapshot(tmp_path)
    wide, wide_opt = _model(WIDE)
    with pytest.raises(CheckpointError) as refused:
        save_checkpoint(tmp_path, 2, wide, wide_opt, job=job_identity("checkpoint_resume", WIDE, "adamw"))
    assert str(refused.value) == (f"ckpt_dir {str(tmp_path)!r} holds another job's checkpoints: d_model=32 "
                                  f"here, 16 in its {JOB_FILE}; use another ckpt_dir")
    assert _snapshot(tmp_path) == before
    assert (tmp_path / LATEST).read_text() == "step_000002\n"
    save_checkpoint(tmp_path, 3, model, opt, job=job)  # the same job goes on
    assert read_job(tmp_path) == job and (tmp_path / LATEST).read_text() == "step_000003\n"


def test_job_refusal_names_every_key_that_differs_and_ignores_what_reshards(tmp_path):
    job = job_identity("checkpoint_resume", SMALL, "adamw")
    assert job_refusal(tmp_path, job) is None  # nothing recorded yet
    (tmp_path / JOB_FILE).write_text(json.dumps({"schema": JOB_SCHEMA, "job": job}))
    assert job_refusal(tmp_path, job) is None
    other = job_identity("checkpoint_resume", ModelConfig(vocab_size=101, d_model=16, nhead=4, dim_feedforward=24,
                                                          num_layers=3), "sgd")
    assert "nhead=4 here, 2 in its job.json (and num_layers, optimizer);" in job_refusal(tmp_path, other)
    assert "run='checkpoint_cost' here, 'checkpoint_resume'" in job_refusal(
        tmp_path, job_identity("checkpoint_cost", SMALL, "adamw"))
    assert not {"world_size", "nproc", "strategy"} & set(job)  # a checkpoint reshards to any layout
    (tmp_path / JOB_FILE).write_text("{")
    with pytest.raises(CheckpointError, match="job.json is unreadable"):
        job_refusal(tmp_path, job)


def test_a_root_saved_without_a_job_is_compared_by_its_tensors(tmp_path):
    model, opt = _model()
    save_checkpoint(tmp_path, 2, model, opt)  # no job recorded
    before = _snapshot(tmp_path)
    wide, wide_opt = _model(WIDE)
    with pytest.raises(CheckpointError, match=r"holds another job's checkpoints: checkpoint .* holds another "
                                              r"model's tensors .*embedding\.weight saved \(101, 16\), model \(101, 32\)"):
        save_checkpoint(tmp_path, 3, wide, wide_opt, job=job_identity("checkpoint_resume", WIDE, "adamw"))
    assert _snapshot(tmp_path) == before


def _resume_config(ckpt: Path, **values):
    base = {"vocab_size": 101, "d_model": 16, "nhead": 2, "dim_feedforward": 24, "num_layers": 2, "batch_size": 4,
            "seq_len": 8, "dataset_size": 8, "ckpt_dir": str(ckpt), "save_every": 2}
    return checkpoint_resume.CheckpointRunConfig.from_mapping({**base, **values})


def test_checkpoint_resume_refuses_another_jobs_ckpt_dir_before_it_starts(tmp_path):
    model, opt = _model()
    save_checkpoint(tmp_path, 2, model, opt, job=job_identity("checkpoint_resume", SMALL, "adamw"))
    before = _snapshot(tmp_path)
    for resume in ({}, {"resume": True}, {"resume": True, "resume_if_present": True}):
        with pytest.raises(ValueError) as refused:
            checkpoint_resume.validate(_resume_config(tmp_path, d_model=32, **resume), 2)
        assert "\n" not in str(refused.value)
        assert str(refused.value).startswith(f"ckpt_dir {str(tmp_path)!r} holds another job's checkpoints: "
                                             "d_model=32 here, 16 in its job.json")
    for world in (2, 4):  # the same job, at any world size
        checkpoint_resume.validate(_resume_config(tmp_path, resume=True), world)
    assert _snapshot(tmp_path) == before


def test_checkpoint_cost_refuses_another_jobs_ckpt_dir(tmp_path):
    shape = checkpoint_cost.scale_model_width(SMALL, 2)
    model, opt = _model(shape)
    save_checkpoint(tmp_path / "verified", 1, model, opt, job=job_identity("checkpoint_cost", shape, "adamw"))
    base = {k: v for k, v in vars(SMALL).items()} | {"batch_size": 4, "seq_len": 8, "ckpt_dir": str(tmp_path)}
    checkpoint_cost.validate(checkpoint_cost.CheckpointCostConfig.from_mapping({**base, "scale": 2}), 2)
    with pytest.raises(ValueError, match=r"holds another job's checkpoints: d_model=16 here, \d+ in its"):
        checkpoint_cost.validate(checkpoint_cost.CheckpointCostConfig.from_mapping({**base, "scale": 1}), 2)
