"""handbook_lib.runtime.mesh and handbook_lib.runtime.axes: one mesh from a layout, each rank's
place on it, and each rank's rows and positions of a batch (a fake process group of 8 ranks)."""

import types
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from handbook_lib.core.parallel_layout import ParallelLayout
from handbook_lib.runtime.axes import layout_batches
from handbook_lib.runtime.mesh import MESH_NAMES, build_layout_mesh


def _on_rank(rank: int, world: int, layout: ParallelLayout):
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    return build_layout_mesh(layout, "cpu")


@pytest.fixture(autouse=True)
def _no_group_left():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", [ParallelLayout(dp_shard=2, sp=2, tp=2), ParallelLayout(dp_replicate=2, sp=2, tp=2),
                                    ParallelLayout(dp_replicate=2, dp_shard=2, sp=2)])
def test_every_rank_finds_its_place_as_the_layout_orders_the_axes(layout):
    for rank in range(8):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no deprecated slicing of a flattened dimension
            mesh = _on_rank(rank, 8, layout)
            fsdp = mesh.fsdp
        i_tp = rank % layout.tp
        i_sp = rank // layout.tp % layout.sp
        i_shard = rank // (layout.tp * layout.sp) % layout.dp_shard
        i_rep = rank // (layout.tp * layout.sp * layout.dp_shard)
        assert (mesh.tp_rank, mesh.sp_rank) == (i_tp, i_sp)
        assert mesh.dp_rank == i_rep * layout.dp_shard + i_shard
        assert mesh.fsdp_rank == i_shard * layout.sp + i_sp
        assert mesh.mesh.mesh_dim_names == MESH_NAMES
        want = (layout.fsdp_size,) if layout.dp_replicate == 1 else (layout.dp_replicate, layout.fsdp_size)
        assert tuple(fsdp.shape) == want


def test_a_layout_for_another_world_is_refused_in_one_line():
    with pytest.raises(ValueError, match="the layout spans 4 ranks .* the job has 8$"):
        _on_rank(0, 8, ParallelLayout(dp_shard=2, tp=2))


def test_each_rank_gets_its_rows_and_its_positions():
    layout = ParallelLayout(dp_shard=2, sp=2, tp=2)
    batch = torch.arange(4 * 8).view(4, 8)   # 4 sequences of 8 positions
    arranged, _ = layout_batches(types.SimpleNamespace(layout=layout), lambda config, step: (batch, batch))(None, 0)
    blocks = arranged.view(8, 2, 4)           # rank r's block: 2 rows x 4 positions
    for rank in range(8):
        dp, sp = rank // 4, rank // 2 % 2
        assert torch.equal(blocks[rank], batch[2 * dp:2 * dp + 2, 4 * sp:4 * sp + 4])
