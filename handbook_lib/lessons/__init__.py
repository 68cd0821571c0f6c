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


__getattr__, __dir__, __all__ = lazy_exports(__name__)
