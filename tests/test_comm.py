"""handbook_lib.models.traffic: ring collectives, per-step traffic of each strategy, and the time model."""


import pytest

from handbook_lib.core import STRATEGIES, ModelConfig, get_strategy, param_count
from handbook_lib.core import STRATEGIES as CONFIG_STRATEGIES
from handbook_lib.models import (
    TRANSFER_KINDS,
    ATTENTION_FLOPS_SOURCE,
    UTILIZATION_MAX,
    compute_forward_share,
    estimate_step_flops,
    expected_utilization,
    fit_utilization,
    fit_utilizations,
    width_utilization,
    get_accelerator,
    DEFAULT_UTILIZATION,
    UTILIZATION_SOURCE,
    Link,
    Unit,
    estimate_collective,
    estimate_collective_time,
    estimate_compute_time,
    estimate_shard_bytes,
    estimate_step_bytes_for_params,
    estimate_step_time,
    estimate_step_traffic,
    wrap_units,
)

from handbook_lib.models.topology import Route

SMALL = ModelConfig(vocab_size=101, d_model=8, nhead=2, dim_feedforward=16, num_layers=4)


def flat(numel: int) -> Unit:
    """A non-root unit holding one 1-D parameter of ``numel`` elements."""
    return Unit("flat", ((numel,),))


# --- collectives -------------------------------------------------------------------------

@pytest.mark.parametrize("kind, sent, steps", [
    ("all_gather", 300, 3),       # N=4, B=400: receive the 3 chunks of 100 you lack, send 3
    ("reduce_scatter", 300, 3),   # 3 partial chunks of 100 passed on
    ("all_reduce", 600, 6),       # reduce-scatter then all-gather: 2 * 300
    ("broadcast", 400, 3),        # pipelined chain: a middle rank forwards all 400
    ("all_to_all", 300, 3),       # keep 1 block of 100, send the other 3, one to each rank
])
def test_ring_collectives_by_hand(kind, sent, steps):
    cost = estimate_collective(kind, 400, 4)
    assert (cost.sent_bytes, cost.received_bytes, cost.steps) == (sent, sent, steps)
    assert (cost.kind, cost.buffer_bytes, cost.group_size) == (kind, 400, 4)
    assert isinstance(cost.sent_bytes, int)


def test_a_send_moves_its_tensor_once_and_a_receive_takes_it():
    send, recv = estimate_collective("send", 400, 4), estimate_collective("recv", 400, 4)
    assert (send.sent_bytes, send.received_bytes, send.steps) == (400, 0, 1)
    assert (recv.sent_bytes, recv.received_bytes, recv.steps) == (0, 400, 1)


@pytest.mark.parametrize("kind", TRANSFER_KINDS)
def test_a_group_of_one_moves_nothing(kind):
    cost = estimate_collective(kind, 1000, 1)
    assert (cost.sent_bytes, cost.received_bytes, cost.steps) == (0, 0, 0)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_all_reduce_is_reduce_scatter_plus_all_gather(n):
    b = 120 * n
    ar = estimate_collective("all_reduce", b, n)
    rs, ag = estimate_collective("reduce_scatter", b, n), estimate_collective("all_gather", b, n)
    assert ar.sent_bytes == rs.sent_bytes + ag.sent_bytes == 2 * (n - 1) * 120
    assert ar.steps == rs.steps + ag.steps == 2 * (n - 1)


def test_all_reduce_of_an_uneven_buffer_uses_ceil_chunks():
    # B=10 over N=3: chunks of ceil(10/3) = 4 bytes, 2 steps of each half: 2 * 2 * 4 = 16
    assert estimate_collective("all_reduce", 10, 3).sent_bytes == 16


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all"])
def test_uneven_all_gather_or_reduce_scatter_is_refused(kind):
    with pytest.raises(ValueError, match="multiple of group_size"):
        estimate_collective(kind, 10, 3)


@pytest.mark.parametrize("args, match", [
    (("allgather", 8, 2), "kind must be one of all_gather, reduce_scatter, all_reduce, broadcast, all_to_all"),
    (("all_gather", -8, 2), "buffer_bytes"),
    (("all_gather", 8.0, 2), "buffer_bytes"),
    (("all_gather", 8, 0), "group_size"),
    (("all_gather", 8, True), "group_size"),
])
def test_estimate_collective_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        estimate_collective(*args)


# --- units -------------------------------------------------------------------------------

def test_units_follow_apply_fsdp2_root_then_one_per_layer():
    units = wrap_units(SMALL)
    assert [u.name for u in units] == ["root", "layers.0", "layers.1", "layers.2", "layers.3"]
    assert [u.root for u in units] == [True, False, False, False, False]
    v, d, f = 101, 8, 16
    assert units[0].shapes == ((v, d), (v, d), (v,))  # embedding, output.weight, output.bias
    assert units[1].numel == 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
    assert sum(u.numel for u in units) == param_count(SMALL)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_unit_padding_agrees_with_the_memory_model(world):
    # the all-gather output of all units is world_size padded shards, as memory.py pads them
    padded = sum(u.padded_numel(world) for u in wrap_units(SMALL)) * 4
    assert padded == world * estimate_shard_bytes(SMALL, world, 0).padded_bytes


def test_padding_by_hand():
    # dim0 = 5 on 2 ranks pads to 6 rows; a (5, 3) weight pads to 6 * 3 elements
    assert Unit("u", ((5,), (5, 3))).padded_numel(2) == 6 + 18
    traffic = estimate_step_traffic([flat(5)], 2, "FULL_SHARD")
    gather = traffic.records[0]
    assert (gather.kind, gather.buffer_bytes, gather.sent_bytes) == ("all_gather", 6 * 4, 3 * 4)


@pytest.mark.parametrize("shapes", [((),), ((3, -1),), ((2.0,),)])
def test_unit_rejects_bad_shapes(shapes):
    with pytest.raises(ValueError, match="shapes"):
        Unit("bad", shapes)


# --- strategies --------------------------------------------------------------------------

def test_full_shard_counts_match_what_fsdp2_was_seen_to_issue():
    # 4 layers + root, root kept unsharded: 5 forward + 4 backward all-gathers, 5 reduce-scatters
    traffic = estimate_step_traffic(wrap_units(SMALL), 2, "FULL_SHARD")
    assert traffic.counts == {"all_gather": 9, "reduce_scatter": 5, "all_reduce": 0, "broadcast": 0}
    first = traffic.records[0]
    assert (first.kind, first.unit, first.phase) == ("all_gather", "root", "forward")
    regathered = [r.unit for r in traffic.records if r.kind == "all_gather" and r.phase == "backward"]
    assert "root" not in regathered and len(regathered) == 4
    resharded = estimate_step_traffic(wrap_units(SMALL), 2, "FULL_SHARD",
                                      root_reshard_after_forward=True)
    assert resharded.counts["all_gather"] == 10


def test_shard_grad_op_gathers_once():
    traffic = estimate_step_traffic(wrap_units(SMALL), 4, "SHARD_GRAD_OP")
    assert traffic.counts == {"all_gather": 5, "reduce_scatter": 5, "all_reduce": 0, "broadcast": 0}
    assert {r.phase for r in traffic.records if r.kind == "all_gather"} == {"forward"}


def test_ddp_and_no_shard_all_reduce_the_unpadded_gradients():
    units, n = wrap_units(SMALL), 4
    grads = param_count(SMALL) * 4
    ddp = estimate_step_traffic(units, n, "DDP")
    assert len(ddp.records) == 1 and ddp.records[0].buffer_bytes == grads
    assert ddp.records[0].group_size == n and ddp.records[0].phase == "backward"
    no_shard = estimate_step_traffic(units, n, "NO_SHARD")
    assert no_shard.counts["all_reduce"] == 5 and no_shard.counts["all_gather"] == 0
    assert sum(r.buffer_bytes for r in no_shard.records) == grads


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_full_shard_moves_one_and_a_half_times_ddp(n, dtype):
    p = 1_000 * n  # divisible by n: no padding
    size = 4 if dtype == "fp32" else 2
    ddp = estimate_step_bytes_for_params(p, n, "DDP", dtype, dtype)
    full = estimate_step_bytes_for_params(p, n, "FULL_SHARD", dtype, dtype)
    assert ddp == 2 * (n - 1) * (p // n) * size
    assert full == 3 * (n - 1) * (p // n) * size
    assert 2 * full == 3 * ddp  # the ratio is 1.5, not 3
    assert estimate_step_bytes_for_params(p, n, "SHARD_GRAD_OP", dtype, dtype) == ddp


def test_bf16_params_halve_the_all_gathers_only():
    units = wrap_units(SMALL)
    fp32 = estimate_step_traffic(units, 4, "FULL_SHARD")
    bf16 = estimate_step_traffic(units, 4, "FULL_SHARD", param_dtype="bf16")

    def total(traffic, kind):
        return sum(r.sent_bytes for r in traffic.records if r.kind == kind)

    assert 2 * total(bf16, "all_gather") == total(fp32, "all_gather")
    assert total(bf16, "reduce_scatter") == total(fp32, "reduce_scatter")
    assert {r.dtype for r in bf16.records if r.kind == "all_gather"} == {"bf16"}


def test_hybrid_shard_by_hand():
    # world 8 = 2 replicas x shard groups of 4; one unit of 8 fp32 elements = 32 bytes
    traffic = estimate_step_traffic([flat(8)], 8, "HYBRID_SHARD", shard_group_size=4)
    kinds = [(r.kind, r.phase, r.group_size, r.buffer_bytes, r.sent_bytes) for r in traffic.records]
    assert kinds == [
        ("all_gather", "forward", 4, 32, 24),         # 3/4 of 32
        ("all_gather", "backward", 4, 32, 24),
        ("reduce_scatter", "backward", 4, 32, 24),
        ("all_reduce", "backward", 2, 8, 8),          # the 8-byte shard, 2 * (2-1)/2 * 8
    ]
    zero2 = estimate_step_traffic([flat(8)], 8, "HYBRID_SHARD_ZERO2", shard_group_size=4)
    assert zero2.counts == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1, "broadcast": 0}


def test_hybrid_pads_to_the_shard_group_not_the_world():
    # dim0 = 10: shard group of 4 pads to 12 rows; the world of 8 would pad to 16
    traffic = estimate_step_traffic([flat(10)], 8, "HYBRID_SHARD", shard_group_size=4)
    assert traffic.records[0].buffer_bytes == 12 * 4
    assert estimate_step_traffic([flat(10)], 8, "FULL_SHARD").records[0].buffer_bytes == 16 * 4


def test_hybrid_with_one_replica_is_full_shard():
    units = wrap_units(SMALL)
    hybrid = estimate_step_traffic(units, 4, "HYBRID_SHARD", shard_group_size=4)
    assert hybrid.sent_bytes == estimate_step_traffic(units, 4, "FULL_SHARD").sent_bytes
    assert all(r.sent_bytes == 0 for r in hybrid.records if r.kind == "all_reduce")


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if get_strategy(s).wrapper != "deepspeed"])
def test_one_rank_sends_nothing(strategy):
    hybrid = {"shard_group_size": 1} if strategy.startswith("HYBRID") else {}
    traffic = estimate_step_traffic(wrap_units(SMALL), 1, strategy, **hybrid)
    assert traffic.sent_bytes == traffic.received_bytes == 0


@pytest.mark.parametrize("strategy", ["DDP", "FULL_SHARD", "SHARD_GRAD_OP"])
def test_grad_accum_with_sync_repeats_the_step(strategy):
    units = wrap_units(SMALL)
    one = estimate_step_traffic(units, 4, strategy)
    four = estimate_step_traffic(units, 4, strategy, grad_accum_steps=4)
    assert four.sent_bytes == 4 * one.sent_bytes
    assert four.counts == {k: 4 * c for k, c in one.counts.items()}
    assert {r.micro_step for r in four.records} == {0, 1, 2, 3}


def test_grad_accum_without_sync_reduces_once_but_gathers_every_micro_step():
    units = wrap_units(SMALL)
    full = estimate_step_traffic(units, 4, "FULL_SHARD", grad_accum_steps=4, sync_every_micro_step=False)
    assert full.counts["all_gather"] == 4 * 9 and full.counts["reduce_scatter"] == 5
    assert {r.micro_step for r in full.records if r.kind == "reduce_scatter"} == {3}
    zero2 = estimate_step_traffic(units, 4, "SHARD_GRAD_OP", grad_accum_steps=4,
                                  sync_every_micro_step=False)
    assert zero2.counts["all_gather"] == 4 * 5 and zero2.counts["reduce_scatter"] == 5
    ddp = estimate_step_traffic(units, 4, "DDP", grad_accum_steps=4, sync_every_micro_step=False)
    assert ddp.counts["all_reduce"] == 1 and ddp.records[0].micro_step == 3
    assert ddp.sent_bytes == estimate_step_traffic(units, 4, "DDP").sent_bytes


def test_strategies_match_the_run_config_vocabulary():
    assert STRATEGIES == CONFIG_STRATEGIES


@pytest.mark.parametrize("kwargs, match", [
    ({"strategy": "ZERO4"}, "strategy must be one of NONE, DDP, NO_SHARD"),
    ({"strategy": "ZERO2"}, "estimate_step_traffic models PyTorch's strategies"),
    ({"world_size": 0}, "world_size"),
    ({"param_dtype": "float32"}, "param_dtype must be one of fp32, bf16, fp16"),
    ({"reduce_dtype": "int8"}, "reduce_dtype must be one of fp32, bf16, fp16"),
    ({"grad_accum_steps": 0}, "grad_accum_steps"),
    ({"strategy": "HYBRID_SHARD", "world_size": 6, "shard_group_size": 4}, "must divide world_size"),
    ({"strategy": "HYBRID_SHARD"}, "shard_group_size"),
    ({"strategy": "HYBRID_SHARD_ZERO2", "shard_group_size": 0}, "shard_group_size"),
    ({"shard_group_size": 2}, "shard_group_size applies only to"),
    ({"units": []}, "units must be a non-empty list of Unit"),
])
def test_estimate_step_traffic_rejects_bad_input(kwargs, match):
    args = {"units": wrap_units(SMALL), "world_size": 4, "strategy": "FULL_SHARD", **kwargs}
    with pytest.raises(ValueError, match=match):
        estimate_step_traffic(args.pop("units"), args.pop("world_size"), args.pop("strategy"), **args)


def test_step_bytes_for_params_rejects_a_negative_count():
    with pytest.raises(ValueError, match="num_params"):
        estimate_step_bytes_for_params(-1, 2, "DDP")


# --- time --------------------------------------------------------------------------------

def test_alpha_beta_by_hand():
    link = Link("toy", bandwidth_bytes_per_s=100.0, latency_s=1.0, source="test")
    # N=4, B=400 all-gather: 3 steps of 1 s, 300 bytes at 100 bytes/s
    assert estimate_collective_time(estimate_collective("all_gather", 400, 4), link) == 3 + 3
    # all-reduce: 6 steps, 600 bytes
    assert estimate_collective_time(estimate_collective("all_reduce", 400, 4), link) == 6 + 6


def test_step_time_with_and_without_overlap_by_hand():
    # FULL_SHARD, one 8-element fp32 unit on 2 ranks: forward's all-gather, backward's all-gather
    # and reduce-scatter, 16 bytes and 1 step each; at 16 bytes/s and 1 s latency each takes 2 s
    link = Link("toy", bandwidth_bytes_per_s=16.0, latency_s=1.0, source="test")
    traffic = estimate_step_traffic([flat(8)], 2, "FULL_SHARD")
    serial = estimate_step_time(traffic, link, compute_s=12.0, overlap=False)
    assert (serial.comm_s, serial.total_s, serial.bound) == (6.0, 18.0, "compute")
    # forward (4 s of compute): its first gather exposed, 2 + 4; backward (8 s): the gather hides,
    # the last reduce-scatter has nothing after it, 8 + 2
    hidden = estimate_step_time(traffic, link, compute_s=12.0, overlap=True)
    assert (hidden.exposed_comm_s, hidden.total_s, hidden.bound) == (4.0, 16.0, "compute")
    assert [(p.phase, p.compute_s, p.edge_s, p.total_s) for p in hidden.phases] == [
        ("forward", 4.0, 2.0, 6.0), ("backward", 8.0, 2.0, 10.0)]
    # 1.2 s of compute: backward's gather (2 s) outlasts its 0.8 s
    starved = estimate_step_time(traffic, link, compute_s=1.2, overlap=True)
    assert (starved.total_s, starved.bound) == pytest.approx((2.4 + 4.0, "communication"))
    # how far compute may shrink before a phase waits: backward's 8 s over its 2 s hidden gather
    # (forward hides nothing: its one gather is the edge); 0.8 / 2 once starved
    assert [p.hidden_s for p in hidden.phases] == [0.0, 2.0]
    assert hidden.compute_margin == 4.0 and starved.compute_margin == pytest.approx(0.4)
    assert serial.compute_margin == 12.0 / 6.0
    # recomputation runs in backward: a quarter of the compute forward, 3 + 2 and 9 + 2
    ac = estimate_step_time(traffic, link, compute_s=12.0, overlap=True, forward_share=0.25)
    assert ac.total_s == 16.0 and ac.phases[0].total_s == 5.0
    # two micro-steps, each reducing: each pays its first gather and its last reduce-scatter
    twice = estimate_step_traffic([flat(8)], 2, "FULL_SHARD", grad_accum_steps=2)
    assert estimate_step_time(twice, link, compute_s=24.0, overlap=True).exposed_comm_s == 8.0
    with pytest.raises(ValueError, match="compute_s"):
        estimate_step_time(traffic, link, compute_s=-1.0, overlap=True)
    with pytest.raises(ValueError, match="forward_share"):
        estimate_step_time(traffic, link, compute_s=1.0, overlap=True, forward_share=1.5)
    # offload's copies run on the host link beside the collectives, spread as compute is: 4/3 s
    # forward, 8/3 s backward; forward 2 + max(1, 0, 4/3), backward 2 + max(2, 2, 8/3)
    copies = estimate_step_time(traffic, link, compute_s=3.0, overlap=True, extra_comm_s=4.0)
    assert (copies.comm_s, copies.total_s, copies.bound) == pytest.approx((2.0 + 4.0, 2 + 4 / 3 + 2 + 8 / 3,
                                                                           "communication"))
    with pytest.raises(ValueError, match="extra_comm_s"):
        estimate_step_time(traffic, link, compute_s=1.0, overlap=True, extra_comm_s=-1.0)


def test_hsdp_all_reduce_runs_beside_the_shard_groups_collectives():
    # HYBRID_SHARD, two units on 4 ranks in shard groups of 2: the replicas' all-reduce crosses
    # machines (3 s each), the shard group's collectives stay inside one (2 s each)
    traffic = estimate_step_traffic([flat(8), flat(8)], 4, "HYBRID_SHARD", shard_group_size=2)
    backward = [r for r in traffic.records if r.phase == "backward"]
    assert [r.kind for r in backward][-2:] == ["reduce_scatter", "all_reduce"]

    def route(record, machines_for_all=False):
        net = record.kind == "all_reduce" or machines_for_all
        return Route("net" if net else "nvl", "ring", 1.0, 0.0, 3 if record.kind == "all_reduce" else 2, "",
                     2 if net else 1)

    intra = sum(2 for r in backward if r.kind != "all_reduce")
    net = sum(3 for r in backward if r.kind == "all_reduce")
    edge = 2 + 3  # the last unit's reduce-scatter, then its all-reduce
    apart = estimate_step_time(traffic, route, compute_s=3.0, overlap=True)
    assert apart.phases[1].edge_s == edge
    assert apart.phases[1].total_s == edge + max(2.0, intra - 2, net - 3)
    one_link = estimate_step_time(traffic, lambda r: route(r, True), compute_s=3.0, overlap=True)
    assert one_link.phases[1].total_s == edge + max(2.0, intra + net - edge)
    assert apart.total_s < one_link.total_s
    # the links' time: each phase's busiest, not their sum
    assert apart.comm_s == 2 * 2 + max(intra, net)


def test_ddp_waits_for_its_last_bucket_only():
    link = Link("toy", bandwidth_bytes_per_s=1e9, latency_s=0.0, source="test")
    traffic = estimate_step_traffic([flat(100 * 2**20)], 2, "DDP")  # 400 MiB of fp32 gradients
    (record,) = traffic.records
    t = estimate_collective_time(record, link)
    step = estimate_step_time(traffic, link, compute_s=10.0, overlap=True)
    assert step.phases[1].edge_s == pytest.approx(t * 25 / 400)
    assert step.total_s == pytest.approx(10.0 + t / 16)


def test_six_p_t_rule_by_hand():
    # 1e9 params, 1e6 tokens: 6e15 FLOPs at 1e15 FLOP/s * 50% = 12 s
    assert estimate_compute_time(10**9, 10**6, 1e15, 0.5) == pytest.approx(12.0)
    # the default: Llama 3 405B's 41 % BF16 MFU on 16,384 H100s (Table 4 of the Llama 3 paper)
    assert DEFAULT_UTILIZATION == 0.41 and "Table 4" in UTILIZATION_SOURCE
    assert estimate_compute_time(10**9, 10**6, 1e15) == pytest.approx(6e15 / (1e15 * 0.41))
    # full recomputation runs the forward twice: 8PT
    assert estimate_compute_time(10**9, 10**6, 1e15, 0.5, activation_checkpointing=True) == pytest.approx(16.0)


def test_attention_and_recomputation_flops_by_hand():
    """PaLM's count: 12·L·w·s FLOPs per token for the score and value products; full
    recomputation runs the forward again, 2·P + 4·L·w·s per token."""
    p, t, s, layers, w = 10**9, 8192, 4096, 24, 2048
    plain = estimate_step_flops(p, t, seq_len=s, num_layers=layers, attention_width=w)
    assert (plain.dense, plain.attention, plain.recompute) == (6 * p * t, 12 * layers * w * s * t, 0)
    assert plain.model == plain.hardware == 6 * p * t + 12 * layers * w * s * t
    ac = estimate_step_flops(p, t, seq_len=s, num_layers=layers, attention_width=w, activation_checkpointing=True)
    assert ac.recompute == 2 * p * t + 4 * layers * w * s * t and ac.model == plain.model
    assert ac.hardware == 8 * p * t + 16 * layers * w * s * t
    assert "appendix B" in ATTENTION_FLOPS_SOURCE
    # without the shape, the 6PT rule
    assert estimate_step_flops(p, t).hardware == 6 * p * t
    # the time: the hardware FLOPs over peak x utilization
    assert estimate_compute_time(p, t, 1e15, 0.5, seq_len=s, num_layers=layers, attention_width=w,
                                 activation_checkpointing=True) == pytest.approx(ac.hardware / 5e14)
    with pytest.raises(ValueError, match="seq_len"):
        estimate_step_flops(p, t, seq_len=-1)
    # forward runs a third of the model FLOPs; backward the rest and the recomputed forward
    assert plain.forward_share == pytest.approx(1 / 3)
    assert ac.forward_share == pytest.approx(plain.model / 3 / (plain.model + plain.model / 3)) == pytest.approx(0.25)
    assert compute_forward_share(p, t, seq_len=s, num_layers=layers, attention_width=w,
                                 activation_checkpointing=True, recompute_flops=0) == pytest.approx(1 / 3)
    assert estimate_step_flops(0, 0).forward_share == pytest.approx(1 / 3)


def test_expected_utilization_grows_with_the_width_toward_the_gpus_own():
    a100, l4 = get_accelerator("a100-80gb"), get_accelerator("l4-24gb")
    assert expected_utilization(a100, 4096) == pytest.approx(0.692 * 4096 / (4096 + 386))
    assert expected_utilization(a100, 386) == pytest.approx(0.692 / 2)  # d_0: half of u_max
    assert width_utilization(0.6, 900, 900) == pytest.approx(0.3) and width_utilization(0.6, 900, 0) == 0
    assert expected_utilization(a100, 1024) < expected_utilization(a100, 8192) < UTILIZATION_MAX[a100.name][0]
    # no published run on an L4, or no width: the default
    assert expected_utilization(l4, 4096) == expected_utilization(a100, 0) == DEFAULT_UTILIZATION
    assert all(source for _, source in UTILIZATION_MAX.values())
    with pytest.raises(ValueError, match="d_model"):
        expected_utilization(a100, -1)


def test_fit_utilization_recovers_the_curve_it_was_made_from():
    points = [(d, 0.6 * d / (d + 900)) for d in (512, 1024, 2048, 8192)]
    u_max, d0 = fit_utilization(points)
    assert d0 == 900 and u_max == pytest.approx(0.6)
    for bad in ([(1024, 0.5)], [(0, 0.5), (1024, 0.5)], [(1024, 1.5), (2048, 0.5)]):
        with pytest.raises(ValueError, match="points"):
            fit_utilization(bad)
    # several GPUs share one d_0, each its own u_max
    both = {"a": points, "b": [(d, 0.3 * d / (d + 900)) for d in (768, 4096)]}
    u, d0 = fit_utilizations(both)
    assert d0 == 900 and u == {"a": pytest.approx(0.6), "b": pytest.approx(0.3)}
    with pytest.raises(ValueError, match="points"):
        fit_utilizations({})


@pytest.mark.parametrize("args, match", [
    ((-1, 10, 1e12), "num_params"),
    ((10, -1, 1e12), "tokens"),
    ((10, 10, 0.0), "peak_flops"),
    ((10, 10, 1e12, 0.0), "utilization"),
    ((10, 10, 1e12, 1.5), "utilization"),
])
def test_compute_time_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        estimate_compute_time(*args)



def test_fsdp_on_one_rank_or_one_replica_issues_no_collective():
    from handbook_lib.core import ModelConfig
    from handbook_lib.models import estimate_step_traffic, wrap_units

    units = wrap_units(ModelConfig(vocab_size=11, d_model=8, nhead=2, dim_feedforward=8, num_layers=2))
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        assert estimate_step_traffic(units, 1, strategy).records == ()
    hybrid = estimate_step_traffic(units, 2, "HYBRID_SHARD", shard_group_size=2)
    assert hybrid.counts["all_reduce"] == 0 and hybrid.counts["reduce_scatter"] == 3


def test_fit_recovers_a_known_alpha_and_beta():
    from handbook_lib.models import AlphaBeta, fit_alpha_beta

    truth = AlphaBeta("reduce_scatter", 4, alpha_s=2e-5, beta_bytes_per_s=3e9)
    sizes = [4096 * 4**k for k in range(6)]
    # times built by hand from the ring model: 3 steps, (N-1)/N of the buffer sent
    times = [3 * 2e-5 + (3 * b // 4) / 3e9 for b in sizes]
    fit = fit_alpha_beta("reduce_scatter", 4, sizes, times)
    assert fit.alpha_s == pytest.approx(2e-5, rel=1e-9)
    assert fit.beta_bytes_per_s == pytest.approx(3e9, rel=1e-9)
    assert truth.predict_s(sizes[2]) == pytest.approx(times[2])


@pytest.mark.parametrize("args, match", [
    (("all_gather", 2, [4096], [1.0]), "two or more"),
    (("all_gather", 1, [4096, 8192], [1.0, 2.0]), "group_size"),
    (("all_gather", 2, [4096, 8192], [1.0, 0.0]), "seconds"),
    (("all_gather", 2, [4096, 8192], [2.0, 1.0]), "do not grow"),
])
def test_fit_rejects_bad_input(args, match):
    from handbook_lib.models import fit_alpha_beta

    with pytest.raises(ValueError, match=match):
        fit_alpha_beta(*args)


def test_decoder_units():
    from handbook_lib.models import DecoderShape, wrap_units

    shape = DecoderShape("t", num_layers=3, d_model=8, nhead=2, vocab_size=100)
    units = wrap_units(shape)
    assert [u.name for u in units] == ["root", "layers.0", "layers.1", "layers.2"] and units[0].root
    assert sum(u.numel for u in units) == shape.num_params


def test_flat_parameters_pad_per_unit_and_empty_units_issue_nothing():
    from handbook_lib.models import Unit, estimate_step_traffic

    units = [Unit("root", (), root=True), Unit("a", ((3, 5), (3,))), Unit("b", ((7,),))]
    flat = estimate_step_traffic(units, 4, "SHARD_GRAD_OP", flat_params=True)
    per_param = estimate_step_traffic(units, 4, "SHARD_GRAD_OP")
    assert {r.unit for r in flat.records} == {"a", "b"}  # the empty root communicates nothing
    gathers = {r.unit: r.buffer_bytes for r in flat.records if r.kind == "all_gather"}
    assert gathers == {"a": 4 * 20, "b": 4 * 8}  # 18 -> 20 and 7 -> 8 elements, padded once
    assert {r.unit: r.buffer_bytes for r in per_param.records if r.kind == "all_gather"} == {
        "a": 4 * (4 * 5 + 4), "b": 4 * 8}  # each parameter's rows padded: 3 -> 4 rows, 3 -> 4


def test_the_grad_scaler_adds_one_four_byte_all_reduce_and_none_communicates_nothing():
    from handbook_lib.models import Unit, estimate_step_traffic

    units = [Unit("root", ((8, 2),), root=True)]
    base = estimate_step_traffic(units, 2, "FULL_SHARD")
    scaled = estimate_step_traffic(units, 2, "FULL_SHARD", grad_scaler_group=2)
    extra = [r for r in scaled.records if r not in base.records]
    assert [(r.kind, r.buffer_bytes, r.group_size) for r in extra] == [("all_reduce", 4, 2)]
    assert estimate_step_traffic(units, 1, "NONE").records == ()


def _simulate_ring(kind: str, n: int) -> tuple[list[dict[int, frozenset[int]]], dict[int, int]]:
    """Run ``ring_schedule``'s transfers on symbolic data: what each rank holds of each chunk (the
    set of ranks whose contribution it sums), and how many chunks each rank sent."""
    from handbook_lib.models import ring_schedule

    if kind == "all_gather":  # rank r starts with its own, complete chunk r
        held = [{r: frozenset(range(n))} for r in range(n)]
    else:  # every rank starts with its own contribution to every chunk
        held = [{c: frozenset({r}) for c in range(n)} for r in range(n)]
    sent = dict.fromkeys(range(n), 0)
    schedule = ring_schedule(kind, n)
    for step in sorted({t.step for t in schedule}):
        moves = [t for t in schedule if t.step == step]
        assert sorted(t.sender for t in moves) == list(range(n))  # every rank sends once a step
        payloads = [(t, held[t.sender][t.chunk]) for t in moves]  # all sends happen at once
        for t, payload in payloads:
            assert t.receiver == (t.sender + 1) % n
            if t.summed:  # a partial sum: exactly the contributions it says it carries
                assert payload == frozenset(t.summed)
                held[t.receiver][t.chunk] = payload | held[t.receiver][t.chunk]
            else:
                assert payload == frozenset(range(n))  # only complete chunks are gathered
                held[t.receiver][t.chunk] = payload
            sent[t.sender] += 1
    return held, sent


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_all_gather_gives_every_rank_every_chunk(n):
    held, sent = _simulate_ring("all_gather", n)
    assert all(h == {c: frozenset(range(n)) for c in range(n)} for h in held)
    buffer = 64 * n
    assert all(k * buffer // n == estimate_collective("all_gather", buffer, n).sent_bytes for k in sent.values())


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_reduce_scatter_leaves_rank_r_the_full_sum_of_chunk_r(n):
    held, sent = _simulate_ring("reduce_scatter", n)
    assert all(held[r][r] == frozenset(range(n)) for r in range(n))
    buffer = 64 * n
    assert all(k * buffer // n == estimate_collective("reduce_scatter", buffer, n).sent_bytes
               for k in sent.values())


@pytest.mark.parametrize("n", [2, 4, 5])
def test_ring_all_reduce_is_both_in_twice_the_steps(n):
    held, sent = _simulate_ring("all_reduce", n)
    assert all(h == {c: frozenset(range(n)) for c in range(n)} for h in held)
    cost = estimate_collective("all_reduce", 64 * n, n)
    assert all(k * 64 == cost.sent_bytes for k in sent.values())
    from handbook_lib.models import ring_schedule

    assert max(t.step for t in ring_schedule("all_reduce", n)) + 1 == cost.steps


def test_ring_schedule_rejects_bad_arguments():
    from handbook_lib.models import ring_schedule

    assert ring_schedule("all_gather", 1) == ()
    with pytest.raises(ValueError, match="kind must be one of"):
        ring_schedule("broadcast", 4)
    with pytest.raises(ValueError, match="group_size"):
        ring_schedule("all_gather", 0)
