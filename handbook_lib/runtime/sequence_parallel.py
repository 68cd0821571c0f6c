"""What a rank does for sequence parallelism: its place on the (dp, sp) mesh, its share of each
batch (rows by dp, positions by sp), and the model sharded by FSDP2 over every rank.

Chapter 9 uses it through the ``sequence_parallel`` run. Rank ``dp_rank · sp + sp_rank`` (the sp
ranks contiguous, those of one node) holds rows ``dp_rank`` of the global batch and positions
``sp_rank`` of each sequence. The parameters are the same on every rank of an sp group and each
computes gradients from its own tokens, so FSDP2 shards them over all ranks (dp × sp flattened,
as torchtitan folds its context-parallel axis into FSDP's mesh) and averages the gradients over
all of them; the sp group is the attention's (Ulysses' all-to-alls, the ring's sends). Every
rank holds as many tokens, so the mean of the ranks' mean losses is the global batch's mean
loss: the same as one process (:func:`handbook_lib.runtime.training.train_one_process`).

The book's training loop (:func:`handbook_lib.runtime.training.train`) slices each global batch
by rank into equal row blocks; :func:`sequence_batches` hands it a batch arranged so that rank
r's block is its rows and its positions, so no loop of its own is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from handbook_lib.core.parallel_config import ParallelConfig
from handbook_lib.runtime.build import apply_fsdp2
from handbook_lib.runtime.data import BatchSource, make_batch
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.model import build_model
from handbook_lib.runtime.parallel_model import (
    AttentionCore,
    ParallelLayer,
    causal_attention,
    from_simple,
)

__all__ = [
    "AttentionError",
    "SequenceMesh",
    "build_sequence_mesh",
    "build_sequence_model",
    "measure_attention_error",
    "sequence_batches",
]


@dataclass(frozen=True)
class SequenceMesh:
    """This rank's place on the (``dp``, ``sp``) mesh."""

    mesh: DeviceMesh
    """The 2-D mesh, dims ``("dp", "sp")``, sp inner (contiguous ranks)."""
    world: DeviceMesh
    """A 1-D mesh over every rank: FSDP2's."""
    dp_size: int
    sp_size: int
    dp_rank: int
    sp_rank: int

    @property
    def sp_group(self) -> dist.ProcessGroup:
        """The ranks that split this rank's sequences (its row of the mesh)."""
        return self.mesh.get_group("sp")


def build_sequence_mesh(config: ParallelConfig, ctx: RankContext) -> SequenceMesh:
    """The (dp, sp) mesh of ``config.sp_size`` on this job, and the world mesh FSDP2 shards over.

    Raises:
        ValueError: if ``sp_size`` does not divide the world, or dp the batch
            (:meth:`ParallelConfig.data_parallel_size`).
    """
    dp, sp = config.data_parallel_size(ctx.world_size), config.sp_size
    kind = ctx.device.type
    mesh = init_device_mesh(kind, (dp, sp), mesh_dim_names=("dp", "sp"))
    world = init_device_mesh(kind, (ctx.world_size,), mesh_dim_names=("shard",))
    return SequenceMesh(mesh, world, dp, sp, ctx.rank // sp, ctx.rank % sp)


def _arrange(batch: torch.Tensor, dp: int, sp: int) -> torch.Tensor:
    """Row block r (of dp·sp equal ones) = rows r // sp, positions r % sp of ``batch``."""
    rows, cols = batch.shape[0] // dp, batch.shape[1] // sp
    return torch.cat([batch[(r // sp) * rows:(r // sp + 1) * rows, (r % sp) * cols:(r % sp + 1) * cols]
                      for r in range(dp * sp)])


def sequence_batches(mesh: SequenceMesh, source: BatchSource = make_batch) -> BatchSource:
    """A :data:`~handbook_lib.runtime.data.BatchSource` for :func:`~handbook_lib.runtime.training.train`
    whose row block r (the loop's slice for rank r) is rank r's rows and positions of
    ``source``'s global batch: shape (world · b/dp, s/sp)."""

    def batches(config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = source(config, step)
        return _arrange(inputs, mesh.dp_size, mesh.sp_size), _arrange(targets, mesh.dp_size, mesh.sp_size)

    return batches


def build_sequence_model(config: ParallelConfig, ctx: RankContext, mesh: SequenceMesh,
                         core: AttentionCore) -> nn.Module:
    """The book's model from ``config.seed`` (:func:`from_simple`: the same function as
    :class:`~handbook_lib.runtime.model.SimpleTransformer`) with ``core`` as every layer's
    attention, on this rank's device, FSDP2-sharded over every rank: one unit per layer and the
    root, each resharded after forward."""
    model = from_simple(build_model(config.model_config(), seed=config.seed)).to(ctx.device)
    model.set_core(core)
    apply_fsdp2(model, mesh.world, reshard_after_forward=True,
                units=[m for m in model.modules() if isinstance(m, ParallelLayer)])
    return model


@dataclass(frozen=True)
class AttentionError:
    """The distributed core against full causal attention, on this rank's chunk: the
    reference's largest magnitude and the largest difference, for the output and for the q, k, v
    gradients (of the sum of the output times a fixed random weight)."""

    out_scale: float
    out_diff: float
    grad_scale: float
    grad_diff: float


def measure_attention_error(core: AttentionCore, config: ParallelConfig, mesh: SequenceMesh,
                            device: torch.device, batch: int = 2) -> AttentionError:
    """Run ``core`` on random q, k, v (``batch`` × ``seq_len`` × ``nhead`` × head_dim, drawn
    from ``config.seed``, the same on every rank) split by this rank's sp position, and compare
    its output and gradients with :func:`causal_attention` on the whole sequence."""
    gen = torch.Generator().manual_seed(config.seed + 9_999)
    shape = (batch, config.seq_len, config.nhead, config.d_model // config.nhead)
    q, k, v, weight = (torch.randn(shape, generator=gen).to(device) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = causal_attention(*full)
    (reference * weight).sum().backward()
    chunk = config.seq_len // mesh.sp_size
    part = slice(mesh.sp_rank * chunk, (mesh.sp_rank + 1) * chunk)
    mine = [t[:, part].clone().requires_grad_() for t in (q, k, v)]
    out = core(*mine)
    (out * weight[:, part]).sum().backward()
    grads = [(m.grad, f.grad[:, part]) for m, f in zip(mine, full)]
    return AttentionError(
        out_scale=reference[:, part].abs().max().item(),
        out_diff=(out.detach() - reference.detach()[:, part]).abs().max().item(),
        grad_scale=max(want.abs().max().item() for _, want in grads),
        grad_diff=max((got - want).abs().max().item() for got, want in grads))
