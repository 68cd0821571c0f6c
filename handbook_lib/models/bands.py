"""How far a predicted step time carries on a GPU: the compute model's error on the published
runs of that GPU (:mod:`handbook_lib.models.published`), as a band a verdict can be read
against. Pure arithmetic: no ``torch``.

A plan that prefers one layout to another by less than the band has found a tie: time both.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from handbook_lib.models.hardware import Accelerator, get_accelerator
from handbook_lib.models.published import throughput_rows

__all__ = ["StepTimeBand", "step_time_band"]


@dataclass(frozen=True)
class StepTimeBand:
    """The compute model's error on one GPU's published runs (the rows not calibrated on)."""

    gpu: str
    """The accelerator's name."""
    runs: int
    """Published runs on it that the model was not fitted on."""
    median: float
    """Median |error|, a fraction: half the runs are closer."""
    p80: float
    """The |error| four runs in five stay within (the 80th percentile), a fraction."""

    def tie(self, a: float, b: float) -> bool:
        """Whether rates (or times) ``a`` and ``b`` differ by less than :attr:`median`."""
        return max(a, b) <= min(a, b) * (1 + self.median)

    def text(self) -> str:
        """One clause: ``"the model's median error on NVIDIA H100 SXM 80GB is 8.9 % (4 runs in 5
        within 20.3 %), over 69 published runs"``."""
        return (f"the model's median error on {self.gpu} is {100 * self.median:.1f} % (4 runs in 5 within "
                f"{100 * self.p80:.1f} %), over {self.runs} published runs")


def step_time_band(gpu: Accelerator | str) -> StepTimeBand | None:
    """The band of ``gpu`` (an accelerator or preset name), or ``None`` where no published run on
    it tests the model (its step times are then unmeasured)."""
    acc = get_accelerator(gpu) if isinstance(gpu, str) else gpu
    errors = sorted(abs(r.error) for r in throughput_rows()
                    if not r.published.calibration and get_accelerator(r.published.gpu).name == acc.name)
    if not errors:
        return None
    return StepTimeBand(acc.name, len(errors), statistics.median(errors), errors[int(0.8 * len(errors))])
