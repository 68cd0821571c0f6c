"""handbook_lib.models.published: published bus bandwidths beside the topology model's."""

from __future__ import annotations

import pytest

from handbook_lib.models import PUBLISHED_BUS_BANDWIDTH, bus_bandwidth_rows


def test_every_independent_published_bus_bandwidth_is_within_15_percent():
    rows = bus_bandwidth_rows()
    independent = [r for r in rows if not r.published.calibration]
    assert len(independent) >= 2 and len({r.published.source for r in independent}) >= 1
    for r in independent:
        assert abs(r.error) < 0.15, (r.published.label, r.published.kind, r.error)


def test_the_model_figure_is_the_ring_bytes_over_the_routed_time():
    row = next(r for r in bus_bandwidth_rows() if r.published.kind == "all_gather" and r.published.gpus == 32)
    b, n = row.published.buffer_bytes, 32
    sent = (n - 1) * (b // n)
    # 4 machines of 8 H100, 8 NDR ports each: min(8 x 47, 369) GB/s, 5 us per ring step
    assert row.model_bytes_per_s == pytest.approx(sent / (31 * 5e-6 + sent / 369e9))
    assert row.algorithm == "ring"
    assert row.error == pytest.approx(row.model_bytes_per_s / 323.53e9 - 1)


def test_a_row_the_parameters_came_from_is_marked_as_calibration():
    calibration = [p for p in PUBLISHED_BUS_BANDWIDTH if p.calibration]
    assert calibration and all("nccl-tests#212" in p.source for p in calibration)
    assert all(p.source for p in PUBLISHED_BUS_BANDWIDTH)
