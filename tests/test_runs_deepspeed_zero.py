"""handbook_lib.runs.deepspeed_zero: DeepSpeed ZeRO for real, beside FSDP2, on 4 ranks.

Chapter 7 runs stages 1–3 in fp32 on 2 ranks (with DeepSpeed's default persistence threshold
and with CPU offload); these runs cover what it does not: 4 ranks, bf16, offload with bf16,
SGD with momentum, plain Adam, a threshold that keeps some tensors whole, and a prefetch bucket
and reuse distance small enough to cut the step's gathers mid-model. Every check of a run
must hold (exact bytes and collectives; losses within the run's tolerance of FSDP2's).
"""

import pytest

pytest.importorskip("deepspeed")

from handbook_lib.core import param_count  # noqa: E402
from handbook_lib.launch import torchrun_batch  # noqa: E402
from handbook_lib.models import estimate_zero_step_traffic  # noqa: E402
from handbook_lib.runs.deepspeed_zero import ZeroRunConfig, fsdp_twin, validate  # noqa: E402

TINY = {"vocab_size": 1001, "d_model": 64, "nhead": 2, "dim_feedforward": 96, "num_layers": 2,
        "batch_size": 8, "seq_len": 16, "steps": 2}
COMPONENTS = ("params", "master", "grads", "optimizer", "optimizer_step")


RUNS = {
    "zero1-sgd-momentum-bf16": {"strategy": "ZERO1", "optimizer": "sgd-momentum", "precision": "bf16-mixed"},
    "zero2-offload-bf16": {"strategy": "ZERO2", "cpu_offload": True, "precision": "bf16-mixed"},
    "zero3-adam-bf16-persistent": {"strategy": "ZERO3", "optimizer": "adam", "precision": "bf16-mixed",
                                   "persistence_threshold": 10_000, "steps": 3},
    "zero3-bf16-master-and-states": {"strategy": "ZERO3", "precision": "bf16", "steps": 3},
    "zero3-bf16-prefetch-reuse": {"strategy": "ZERO3", "precision": "bf16-mixed", "steps": 3,
                                  "prefetch_bucket_size": 30_000, "max_reuse_distance": 100_000},
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The three runs, in one job of 4 ranks (one engine after another on one process group)."""
    runs = torchrun_batch("deepspeed_zero", 4, {k: {**TINY, **v} for k, v in RUNS.items()},
                          out=tmp_path_factory.mktemp("zero"), timeout_s=600, stream=False)
    for result in runs.values():
        assert not result.failed_checks()
        quantities = {c.quantity for c in result.checks}
        assert {f"{name}_bytes" for name in COMPONENTS} <= quantities
        assert {f"loss_step{s + 1}_vs_fsdp2" for s in range(result.config["steps"])} <= quantities
        assert {c.rank for c in result.checks} == {0, 1, 2, 3}
        zero3, offload = result.config["strategy"] == "ZERO3", result.config.get("cpu_offload")
        persistent = zero3 and result.config.get("persistence_threshold")
        peaks = ({"buckets_at_rest_bytes"} | (set() if persistent else {"optimizer_step_peak_bytes"})
                 | (set() if zero3 else {"backward_peak_bytes"}))
        assert offload or peaks <= quantities, result.config
    return runs


def test_zero3_keeps_a_bf16_master_and_bf16_adam_states_ten_bytes_a_parameter(results):
    """``precision="bf16"`` on ZeRO: DeepSpeed's ``bf16_master_weights_and_grads`` and
    ``bf16_optimizer_states``: of each rank's partition of p elements, the bf16 parameters (2p),
    a bf16 master (2p), bf16 gradients (2p) and AdamW's two bf16 moments (4p), 10 bytes an
    element against 18 with the fp32 master (DeepSpeed's own example counts the same)."""
    from handbook_lib.runtime import build_model

    result = results["zero3-bf16-master-and-states"]
    assert result.extra["deepspeed_config"]["bf16"] == {
        "enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    model = build_model(ZeroRunConfig.from_mapping(result.config).model_config())
    part = sum(-(-p.numel() // 4) for p in model.parameters())  # every tensor split 4 ways, rounded up
    for rank in result.ranks:
        assert (rank["params_bytes"], rank["master_bytes"], rank["grads_bytes"], rank["optimizer_bytes"]) == (
            2 * part, 2 * part, 2 * part, 4 * part)


def test_zero1_sgd_momentum_bf16(results):
    result = results["zero1-sgd-momentum-bf16"]
    rank0 = result.ranks[0]
    assert rank0["optimizer_step_bytes"] == 0  # SGD keeps no step counter
    assert rank0["optimizer_bytes"] == rank0["master_bytes"]  # one momentum buffer
    assert rank0["fsdp2"]["strategy"] == "FULL_SHARD"  # FSDP has no ZeRO-1
    # PyTorch's ZeRO-1 beside it: whole tensors per rank, so the 4 ranks' momentum shares differ,
    # where DeepSpeed's flat partitions are equal; together they hold the model's once
    own = [rank["torch_zero1"] for rank in result.ranks]
    assert {c.quantity for c in result.checks} >= {"torch_zero1_optimizer_bytes", "loss_step2_torch_zero1_vs_deepspeed"}
    model = ZeroRunConfig.from_mapping(result.config).model_config()
    assert sum(o["optimizer"] for o in own) == 4 * param_count(model)  # one fp32 momentum a parameter
    assert len({o["optimizer"] for o in own}) > 1 and len({rank["optimizer_bytes"] for rank in result.ranks}) == 1
    assert result.extra["deepspeed_config"]["zero_optimization"]["stage"] == 1


def test_zero2_offload_bf16(results):
    result = results["zero2-offload-bf16"]
    for rank in result.ranks:  # offloaded: the fp32 gradient of the rank's own partition
        assert rank["grads_bytes"] == rank["master_bytes"]
    assert result.extra["deepspeed_config"]["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}


def test_zero3_adam_bf16_with_some_tensors_persistent(results):
    result = results["zero3-adam-bf16-persistent"]
    gathers = result.ranks[0]["collectives"]["all_gather"]["count"]
    traffic = estimate_zero_step_traffic(ZeroRunConfig.from_mapping(TINY).model_config(), 4, "ZERO3",
                                         "bf16-mixed", persistence_threshold=10_000)
    # modules with a tensor above the threshold in forward and backward, small tensors after the step
    assert {r.phase for r in traffic.records if r.kind == "all_gather"} == {"forward", "backward", "step"}
    assert gathers == sum(r.kind == "all_gather" for r in traffic.records)
    assert result.extra["deepspeed_config"]["optimizer"]["params"]["adam_w_mode"] is False


def test_zero3_prefetch_and_reuse_gather_what_the_replayed_trace_says(results):
    """A 30,000-element prefetch bucket and a 100,000-element reuse distance: fewer all-gathers
    than a module at a time, all in forward (a prefetch passes each tensor's backward use in the
    queue, so forward releases nothing), and the run's exact checks hold them."""
    result = results["zero3-bf16-prefetch-reuse"]
    model = ZeroRunConfig.from_mapping(TINY).model_config()
    kwargs = {"prefetch_bucket_size": 30_000, "max_reuse_distance": 100_000}
    traffic = estimate_zero_step_traffic(model, 4, "ZERO3", "bf16-mixed", **kwargs)
    one_by_one = estimate_zero_step_traffic(model, 4, "ZERO3", "bf16-mixed")
    gathers = [r for r in traffic.records if r.kind == "all_gather"]
    assert len(gathers) < sum(r.kind == "all_gather" for r in one_by_one.records)
    assert {r.phase for r in gathers} == {"forward"}
    counted = result.ranks[0]["collectives"]["all_gather"]
    assert (counted["count"], counted["buffer_bytes"]) == (len(gathers), sum(r.buffer_bytes for r in gathers))
    assert {"stage3_prefetch_bucket_size": 30_000, "stage3_max_reuse_distance": 100_000}.items() <= \
        result.extra["deepspeed_config"]["zero_optimization"].items()


def test_zero3_holds_its_gradient_bucket_at_rest_and_reports_its_backward_beside_the_model(results):
    """ZeRO-3 allocates its reduce bucket (5e8 elements, fp32 here: the run reduces in fp32) as the
    engine starts and keeps it; its forward-and-backward peak, which the model approximates, is
    reported beside the prediction (chapter 7 shows the error)."""
    result = results["zero3-adam-bf16-persistent"]
    for rank in result.ranks:
        assert rank["step_bytes"]["buckets_at_rest"] == {"predicted": 4 * 500_000_000, "measured": 4 * 500_000_000}
        backward = rank["step_bytes"]["backward"]
        assert backward["measured"] > 0 and backward["predicted"] > 0
    assert "backward_peak_bytes" not in {c.quantity for c in result.checks}
    assert "optimizer_step_peak_bytes" not in {c.quantity for c in result.checks}  # persistent tensors regathered


def test_the_fsdp_twin_has_the_same_sharding_at_rest_where_fsdp_has_one():
    assert [fsdp_twin(f"ZERO{k}") for k in (1, 2, 3)] == ["FULL_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"]


@pytest.mark.parametrize("changes, world, match", [
    ({"strategy": "FULL_SHARD"}, 2, "deepspeed_zero runs strategy ZERO1, ZERO2, ZERO3; got 'FULL_SHARD'"),
    ({}, 1, "needs >= 2 ranks"),
    ({"precision": "fp16-mixed"}, 2, "runs precision fp32, bf16-mixed"),
    ({"init": "meta"}, 2, "init='full' only"),
    ({"grad_accum_steps": 2}, 2, "grad_accum_steps=1"),
    ({"steps": 1, "strategy": "ZERO2"}, 2, "steps >= 2"),
    ({"steps": 2}, 2, "steps >= 3 with ZeRO-3"),
    ({"batch_size": 9}, 2, "batch_size=9 must be divisible"),
    ({"persistence_threshold": -1}, 2, "persistence_threshold"),
    ({"prefetch_bucket_size": -1}, 2, "prefetch_bucket_size"),
    ({"strategy": "ZERO2", "max_reuse_distance": 10}, 2, "are ZeRO-3's; with strategy 'ZERO2' leave them 0"),
])
def test_validate_refuses(changes, world, match):
    with pytest.raises(ValueError, match=match):
        validate(ZeroRunConfig.from_mapping({**TINY, "steps": 3, **changes}), world)
