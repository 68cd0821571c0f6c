"""DeepSpeed Ulysses as the book's attention core: ``deepspeed.sequence.layer.DistributedAttention``.

Chapter 9 uses it through the ``sequence_parallel`` run (``sp_method=ulysses``). DeepSpeed's
``DistributedAttention(local_attention, sequence_process_group, scatter_idx, gather_idx)``
wraps a local attention with four all-to-alls (Jacobs et al. 2023, "DeepSpeed Ulysses",
arXiv 2309.14509): Q, K and V go from (s/P tokens, h heads) to (s tokens, h/P heads), the local
attention runs on the whole sequence with its h/P heads, and the output comes back; each
all-to-all's gradient is the all-to-all the other way, so backward has four too. For the book's
(batch, seq, heads, head_dim) tensors the heads are scattered (``scatter_idx=2``) and the
sequence gathered (``gather_idx=1``), with ``batch_dim_idx=0``. Every all-to-all is
``deepspeed.comm.all_to_all_single`` → ``torch.distributed.all_to_all_single``, which gloo
implements, so it runs on the CPU; :mod:`handbook_lib.models.sequence_parallel` counts them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import Tensor

from handbook_lib.integrations.zero_engine import import_deepspeed
from handbook_lib.runtime.parallel_model import causal_attention

__all__ = ["ulysses_core"]


Core = Callable[[Tensor, Tensor, Tensor], Tensor]
"""An attention core: ``core(q, k, v)``, each (batch, seq, heads, head_dim)."""


def ulysses_core(group: dist.ProcessGroup) -> Core:
    """An :data:`~handbook_lib.runtime.parallel_model.AttentionCore` for
    ``model.set_core``: DeepSpeed's ``DistributedAttention`` over ``group`` (the
    sequence-parallel ranks, chunk i on its rank i) around the book's causal SDPA.
    DeepSpeed's communication layer is pointed at the process group this job already
    has (``deepspeed.comm.init_distributed``, no MPI discovery).

    The ``nhead`` of the tensors it is given must be divisible by the group's size
    (refused by :class:`~handbook_lib.core.config.ParallelConfig` before any run).
    """
    import_deepspeed()
    import deepspeed.comm as ds_comm
    from deepspeed.sequence.layer import DistributedAttention

    if not ds_comm.is_initialized():  # nccl, not "cpu:gloo,cuda:nccl"
        backend = "nccl" if "nccl" in dist.get_backend() else dist.get_backend()
        ds_comm.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                                 verbose=False)
    # all-to-all: (a chunk of the sequence, all heads) -> (the sequence, 1/P of them)
    attention = DistributedAttention(causal_attention, group,
                                     scatter_idx=2, gather_idx=1)

    def core(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attention(q, k, v, 0)

    return core
