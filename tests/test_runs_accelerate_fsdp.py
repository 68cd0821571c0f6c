"""handbook_lib.runs.accelerate_fsdp: FSDP through Accelerate, verified instead of assumed.

Chapter 7 runs FULL_SHARD on 2 ranks; this test runs SHARD_GRAD_OP. Without a GPU, Accelerate
has no FSDP: ``Accelerator(cpu=True)`` makes the job DDP over gloo (the whole model on every
rank, the losses FSDP2's), and ``Accelerator()`` does not distribute at all (NO). With GPUs the
same run shards. Either way every check must pass.
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
    result = torchrun("accelerate_fsdp", 2, TINY, out=tmp_path / "run", timeout_s=300, stream=False)
    assert not result.failed_checks()
    rank0 = result.ranks[0]
    assert rank0["asked"]["FSDP_VERSION"] == "2" and rank0["asked"]["FSDP_RESHARD_AFTER_FORWARD"] == "false"
    assert all(r["moved_before_load"] > 0 for r in result.ranks)  # load_state had something to undo
    checks = {(c.quantity, c.rank): c.measured for c in result.checks}
    assert checks["load_state_max_abs_diff", 0] == checks["load_state_max_abs_diff", 1] == 0.0
    assert checks["exported_elements", 0] == param_count(RunConfig.from_mapping(TINY).model_config())
    if torch.cuda.is_available():
        assert rank0["sharded"] and rank0["dtensor_params"]
        return
    assert (rank0["distributed_type"], rank0["wrapper"], rank0["type_without_cpu_flag"]) == (
        "MULTI_CPU", "DistributedDataParallel", "NO")
    assert not rank0["sharded"] and "NOT sharded" in rank0["verdict"]
    whole = 4 * param_count(RunConfig.from_mapping(TINY).model_config())
    assert all(r["param_bytes"] == whole for r in result.ranks)


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
