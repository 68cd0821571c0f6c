"""handbook_lib.runtime.trace: FSDP2's named ranges read from a profiler's events."""

from types import SimpleNamespace

import torch

from handbook_lib.runtime.trace import TraceRange, fsdp_ranges, profiled


def _event(name: str, start_us: float, end_us: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start_us, end=end_us))


def test_ranges_name_their_unit_the_root_when_none_and_start_from_the_first_event():
    events = [
        _event("FSDP::pre_backward (layers.1)", 9_000, 9_500),
        _event("aten::mm", 500, 700),  # not FSDP's: left out, but its start is the origin
        _event("FSDP::all_gather", 1_000, 3_500),  # the root's: FSDP2 names no unit
        _event("FSDP::backward_prefetch for layers.0", 8_000, 8_400),
        _event("FSDP::post_backward_rs_wait ()", 9_600, 9_610),  # empty brackets: the root too
        _event("FSDP::all_gather (layers.0)", 4_000, 4_250),
        _event("Optimizer.step#AdamW.step", 10_000, 11_000),
    ]
    assert fsdp_ranges(events) == [
        TraceRange("all_gather", "root", 0.5, 2.5),
        TraceRange("all_gather", "layers.0", 3.5, 0.25),
        TraceRange("backward_prefetch", "layers.0", 7.5, 0.4),
        TraceRange("pre_backward", "layers.1", 8.5, 0.5),
        TraceRange("post_backward_rs_wait", "root", 9.1, 0.01),
    ]
    assert fsdp_ranges([]) == []


def test_a_named_range_of_a_real_profile_is_read_back():
    with profiled(torch.device("cpu")) as prof:
        with torch.profiler.record_function("FSDP::pre_forward (layers.3)"):
            torch.ones(8) @ torch.ones(8)
    ranges = fsdp_ranges(prof.events())
    assert [(r.kind, r.unit) for r in ranges] == [("pre_forward", "layers.3")]
    assert ranges[0].duration_ms > 0 and ranges[0].start_ms >= 0
