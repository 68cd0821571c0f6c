"""handbook_lib.launch.torchrun_batch: several configs in one job, each with its own result.

One torchrun and one process group run the configs one after another; each result is what a
separate run would have written, failures name the config that was running, and a bad config
is refused (naming its label) before anything starts.
"""

from __future__ import annotations

import json

import pytest

from handbook_lib.core import BATCH_KEY, CONFIG_FILE, RESULTS_DIR
from handbook_lib.launch import (
    ChecksFailed,
    RunFailed,
    torchrun,
    torchrun_batch,
    torchrun_batches,
)

CONFIGS = {"quiet": {"mode": "none"}, "off by one": {"mode": "bad_check"}, "again": {"mode": "none", "fail_rank": 0}}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """One job of the three configs; the one whose check is off raises :class:`ChecksFailed`,
    which carries every config's result."""
    out = tmp_path_factory.mktemp("batch")
    with pytest.raises(ChecksFailed) as info:
        torchrun_batch("fault", 2, CONFIGS, out=out, stream=False, timeout_s=120)
    return out, info.value


def test_each_config_has_its_own_result_in_the_order_given(batch):
    out, err = batch
    results = err.results
    assert list(results) == list(CONFIGS)
    assert sorted(p.name for p in (out / RESULTS_DIR).iterdir()) == ["0.json", "1.json", "2.json"]
    written = json.loads((out / CONFIG_FILE).read_text())[BATCH_KEY]
    assert [e["label"] for e in written] == list(CONFIGS)
    for (label, config), entry in zip(CONFIGS.items(), written):
        assert results[label].config == entry["config"]
        assert all(results[label].config[k] == v for k, v in config.items())
        assert results[label].world_size == 2
        assert results[label].metric("all_reduce_sum") == [2.0, 2.0]  # every config ran on both ranks


def test_a_batch_result_equals_a_separate_run(batch):
    _, err = batch
    alone = torchrun("fault", 2, CONFIGS["off by one"], stream=False, timeout_s=120, allow_failed_checks=True)
    assert len(alone.failed_checks()) == 2  # a failing result handed back, as asked
    assert [c.to_dict() for c in alone.checks] == [c.to_dict() for c in err.results["off by one"].checks]
    assert alone.ranks == err.results["off by one"].ranks


def test_a_failed_check_names_its_config_and_keeps_every_result(batch):
    _, err = batch
    assert "(in 'off by one')" in str(err).splitlines()[0]
    assert err.result is err.results["off by one"]
    assert [c.quantity for c in err.failed] == ["ranks_counted", "ranks_counted"]
    assert not err.results["quiet"].failed_checks() and not err.results["again"].failed_checks()


def test_a_failing_rank_names_the_config_it_was_running():
    with pytest.raises(RunFailed) as info:
        torchrun_batch("fault", 2, {"first": {"mode": "none"}, "second": {"mode": "raise", "fail_rank": 1}},
                       stream=False, timeout_s=120)
    assert str(info.value).startswith("run 'fault' failed in config 'second': rank 1 raised RuntimeError")


@pytest.mark.parametrize("configs, match", [
    ({}, "configs must be a non-empty mapping"),
    ({"": {"mode": "none"}}, "labels must be non-empty strings"),
    ({"ok": {"mode": "none"}, "bad": {"mode": "explode"}}, "config 'bad': config key 'mode' got 'explode'"),
    ({"ok": {"mode": "none"}, "bad": {"fail_rank": 5}}, r"config 'bad': fail_rank must be in \[0, 2\)"),
])
def test_a_bad_batch_is_refused_before_anything_starts(tmp_path, configs, match):
    out = tmp_path / "never"
    with pytest.raises(ValueError, match=match):
        torchrun_batch("fault", 2, configs, out=out, stream=False)
    assert not out.exists()


def test_batches_group_the_runs_by_rank_count_and_keep_their_order():
    runs = {"one": (1, {"mode": "none", "fail_rank": 0}), "two": (2, {"mode": "none"}),
            "one again": (1, {"mode": "bad_check", "fail_rank": 0})}
    results = torchrun_batches("fault", runs, stream=False, timeout_s=120, allow_failed_checks=True)
    assert list(results) == list(runs)
    assert [r.world_size for r in results.values()] == [1, 2, 1]
    assert [len(r.failed_checks()) for r in results.values()] == [0, 0, 1]


@pytest.mark.parametrize("runs, match", [
    ({}, "runs must be a non-empty mapping"),
    ({"a": {"mode": "none"}}, r"runs\['a'\] must be \(nproc, config\)"),
    ({"a": (0, {"mode": "none"})}, r"runs\['a'\] nproc must be an int >= 1, got 0"),
    ({"a": (2, {"mode": "none"}), "b": (1, {"mode": "none"})}, r"config 'b': fail_rank must be in \[0, 1\)"),
])
def test_bad_batches_are_refused_before_any_starts(runs, match):
    with pytest.raises(ValueError, match=match):
        torchrun_batches("fault", runs, stream=False)
