"""handbook_lib.launch over several nodes, for real on one machine: two torchrun agents on
127.0.0.1 form one job of 2 nodes x 2 gloo ranks through torchrun's c10d rendezvous.

Chapter 8 runs HSDP this way (shard within a node, replicate across); this file runs FULL_SHARD
over all 4 ranks, the loss of a whole node, and the arguments' refusals. Each real job is run
once (a module-scoped fixture) and asserted from several angles.
"""

from __future__ import annotations

import pytest

from handbook_lib.core import RunConfig, max_relative_difference
from handbook_lib.launch import RunFailed, torchrun
from handbook_lib.runtime import train_one_process
from tests.conftest import processes_mentioning

SMALL = {"vocab_size": 1001, "d_model": 64, "nhead": 2, "dim_feedforward": 96, "num_layers": 2,
         "steps": 3, "seq_len": 32}


@pytest.fixture(scope="module")
def two_nodes():
    """FULL_SHARD over 2 nodes x 2 ranks, and the same global batch trained in this process."""
    config = {**SMALL, "strategy": "FULL_SHARD"}
    multi = torchrun("fsdp_train", 2, config, nnodes=2, stream=False, timeout_s=300)
    return multi, train_one_process(RunConfig.from_mapping(config))


def test_two_agents_form_one_job_of_four_ranks(two_nodes):
    multi, _ = two_nodes
    assert multi.world_size == 4
    placement = [(r["rank"], r["node_rank"], r["local_rank"]) for r in multi.ranks]
    # torchrun numbers the nodes in the order their agents join; the ranks of a node are
    # consecutive and its local ranks count from 0
    nodes = sorted({node for _, node, _ in placement})
    assert nodes == [0, 1]
    assert [(node * 2 + local) for _, node, local in placement] == [0, 1, 2, 3]
    assert all(r["host"] for r in multi.ranks)


def test_every_byte_check_holds_across_nodes(two_nodes):
    multi, _ = two_nodes
    assert multi.checks and not multi.failed_checks()
    counted = {c.quantity for c in multi.checks}
    assert {"param_shard_bytes", "all_gather_buffer_bytes", "reduce_scatter_buffer_bytes"} <= counted
    assert {c.rank for c in multi.checks if c.quantity == "param_shard_bytes"} == {0, 1, 2, 3}


def test_losses_match_the_single_process_run(two_nodes):
    multi, single = two_nodes
    assert max_relative_difference(multi.metric("losses")[0], single.losses) < 1e-5


def test_a_lost_node_is_named_and_nothing_is_left(no_leftovers):
    # rank 1, alone on the second node, kills its own agent with SIGKILL: the node is gone
    with pytest.raises(RunFailed) as info:
        torchrun("fault", 1, {"mode": "kill_agent", "fail_rank": 1, "sleep_s": 60}, nnodes=2,
                 out=no_leftovers, stream=False, timeout_s=120)
    message = str(info.value)
    assert info.value.rank == 1  # the lost node's rank, named with its node
    assert "rank 1 (node 1, local rank 0)" in message.splitlines()[0]
    assert "the first torchrun agent to end was killed by SIGKILL" in message
    assert processes_mentioning(str(no_leftovers)) == []


@pytest.mark.parametrize("kwargs, words", [
    ({"nnodes": 0}, "nnodes must be an int >= 1, got 0"),
    ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:29500"}, "node_rank must be an int in [0, 2)"),
    ({"nnodes": 2, "node_rank": 1}, "rdzv_endpoint must be 'host:port'"),
    ({"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "no-port"}, "rdzv_endpoint must be 'host:port'"),
    ({"rdzv_endpoint": "h:29500"}, "rdzv_endpoint needs node_rank"),
])
def test_bad_node_arguments_are_refused_before_anything_starts(kwargs, words, tmp_path):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        torchrun("fault", 2, {"mode": "none"}, out=tmp_path / "never", **kwargs)
    assert not (tmp_path / "never").exists()


def test_on_a_faked_gpu_machine_each_local_node_gets_its_own_gpus(monkeypatch):
    import torch

    from handbook_lib.launch.nodes import check_nodes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nodes = check_nodes(2, None, None)
    assert [nodes.agent_env(k, 2) for k in range(nodes.local_agents)] == [
        {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # a hub that gave this kernel 4 GPUs
    assert nodes.agent_env(1, 2) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    one = check_nodes(2, 1, "10.0.0.1:29500")  # a real node: its GPUs are its own
    assert one.local_agents == 1 and one.agent_env(0, 8) == {}
    with pytest.raises(ValueError, match=r"nnodes x nproc = 2 x 4 ranks on this machine but 4 GPU"):
        torchrun("fault", 4, {"mode": "none"}, nnodes=2)

