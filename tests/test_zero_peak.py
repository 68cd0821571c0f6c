"""handbook_lib.models.zero_peak: DeepSpeed ZeRO's peak, moment by moment.

The real runs (tests/test_runs_deepspeed_zero.py, chapter 7) measure the buckets, the ZeRO-1/2
bucket moment and the optimizer step against these functions on CPU ranks; here the arithmetic
is checked against sums written out by hand, and the refusals.
"""

import math

import pytest

from handbook_lib.core.architecture import ModelConfig, param_shapes
from handbook_lib.models.zero import flat_partition
from handbook_lib.models.zero_peak import (
    BOOK_RUNS,
    DEEPSPEED_DEFAULTS,
    ZeroKnobs,
    estimate_zero_peak,
    zero_plan_traffic,
    zero_step_bytes,
)

TINY = ModelConfig(vocab_size=1001, d_model=64, nhead=2, dim_feedforward=96, num_layers=2)


def _numels(model):
    return [math.prod(shape) for _, shape in param_shapes(model)]


def test_zero2_step_on_one_piece_is_a_view_of_the_gradients_and_the_norm_copies_it_to_float64():
    """Rank 0 of 4 on the tiny model: its partition lies inside the embedding, one tensor, so the
    flat fp32 partition is a view of that gradient (no copy); the norm's float64 copy of the
    partition (8 B an element) beside the embedding's whole gradient is the step's peak, and
    the for-loop AdamW's two temporaries are below it."""
    numels = _numels(TINY)
    part = flat_partition(sum(numels), 4)[1]
    assert part < numels[0]  # one piece
    held = 4 * numels[0]  # the whole tensor that overlaps the partition, fp32
    expected = max(held + 8 * part, held + 2 * 4 * part)
    assert zero_step_bytes(TINY, 4, "ZERO2", "fp32", optimizer_impl="for-loop", rank=0) == expected
    assert expected == held + 8 * part


def test_zero2_step_flattens_and_casts_a_partition_of_several_pieces():
    """The last rank's partition spans several tensors and the padding: in bf16-mixed the pieces
    are flattened in bf16 (2 B) and cast to fp32 (4 B) while the gradients are alive, then the
    fp32 copy carries AdamW's temporaries."""
    numels, world = _numels(TINY), 4
    padded, part = flat_partition(sum(numels), world)
    start, offset, held, pieces = (world - 1) * part, 0, 0, []
    for n in numels:
        if offset + n > start:
            held += n
            pieces.append(min(offset + n, padded) - max(start, offset))
        offset += n
    held = 2 * (held + padded - sum(numels))  # the last rank also holds the padding, bf16
    norm = max(8 * n + 8 * i for i, n in enumerate(pieces))
    expected = max(held + norm, held + 2 * part + 4 * part, 4 * part + 2 * 4 * part)
    assert len(pieces) > 1
    assert zero_step_bytes(TINY, world, "ZERO2", "bf16-mixed", optimizer_impl="for-loop",
                           rank=world - 1) == expected


def test_zero12_bucket_moment_is_the_buckets_and_the_gradients_collected():
    """One bucket of 5e8 elements in the compute dtype (two with overlap_comm), and the tiny
    model's gradients, smaller than a bucket: in bf16 and again in fp32 for the reduction."""
    p = flat_partition(sum(_numels(TINY)), 2)[0]
    for knobs, buckets in ((DEEPSPEED_DEFAULTS, 1), (ZeroKnobs(overlap_comm=True), 2)):
        peak = estimate_zero_peak(TINY, 2, "ZERO2", "bf16-mixed", micro_batch=4, seq_len=16, backend="gloo",
                                  knobs=knobs)
        assert peak.buckets == buckets * 2 * 500_000_000
        assert peak.phases["gradient_buckets"] - peak.at_rest == peak.buckets + 2 * p + 4 * p
    small = estimate_zero_peak(TINY, 2, "ZERO2", "fp32", micro_batch=4, seq_len=16, backend="gloo",
                               knobs=ZeroKnobs(reduce_bucket_size=1000))
    assert small.phases["gradient_buckets"] - small.at_rest == 4 * 1000 + 4 * 1000  # a bucket's worth pending


def test_zero3_keeps_its_bucket_at_rest_in_the_reduce_dtype():
    peak = estimate_zero_peak(TINY, 2, "ZERO3", "bf16-mixed", micro_batch=4, seq_len=16, backend="gloo",
                              knobs=BOOK_RUNS)
    assert peak.buckets == 4 * 500_000_000  # fp32: the precision's reduce dtype
    assert peak.at_rest == peak.state.total + peak.buckets
    assert peak.model_state == peak.state.total
    assert set(peak.phases) == {"forward_backward", "optimizer_step"}


def test_zero3_forward_and_backward_adds_a_modules_gradient_and_what_it_holds_gathered():
    from handbook_lib.models.memory import estimate_memory

    unsharded = estimate_memory(TINY, 1, "NONE", "fp32", micro_batch=4, seq_len=16, backend="gloo")
    moving = max(v - unsharded.model_state for k, v in unsharded.phases.items() if k != "optimizer_step")
    module = 1001 * 64 + 1001  # the output head, weight and bias: the largest module
    # gathered at once: one module at a time (no prefetch, no reuse); nothing (DeepSpeed's
    # defaults keep every tensor of this model whole); the whole model (prefetch, reuse, no
    # tensor kept whole): the first fetch prefetches it all and backward reuses it
    whole = ZeroKnobs(persistence_threshold=0)
    for knobs, gathered in ((BOOK_RUNS, module), (DEEPSPEED_DEFAULTS, 0), (whole, sum(_numels(TINY)))):
        peak = estimate_zero_peak(TINY, 2, "ZERO3", "fp32", micro_batch=4, seq_len=16, backend="gloo",
                                  knobs=knobs)
        assert peak.activations == moving
        assert peak.phases["forward_backward"] - peak.at_rest == moving + 4 * module + 4 * gathered


def test_optimizer_default_is_deepspeeds_fused_adam_on_a_gpu_and_torch_on_the_cpu():
    gpu = estimate_zero_peak(TINY, 2, "ZERO3", "fp32", micro_batch=1, seq_len=16)
    cpu = estimate_zero_peak(TINY, 2, "ZERO3", "fp32", micro_batch=1, seq_len=16, backend="gloo")
    part = sum(-(-n // 2) for n in _numels(TINY))
    assert gpu.phases["optimizer_step"] - gpu.at_rest == 4 * part
    assert cpu.phases["optimizer_step"] - cpu.at_rest == 3 * 4 * part


def test_plan_traffic_of_zero3_is_full_shards_and_of_zero12_an_all_reduce_and_a_gather():
    from handbook_lib.models.layout import model_layout
    from handbook_lib.models.traffic import estimate_step_traffic

    layout = model_layout("llama2-7b")
    zero3 = zero_plan_traffic(layout, 16, "ZERO3")
    fsdp = estimate_step_traffic(layout.units(), 16, "FULL_SHARD", param_dtype="bf16", reduce_dtype="fp32")
    assert zero3.sent_bytes == fsdp.sent_bytes
    zero2 = zero_plan_traffic(layout, 16, "ZERO2")
    assert [r.kind for r in zero2.records] == ["all_reduce", "all_gather"]
    assert zero2.records[1].buffer_bytes == 2 * flat_partition(layout.num_params, 16)[0]


@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": "FULL_SHARD"}, "strategy must be a DeepSpeed ZeRO row"),
    ({"micro_batch": 0}, "micro_batch"),
    ({"backend": "mpi"}, "backend"),
])
def test_refusals_name_the_argument(kwargs, message):
    args = {"strategy": "ZERO3", "micro_batch": 1, "seq_len": 16, **kwargs}
    strategy = args.pop("strategy")
    with pytest.raises(ValueError, match=message):
        estimate_zero_peak(TINY, 2, strategy, **args)


def test_knobs_refuse_a_bucket_of_no_elements():
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        ZeroKnobs(reduce_bucket_size=0)
    assert ZeroKnobs().overlaps(3) and not ZeroKnobs().overlaps(2) and ZeroKnobs(overlap_comm=True).overlaps(1)
