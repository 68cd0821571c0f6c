"""The FSDP clinic's DeepSpeed case: "ZeRO-3 uses more memory than ZeRO-2" on a small model.

Chapter 10, "Memory" (chapter 7 introduces ZeRO). ZeRO-3 keeps every tensor of at most
``stage3_param_persistence_threshold`` elements (DeepSpeed's default: 100,000) whole on every rank,
besides its partition, so that small tensors are not gathered one by one. In a model whose
tensors are all that small, ZeRO-3 then holds every parameter whole *and* its partition: more than
ZeRO-2, which holds them whole once. At scale those tensors are a rounding. The case measures
both stages with real DeepSpeed engines (:func:`~handbook_lib.integrations.zero_engine.build_engine`)
against :func:`~handbook_lib.models.zero.estimate_zero_rank_bytes`, exact.
"""

from __future__ import annotations

import torch

from handbook_lib.models.model_state import RankState
from handbook_lib.models.zero import DEFAULT_PERSISTENCE_THRESHOLD, estimate_zero_rank_bytes
from handbook_lib.runtime.clinic_common import CaseFn, CaseSetup, Half

__all__ = ["zero3_small_model", "measure_stage", "ZERO_CASES"]

_PARTS = ("params", "master", "grads", "optimizer", "optimizer_step")


def measure_stage(setup: CaseSetup, strategy: str, threshold: int) -> RankState:
    """What this rank holds under DeepSpeed ``strategy`` (``ZERO2``, ``ZERO3``) with the
    persistence ``threshold`` (elements), after one training step of the config's model: the
    parameters, the fp32 master partition, the gradients held before the step, the optimizer
    state (bytes; :func:`~handbook_lib.integrations.zero_engine.measure_zero_bytes`)."""
    from handbook_lib.integrations.zero_engine import build_engine, measure_zero_bytes, measure_zero_grad_bytes

    config = setup.config.replace(strategy=strategy, init="full")
    engine, _, _ = build_engine(config, setup.ctx, persistence_threshold=threshold)
    x, y = (t.to(setup.ctx.device) for t in setup.batch(0))
    loss = torch.nn.functional.cross_entropy(engine(x).float().flatten(0, 1), y.flatten())
    engine.backward(loss)
    grads = measure_zero_grad_bytes(engine)
    engine.step()
    held = measure_zero_bytes(engine, grads)
    engine.destroy()
    return held


def _check_stage(half: Half, setup: CaseSetup, label: str, strategy: str, threshold: int) -> int:
    """Measure one stage, check its parts and total against the model; return the total (bytes)."""
    held = measure_stage(setup, strategy, threshold)
    predicted = estimate_zero_rank_bytes(setup.layout, setup.world, strategy, rank=setup.rank,
                                         persistence_threshold=threshold)
    half.check(f"{label}_param_bytes", predicted.params, held.params, "bytes")
    half.check(f"{label}_state_bytes", predicted.total, held.total, "bytes")
    half.metrics[label] = {name: getattr(held, name) for name in _PARTS}
    return held.total


def zero3_small_model(setup: CaseSetup) -> tuple[Half, Half]:
    """ZeRO-2 against ZeRO-3 with DeepSpeed's default persistence threshold (broken: ZeRO-3 holds
    more) and with a threshold of 0 (fixed: every tensor partitioned, ZeRO-3 holds less). Checked:
    each stage's parameter and total bytes against
    :func:`~handbook_lib.models.zero.estimate_zero_rank_bytes`, exact; ZeRO-2 is measured once
    and compared in both halves."""
    broken, fixed = setup.half(), setup.half()
    zero2 = _check_stage(broken, setup, "zero2", "ZERO2", 0)
    default = _check_stage(broken, setup, "zero3", "ZERO3", DEFAULT_PERSISTENCE_THRESHOLD)
    fixed.metrics["zero2"] = broken.metrics["zero2"]
    sharded = _check_stage(fixed, setup, "zero3", "ZERO3", 0)
    largest = setup.layout.largest_tensor
    for half, total, threshold in ((broken, default, DEFAULT_PERSISTENCE_THRESHOLD), (fixed, sharded, 0)):
        half.symptom = total > zero2
        half.metrics.update(zero2_total=zero2, zero3_total=total, threshold=threshold, largest_tensor=largest)
        half.finding = (f"threshold {threshold:,} (largest tensor {largest:,} elements): ZeRO-3 holds "
                        f"{total:,} B against ZeRO-2's {zero2:,} B on rank {setup.rank}")
    return broken, fixed


ZERO_CASES: dict[str, CaseFn] = {"zero3_small_model": zero3_small_model}
"""The DeepSpeed case of the clinic, by name."""
