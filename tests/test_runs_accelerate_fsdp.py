"""handbook_lib.runs.accelerate_fsdp: FSDP through Accelerate, verified instead of assumed.

Chapter 7 runs FULL_SHARD on 2 ranks; this test runs SHARD_GRAD_OP. Without a GPU, Accelerate
does not distribute at all (its distributed type is NO): the run must say so and fail its
checks — the whole model on every rank, losses that part after step 1. With GPUs the same run
must pass them.
"""

import pytest
import torch

pytest.importorskip("accelerate")

from handbook_lib.core import RunConfig, param_count
from handbook_lib.integrations import launch_env  # noqa: E402
from handbook_lib.launch import torchrun  # noqa: E402
from handbook_lib.runs.accelerate_fsdp import validate  # noqa: E402

TINY = {"vocab_size": 1001, "d_model": 64, "nhead": 2, "dim_feedforward": 96, "num_layers": 2,
        "batch_size": 8, "seq_len": 16, "steps": 3, "strategy": "SHARD_GRAD_OP"}


def test_accelerate_reports_what_it_really_did(tmp_path):
    result = torchrun("accelerate_fsdp", 2, TINY, out=tmp_path / "run", timeout_s=300, stream=False,
                      allow_failed_checks=True)
    rank0 = result.ranks[0]
    assert rank0["asked"]["FSDP_VERSION"] == "2" and rank0["asked"]["FSDP_RESHARD_AFTER_FORWARD"] == "false"
    if torch.cuda.is_available():
        assert rank0["sharded"] and rank0["dtensor_params"] and not result.failed_checks()
        return
    assert rank0["distributed_type"] == "NO" and not rank0["sharded"]
    assert "NOT distributed" in rank0["verdict"]
    whole = 4 * param_count(RunConfig.from_mapping(TINY).model_config())
    failed = {(c.quantity, c.rank) for c in result.failed_checks()}
    assert {("param_bytes", 0), ("param_bytes", 1)} <= failed
    assert all(r["param_bytes"] == whole for r in result.ranks)
    assert ("loss_step1_vs_fsdp2", 0) not in failed  # the same weights and batch: one step agrees
    assert ("loss_step2_vs_fsdp2", 0) in failed  # then each rank followed its own half of the batch


def test_launch_env_is_what_accelerate_launch_sets():
    env = launch_env(RunConfig.from_mapping(TINY), 4)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "TransformerLayer"
    assert not any(k.startswith(("MASTER_", "RANK", "WORLD")) for k in env)


@pytest.mark.parametrize("changes, world, match", [
    ({"strategy": "DDP"}, 2, "runs api='fsdp2' with strategy SHARD_GRAD_OP, FULL_SHARD"),
    ({"api": "fsdp1"}, 2, "runs api='fsdp2'"),
    ({}, 1, "needs >= 2 ranks"),
    ({"precision": "bf16-mixed"}, 2, "precision='fp32'"),
    ({"steps": 1}, 2, "steps >= 2"),
    ({"batch_size": 9}, 2, "batch_size=9 must be divisible"),
])
def test_validate_refuses(changes, world, match):
    with pytest.raises(ValueError, match=match):
        validate(RunConfig.from_mapping({**TINY, **changes}), world)
