"""The memory model's terms for CUDA ranks (``backend="nccl"``): foreach Adam's temporary in the
optimizer step and, with CPU offload, the device copies of a unit's shards at its all-gather.

The foreach temporary is measured here with torch's own ``_multi_tensor_adam`` (``foreach=True``
runs the same Python on CPU tensors); the offload copies exist on a GPU only and are checked
against hand arithmetic of what FSDP2's source allocates. Every CPU (gloo) prediction is pinned
unchanged by ``tests/test_predictions.py``.
"""

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from handbook_lib.core import ModelConfig, param_count, param_shapes
from handbook_lib.models import estimate_memory, estimate_shard_bytes
from handbook_lib.models.offload import estimate_offload_gather_bytes

TINY = ModelConfig(vocab_size=1001, d_model=64, nhead=2, dim_feedforward=96, num_layers=2)
KW = dict(micro_batch=2, seq_len=16)


def _adam_step_rise(shapes, foreach: bool) -> int:
    """Bytes AdamW's second step allocates beyond the state at rest, as torch's memory tracker
    sees them (the first step creates the moments)."""
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    opt.step()
    tracker = MemTracker()
    tracker.track_external(*params, opt)
    cpu = torch.device("cpu")

    def total(kind: str) -> int:
        snap = tracker.get_tracker_snapshot(kind)[cpu]
        return next(v for k, v in snap.items() if str(getattr(k, "value", k)) == "Total")

    with tracker:
        before = total("current")
        opt.step()
    return total("peak") - before


def test_foreach_adam_holds_one_fp32_moment_as_torch_allocates_it():
    """``_multi_tensor_adam``'s ``exp_avg_sq_sqrt``: 4 bytes of every parameter, all at once —
    what the nccl optimizer step adds to the state (NONE: one process, nothing else alive)."""
    shapes = [s for _, s in param_shapes(TINY)]
    n = param_count(TINY)
    measured = _adam_step_rise(shapes, foreach=True)
    assert measured == 4 * n == 751_268
    est = estimate_memory(TINY, 1, "NONE", "fp32", "adamw", backend="nccl")
    assert est.phases["optimizer_step"] - est.model_state == measured
    # the CPU's per-tensor Adam: two temporaries of the largest tensor (the embedding, 1001 x 64)
    # while the tensor before it (64 elements) still has its denominator bound
    gloo = estimate_memory(TINY, 1, "NONE", "fp32", "adamw", backend="gloo")
    assert gloo.phases["optimizer_step"] - gloo.model_state == 8 * 1001 * 64 + 4 * 64
    assert _adam_step_rise(shapes, foreach=False) == 8 * 1001 * 64 + 4 * 64


@pytest.mark.parametrize("strategy, world, group", [
    ("NONE", 1, 1), ("DDP", 2, 1), ("NO_SHARD", 2, 1), ("SHARD_GRAD_OP", 2, 2), ("FULL_SHARD", 4, 4),
    ("HYBRID_SHARD", 4, 2), ("HYBRID_SHARD_ZERO2", 4, 2)])
def test_the_optimizer_step_on_cuda_by_strategy(strategy, world, group):
    """One fp32 moment of the rank's local parameters (its shard where the strategy shards the
    optimizer state, else every parameter) on top of the state and DDP's buckets."""
    n = param_count(TINY)
    hybrid = {"shard_group_size": group} if strategy.startswith("HYBRID") else {}
    est = estimate_memory(TINY, world, strategy, rank=world - 1, **hybrid, **KW)
    local = estimate_shard_bytes(TINY, group, (world - 1) % group).shard_bytes if group > 1 else 4 * n
    buckets = 4 * n if strategy == "DDP" else 0
    assert est.phases["optimizer_step"] == est.model_state + buckets + local
    # the CPU's for-loop, measured on the rank's own shards (dim 0 cut in ceil(rows / N))
    gloo = estimate_memory(TINY, world, strategy, rank=world - 1, backend="gloo", **hybrid, **KW)
    rank = (world - 1) % group
    shards = [(max(0, min(-(-s[0] // group), s[0] - rank * -(-s[0] // group))), *s[1:])
              for _, s in param_shapes(TINY)]
    rise = _adam_step_rise([s for s in shards if s[0]], foreach=False)
    assert gloo.phases["optimizer_step"] == est.model_state + buckets + rise


def test_no_foreach_term_without_two_moments_or_with_offload():
    """SGD keeps one momentum buffer updated in place (no temporary); with CPU offload the step
    runs on the host; gradients accumulated between micro-steps are gone by the step."""
    for optimizer in ("sgd", "sgd-momentum"):
        assert "optimizer_step" not in estimate_memory(TINY, 2, "FULL_SHARD", optimizer=optimizer, **KW).phases
    assert "optimizer_step" not in estimate_memory(TINY, 2, "FULL_SHARD", cpu_offload=True, **KW).phases
    one = estimate_memory(TINY, 2, "FULL_SHARD", **KW)
    two = estimate_memory(TINY, 2, "FULL_SHARD", grad_accum_steps=2, **KW)
    assert one.phases["optimizer_step"] == two.phases["optimizer_step"]


def test_the_foreach_step_can_be_the_peak():
    """Without activations (a state-only question), 7B on 8 GPUs: FSDP's 16 bytes per parameter
    over 8, plus the temporary's 4 — 20P/8 on a GPU, 16P/8 on the CPU."""
    p = 7_000_000_000
    gpu = estimate_memory(p, 8, "FULL_SHARD", "bf16-mixed")
    cpu = estimate_memory(p, 8, "FULL_SHARD", "bf16-mixed", backend="gloo")
    assert (gpu.peak_phase, gpu.peak) == ("optimizer_step", 20 * p // 8)
    assert cpu.peak == 16 * p // 8 and "optimizer_step" not in cpu.phases
    assert gpu.components["grad_buffers"] == 4 * p // 8


# ------------------------------------------------------------------------- CPU offload on CUDA
@pytest.mark.parametrize("shards, c, group, expected", [
    # N > 1: every input kept while the output (c·N·Σ) is allocated
    ((10, 30), 4, 2, 4 * 40 * 2 + 4 * 40),
    ((10, 30), 2, 2, 2 * 40 * 2 + 2 * 40),
    # in bf16 the fp32 copy made beside the casts (2·1001 + 4·1000 = 6002) stays under it
    ((1, 1000), 2, 2, 2 * 1001 * 2 + 2 * 1001),
    # N = 1, fp32: tensor by tensor; at the second, the first's output and input and the
    # second's input, 4·(10 + 10 + 30); then the second's output beside its input, 4·(40 + 30)
    ((10, 30), 4, 1, max(4 * (0 + 0 + 10), 4 * (10 + 10), 4 * (10 + 10 + 30), 4 * (40 + 30))),
    # N = 1, bf16: the fp32 copy (4·s) beside its cast (2·s)
    ((10, 30), 2, 1, max(2 * 10 + 4 * 10, 2 * 20, 2 * (10 + 10 + 30) + 4 * 30, 2 * (40 + 30))),
    ((), 4, 3, 0),
])
def test_offload_gather_bytes_by_hand(shards, c, group, expected):
    assert estimate_offload_gather_bytes(shards, c, group) == expected


@pytest.mark.parametrize("args, match", [
    (((1,), 0, 1), "compute_bytes must be an int >= 1"),
    (((1,), 4, 0), "group must be an int >= 1"),
    (((-1,), 4, 1), "shards must be an int >= 0"),
])
def test_offload_gather_bytes_refuses_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        estimate_offload_gather_bytes(*args)


def test_offloaded_root_copied_in_on_one_gpu():
    """One GPU, fp32, the book's model: the root (embedding 10000 x 256, head 10000 x 256 and its
    bias) copied tensor by tensor. At the head's weight the embedding's output (4s), its input
    (4s, still bound) and the head's input (4s) are alive: 12s = 30.72 MB, plus the bias's
    40 kB at the next. FSDP2 keeps the root gathered into backward, so it is copied in once, before
    the embedding; resharded after forward, it is copied in again as backward starts, beside the
    activations, against the root's 4R = 20.52 MB gathered then."""
    config = ModelConfig()
    est = estimate_memory(config, 1, "FULL_SHARD", "fp32", micro_batch=4, seq_len=64, cpu_offload=True)
    again = estimate_memory(config, 1, "FULL_SHARD", "fp32", micro_batch=4, seq_len=64, cpu_offload=True,
                            root_reshard_after_forward=True)
    s, bias = 10_000 * 256, 10_000
    assert max(12 * s, 4 * (2 * s + s + bias)) == 30_760_000
    assert again.phases["offload_gather"] - again.phases["backward_start"] == 30_760_000 - 4 * (2 * s + bias)
    assert est.phases["offload_gather"] < again.phases["offload_gather"]  # no copy beside the activations
    assert again.peak_phase == "head_backward"  # the head's gradients still lead, by 0.3 MB
    # kept, the root adds its 4R to the loss's backward, which then leads
    assert est.phases["loss_backward"] - again.phases["loss_backward"] == 4 * (2 * s + bias)
    assert est.peak_phase == "loss_backward"
    gloo = estimate_memory(config, 1, "FULL_SHARD", "fp32", micro_batch=4, seq_len=64, cpu_offload=True,
                           backend="gloo")
    assert "offload_gather" not in gloo.phases  # ``.to(cpu)`` copies nothing on a CPU run
    # on a CPU the offloaded step runs in the same memory: the for-loop's temporaries, the head's
    # weight (s) twice while the final norm's bias (256) before it is still bound
    assert gloo.phases.pop("optimizer_step") == 8 * s + 4 * 256
    assert {k: v for k, v in est.phases.items() if k != "offload_gather"} == gloo.phases


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_offload_copies_stay_under_the_gathered_phases_with_shards(precision):
    """With N > 1 a unit's copy-in (its output and 1/N inputs) holds less than its copy-out (the
    output and the unsharded parameters): the offloaded peak is where the CPU model puts it."""
    config = ModelConfig()
    est = estimate_memory(config, 4, "FULL_SHARD", precision, micro_batch=4, seq_len=64, cpu_offload=True)
    others = {k: v for k, v in est.phases.items() if k != "offload_gather"}
    assert 0 < est.phases["offload_gather"] < max(others.values()) == est.peak
    assert "offload_gather" not in estimate_memory(config, 4, "FULL_SHARD", precision, micro_batch=4,
                                                   seq_len=64).phases
