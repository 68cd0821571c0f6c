"""Model state: the bytes of parameters, gradients and optimizer states a rank holds at rest.

Pure arithmetic: no ``torch.distributed``, no side effects.

Chapter 1 introduces the model state ("16 bytes per parameter"); chapter 2 shards it
(:mod:`handbook_lib.models.memory` adds what a step holds on top); chapter 5 adds what gradient
accumulation keeps between micro-steps; chapter 7 compares FSDP's and DeepSpeed's layouts part
by part (:class:`RankState`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

from handbook_lib.core.checks import check_int, lookup
from handbook_lib.core.config import dtype_bytes, get_precision
from handbook_lib.core.strategies import get_strategy
from handbook_lib.models.init_bytes import device_storage_bytes
from handbook_lib.models.layout import ModelLike, model_layout
from handbook_lib.models.sharding import Unit

__all__ = ["OptimizerRule", "OPTIMIZER_RULES", "OPTIMIZER_STATES", "optimizer_states", "optimizer_step_bytes",
           "optimizer_temporary_bytes",
           "ModelStateBytes", "estimate_model_state_bytes", "estimate_accumulation_bytes", "RankState"]


@dataclass(frozen=True)
class OptimizerRule:
    """What an optimizer keeps per parameter tensor."""

    states: int
    """State tensors of the parameter's shape: Adam's two moments, SGD's momentum buffer."""
    step_counter: bool
    """A 4-byte ``step`` scalar per tensor (Adam's), not sharded: counted apart."""


OPTIMIZER_RULES: dict[str, OptimizerRule] = {
    "adamw": OptimizerRule(2, True), "adam": OptimizerRule(2, True),
    "sgd-momentum": OptimizerRule(1, False), "sgd": OptimizerRule(0, False),
}
"""Each ``optimizer`` of the run config and what it keeps: the one optimizer table the memory,
ZeRO and checkpoint models read."""

OPTIMIZER_STATES: dict[str, int] = {name: rule.states for name, rule in OPTIMIZER_RULES.items()}
"""State tensors per parameter, each the parameter's shape: Adam's two moments, SGD's momentum.

(Adam also keeps one ``step`` scalar per parameter tensor; it is not sharded and is counted
apart, as ``optimizer_other``.)
"""


def optimizer_states(optimizer: str) -> int:
    """How many parameter-shaped state tensors ``optimizer`` keeps (see :data:`OPTIMIZER_RULES`).

    Raises:
        ValueError: for an unknown optimizer, listing the accepted ones.
    """
    return lookup(OPTIMIZER_RULES, optimizer, "optimizer").states


def optimizer_step_bytes(model: ModelLike, optimizer: str, units: Sequence[Unit] | None = None) -> int:
    """Bytes of Adam's per-tensor ``step`` counters (a 4-byte float each; 0 for SGD).

    They are not sharded: every rank holds one per parameter tensor it has a shard of (none are
    counted for a model known by its sizes only). With FSDP1's flat parameters, pass the
    ``units``: the optimizer then sees one tensor per unit that has parameters.
    """
    rule = lookup(OPTIMIZER_RULES, optimizer, "optimizer")
    tensors = model_layout(model).step_tensors if units is None else sum(1 for u in units if u.numel)
    return 4 * tensors if rule.step_counter else 0


def optimizer_temporary_bytes(local_numels: Sequence[int], optimizer: str, impl: str,
                              element_bytes: int = 4) -> int:
    """The most bytes one optimizer step allocates beyond the state it updates in place, in the
    state's dtype (``element_bytes`` e: 4 in fp32, 2 in pure bf16), for ``impl``
    (``for-loop``, ``foreach`` or ``fused``; resolve ``default`` first with
    :func:`~handbook_lib.core.config.optimizer_impl_on`), over the rank's local parameter
    tensors of ``local_numels`` elements in the optimizer's order.

    Adam and AdamW (``torch/optim/adam.py``) build ``sqrt(v̂)`` out of place; every other update
    is in place:

    - ``foreach`` (``_multi_tensor_adam``): ``torch._foreach_sqrt`` of every second moment at
      once, one copy of every local parameter: ``e·Σ n_i``;
    - ``for-loop`` (``_single_tensor_adam``): ``(v.sqrt() / c).add_(eps)``, two tensors of one
      parameter's size while the previous parameter's ``denom`` is still bound:
      ``e·max_i (n_{i-1} + 2·n_i)``;
    - ``fused`` (``torch._fused_adamw_``): nothing, the kernel updates each element in place.

    SGD, with or without momentum, updates in place under every implementation: 0. Measured on
    CPU ranks by every ``fsdp_train`` run (``optimizer_temporary_bytes``), to the byte.

    Raises:
        ValueError: for an unknown optimizer or implementation.
    """
    rule = lookup(OPTIMIZER_RULES, optimizer, "optimizer")
    lookup(dict.fromkeys(("for-loop", "foreach", "fused")), impl, "optimizer_impl")
    if rule.states != 2 or impl == "fused":
        return 0
    if impl == "foreach":
        return element_bytes * sum(local_numels)
    pairs = zip((0, *local_numels), local_numels)
    return element_bytes * max((before + 2 * n for before, n in pairs), default=0)


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model state: parameters, gradients and optimizer states."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        """Sum of the three components, bytes."""
        return self.params + self.grads + self.optimizer


def estimate_model_state_bytes(
    num_params: ModelLike,
    *,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optimizer_bytes: int = 8,
) -> ModelStateBytes:
    """Model-state bytes of an unsharded model: the chapter-1 "16 bytes per parameter".

    The defaults are fp32 training with Adam: 4 B parameter + 4 B gradient + 8 B optimizer state
    (two fp32 moments) per parameter. Activations, temporary buffers and the Adam step counters
    are not included.
    """
    n = model_layout(num_params).num_params
    for name, value in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes),
                        ("optimizer_bytes", optimizer_bytes)):
        check_int(name, value, 0)
    return ModelStateBytes(params=n * param_bytes, grads=n * grad_bytes, optimizer=n * optimizer_bytes)


def estimate_accumulation_bytes(
    model: ModelLike,
    strategy: str = "FULL_SHARD",
    precision: str = "fp32",
    *,
    reduce_dtype: str | None = None,
    device: str = "cpu",
) -> int:
    """Bytes a rank holds between the micro-steps of gradient accumulation, beyond its state at
    rest: with gradient sync off (FSDP2's ``set_requires_gradient_sync(False)``), a strategy
    that shards gradients keeps every parameter's *unsharded* gradient, in the reduce dtype,
    until the last micro-step reduce-scatters it: P·r bytes, where FSDP held P·4/N. A
    replicating strategy (DDP, NO_SHARD) accumulates in the gradients it holds anyway: 0.

    ``device="cuda"``: each gradient is its own storage, rounded up to the caching allocator's
    512 B (:func:`~handbook_lib.models.init_bytes.device_storage_bytes`); needs a model with
    exact tensors. Not yet measured on a GPU.
    """
    row = get_strategy(strategy).torch_only("estimate_accumulation_bytes")
    size = dtype_bytes(reduce_dtype or get_precision(precision).reduce)
    device_storage_bytes(0, device)  # checks the device
    if not row.shards_grads:
        return 0
    layout = model_layout(model)
    if device == "cpu":
        return layout.num_params * size
    layout.require_exact("estimate_accumulation_bytes")
    return sum(device_storage_bytes(prod(shape) * size, device) for _, shape in layout.tensors)


@dataclass(frozen=True)
class RankState:
    """One rank's model state just before the optimizer step, bytes, in the same five parts for
    every row of the strategy table — PyTorch's (FSDP2, DDP, one process) and DeepSpeed's ZeRO —
    so that the two families compare part by part (chapter 7). Predictions
    (:func:`~handbook_lib.models.memory.estimate_rank_state`) and measurements
    (:func:`handbook_lib.integrations.zero_engine.measure_zero_bytes`) share it."""

    params: int
    """Parameters held (FSDP2: the sharded fp32 parameters with their padding; DDP: all)."""
    master: int
    """A separate fp32 master copy (ZeRO only: PyTorch's optimizer updates the parameters)."""
    grads: int
    """Gradients held after backward."""
    optimizer: int
    """Optimizer state tensors (Adam's two moments)."""
    optimizer_step: int
    """Adam's step counters (one per tensor with PyTorch, one per flat group with ZeRO)."""

    @property
    def total(self) -> int:
        """All five parts, bytes."""
        return self.params + self.master + self.grads + self.optimizer + self.optimizer_step
