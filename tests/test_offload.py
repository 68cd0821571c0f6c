"""handbook_lib.models.offload: what FSDP2's CPU offload costs per step."""

import pytest

from handbook_lib.models import (
    CPU_ADAM_PARAMS_PER_S_PER_CORE,
    Host,
    Unit,
    estimate_offload,
    estimate_step_traffic,
)


def _units() -> list[Unit]:
    return [Unit("root", ((1000,),), root=True), Unit("layers.0", ((4000,),)), Unit("layers.1", ((4000,),))]


def test_full_shard_copies_each_shard_up_per_all_gather_and_each_gradient_down():
    # 4 ranks, bf16 gathers, fp32 reduction: the root gathered once, each layer twice
    traffic = estimate_step_traffic(_units(), 4, "FULL_SHARD", param_dtype="bf16", reduce_dtype="fp32")
    host = Host("test", 16, 10**12, "pcie4", "test")
    cost = estimate_offload(traffic, 9000, host, 4, params_per_s_per_core=1e6)
    assert cost.host_to_device_bytes == 4 * (250 + 2 * 1000 + 2 * 1000)  # fp32 shards, P / 4 each
    assert cost.device_to_host_bytes == 4 * (250 + 1000 + 1000)  # fp32 reduced gradients
    assert cost.copy_s == pytest.approx((17_000 + 9_000) / 25e9)  # PCIe 4 at 25 GB/s
    assert cost.optimizer_params == 2250
    assert cost.optimizer_s == pytest.approx(2250 / (16 / 4 * 1e6))  # 4 cores a rank
    assert cost.link == "PCIe 4.0 x16"


def test_the_cpu_step_is_capped_by_the_hosts_memory_bandwidth():
    """Adam moves 28 B a parameter at the least (read p, g, m, v; write p, m, v): 4 ranks on a
    host of 16 cores at 1e6 parameters/s each would step 4e6 a second; with 56 MB/s of memory,
    14 MB/s a rank streams only 5e5 parameters a second."""
    from handbook_lib.models import ADAM_BYTES_PER_PARAM

    assert ADAM_BYTES_PER_PARAM == 4 * 4 + 3 * 4
    traffic = estimate_step_traffic(_units(), 4, "FULL_SHARD", param_dtype="bf16", reduce_dtype="fp32")
    slow = Host("test", 16, 10**12, "pcie4", "test", memory_bandwidth_bytes_per_s=56e6)
    cost = estimate_offload(traffic, 9000, slow, 4, params_per_s_per_core=1e6)
    assert cost.optimizer_s == pytest.approx(2250 / 5e5) and cost.optimizer_limit == "memory bandwidth"
    fast = Host("test", 16, 10**12, "pcie4", "test", memory_bandwidth_bytes_per_s=56e9)
    cost = estimate_offload(traffic, 9000, fast, 4, params_per_s_per_core=1e6)
    assert cost.optimizer_s == pytest.approx(2250 / 4e6) and cost.optimizer_limit == "cores"


def test_gpus_behind_one_pcie_uplink_share_it():
    """Every rank copies in the same phase: two GPUs behind one switch's x16 uplink each get half
    of it, four a quarter; the bytes and the CPU step do not change."""
    traffic = estimate_step_traffic(_units(), 4, "FULL_SHARD", param_dtype="bf16", reduce_dtype="fp32")
    alone = estimate_offload(traffic, 9000, Host("t", 16, 10**12, "pcie4", "t"), 4)
    for shared in (2, 4):
        cost = estimate_offload(traffic, 9000, Host("t", 16, 10**12, "pcie4", "t", gpus_per_uplink=shared), 4)
        assert cost.copy_s == pytest.approx(26_000 / (25e9 / shared))
        assert (cost.host_to_device_bytes, cost.optimizer_s) == (alone.host_to_device_bytes, alone.optimizer_s)
    with pytest.raises(ValueError, match="gpus_per_uplink"):
        Host("t", 16, 10**12, "pcie4", "t", gpus_per_uplink=0)
    from handbook_lib.models import get_accelerator

    assert get_accelerator("a100-80gb").host.gpus_per_uplink == 2
    assert get_accelerator("h100-80gb").host.gpus_per_uplink == 1


def test_shard_grad_op_copies_each_shard_up_once():
    traffic = estimate_step_traffic(_units(), 4, "SHARD_GRAD_OP")
    cost = estimate_offload(traffic, 9000, Host("t", 8, 10**12, "pcie5", "t"), 8)
    assert cost.host_to_device_bytes == 4 * 2250 and cost.device_to_host_bytes == 4 * 2250


def test_the_cpu_speed_is_a_measurement_of_this_machine():
    from handbook_lib.models import CPU_ADAM_SOURCE

    assert CPU_ADAM_PARAMS_PER_S_PER_CORE == 1.5e8
    assert "measured" in CPU_ADAM_SOURCE and "measure_cpu_adam" in CPU_ADAM_SOURCE


@pytest.mark.parametrize("kwargs, match", [
    ({"num_params": 0}, "num_params"), ({"gpus_per_node": 0}, "gpus_per_node"),
    ({"params_per_s_per_core": 0.0}, "params_per_s_per_core"),
])
def test_bad_input(kwargs, match):
    traffic = estimate_step_traffic(_units(), 2, "FULL_SHARD")
    args = {"num_params": 9000, "gpus_per_node": 2, **kwargs}
    speed = {k: v for k, v in args.items() if k == "params_per_s_per_core"}
    with pytest.raises(ValueError, match=match):
        estimate_offload(traffic, args["num_params"], Host("t", 8, 10**12, "pcie4", "t"), args["gpus_per_node"],
                         **speed)
