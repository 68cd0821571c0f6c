"""handbook_lib.runtime.checkpoint in one process: counting, atomic saves, clear errors, export.

DCP saves and loads without a process group (a world of one), so everything here runs in the
test process on plain modules; the runs of ``test_runs_checkpoint_resume`` do the same with
FSDP2 on 2 and 4 ranks, killed for real.
"""

import json
import os
import time

import pytest
import torch
from torch.distributed.checkpoint import CheckpointException as DcpCheckpointException

from handbook_lib.core import ModelConfig
from handbook_lib.models import (
    FSDP1_STATE_DICT_TYPES,
    LATEST,
    MANIFEST,
    TensorCount,
    checkpoint_name,
    estimate_checkpoint_count,
)
from handbook_lib.models import checkpoint as checkpoint_model
from handbook_lib.runtime import (
    CheckpointError,
    build_model,
    checkpoint_files,
    checkpoint_items,
    count_checkpoint,
    count_state_tensors,
    export_full_state_dict,
    load_checkpoint,
    load_exported,
    resolve_checkpoint,
    save_checkpoint,
    validate_checkpoint,
)
from handbook_lib.runtime import checkpoint as ckpt
from handbook_lib.runtime import checkpoint_verify

SMALL = ModelConfig(vocab_size=101, d_model=16, nhead=2, dim_feedforward=24, num_layers=2)


def _trained(seed: int = 0, steps: int = 1, optimizer: str = "adamw"):
    """A plain model and its optimizer after ``steps`` steps on fixed random tokens."""
    model = build_model(SMALL, seed=seed)
    opt = {"adamw": torch.optim.AdamW, "sgd-momentum": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
           "sgd": torch.optim.SGD}[optimizer](model.parameters(), lr=1e-2)
    for step in range(steps):
        _step(model, opt, step)
    return model, opt


def _step(model, opt, step: int) -> float:
    tokens = torch.randint(0, SMALL.vocab_size, (4, 9), generator=torch.Generator().manual_seed(step))
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_seed_counted_the_top_level_only():
    model, opt = _trained()
    params = list(model.parameters())
    state = opt.state_dict()
    assert count_state_tensors(state, nested=False) == TensorCount(0, 0)  # the seed's "0 tensors"
    # AdamW: exp_avg and exp_avg_sq shaped like each parameter, plus one fp32 step scalar each
    expected = TensorCount(3 * len(params), sum(8 * p.numel() + 4 for p in params))
    assert count_state_tensors(state) == expected
    assert count_state_tensors(model.state_dict()) == TensorCount(len(params), sum(4 * p.numel() for p in params))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd-momentum", "sgd"])
def test_estimate_matches_a_real_state_dict(optimizer):
    model, opt = _trained(optimizer=optimizer)
    predicted = estimate_checkpoint_count(SMALL, optimizer)
    assert predicted["model"] == count_state_tensors(model.state_dict())
    assert predicted["optim"] == count_state_tensors(opt.state_dict())


def test_save_writes_aside_then_points_latest(tmp_path):
    model, opt = _trained()
    saved = save_checkpoint(tmp_path, 1, model, opt, extra={"data_position": 1})
    assert saved.path == tmp_path / "step_000001" and saved.seconds > 0
    assert (tmp_path / LATEST).read_text() == "step_000001\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_000001"]  # no .tmp left
    assert dict(checkpoint_files(saved.path)) == saved.files
    manifest = validate_checkpoint(tmp_path)
    assert (manifest["step"], manifest["world_size"], manifest["extra"]) == (1, 1, {"data_position": 1})
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp"}  # written before the manifest
    _step(model, opt, 1)
    save_checkpoint(tmp_path, 2, model, opt)
    assert resolve_checkpoint(tmp_path) == tmp_path / checkpoint_name(2)


def test_checkpoint_count_is_read_from_metadata_and_exact(tmp_path):
    model, opt = _trained(steps=2)
    saved = save_checkpoint(tmp_path, 2, model, opt)
    counts = count_checkpoint(saved.path)
    assert counts["model"] == count_state_tensors(model.state_dict())
    assert counts["optim"] == count_state_tensors(opt.state_dict())
    assert counts["model"] == estimate_checkpoint_count(SMALL, "adamw")["model"]
    rng = torch.get_rng_state()
    assert counts["rng"] == TensorCount(1, rng.numel() * rng.element_size())
    assert counts["total"] == counts["model"] + counts["optim"] + counts["rng"]
    assert sum(saved.files.values()) > counts["total"].bytes  # files add headers and the index
    # every tensor, plus one item per optimizer hyperparameter and the two generators that are
    # not tensors (Python's, NumPy's); the items fill the shard file
    assert checkpoint_items(saved.path) == {
        "__0_0.distcp": (counts["total"].tensors + len(opt.param_groups[0]) + 2, saved.files["__0_0.distcp"])}
    (saved.path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="cannot read DCP metadata"):
        count_checkpoint(saved.path)


def test_resume_continues_exactly(tmp_path):
    model, opt = _trained(steps=2)
    save_checkpoint(tmp_path, 2, model, opt, extra={"data_position": 2})
    expected = [_step(model, opt, s) for s in (2, 3)]
    fresh, fresh_opt = _trained(seed=1, steps=0)
    loaded = load_checkpoint(tmp_path, fresh, fresh_opt)
    assert (loaded.step, loaded.extra, loaded.rng_restored) == (2, {"data_position": 2}, True)
    assert [_step(fresh, fresh_opt, s) for s in (2, 3)] == expected  # bit for bit
    assert _same_tensors(model.state_dict(), fresh.state_dict())


def test_rng_state_is_restored_at_the_same_world_size(tmp_path):
    model, opt = _trained()
    torch.manual_seed(123)
    saved_rng = torch.get_rng_state()
    save_checkpoint(tmp_path, 1, model, opt)
    torch.manual_seed(7)
    load_checkpoint(tmp_path, model, opt)
    assert torch.equal(torch.get_rng_state(), saved_rng)
    torch.manual_seed(7)
    assert not load_checkpoint(tmp_path, model, opt, restore_rng=False).rng_restored
    assert not torch.equal(torch.get_rng_state(), saved_rng)


def test_every_generator_is_restored_not_only_torchs(tmp_path):
    """Issue 26: torch's CPU generator was the only one saved; Python's and NumPy's are too."""
    import random

    import numpy as np

    model, opt = _trained()
    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    save_checkpoint(tmp_path, 1, model, opt)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    load_checkpoint(tmp_path, model, opt)
    drawn = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(drawn[0], expected[0]) and drawn[1:] == expected[1:]


class _Counter:
    """A part of a job's state that is not a tensor: DCP's Stateful protocol."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value, "history": list(range(self.value))}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]
        assert state["history"] == list(range(self.value))


def test_stateful_parts_are_saved_and_loaded_by_name(tmp_path):
    model, opt = _trained()
    save_checkpoint(tmp_path, 1, model, opt, stateful={"counter": _Counter(5)})
    restored = _Counter()
    load_checkpoint(tmp_path, model, opt, stateful={"counter": restored})
    assert restored.value == 5
    with pytest.raises(CheckpointError, match=r"holds no other state \(it has counter, model, optim, "
                       r"rng\); nothing was loaded"):
        load_checkpoint(tmp_path, model, opt, stateful={"other": _Counter()})
    with pytest.raises(ValueError, match=r"stateful names \['rng'\] are reserved"):
        save_checkpoint(tmp_path, 2, model, opt, stateful={"rng": _Counter()})


def test_a_cpu_checkpoint_refuses_to_restore_a_gpus_generator(tmp_path):
    from handbook_lib.runtime.random_state import rng_state, set_rng_state

    state = rng_state(torch.device("cpu"))
    assert set(state) == {"cpu", "python", "numpy"}  # no CUDA generator on the CPU
    with pytest.raises(ValueError, match="holds no CUDA generator state"):
        set_rng_state(state, torch.device("cuda", 0))


def test_a_save_that_dies_leaves_the_previous_checkpoint(tmp_path):
    model, opt = _trained()
    save_checkpoint(tmp_path, 1, model, opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, opt, 1)

    def die():  # in one process an exception stands in for the SIGKILL of the run tests
        raise RuntimeError("stopped after the shard was written")

    # DCP reports every rank's failure in one exception; the save says it in one line per rank
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*step_000002\.tmp: rank 0: "
                       r"RuntimeError: stopped after the shard was written; it is never loaded") as info:
        save_checkpoint(tmp_path, 2, model, opt, after_shard_written=die)
    assert "\n" not in str(info.value)
    half = tmp_path / "step_000002.tmp"
    assert (half / "__0_0.distcp").exists() and not (half / ".metadata").exists()
    assert (tmp_path / LATEST).read_text() == "step_000001\n"
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint .*checkpoint\.json is missing"):
        load_checkpoint(half, model, opt)
    fresh, fresh_opt = _trained(seed=1, steps=0)
    assert load_checkpoint(tmp_path, fresh, fresh_opt).step == 1
    assert _same_tensors(fresh.state_dict(), before)
    save_checkpoint(tmp_path, 2, model, opt)  # the next save of that step replaces the debris
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_000001", "step_000002"]


def _fail_replace(monkeypatch, fails, message: str) -> None:
    """Make the checkpoint module's ``os.replace`` raise ``OSError(message)`` where
    ``fails(src, dst)`` is true (a crash at that rename), and rename as usual elsewhere."""
    real_replace = os.replace

    def replace(src, dst):
        if fails(src, dst):
            raise OSError(message)
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", replace)


def test_pointer_is_replaced_atomically(tmp_path, monkeypatch):
    model, opt = _trained()
    save_checkpoint(tmp_path, 1, model, opt)
    _fail_replace(monkeypatch, lambda src, dst: os.path.basename(dst) == LATEST, "disk full")
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, model, opt)
    monkeypatch.undo()
    assert (tmp_path / LATEST).read_text() == "step_000001\n"  # old pointer intact, never empty
    assert resolve_checkpoint(tmp_path) == tmp_path / "step_000001"
    validate_checkpoint(tmp_path / "step_000002")  # complete, just not (yet) latest


@pytest.mark.parametrize("damage, message", [
    ("truncate_shard", r"__0_0\.distcp has \d+ bytes, the manifest says \d+"),
    ("delete_metadata", r"file \.metadata is missing"),
    ("garble_manifest", r"checkpoint\.json is unreadable"),
    ("zero_shard", r"__0_0\.distcp does not match its sha256 checksum"),  # size unchanged: the checksum tells
    ("dangling_pointer", r"points to 'step_000009', which does not exist"),
])
def test_damaged_checkpoint_raises_a_clear_error(tmp_path, damage, message):
    model, opt = _trained()
    path = save_checkpoint(tmp_path, 1, model, opt).path
    shard = path / "__0_0.distcp"
    if damage == "truncate_shard":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "delete_metadata":
        (path / ".metadata").unlink()
    elif damage == "garble_manifest":
        (path / MANIFEST).write_text('{"schema": ')
    elif damage == "zero_shard":  # same size, content destroyed: only the checksum can tell
        shard.write_bytes(bytes(shard.stat().st_size))
    elif damage == "dangling_pointer":
        (tmp_path / LATEST).write_text("step_000009\n")
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path, *_trained(seed=1, steps=0))
    assert issubclass(CheckpointError, RuntimeError)


def test_no_checkpoint_and_a_wrong_model_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        resolve_checkpoint(tmp_path / "nothing")
    model, opt = _trained()
    save_checkpoint(tmp_path, 1, model, opt)
    other = build_model(ModelConfig(vocab_size=103, d_model=16, nhead=2, dim_feedforward=24, num_layers=2))
    with pytest.raises(CheckpointError, match=r"another model's tensors .*nothing was loaded\. shapes differ \(3\): "
                                              r"embedding\.weight saved \(101, 16\), model \(103, 16\), "
                                              r"output\.weight saved .*output\.bias saved \(101,\), model \(103,\)$"):
        load_checkpoint(tmp_path, other)


def test_keep_last_prunes_old_checkpoints(tmp_path):
    model, opt = _trained()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, opt, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_000002", "step_000003"]
    save_checkpoint(tmp_path, 1, model, opt, keep_last=1)  # a job resumed from an older step
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_000001"]  # latest is never pruned


def test_export_loads_into_a_plain_module_with_weights_only(tmp_path):
    model, _ = _trained(steps=2)
    size = export_full_state_dict(model, tmp_path / "model.pt")
    assert size == (tmp_path / "model.pt").stat().st_size
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]  # its temporary file is gone
    plain = load_exported(tmp_path / "model.pt", SMALL)
    assert _same_tensors(plain.state_dict(), model.state_dict())
    tokens = torch.randint(0, SMALL.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(plain(tokens), model(tokens))
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert json.dumps(sorted(state)) == json.dumps(sorted(model.state_dict()))
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_exported(tmp_path / "model.pt", ModelConfig(vocab_size=102, d_model=16, nhead=2,
                                                         dim_feedforward=24, num_layers=2))


def test_a_probe_is_reproduced_where_it_was_computed(tmp_path, monkeypatch):
    """gpu-path.md S3-2: the plain module reruns the probe on the job's device, one CPU thread."""
    from handbook_lib.runtime import reproduces_probe

    model, _ = _trained(steps=2)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.no_grad():
        logits = model(tokens)
    torch.set_num_threads(threads)
    torch.save({"inputs": tokens, "logits": logits, "device": "cpu"}, tmp_path / "probe.pt")
    torch.save({"inputs": tokens, "logits": logits}, tmp_path / "old.pt")  # before "device" was saved
    torch.save({"inputs": tokens, "logits": logits + 1e-6, "device": "cpu"}, tmp_path / "off.pt")
    assert reproduces_probe(model, tmp_path / "probe.pt") and reproduces_probe(model, tmp_path / "old.pt")
    assert not reproduces_probe(model, tmp_path / "off.pt")
    assert torch.get_num_threads() == threads
    torch.save({"inputs": tokens, "logits": logits, "device": "cuda"}, tmp_path / "gpu.pt")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="computed on CUDA and no GPU is visible here"):
        reproduces_probe(model, tmp_path / "gpu.pt")


def test_fsdp1_state_dict_types_are_all_explained():
    assert set(FSDP1_STATE_DICT_TYPES) == {"FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"}
    assert "final" in FSDP1_STATE_DICT_TYPES["FULL_STATE_DICT"][2]
    assert "intermediate" in FSDP1_STATE_DICT_TYPES["SHARDED_STATE_DICT"][2]
    with pytest.raises(ValueError, match=r"^step must be an int >= 0, got -1$"):
        checkpoint_name(-1)


def _present(root, name: str, step: checkpoint_model.CommitStep, hashed: list) -> bool:
    """Whether ``step`` of the save of ``name`` under ``root`` is done, as far as can be seen."""
    if not step.path:  # the hash step writes nothing: done once this process has hashed a file
        return bool(hashed)
    if step.path == LATEST:  # the pointer exists already: the step is done when it names step_K
        return (root / LATEST).read_text() == f"{name}\n"
    path = step.path.format(name=name)  # once renamed, what was in step_K.tmp is in step_K
    return any(root.glob(path)) or any(root.glob(path.replace(f"{name}.tmp", name)))


def _count_hashing(monkeypatch, hashed: list, observe=None) -> None:
    """Record in ``hashed`` the name of every file the checkpoint code hashes (calling ``observe``
    before and after each, if given)."""
    real = checkpoint_verify._hash_spans

    def hash_spans(path, spans):
        if observe is not None:
            observe()
        out = real(path, spans)
        hashed.append(os.path.basename(path))
        if observe is not None:
            observe()
        return out

    monkeypatch.setattr(checkpoint_verify, "_hash_spans", hash_spans)


def test_commit_steps_are_what_a_save_does_in_that_order(tmp_path, monkeypatch):
    """COMMIT_STEPS against a real save: each step's path appears, in the listed order, at the
    moments the save can be observed (each os.replace, the shard hook, each hash, entering and
    leaving DCP), and until the last step ``latest`` still names the previous checkpoint."""
    model, opt = _trained()
    save_checkpoint(tmp_path, 1, model, opt)
    name, previous = checkpoint_name(2), checkpoint_name(1)
    seen: list[list[bool]] = []
    pointers: list[str] = []
    hashed: list[str] = []

    def observe() -> None:
        seen.append([_present(tmp_path, name, s, hashed) for s in checkpoint_model.COMMIT_STEPS])
        pointers.append((tmp_path / LATEST).read_text())

    real_replace, real_save = os.replace, ckpt.dcp.save

    def replace(src, dst):
        observe()
        real_replace(src, dst)
        observe()

    def dcp_save(*args, **kwargs):
        observe()
        try:
            return real_save(*args, **kwargs)
        finally:
            observe()

    monkeypatch.setattr(ckpt.os, "replace", replace)
    monkeypatch.setattr(ckpt.dcp, "save", dcp_save)
    _count_hashing(monkeypatch, hashed, observe)
    _step(model, opt, 1)
    save_checkpoint(tmp_path, 2, model, opt, after_shard_written=observe)
    monkeypatch.undo()

    assert seen[0] == [False] * len(checkpoint_model.COMMIT_STEPS) and all(seen[-1])
    first = [next(i for i, row in enumerate(seen) if row[k]) for k in range(len(checkpoint_model.COMMIT_STEPS))]
    assert first == sorted(first), [s.name for s in checkpoint_model.COMMIT_STEPS]
    # the steps after "write aside" are each observed on their own, strictly in order
    assert len(set(first[1:])) == len(first) - 1
    # a crash at any observed moment before the pointer is replaced leaves the previous checkpoint
    assert all(p == f"{previous}\n" for p, row in zip(pointers, seen) if not row[-1])
    assert [s.name for s in checkpoint_model.COMMIT_STEPS][-2:] == ["rename", "point latest"]
    assert hashed == ["__0_0.distcp", ".metadata"]  # each file once: the shard, then the index


def test_an_asynchronous_save_commits_only_in_wait(tmp_path):
    """Staged, written and hashed in the background: the ``background`` steps of COMMIT_STEPS
    are done before ``wait()``, and nothing else; ``wait()`` commits."""
    model, opt = _trained()
    save_checkpoint(tmp_path, 1, model, opt)
    _step(model, opt, 1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    pending = save_checkpoint(tmp_path, 2, model, opt, asynchronous=True)
    assert isinstance(pending, ckpt.PendingCheckpoint) and pending.path == tmp_path / "step_000002.tmp"
    _step(model, opt, 2)  # training goes on: the save holds the state of the call, staged
    while not pending.done():
        time.sleep(0.001)
    done = [_present(tmp_path, checkpoint_name(2), s, ["hashed"]) for s in checkpoint_model.COMMIT_STEPS]
    assert done == [s.background or s.name == "write aside" for s in checkpoint_model.COMMIT_STEPS]
    assert (tmp_path / LATEST).read_text() == "step_000001\n"
    assert resolve_checkpoint(tmp_path) == tmp_path / "step_000001"  # a job killed now resumes from 1
    saved = pending.wait()
    assert pending.wait() is saved  # a second call: the same result, nothing done twice
    assert (saved.path, saved.step, saved.asynchronous) == (tmp_path / "step_000002", 2, True)
    assert (tmp_path / LATEST).read_text() == "step_000002\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_000001", "step_000002"]
    assert 0 < saved.blocked_s < saved.seconds and 0 < saved.wait_s < saved.seconds
    assert saved.hashed == {k: v for k, v in saved.files.items() if k != MANIFEST}
    fresh, fresh_opt = _trained(seed=1, steps=0)
    load_checkpoint(tmp_path, fresh, fresh_opt)
    assert _same_tensors(fresh.state_dict(), expected)


def test_an_asynchronous_save_never_waited_for_leaves_only_its_tmp(tmp_path):
    model, opt = _trained()
    save_checkpoint(tmp_path, 1, model, opt)
    pending = save_checkpoint(tmp_path, 2, model, opt, asynchronous=True)
    while not pending.done():
        time.sleep(0.001)
    ckpt._PENDING.clear()  # as if the job died here: wait() never runs
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_000001", "step_000002.tmp"]
    assert sorted(p.name for p in pending.path.iterdir()) == [".metadata", "__0_0.distcp"]  # no manifest
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint .*checkpoint\.json is missing"):
        load_checkpoint(pending.path, model, opt)
    assert load_checkpoint(tmp_path, model, opt).step == 1


def test_an_asynchronous_save_that_fails_raises_in_wait_and_commits_nothing(tmp_path):
    model, opt = _trained()
    save_checkpoint(tmp_path, 1, model, opt)

    def die():  # in the background thread, once the shard is on disk
        raise RuntimeError("disk gone")

    pending = save_checkpoint(tmp_path, 2, model, opt, asynchronous=True, after_shard_written=die)
    with pytest.raises(DcpCheckpointException, match="disk gone"):
        pending.wait()
    assert (tmp_path / LATEST).read_text() == "step_000001\n" and not (tmp_path / "step_000002").exists()
    assert save_checkpoint(tmp_path, 2, model, opt).step == 2  # the next save is not held up by it


def test_asynchronous_and_synchronous_saves_hold_the_same_bytes(tmp_path):
    """The same state saved both ways: identical shard files (their checksums), identical
    tensors loaded; the next save commits a pending one first."""
    model, opt = _trained(steps=2)
    pending = save_checkpoint(tmp_path / "async", 2, model, opt, asynchronous=True)
    sync = save_checkpoint(tmp_path / "sync", 2, model, opt)  # commits the pending save first
    assert pending.done() and (tmp_path / "async" / LATEST).read_text() == "step_000002\n"
    waited = pending.wait()
    manifests = [json.loads((s.path / MANIFEST).read_text()) for s in (waited, sync)]
    assert manifests[0]["sha256"]["__0_0.distcp"] == manifests[1]["sha256"]["__0_0.distcp"]
    loaded = []
    for s in (waited, sync):
        fresh, fresh_opt = _trained(seed=1, steps=0)
        load_checkpoint(s.path, fresh, fresh_opt)
        loaded.append((fresh.state_dict(), fresh_opt.state_dict()["state"]))
    assert _same_tensors(loaded[0][0], loaded[1][0]) and _same_tensors(loaded[0][0], model.state_dict())
    assert all(_same_tensors(loaded[0][1][i], loaded[1][1][i]) for i in loaded[0][1])


def test_a_resave_of_the_latest_step_never_leaves_latest_dangling(tmp_path, monkeypatch):
    """Re-saving the step ``latest`` names (a job resumed from an older checkpoint reaches it
    again): the old copy is moved aside in one rename, and a crash before the new one is in
    place leaves ``latest`` loading the old copy, never nothing."""
    model, opt = _trained(steps=1)
    save_checkpoint(tmp_path, 2, model, opt)
    old_weights = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, opt, 1)
    _fail_replace(monkeypatch, lambda src, dst: str(src).endswith(".tmp"), "node lost")  # the new copy
    with pytest.raises(OSError, match="node lost"):
        save_checkpoint(tmp_path, 2, model, opt)
    monkeypatch.undo()
    assert (tmp_path / LATEST).read_text() == "step_000002\n" and not (tmp_path / "step_000002").exists()
    assert resolve_checkpoint(tmp_path) == tmp_path / "step_000002.old"
    fresh, fresh_opt = _trained(seed=1, steps=0)
    assert load_checkpoint(tmp_path, fresh, fresh_opt).step == 2
    assert _same_tensors(fresh.state_dict(), old_weights)
    save_checkpoint(tmp_path, 2, model, opt, keep_last=1)  # the job, restarted, saves step 2 again
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_000002"]
    fresh, _ = _trained(seed=1, steps=0)
    load_checkpoint(tmp_path, fresh)
    assert _same_tensors(fresh.state_dict(), model.state_dict())


def test_a_resave_that_completes_leaves_nothing_aside(tmp_path):
    model, opt = _trained()
    save_checkpoint(tmp_path, 1, model, opt)
    _step(model, opt, 1)
    save_checkpoint(tmp_path, 1, model, opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_000001"]
    fresh, _ = _trained(seed=1, steps=0)
    load_checkpoint(tmp_path, fresh)
    assert _same_tensors(fresh.state_dict(), model.state_dict())


def test_checkpoint_cost_of_a_70b_job():
    """The arithmetic of chapter 6's cost section, from the model's shape, checked by hand."""
    from handbook_lib.models import (
        NCCL_DEFAULT_TIMEOUT_S,
        checkpoint_interval_s,
        estimate_checkpoint_cost,
        job_mtbf_s,
        model_layout,
    )

    params = model_layout("llama2-70b").num_params
    cost = estimate_checkpoint_cost(params, nodes=16, storage_gbps=5.0, hash_gbps=1.35)
    assert cost.total_bytes == 12 * params and 800e9 < cost.total_bytes < 850e9
    assert cost.bytes_per_rank == -(-12 * params // 128)
    assert cost.write_s == pytest.approx(8 * cost.bytes_per_rank / 5e9)
    assert cost.rank0_hash_s == pytest.approx(12 * params / 1.35e9) and cost.rank0_hash_s > NCCL_DEFAULT_TIMEOUT_S
    assert cost.load_read_bytes == 128 * cost.total_bytes
    assert cost.own_hash_s == pytest.approx(cost.bytes_per_rank / 1.35e9)
    assert job_mtbf_s(16_384) == pytest.approx(54 * 24 * 3600 / 419)
    assert checkpoint_interval_s(10.0, 3600.0 * 20) == pytest.approx((2 * 10 * 72_000) ** 0.5)
    with pytest.raises(ValueError):
        checkpoint_interval_s(0, 1)


def test_nccl_default_timeout_is_what_pytorch_documents():
    import torch.distributed as dist

    from handbook_lib.models import NCCL_DEFAULT_TIMEOUT_S

    assert NCCL_DEFAULT_TIMEOUT_S == 600
    doc = " ".join(dist.init_process_group.__doc__.split())
    assert "10 minutes for NCCL" in doc
