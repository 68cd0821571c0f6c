"""One device mesh per job, built from its :class:`~handbook_lib.core.parallel_layout.ParallelLayout`.

Every run that shards builds its mesh here, and only here: chapter 5's FSDP and HSDP runs
(FSDP's 1-D or 2-D mesh) and chapter 9's tensor- and sequence-parallel runs take their
sub-meshes of the same value. The mesh has every dimension of
:data:`~handbook_lib.core.parallel_layout.MESH_DIMS`, outermost first (``pp``, ``dp_replicate``,
``dp_shard``, ``sp``, ``tp``; a dimension of one rank is kept, so each name always exists), as
torchtitan's ``ParallelDims.build_mesh`` lays them out: ``tp`` innermost, contiguous ranks (one
node's). Its named sub-meshes:

- ``pp``: the pipeline's ranks (a stage's activations go to the next);

- ``tp``: the tensor-parallel group (the plan's collectives);
- ``sp``: the ranks that split each sequence (the attention core's all-to-alls or ring);
- ``fsdp``: ``dp_shard × sp`` flattened, the ranks FSDP shards over: the ranks of a sequence
  split hold the same parameters, so they shard them too (torchtitan's ``dp_shard_cp``);
- ``dp``: ``dp_replicate × dp_shard`` flattened, the ranks with their own rows of the batch.

Rank ``r`` sits at ``(((i_pp · dp_replicate + i_rep) · dp_shard + i_shard) · sp + i_sp) · tp + i_tp``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from handbook_lib.core.parallel_layout import MESH_DIMS, ParallelLayout

__all__ = ["MESH_NAMES", "LayoutMesh", "build_layout_mesh"]

MESH_NAMES: tuple[str, ...] = MESH_DIMS
"""The dimensions of the mesh :func:`build_layout_mesh` builds, outermost first."""


@dataclass(frozen=True)
class LayoutMesh:
    """A job's mesh and this rank's place on it."""

    layout: ParallelLayout
    mesh: DeviceMesh
    """Dimensions :data:`MESH_NAMES`, sizes the layout's degrees, with the flattened ``fsdp``
    and ``dp`` dimensions registered on it."""
    fsdp_flat: DeviceMesh
    """``dp_shard × sp`` flattened (1-D)."""
    dp_flat: DeviceMesh
    """``dp_replicate × dp_shard`` flattened (1-D)."""

    @property
    def tp(self) -> DeviceMesh:
        """The tensor-parallel sub-mesh (1-D, ``tp`` ranks)."""
        return self.mesh["tp"]

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """The process group of the pipeline's ranks this rank passes activations with."""
        return self.mesh.get_group("pp")

    @property
    def pp_rank(self) -> int:
        """Which pipeline rank this is (its stages: :func:`~handbook_lib.models.pipeline.rank_stages`)."""
        return self.coordinate("pp")

    @property
    def sp_group(self) -> dist.ProcessGroup:
        """The process group of the ranks that split this rank's sequences."""
        return self.mesh.get_group("sp")

    @property
    def fsdp(self) -> DeviceMesh:
        """The mesh FSDP shards over: ``fsdp`` (1-D), or (``dp_replicate``, ``fsdp``) for HSDP,
        whose replicas all-reduce what each shard group reduce-scatters."""
        if self.layout.dp_replicate == 1:
            return self.fsdp_flat
        if self.layout.sp == 1:
            return self.mesh["dp_replicate", "dp_shard"]
        with warnings.catch_warnings():  # PyTorch asks callers to keep flattened meshes; this
            warnings.simplefilter("ignore")  # 2-D one has a flattened dimension inside
            return self.mesh["dp_replicate", "fsdp"]

    def coordinate(self, dim: str) -> int:
        """This rank's index along ``dim`` (a name of :data:`MESH_NAMES`, ``fsdp`` or ``dp``)."""
        flat = {"fsdp": self.fsdp_flat, "dp": self.dp_flat}
        return flat[dim].get_local_rank() if dim in flat else self.mesh.get_local_rank(dim)

    @property
    def dp_rank(self) -> int:
        """Which data-parallel share of the global batch this rank trains on (its rows)."""
        return self.coordinate("dp")

    @property
    def sp_rank(self) -> int:
        """Which part of each sequence this rank holds (its positions)."""
        return self.coordinate("sp")

    @property
    def tp_rank(self) -> int:
        return self.coordinate("tp")

    @property
    def fsdp_rank(self) -> int:
        """This rank's index in its FSDP shard group: which shard it holds."""
        return self.coordinate("fsdp")


def build_layout_mesh(layout: ParallelLayout, device_type: str) -> LayoutMesh:
    """The mesh of ``layout`` over this job's ranks on ``device_type`` (``cpu``: gloo, ``cuda``:
    NCCL), with its flattened ``fsdp`` and ``dp`` dimensions.

    Raises:
        ValueError: if the job's world size is not the layout's.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != layout.world_size:
        raise ValueError(f"the layout spans {layout.world_size} ranks ({layout}), the job has {world}")
    sizes = tuple(getattr(layout, name) for name in MESH_NAMES)
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=MESH_NAMES)
    fsdp = mesh["dp_shard", "sp"]._flatten("fsdp")
    dp = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return LayoutMesh(layout, mesh, fsdp, dp)
