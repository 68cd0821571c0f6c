"""Single-process demonstrations a chapter calls directly, on the runtime's one training loop:
why a language model needs its causal mask (chapter 1), and fp16 without loss scaling (chapter 5).

Every name below is imported from its module on first use, so importing one module of
this layer (a rank's harness importing its process-group set-up) loads no other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from handbook_lib.core.lazy import lazy_exports

if TYPE_CHECKING:  # what a type checker sees; at run time each name is imported on first use
    from handbook_lib.lessons.causality import (
        CAUSALITY_SETUP,
        MASK_VARIANTS,
        CausalityResult,
        CausalityRun,
        estimate_position_blind_loss,
        measure_causality,
        measure_future_gradient_share,
        random_batch,
    )
    from handbook_lib.lessons.loss_scaling import (
        GLOBAL_BATCH_TOKENS,
        PRECISION_VARIANTS,
        UNDERFLOW_SETUP,
        LossScalingResult,
        PrecisionRun,
        measure_loss_scaling,
    )

_HOMES = {
    "CAUSALITY_SETUP": "causality",
    "MASK_VARIANTS": "causality",
    "random_batch": "causality",
    "measure_future_gradient_share": "causality",
    "estimate_position_blind_loss": "causality",
    "CausalityRun": "causality",
    "CausalityResult": "causality",
    "measure_causality": "causality",
    "UNDERFLOW_SETUP": "loss_scaling",
    "GLOBAL_BATCH_TOKENS": "loss_scaling",
    "PRECISION_VARIANTS": "loss_scaling",
    "PrecisionRun": "loss_scaling",
    "LossScalingResult": "loss_scaling",
    "measure_loss_scaling": "loss_scaling",
}
"""Each exported name and the module of this package it is defined in."""

__all__ = [
    "CAUSALITY_SETUP", "MASK_VARIANTS", "random_batch", "measure_future_gradient_share",
    "estimate_position_blind_loss", "CausalityRun", "CausalityResult", "measure_causality",
    "UNDERFLOW_SETUP", "GLOBAL_BATCH_TOKENS", "PRECISION_VARIANTS", "PrecisionRun",
    "LossScalingResult", "measure_loss_scaling",
]

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
