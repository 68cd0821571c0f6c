"""handbook_lib.models.bands: the compute model's error on a GPU's published runs."""

from __future__ import annotations

import statistics

import pytest

from handbook_lib.models import get_accelerator, step_time_band, throughput_rows


def test_the_band_is_the_gpus_own_rows_not_calibrated_on():
    band = step_time_band("h100-80gb")
    errors = sorted(abs(r.error) for r in throughput_rows()
                    if r.published.gpu == "h100-80gb" and not r.published.calibration)
    assert band.runs == len(errors) == 69 and band.gpu == "NVIDIA H100 SXM 80GB"
    assert band.median == statistics.median(errors)
    # four runs in five are within p80, and it is one of the errors
    assert band.p80 in errors and sum(e <= band.p80 for e in errors) >= 0.8 * len(errors)
    assert step_time_band(get_accelerator("h100-80gb")) == band
    assert "median error on NVIDIA H100 SXM 80GB is" in band.text() and "69 published runs" in band.text()


def test_a_lead_inside_the_median_is_a_tie():
    band = step_time_band("a100-80gb")
    assert band.tie(100.0, 100.0 * (1 + band.median / 2)) and band.tie(100.0 * (1 + band.median / 2), 100.0)
    assert not band.tie(100.0, 100.0 * (1 + 2 * band.median))


@pytest.mark.parametrize("gpu", ["l4-24gb", "h200-141gb", "b200-180gb"])
def test_a_gpu_without_published_runs_has_no_band(gpu):
    assert step_time_band(gpu) is None
