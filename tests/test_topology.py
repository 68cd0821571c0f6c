"""handbook_lib.models.topology: a collective's route over machines, priced as NCCL runs it.

Every expected figure below is worked out by hand from the datasheet line rates and the
published efficiencies (NVLink 450 GB/s x 0.82, InfiniBand NDR 50 GB/s x 0.94), not read back
from the module's own helpers.
"""

from __future__ import annotations

import math

import pytest

from handbook_lib.models import (
    DECODER_SHAPES,
    CollectiveCost,
    bytes_by_link,
    estimate_collective,
    estimate_step_traffic,
    node_preset,
    plan,
    route_collective,
    wrap_units,
)

NVLINK4 = 450e9 * 0.82  # 369 GB/s
NDR = 50e9 * 0.94  # 47 GB/s per port
DGX_H100 = node_preset("h100-80gb")  # 8 GPUs, NVLink 4, 8 NDR ports


def test_a_dgx_h100_has_one_ndr_port_per_gpu_and_ethernet_one_per_machine():
    assert (DGX_H100.gpus_per_node, DGX_H100.nics_per_node) == (8, 8)
    assert node_preset("h100-80gb", inter_link="100gbe").nics_per_node == 1
    assert node_preset("h100-80gb", nics_per_node=4).nics_per_node == 4
    with pytest.raises(ValueError, match="nics_per_node"):
        node_preset("h100-80gb", nics_per_node=0)


def test_a_ring_over_every_gpu_of_four_dgx_runs_at_nvlink_speed_not_one_nic():
    # 8 rings, one per port, each leaving a machine once: min(8 x 47, 369) GB/s per GPU
    cost = estimate_collective("all_gather", 32 * 2**20, 32)
    route = route_collective(cost, DGX_H100, 32, "FULL_SHARD")
    assert route.algorithm == "ring" and route.name == DGX_H100.inter_link.name
    assert route.bandwidth_bytes_per_s == pytest.approx(min(8 * NDR, NVLINK4))
    # every ring step waits on its slower hop: NVLink's fitted step (7.7 us) over the port's 5 us
    assert route.latency_s == pytest.approx(31 * 7.7e-6)
    assert route.seconds == pytest.approx(31 * 7.7e-6 + (31 / 32) * 32 * 2**20 / NVLINK4)
    assert "ring over 4 machines" in route.description and "NVLink 4" in route.description


def test_hsdp_replica_all_reduce_shares_the_ports_one_group_per_gpu():
    # 8 concurrent groups (one per local rank), one rank per machine: 8 ports / 8 groups = 1 each
    cost = estimate_collective("all_reduce", 8 * 2**20, 4)
    route = route_collective(cost, DGX_H100, 32, "HYBRID_SHARD")
    assert route.bandwidth_bytes_per_s == pytest.approx(NDR)
    assert "shared by 8 groups" in route.description
    # the shard group's collectives stay inside a machine
    inside = route_collective(estimate_collective("all_gather", 8 * 2**20, 8), DGX_H100, 32, "HYBRID_SHARD")
    assert inside.name == DGX_H100.intra_link.name and inside.bandwidth_bytes_per_s == pytest.approx(NVLINK4)


def test_one_ethernet_port_per_machine_is_shared_by_its_gpus():
    node = node_preset("h100-80gb", inter_link="100gbe")  # 12.5 GB/s, efficiency 1
    ring = route_collective(estimate_collective("all_gather", 2**24, 16), node, 16, "FULL_SHARD")
    assert ring.bandwidth_bytes_per_s == pytest.approx(12.5e9)
    replica = route_collective(estimate_collective("all_reduce", 2**24, 2), node, 16, "HYBRID_SHARD")
    assert replica.bandwidth_bytes_per_s == pytest.approx(12.5e9 / 8)


def test_an_all_reduce_takes_the_tree_when_it_is_faster_and_says_so():
    b = 2**20  # 1 MiB on 64 GPUs (8 machines): latency decides
    small = route_collective(estimate_collective("all_reduce", b, 64), DGX_H100, 64, "DDP")
    step = 7.7e-6  # a ring step waits for its slower hop: NVLink's fitted 7.7 us, not the port's 5
    ring_s = 2 * 63 * step + 2 * 63 * math.ceil(b / 64) / NVLINK4
    tree_s = 2 * (3 * step + 7 * 7.7e-6) + 2 * b / NVLINK4  # log2(8) = 3 machine levels, 7-rank chain
    assert tree_s < ring_s
    assert small.algorithm == "tree" and small.seconds == pytest.approx(tree_s)
    big = 2**34  # 16 GiB on 16 GPUs (2 machines): the ring's 2(N-1)/N B beats the tree's 2B
    large = route_collective(estimate_collective("all_reduce", big, 16), DGX_H100, 16, "DDP")
    assert large.algorithm == "ring"
    assert large.seconds == pytest.approx(2 * 15 * step + 2 * 15 * (big // 16) / NVLINK4)


def test_a_group_inside_one_machine_is_a_ring_on_its_link():
    cost = CollectiveCost("reduce_scatter", 8000, 8, 7000, 7000, 7)
    route = route_collective(cost, DGX_H100, 8, "FULL_SHARD")
    assert (route.algorithm, route.name) == ("ring", DGX_H100.intra_link.name)
    assert route.seconds == pytest.approx(7 * 7.7e-6 + 7000 / NVLINK4)


def test_bytes_by_link_puts_hsdp_gathers_on_nvlink_and_its_all_reduce_on_the_network():
    node = DGX_H100
    units = wrap_units(DECODER_SHAPES["7b"])
    hybrid = estimate_step_traffic(units, 16, "HYBRID_SHARD", shard_group_size=8)
    full = estimate_step_traffic(units, 16, "FULL_SHARD")
    one_node = estimate_step_traffic(units, 8, "FULL_SHARD")
    for traffic, strategy, gpus in ((hybrid, "HYBRID_SHARD", 16), (full, "FULL_SHARD", 16),
                                    (one_node, "FULL_SHARD", 8)):
        by_link = bytes_by_link(traffic, lambda r, s=strategy, g=gpus: route_collective(r, node, g, s))
        assert sum(by_link.values()) == traffic.sent_bytes
        if traffic is hybrid:  # the reduce-scatters' shards, all-reduced between the 2 replicas
            across = sum(r.sent_bytes for r in traffic.records if r.kind == "all_reduce")
            assert by_link == {node.intra_link.name: traffic.sent_bytes - across, node.inter_link.name: across}
        elif traffic is full:  # every ring spans both machines
            assert by_link == {node.inter_link.name: traffic.sent_bytes}
        else:
            assert by_link == {node.intra_link.name: traffic.sent_bytes}


def test_70b_full_shard_on_four_dgx_costs_about_what_it_costs_on_one():
    # issue 23: at one NIC per ring this was 10.71 s against 1.07 s on one machine
    on = {n: next(o for o in plan("llama2-70b", "h100-80gb", n).options if o.name == "FULL_SHARD")
          for n in (8, 32)}
    # every ring at 369 GB/s on both, 7.7 us per ring step (NVLink's, slower than the port's 5)
    for n, alpha in ((8, 7.7e-6), (32, 7.7e-6)):
        traffic = estimate_step_traffic(wrap_units(DECODER_SHAPES["70b"]), n, "FULL_SHARD",
                                        param_dtype="bf16", reduce_dtype="fp32")
        expected = sum(r.steps * alpha + r.sent_bytes / NVLINK4 for r in traffic.records)
        assert on[n].comm_s == pytest.approx(expected)
    assert 1 < on[32].comm_s / on[8].comm_s < 1.15  # (31/32) / (7/8) = 1.107 of it is the bytes
    assert any("ring over 4 machines" in r and "InfiniBand NDR" in r for r in on[32].routes)
    assert all("NVLink 4" in r for r in on[8].routes)


def test_the_model_bus_bandwidth_is_within_15_percent_of_a_published_multi_node_figure():
    # NVIDIA/nccl#1218 (2024): all_reduce_perf on 32 DGX-class H100 machines (256 GPUs, 8 x
    # 400 Gb/s each), 2 GB messages: 340 GB/s bus bandwidth. busbw = 2(N-1)/N * B / t.
    b, n = 2 * 2**30, 256
    node = node_preset("h100-80gb")
    route = route_collective(estimate_collective("all_reduce", b, n), node, n, "DDP")
    busbw = 2 * (n - 1) / n * b / route.seconds
    assert abs(busbw / 340e9 - 1) < 0.15


def test_the_plan_takes_the_ports_a_node_has():
    thin = plan("llama2-70b", "h100-80gb", 32, nics_per_node=1)
    full = next(o for o in thin.options if o.name == "FULL_SHARD")
    assert thin.nics_per_node == 1 and plan("llama2-70b", "h100-80gb", 32).nics_per_node == 8
    assert any("1 x InfiniBand NDR" in r and "network bound" in r for r in full.routes)
    traffic = estimate_step_traffic(wrap_units(DECODER_SHAPES["70b"]), 32, "FULL_SHARD",
                                    param_dtype="bf16", reduce_dtype="fp32")
    # one port per node for a ring over all 8 GPUs of each: 1 x 8 / 8 = one port's 47 GB/s
    assert full.comm_s == pytest.approx(sum(r.steps * 7.7e-6 + r.sent_bytes / NDR for r in traffic.records))
