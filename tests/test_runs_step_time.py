"""handbook_lib.runs.step_time: DDP and FSDP timed in one job, in turns, with identical losses."""

import pytest

from handbook_lib.core import max_relative_difference
from handbook_lib.launch import torchrun
from handbook_lib.runs.step_time import StepTimeConfig, validate

TINY = {"vocab_size": 1001, "d_model": 64, "nhead": 2, "dim_feedforward": 96, "num_layers": 2,
        "batch_size": 4, "seq_len": 16, "steps": 1, "repeats": 3, "variants": "DDP,FULL_SHARD"}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return torchrun("step_time", 2, TINY, out=tmp_path_factory.mktemp("step_time"), timeout_s=300, stream=False)


def test_every_variant_is_timed_every_repeat(result):
    rank0 = result.ranks[0]
    assert result.extra["variants"] == ["DDP", "FULL_SHARD"]
    for name in ("DDP", "FULL_SHARD"):
        assert len(rank0["step_time_s"][name]) == TINY["repeats"]
        assert all(t > 0 for t in rank0["step_time_s"][name])
        ratios = [t / d for t, d in zip(rank0["step_time_s"][name], rank0["step_time_s"]["DDP"])]
        assert rank0["ratio_to_ddp"][name] == pytest.approx(ratios)
    assert rank0["ratio_to_ddp"]["DDP"] == [1.0] * TINY["repeats"]


def test_variants_train_identically(result):
    # warm-up + repeats x steps batches each, the same batches in the same order for every variant
    losses = result.ranks[0]["local_losses"]
    assert len(losses["DDP"]) == TINY["repeats"] * TINY["steps"]
    assert max_relative_difference(losses["FULL_SHARD"], losses["DDP"]) <= 1e-5
    assert [c.quantity for c in result.checks] == ["loss_FULL_SHARD_vs_DDP"] * 2
    assert not result.failed_checks()


@pytest.mark.parametrize("changes, world, match", [
    ({"variants": "FULL_SHARD,DDP"}, 2, "must start with DDP"),
    ({"variants": "DDP,ZERO3"}, 2, "unknown strategy 'ZERO3'"),
    ({"variants": "DDP,ZERO4"}, 2, "unknown strategy 'ZERO4'"),
    ({}, 1, "2 or more ranks"),
    ({"precision": "bf16-mixed"}, 2, "fp32"),
])
def test_bad_configs_are_rejected_before_launch(changes, world, match):
    with pytest.raises(ValueError, match=match):
        validate(StepTimeConfig.from_mapping({**TINY, **changes}), world)


def test_rank0_reports_progress_and_the_cli_prints_the_ratio(result, monkeypatch, capsys):
    import handbook_lib.face.commands as commands
    from handbook_lib.face import main, step_time_summary

    logs = "".join(p.read_text(errors="replace") for p in result.path.parent.rglob("*.log"))
    assert "step_time: building DDP, FULL_SHARD; then 1 warm-up step(s) each and 3 repeats" in logs
    assert "warm-up done: FULL_SHARD" in logs and "repeat 3/3: DDP " in logs
    assert step_time_summary(result).startswith("FSDP/DDP step time (median of 3 repeats): FULL_SHARD ")
    # the CLI's `run step_time` prints the checks with a verdict, the ratio table and its summary
    monkeypatch.setattr(commands, "torchrun", lambda *args, **kwargs: result)
    assert main(["run", "step_time", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "2 checks: 2 within tolerance" in out and "nats = loss in natural-log units" in out
    assert "ratio to DDP (median)" in out and step_time_summary(result) in out
    assert max(len(line) for line in out.splitlines()) <= 100
