"""handbook_lib.runs.checkpoint_cost: one real 2-rank FSDP2 job, asserted from several angles.

A smaller model than chapter 6's (which runs scale 1 and 10 of its own), widened 2x, timed twice:
each rank hashes only the file it wrote, verifies only what it reads, the asynchronous save holds
the synchronous one's bytes, and a damaged item of rank 1's file is refused by rank 1, by name.
"""

import json
from statistics import median

import pytest

from handbook_lib.core import ModelConfig, RunConfig
from handbook_lib.launch import torchrun
from handbook_lib.models import CHECKSUM, MANIFEST
from handbook_lib.models.checkpoint import scale_model_width
from handbook_lib.models.layout import model_layout
from handbook_lib.runs.checkpoint_cost import TIMES, job_times
from handbook_lib.runtime import CheckpointError, SimpleTransformer, load_checkpoint, validate_checkpoint

TINY = {"vocab_size": 1001, "d_model": 32, "nhead": 2, "dim_feedforward": 48, "num_layers": 2,
        "batch_size": 4, "seq_len": 8, "steps": 2, "scale": 2, "repeats": 2}
WIDE = scale_model_width(RunConfig.from_mapping({k: v for k, v in TINY.items() if k not in ("scale", "repeats")})
                         .model_config(), 2)


@pytest.fixture(scope="module")
def cost(tmp_path_factory):
    root = tmp_path_factory.mktemp("cost")
    result = torchrun("checkpoint_cost", 2, {**TINY, "ckpt_dir": str(root / "ckpt")}, out=root / "out",
                      timeout_s=180, stream=False)
    return root / "ckpt", result


def _latest(root):
    return root / (root / "latest").read_text().strip()


def test_every_check_is_exact(cost):
    _, result = cost
    assert all(c.exact for c in result.checks)
    per_rank = ["hashed_bytes", "verified_bytes", "verified_bytes_not_read", "async_tensors_differing",
                "sync_tensors_differing"]
    assert sorted(c.quantity for c in result.checks) == sorted(
        per_rank * 2 + ["files_hashed", "bytes_hashed", "async_shards_identical", "damaged_file_refused_by_its_rank",
                        "damaged_file_named", "damaged_file_named_in_one_process"])


def test_each_rank_hashed_only_the_file_it_wrote(cost):
    root, result = cost
    ckpt = _latest(root / "plain")  # never damaged; the same state, so the same shard sizes
    sizes = {p.name: p.stat().st_size for p in ckpt.iterdir()}
    assert sorted(sizes) == [".metadata", "__0_0.distcp", "__1_0.distcp", MANIFEST]
    hashed = result.metric("hashed_bytes")
    verified_ckpt = _latest(root / "verified")
    assert hashed == [sizes["__0_0.distcp"] + (verified_ckpt / ".metadata").stat().st_size, sizes["__1_0.distcp"]]
    assert sum(hashed) == result.extra["checkpoint_bytes"] < 2 * result.extra["checkpoint_bytes"]
    assert result.extra["files"] == {p.name: p.stat().st_size for p in verified_ckpt.iterdir()}


def test_each_rank_verified_what_it_read_not_the_whole_checkpoint(cost):
    _, result = cost
    total = result.extra["checkpoint_bytes"]
    verified, read = result.metric("verified_bytes"), result.metric("read_bytes")
    meta = result.extra["files"][".metadata"]
    assert [v - meta for v in verified] == read  # .metadata, and exactly the bytes read
    assert all(v < total for v in verified)  # the first design: every rank verified all of it
    assert sum(verified) < 2 * total
    # rank 0 also reads the replicated items DCP wrote into rank 1's file (step counters, the
    # optimizer's hyperparameters): a little more than its own file; rank 1 reads its own only
    assert read[1] == result.extra["files"]["__1_0.distcp"]
    assert result.extra["files"]["__0_0.distcp"] < read[0] < total


def test_a_damaged_item_of_rank_1_is_refused_by_rank_1_by_name(cost):
    root, result = cost
    assert result.extra["damaged_file"] == "__1_0.distcp" and result.extra["refused_by"] == [1]
    message = result.extra["message"]
    assert message.startswith("corrupt checkpoint <checkpoint>: __1_0.distcp does not match its sha256 checksum")
    assert message.endswith("(found by rank 1)") and "\n" not in message
    ckpt = _latest(root / "verified")
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp does not match its sha256 checksum"):
        validate_checkpoint(ckpt)  # in this process, no process group: every item of every file
    with pytest.raises(CheckpointError, match=r"^corrupt checkpoint .*: __1_0\.distcp does not match"):
        load_checkpoint(ckpt, SimpleTransformer(WIDE))  # one process reads both files' model items


def test_the_asynchronous_save_holds_the_synchronous_ones_bytes(cost):
    root, _ = cost
    manifests = [json.loads((_latest(root / kind) / MANIFEST).read_text()) for kind in ("async", "verified")]
    for shard in ("__0_0.distcp",):  # rank 1's file of the verified checkpoint was damaged afterwards
        assert manifests[0][CHECKSUM][shard] == manifests[1][CHECKSUM][shard]
    plain, other = SimpleTransformer(WIDE), SimpleTransformer(WIDE)
    load_checkpoint(_latest(root / "async"), plain)
    load_checkpoint(_latest(root / "plain"), other, verify_checksums=False)
    a, b = plain.state_dict(), other.state_dict()
    assert all(a[k].equal(b[k]) for k in a)


def test_the_model_is_widened_and_the_times_and_fractions_are_reported(cost):
    _, result = cost
    assert result.extra["params"] == model_layout(WIDE).num_params
    assert result.extra["model"]["d_model"] == WIDE.d_model
    base = model_layout(ModelConfig(vocab_size=1001, d_model=32, nhead=2, dim_feedforward=48, num_layers=2))
    assert 1.8 < result.extra["params"] / base.num_params < 2.2
    for rank in result.ranks:
        assert all(len(rank[key]) == 2 and all(t >= 0 for t in rank[key]) for key in TIMES)
        assert rank["hash_fraction_of_save"] == pytest.approx(median(rank["hash_s"]) / median(rank["save_s"]))
        assert rank["verify_fraction_of_load"] == pytest.approx(median(rank["verify_s"]) / median(rank["load_s"]))
        assert rank["async_blocked_fraction_of_save"] == pytest.approx(
            median(rank["async_blocked_s"]) / median(rank["save_s"]))
        assert 0 < rank["hash_fraction_of_save"] < 1 and 0 < rank["verify_fraction_of_load"] < 1
        assert all(0 < h < s for h, s in zip(rank["hash_s"], rank["save_s"]))  # hashing is inside the save
        assert all(b < t for b, t in zip(rank["async_blocked_s"], rank["async_total_s"]))
    job = result.extra["job"]
    assert job == job_times([rank for rank in result.ranks])
    for key in TIMES:  # the slowest rank of each repeat, then the median of the repeats
        assert job[key] == median(max(a, b) for a, b in zip(*(rank[key] for rank in result.ranks)))
    assert job["hash_fraction_of_save"] == job["hash_s"] / job["save_s"]  # medians of 2: means


def test_job_times_take_the_slowest_rank_of_each_repeat():
    ranks = [{key: [1.0, 4.0, 2.0] for key in TIMES}, {key: [3.0, 1.0, 2.0] for key in TIMES}]
    ranks[0]["hash_s"] = [0.5, 0.5, 0.5]
    ranks[1]["hash_s"] = [0.3, 0.9, 0.1]
    job = job_times(ranks)
    assert job["save_s"] == 3.0  # median of 3, 4, 2
    assert job["hash_s"] == 0.5 and job["hash_fraction_of_save"] == 0.5 / 3.0


def test_bad_configs_are_refused_before_any_process_starts(tmp_path):
    from handbook_lib.runs.checkpoint_cost import CONFIG, validate

    with pytest.raises(ValueError, match=r"checkpoint_cost supports api='fsdp2' with strategy .*got api='fsdp2', "
                                         r"strategy='DDP'"):
        validate(CONFIG.from_mapping({"strategy": "DDP"}), 2)
    with pytest.raises(ValueError, match=r"config key 'scale' must be an int >= 1, got 0"):
        CONFIG.from_mapping({"scale": 0})
    with pytest.raises(ValueError, match="batch_size=9 must be divisible by the number of ranks 2"):
        validate(CONFIG.from_mapping({"batch_size": 9}), 2)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="ckpt_dir"):
        validate(CONFIG.from_mapping({"ckpt_dir": str(tmp_path / "file")}), 2)
