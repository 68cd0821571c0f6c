"""handbook_lib.runtime.measure: the helpers the runs share (the measurements themselves are checked by
the runs' own tests against the models)."""

import pytest
import torch
from torch import nn

from handbook_lib.models import estimate_collective
from handbook_lib.runtime import CollectiveCall, collective_totals, tensors_in


def test_collective_totals_sum_each_kind_with_the_ring_model():
    calls = [CollectiveCall("all_gather", "fp32", 800, 4), CollectiveCall("all_gather", "fp32", 400, 4),
             CollectiveCall("all_reduce", "fp32", 8, 2)]
    totals = collective_totals(calls)
    assert totals["all_gather"] == {"count": 2, "buffer_bytes": 1200,
                                    "sent_bytes": 3 * 800 // 4 + 3 * 400 // 4}
    assert totals["all_reduce"] == {"count": 1, "buffer_bytes": 8,
                                    "sent_bytes": estimate_collective("all_reduce", 8, 2).sent_bytes}
    assert collective_totals([]) == {}


def test_tensors_in_walks_lists_tuples_and_dicts():
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    found = tensors_in({"x": [a, (b, "not a tensor")], "y": {"z": c}, "n": 4})
    assert [t.numel() for t in found] == [1, 2, 3]
    assert tensors_in(None) == []


def test_counter_times_each_call_and_names_its_phase(tmp_path):
    """A one-rank gloo group: an all-gather in forward, an all-reduce issued by autograd in
    backward, one more after it; each is timed from the counter's start, in issue order."""
    import time

    import torch.distributed as dist

    from handbook_lib.runtime import CollectiveCounter

    class ReduceInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            dist.all_reduce(grad)
            return grad

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x = torch.ones(4, requires_grad=True)
        begin = time.perf_counter()
        with CollectiveCounter(record_ends=True) as counter:
            out = torch.empty(4)
            dist.all_gather_into_tensor(out, torch.ones(4))
            ReduceInBackward.apply(x).sum().backward()
            dist.all_reduce(torch.ones(2))
        elapsed = time.perf_counter() - begin
    finally:
        dist.destroy_process_group()
    calls = counter.calls
    assert [(c.kind, c.phase, c.unit) for c in calls] == [
        ("all_gather", "forward", None), ("all_reduce", "backward", None), ("all_reduce", "optimizer", None)]
    starts = [c.start_s for c in calls]
    assert 0 <= starts[0] <= starts[1] <= starts[2] <= elapsed
    assert all(c.end_s is not None and c.start_s <= c.end_s <= elapsed for c in calls)  # gloo: all finished
    assert [c.buffer_bytes for c in calls] == [16, 16, 8]


def test_cpu_adam_is_measured_in_parameters_per_second():
    import torch

    from handbook_lib.models import CPU_ADAM_PARAMS_PER_S_PER_CORE
    from handbook_lib.runtime.measure import measure_cpu_adam

    threads = torch.get_num_threads()
    rate = measure_cpu_adam(2**20, tensors=4, repeats=2)
    assert torch.get_num_threads() == threads  # restored
    # a step over 1 Mi parameters takes microseconds to seconds on any CPU; the planner's figure
    # was measured the same way on this book's machine
    assert 1e6 < rate < 1e11 and 1e6 < CPU_ADAM_PARAMS_PER_S_PER_CORE < 1e11
    with pytest.raises(ValueError, match="multiple of tensors"):
        measure_cpu_adam(10, tensors=3)
    with pytest.raises(ValueError, match="threads"):
        measure_cpu_adam(threads=0)


def test_bytes_between_micro_steps_wait_for_released_buffers(monkeypatch):
    """A finished collective's buffer may be released a moment late (gloo's worker thread):
    the reading between micro-steps is the smallest over a short wait, never a later rise."""
    from handbook_lib.runtime.measure import StepMemoryTracker

    tracker = StepMemoryTracker.__new__(StepMemoryTracker)
    readings = iter([1_517_032, 1_517_032, 1_000_000] + [1_000_000] * 20)
    monkeypatch.setattr(tracker, "_current_total", lambda: next(readings))
    tracker.mark_between_micro_steps()
    assert tracker._between == 1_000_000


def test_counter_sees_functional_collectives_and_all_to_all(tmp_path):
    """The kinds tensor and sequence parallelism issue: the functional collectives DTensor uses
    (an all-gather's buffer is its output, input x group) and ``all_to_all_single``. (A group of
    one cannot send to itself: the ring's sends and receives are counted by the runs' tests.)"""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from handbook_lib.runtime import CollectiveCounter

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with CollectiveCounter(functional=True) as counter, CollectiveCounter() as plain:
            funcol.all_reduce(torch.ones(3), "sum", dist.group.WORLD).wait()
            funcol.all_gather_tensor(torch.ones(5), 0, dist.group.WORLD).wait()
            out = torch.empty(6)
            dist.all_to_all_single(out, torch.ones(6))
    finally:
        dist.destroy_process_group()
    assert [(c.kind, c.buffer_bytes, c.group_size) for c in counter.calls] == [
        ("all_reduce", 12, 1), ("all_gather", 20, 1), ("all_to_all", 24, 1)]
    assert [c.kind for c in plain.calls] == ["all_to_all"]  # the functional ones only when asked


def test_activations_after_forward_can_wait_for_a_late_release(monkeypatch):
    """settle=True (chapter 9's loss_parallel on gloo): the smallest reading over a short wait,
    as between micro-steps; without it, the reading of the moment."""
    from handbook_lib.runtime.measure import StepMemoryTracker

    tracker = StepMemoryTracker.__new__(StepMemoryTracker)
    readings = iter([147_528, 147_528, 147_464] + [147_464] * 20)
    monkeypatch.setattr(tracker, "_current_activations", lambda: next(readings))
    tracker.after_forward(settle=True)
    assert tracker._activations == 147_464
    monkeypatch.setattr(tracker, "_current_activations", lambda: 147_528)
    tracker.after_forward()
    assert tracker._activations == 147_528


class _FakeAllocator:
    """``torch.cuda``'s allocator readings for a tracker run on the CPU: fixed counts, so that
    what the tracker derives from them is known by hand."""

    def __init__(self, at_enter: int, peak: int, reserved: int, free: int, total: int) -> None:
        self.at_enter, self.peak, self.reserved, self.free, self.total = at_enter, peak, reserved, free, total
        self.calls: list[str] = []

    def install(self, monkeypatch) -> None:
        def log(name, value):
            def read(*args, **kwargs):
                self.calls.append(name)
                return value
            return read
        for name, value in (("synchronize", None), ("reset_peak_memory_stats", None),
                            ("memory_allocated", self.at_enter), ("max_memory_allocated", self.peak),
                            ("max_memory_reserved", 2 * self.reserved), ("memory_reserved", self.reserved),
                            ("mem_get_info", (self.free, self.total))):
            monkeypatch.setattr(torch.cuda, name, log(name, value))


def test_cuda_tracker_reports_the_allocator_rise_beside_its_own(monkeypatch):
    """On CUDA the tracker records ``memory_allocated`` and ``mem_get_info`` as the step begins
    (after resetting the peak), and reports the allocator's rise (``max_memory_allocated`` -
    start) beside its own (its peak - what it saw at the start); the difference is named as
    workspaces and rounding. The tracker's side is a real step of a real model on the CPU."""
    from handbook_lib.runtime.measure import UNTRACKED_WORDS, StepMemoryTracker

    model = nn.Linear(64, 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 64)
    model(x).sum().backward()
    optimizer.step()  # the moments exist: the state at rest is params, grads and moments
    fake = _FakeAllocator(at_enter=5_000_000, peak=6_234_567, reserved=8 * 2**20, free=2**30, total=2**31)
    fake.install(monkeypatch)
    tracker = StepMemoryTracker(model, optimizer, torch.device("cpu"))
    tracker._cuda = True  # the device the readings are faked for; the tensors stay on the CPU
    with tracker:
        loss = model(x).sum()
        tracker.after_forward()
        loss.backward()
        optimizer.step()
    mem = tracker.result
    n = 64 * 32 + 32
    state = 4 * n * 4 + 2 * 4  # params, grads, Adam's two moments and its two step counters
    assert mem.tracked_at_enter_bytes == state
    assert fake.calls[:4] == ["synchronize", "reset_peak_memory_stats", "memory_allocated", "mem_get_info"]
    assert (mem.allocator_peak_bytes, mem.allocator_at_enter_bytes) == (6_234_567, 5_000_000)
    assert mem.allocator_step_bytes == 1_234_567
    assert mem.tracker_step_bytes == mem.peak_bytes - state > 0
    metrics = mem.allocator_metrics()
    assert metrics["untracked_at_enter_bytes"] == 5_000_000 - state
    assert metrics["untracked_step_bytes"] == 1_234_567 - mem.tracker_step_bytes
    assert metrics["untracked_what"] == UNTRACKED_WORDS and "not a prefetched unit" in UNTRACKED_WORDS
    assert (metrics["device_free_bytes"], metrics["device_reserved_bytes"], metrics["device_total_bytes"]) == \
        (2**30, 8 * 2**20, 2**31)
    assert metrics["allocator_reserved_bytes"] == 16 * 2**20
    assert mem.device_memory.usable_bytes == 2**30 + 8 * 2**20
    assert mem.device_memory.outside_allocator_bytes == 2**31 - 2**30 - 8 * 2**20


def test_cpu_tracker_reads_no_allocator(monkeypatch):
    from handbook_lib.runtime.measure import StepMemoryTracker, measure_device_memory

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: pytest.fail("read on a CPU rank"))
    model = nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with StepMemoryTracker(model, optimizer, torch.device("cpu")) as tracker:
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
    mem = tracker.result
    assert mem.allocator_peak_bytes is None and mem.allocator_step_bytes is None and mem.device_memory is None
    assert mem.allocator_metrics() == {}
    assert mem.tracked_at_enter_bytes == 4 * (64 + 8) and mem.tracker_step_bytes == mem.peak_bytes - 288
    assert measure_device_memory(torch.device("cpu")) is None


def test_new_bytes_peak_counts_what_the_operators_allocate_and_free():
    """Outputs the operators allocate count while alive; a view, an in-place update and the
    tensors that existed before do not: 400 B and 200 B alive at once, then 40 B."""
    import torch

    from handbook_lib.runtime.measure import NewBytesPeak

    before = torch.ones(1000)
    with NewBytesPeak() as seen:
        a = torch.zeros(100)
        b = torch.zeros(50)
        before.add_(1)  # in place: nothing new
        view = a.view(10, 10)  # a view: the same storage
        del a, view
        c = torch.zeros(10)
    assert (seen.peak, seen.live) == (600, 240)
    del b, c
    assert seen.live == 0
