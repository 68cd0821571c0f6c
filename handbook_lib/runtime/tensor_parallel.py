"""Tensor parallelism inside a group of ranks: the plan, and the loss on split logits.

Chapter 9 shows it. On the ``tp`` sub-mesh of the job's one mesh
(:mod:`handbook_lib.runtime.mesh`; ``tp`` the inner axis, contiguous ranks: one node's),
:func:`apply_tensor_parallel` splits every layer Megatron's way (Shoeybi et al., 2019):
``ColwiseParallel`` on Q, K, V and ``linear1`` (each rank its heads and its slice of the
feed-forward width), ``RowwiseParallel`` on ``out_proj`` and ``linear2`` (their partial sums
reduced), the embedding by vocabulary rows and the head by vocabulary columns (the loss computed
on the split logits, ``loss_parallel``: :func:`tp_loss`). With ``sequence_parallel`` the
activations between the blocks — the residual adds and the norms — stay split by sequence
(Korthikanti et al., 2022): each block's all-reduce becomes a reduce-scatter after it and an
all-gather before the next; the attention's input is gathered once for Q, K and V together
(``PrepareModuleInput``). The other steps — the sequence split, activation checkpointing, FSDP2
over the data-parallel ranks — and their order are :func:`handbook_lib.runtime.build.apply_axes`'s.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn import functional as F


__all__ = ["apply_tensor_parallel", "tp_loss"]


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh,
                          sequence_parallel: bool = False) -> None:
    """Split ``model`` (the book's split-attention model, or a pipeline stage of it)
    in place over the tensor-parallel mesh (the module's plan).

    Placements on the ``tp`` axis (one rank holds 1/tp of each split tensor): the
    embedding, Q/K/V, ``linear1`` and the head split by rows (dim 0, biases too);
    ``out_proj`` and ``linear2`` by columns (dim 1), their biases replicated; the
    norms replicated. The head's output stays a DTensor split by vocabulary
    (``Shard(-1)``) for :func:`tp_loss`. Chapter 9 shows this function: lines fit
    its column (86 characters).
    """
    seq = Shard(1) if sequence_parallel else Replicate()  # between the blocks
    ends = {
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                  use_local_output=False),  # logits: by vocabulary
    }  # (a pipeline's middle stage holds neither)
    parallelize_module(model, tp_mesh, {name: style for name, style in ends.items()
                                        if getattr(model, name, None) is not None})
    for layer in model.layers:
        plan = {
            "self_attn": PrepareModuleInput(input_layouts=(seq,),
                                            desired_input_layouts=(Replicate(),)),
            "self_attn.q_proj": ColwiseParallel(),  # each rank: its heads
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.out_proj": RowwiseParallel(output_layouts=seq),  # partial sums
            "linear1": ColwiseParallel(input_layouts=seq),  # its slice of the width
            "linear2": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:  # local outputs, for the residual adds
            plan.update({"norm1": SequenceParallel(use_local_output=True),
                         "norm2": SequenceParallel(use_local_output=True)})
        parallelize_module(layer, tp_mesh, plan)


def tp_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits split by vocabulary (a ``Shard(-1)`` DTensor),
    computed without gathering them (``loss_parallel``) and in fp32 whatever the logits' dtype,
    as :func:`~handbook_lib.runtime.training.next_token_loss` computes it: a replicated scalar
    DTensor. Call its ``backward`` inside ``loss_parallel()`` too."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
