"""Activation checkpointing as a rank applies it: which layers recompute, and what a selective
policy keeps.

The memory model reads the same lists (:data:`~handbook_lib.models.activations.MATRIX_PRODUCTS`,
:data:`~handbook_lib.models.activations.ATTENTION_OPS`) and prices what this module keeps
(:func:`~handbook_lib.models.activations.estimate_activation_bytes`); the runs check the two
against each other, byte for byte on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from handbook_lib.core.config import checkpointing_mode
from handbook_lib.models.activations import ATTENTION_OPS, MATRIX_PRODUCTS, saved_families

__all__ = ["apply_activation_checkpointing", "selective_policy"]


def _ops(names: tuple[str, ...]) -> set[Any]:
    return {getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)}


def selective_policy(matmul_every: int = 1,
                     ac_save: str = "matmul+attention") -> Callable[[], Any]:
    """A ``context_fn`` for ``torch.utils.checkpoint``: each checkpointed call gets
    a policy that must save the outputs of the operator families ``ac_save`` names,
    the matrix products (:data:`MATRIX_PRODUCTS`) and the fused attentions
    (:data:`ATTENTION_OPS`), and may recompute the rest, except that of the matrix
    products it keeps the 1st, (n+1)-th, (2n+1)-th, ... only (n = ``matmul_every``;
    torchtitan's op policy keeps every second). The forward and the recomputation
    count their products apart: both make the same choices."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        create_selective_checkpoint_contexts,
    )

    matmul, attention = saved_families(ac_save)
    saved = _ops(ATTENTION_OPS) if attention else set()
    products = _ops(MATRIX_PRODUCTS) if matmul else set()
    keep, drop = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE

    def context() -> Any:
        seen = {False: 0, True: 0}  # products met, in forward and in recomputation

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            if func in products:
                seen[ctx.is_recompute] += 1
                nth = seen[ctx.is_recompute] - 1
                return keep if nth % matmul_every == 0 else drop
            return keep if func in saved else drop

        return create_selective_checkpoint_contexts(policy)

    return context


def apply_activation_checkpointing(model: nn.Module, mode: str = "full", every: int = 1,
                                   matmul_every: int = 1, ac_save: str = "matmul+attention") -> None:
    """Wrap each of ``model.layers`` (``every`` k: layers 0, k, 2k, ... only) so its activations
    are recomputed in backward. ``full`` keeps each layer's input only. ``selective`` keeps,
    besides, the outputs of the operators named in
    :data:`~handbook_lib.models.activations.SELECTIVE_SAVE` (the matrix products and the fused
    attention), every ``matmul_every``-th product only, of the families ``ac_save`` names
    (:func:`selective_policy`). ``none`` (or
    ``False``) leaves the model as it is."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    mode = checkpointing_mode(mode)
    if mode == "none":
        return
    kwargs = {"context_fn": selective_policy(matmul_every, ac_save)} if mode == "selective" else {}
    layers: Any = model.layers
    for i, layer in enumerate(layers):
        if i % every == 0:
            layers[i] = checkpoint_wrapper(layer, **kwargs)
