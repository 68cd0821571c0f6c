"""handbook_lib.models.cluster and topology.network_share: one job's layouts over machines.

Each figure is recomputed here from the models it is built on, or from the ring's arithmetic."""

from __future__ import annotations

import pytest

from handbook_lib.models import (
    compare_cluster_layouts,
    estimate_collective,
    estimate_memory,
    estimate_step_time,
    estimate_step_traffic,
    get_shape,
    network_share,
    node_preset,
    route_collective,
    usable_memory_bytes,
    wrap_units,
)

DGX = node_preset("h100-80gb")  # 8 H100, 8 NDR ports
SHAPE = get_shape("70b")


def test_only_the_hop_that_leaves_a_machine_uses_a_port():
    # a ring of 32 over 4 machines of 8: each rank's exit hop comes once in 8 channels
    gather = estimate_collective("all_gather", 32 * 1024, 32)
    assert network_share(gather, DGX, 32, "FULL_SHARD") == 1 / 8
    # inside one machine: nothing on the network
    assert network_share(estimate_collective("all_gather", 8 * 1024, 8), DGX, 32, "HYBRID_SHARD") == 0
    # HSDP's replica all-reduce has one rank per machine: all of its bytes leave the machine
    replica = estimate_collective("all_reduce", 1024, 4)
    assert network_share(replica, DGX, 32, "HYBRID_SHARD") == 1
    # shard groups of 16 span two machines, 8 ranks on each
    assert network_share(estimate_collective("reduce_scatter", 16 * 64, 16), DGX, 32,
                         "HYBRID_SHARD") == 1 / 8


def test_full_shard_on_four_dgx_sends_an_eighth_of_its_bytes_over_the_network():
    (row,) = compare_cluster_layouts(SHAPE, DGX, 32)
    traffic = estimate_step_traffic(wrap_units(SHAPE), 32, "FULL_SHARD", param_dtype="bf16",
                                    reduce_dtype="fp32")
    sent = sum(r.sent_bytes for r in traffic.records)  # rings only: no all-reduce
    assert row.nvlink_bytes + row.network_bytes == sent
    assert row.network_bytes == pytest.approx(sent / 8, rel=1e-9)
    assert row.label == "FULL_SHARD" and row.shard_group_size is None


def test_hsdp_in_one_machine_sends_only_its_all_reduce_over_the_network():
    (row,) = compare_cluster_layouts(SHAPE, DGX, 32, (8,))
    traffic = estimate_step_traffic(wrap_units(SHAPE), 32, "HYBRID_SHARD", param_dtype="bf16",
                                    reduce_dtype="fp32", shard_group_size=8)
    routes = [route_collective(r, DGX, 32, "HYBRID_SHARD") for r in traffic.records]
    reduce = sum(route.sent_bytes for r, route in zip(traffic.records, routes, strict=True)
                 if r.kind == "all_reduce")
    assert row.network_bytes == reduce
    assert row.nvlink_bytes == sum(route.sent_bytes for route in routes) - reduce
    assert row.label == "HSDP/8" and row.strategy == "HYBRID_SHARD"
    assert len(row.routes) == 2 and row.routes[0].startswith("ring on NVLink")
    assert "shared by 8 groups at once" in row.routes[1]


def test_times_and_peaks_are_the_models_own():
    rows = compare_cluster_layouts(SHAPE, DGX, 32, (None, 16))
    # full activation checkpointing: 8PT and attention's 16·L·w·s·T (forward twice), over the
    # bf16 peak at the H100's utilization for Llama-2 70B's width, 0.468 x 8192 / (8192 + 386)
    flops = 8 * SHAPE.num_params * 4096 + 16 * 80 * 8192 * 4096 * 4096
    compute = flops / (DGX.accelerator.peak_flops_bf16 * 0.468 * 8192 / (8192 + 386))
    for row, group in zip(rows, (None, 16), strict=True):
        assert row.compute_s == pytest.approx(compute, rel=1e-12)
        traffic = estimate_step_traffic(wrap_units(SHAPE), 32, row.strategy, param_dtype="bf16",
                                        reduce_dtype="fp32", shard_group_size=group)
        step = estimate_step_time(traffic, lambda r, s=row.strategy: route_collective(r, DGX, 32, s),
                                  compute, overlap=True)
        assert (row.comm_s, row.step_s) == (pytest.approx(step.comm_s), pytest.approx(step.total_s))
        peak = estimate_memory(SHAPE, 32, row.strategy, "bf16-mixed", micro_batch=1, seq_len=4096,
                               shard_group_size=group, activation_checkpointing=True).peak_reserved
        assert row.peak_reserved == peak
        assert row.fits == (peak <= usable_memory_bytes(DGX.accelerator))
    # a lower utilization lengthens compute in proportion
    (slow,) = compare_cluster_layouts(SHAPE, DGX, 32, utilization=0.468 * 8192 / (8192 + 386) / 2)
    assert slow.compute_s == pytest.approx(2 * compute)


def test_a_shard_group_must_divide_the_gpus():
    with pytest.raises(ValueError, match="shard_group_size 12 must divide gpus=32"):
        compare_cluster_layouts(SHAPE, DGX, 32, (12,))


def test_hsdp_groups_are_the_rows_and_columns_of_torchs_mesh():
    import torch

    from handbook_lib.models import hsdp_groups

    for world, group in ((4, 2), (8, 4), (32, 8), (6, 1)):
        mesh = torch.arange(world).reshape(world // group, group)  # init_device_mesh's layout
        shard, replica = hsdp_groups(world, group)
        assert shard == tuple(tuple(row.tolist()) for row in mesh)
        assert replica == tuple(tuple(col.tolist()) for col in mesh.T)
    assert hsdp_groups(4, 2) == (((0, 1), (2, 3)), ((0, 2), (1, 3)))
    with pytest.raises(ValueError, match="must divide world_size=4"):
        hsdp_groups(4, 3)
