"""handbook_lib.models.sensitivity: a plan's verdict under each assumption changed alone."""

import pytest

from handbook_lib.models import TRAINING_CONTEXT_BYTES, flip_points, plan, plan_sensitivity

ARGS = ("gpt3-175b", "a100-80gb", 64)


def test_the_175b_verdict_rests_on_a_five_percent_margin():
    base, rows = plan_sensitivity(*ARGS, seq_len=4096)
    assert base.recommended.name == "FULL_SHARD + AC"
    by = {(r.assumption, r.changed): r for r in rows}
    assert by[("headroom", "10 %")].flips and by[("headroom", "10 %")].recommended == "FULL_SHARD + AC + offload"
    assert by[("capacity", "80 GB (1e9)")].flips  # the datasheet's GB read as decimal: the old verdict
    assert not by[("allocator reserve", "none")].flips and by[("allocator reserve", "30 %")].flips
    # the A100's utilization at GPT-3's width 12,288: 0.692 x 12288 / (12288 + 386) = 67 %
    assert [r.planned for r in rows if r.assumption == "utilization"] == ["67 %", "67 %"]
    assert not by[("utilization", "50 %")].flips and not by[("network ports", "1 per node")].flips
    # a changed row is the plan itself, planned again: the same numbers
    again = plan(*ARGS, seq_len=4096, headroom=0.10).recommended
    assert by[("headroom", "10 %")].step_s == again.step_s and by[("headroom", "10 %")].margin == again.margin


def test_flip_points_are_where_the_verdict_turns():
    base = plan(*ARGS, seq_len=4096)
    o, flips = base.recommended, flip_points(base)
    nccl = 16 * 20 * 2**20  # FULL_SHARD's ring over 8 nodes: 16 channels of 20 MiB
    usable = round(79.25 * 2**30) - TRAINING_CONTEXT_BYTES - nccl  # CUDA's total less a training context
    assert flips.headroom == pytest.approx(1 - o.peak_reserved_bytes / usable)
    # the capacity (memory_bytes=, the memory CUDA would report) at which it no longer fits
    assert flips.memory_bytes == int(o.peak_reserved_bytes + TRAINING_CONTEXT_BYTES + nccl)
    below = plan(*ARGS, seq_len=4096, headroom=flips.headroom - 0.002).recommended
    above = plan(*ARGS, seq_len=4096, headroom=flips.headroom + 0.002).recommended
    assert below.name == o.name and above.name != o.name
    assert plan(*ARGS, seq_len=4096, memory_bytes=flips.memory_bytes + 2**20).recommended.name == o.name
    assert plan(*ARGS, seq_len=4096, memory_bytes=flips.memory_bytes - 2**20).recommended.name != o.name


def test_the_utilization_at_which_communication_shows():
    args = ("llama2-13b", "l4-24gb", 64)
    base = plan(*args, seq_len=4096)
    o, flips = base.recommended, flip_points(base)
    # per phase: backward's compute over its busiest link's hidden collectives, not the step's
    # compute over all its communication (which would flip later)
    assert o.bound == "compute" and flips.utilization == pytest.approx(0.41 * o.compute_margin)
    assert flips.utilization > 0.41 * o.compute_s / o.comm_s

    def same(u):
        return next(x for x in plan(*args, seq_len=4096, utilization=u).options if x.name == o.name)
    assert same(flips.utilization * 0.98).bound == "compute"
    assert same(min(1.0, flips.utilization * 1.02)).bound == "communication"
    assert flips.network_factor == pytest.approx(1 / o.compute_margin)


def test_nothing_fits_has_no_flip_points():
    base = plan("llama2-70b", "l4-24gb", 1, seq_len=65536)
    assert base.recommended is None and flip_points(base) is None
