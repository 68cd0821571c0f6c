"""The CUDA side of the exact byte checks, without a GPU: the caching allocator's 512-B rounding
(issue 29, S1-1 and S1-5), computed by hand for a tiny model, and measured for FSDP2 and DDP on a
fake process group with tests/storage_tracker.py, each host storage rounded as on CUDA."""

import pytest

from handbook_lib.core.config import ModelConfig
from handbook_lib.models.init_bytes import device_storage_bytes, estimate_init_bytes
from handbook_lib.models.model_state import estimate_accumulation_bytes

TINY = ModelConfig(vocab_size=1001, d_model=64, nhead=2, dim_feedforward=96, num_layers=2)
# by hand, each storage rounded up to 512 B: a layer's in_proj 192x64 (49152 B), its bias 768 B
# -> 1024, out_proj 16384, its bias 256 -> 512, linear1 and linear2 24576 each, their biases
# 384 and 256 -> 512 each, four norm vectors 256 -> 512 each
LAYER = 49152 + 1024 + 16384 + 512 + 24576 + 512 + 24576 + 512 + 4 * 512
TABLE = 501 * 512  # embedding and output weight: 1001·64·4 = 256,256 B -> 256,512
BIAS = 4096  # the output bias: 4004 B
MODEL = TABLE + 2 * LAYER + TABLE + BIAS


def test_storage_rounding():
    assert [device_storage_bytes(b, "cuda") for b in (0, 1, 512, 513)] == [0, 512, 512, 1024]
    assert device_storage_bytes(513, "cpu") == 513
    with pytest.raises(ValueError, match="device"):
        device_storage_bytes(1, "mps")


def test_unsharded_init_on_cuda_has_no_host_part():
    assert LAYER == 119296 and MODEL == 755712
    assert estimate_init_bytes(TINY, 1, "NONE", "meta", device="cuda") == MODEL
    assert estimate_init_bytes(TINY, 1, "NONE", "full", device="cuda") == MODEL
    # DDP: 751,268 B of gradients fit the first 1 MiB bucket, one storage: 1468 blocks
    assert estimate_init_bytes(TINY, 2, "DDP", "meta", device="cuda") == MODEL + 1468 * 512


def test_sharded_init_on_cuda_rounds_each_padded_shard():
    # 2 ranks: a layer's halves are 24576, 384->512, 8192, 128->512, 12288, 192->512, 12288,
    # 128->512 and four 128->512 B; the tables 501 rows, 128,256 B -> 128,512; bias 2004 -> 2048
    layer = 24576 + 512 + 8192 + 512 + 12288 + 512 + 12288 + 512 + 4 * 512
    table = 251 * 512
    held = table + 2 * layer + table + 2048
    assert estimate_init_bytes(TINY, 2, "FULL_SHARD", "meta", rank=0, device="cuda") == held
    # rank 1 holds 500 rows (128,000 B, no rounding): to_empty gives it that, then FSDP2 re-pads
    # the root's tensors at the end; the output weight's new padded storage comes while the
    # embedding is already re-padded and its own unpadded one is still alive
    unpadded = 128000 + 2 * layer + 128000 + 2048
    peak = unpadded + (table - 128000) + table
    assert estimate_init_bytes(TINY, 2, "FULL_SHARD", "meta", rank=1, device="cuda") == peak == 509952
    # full: the whole model on the GPU, then each unit's shards beside its originals; the root
    # comes last and is the largest moment: its originals, every layer's shards, its shards
    root = 2 * TABLE + BIAS
    at_root = root + 2 * layer + (2 * table + 2048)
    assert at_root > MODEL + layer  # the first layer's moment
    assert estimate_init_bytes(TINY, 2, "FULL_SHARD", "full", device="cuda") == at_root == 899072
    # the CPU prediction is unchanged: shards, the head being copied in, two mesh ids
    cpu = estimate_init_bytes(TINY, 2, "FULL_SHARD", "meta")
    assert cpu == estimate_init_bytes(TINY, 2, "FULL_SHARD", "meta", device="cpu") != held


def test_accumulated_gradients_are_rounded_per_parameter_on_cuda():
    n_bytes = 4 * (1001 * 64 + 2 * 29344 + 1001 * 64 + 1001)
    assert estimate_accumulation_bytes(TINY, "FULL_SHARD", "fp32") == n_bytes
    assert estimate_accumulation_bytes(TINY, "FULL_SHARD", "fp32", device="cuda") == MODEL
    # bf16 reduce: every storage half as large, then rounded (a layer: 24576, 384->512, 8192,
    # 128->512, 12288 twice, 192 and 128 -> 512 each, four 128 -> 512)
    layer = 24576 + 512 + 8192 + 512 + 12288 + 512 + 12288 + 512 + 4 * 512
    half = 2 * 251 * 512 + 2 * layer + 2048
    assert estimate_accumulation_bytes(TINY, "FULL_SHARD", "fp32", reduce_dtype="bf16", device="cuda") == half
    assert estimate_accumulation_bytes(TINY, "DDP", device="cuda") == 0


def test_held_between_micro_steps_on_cuda():
    from handbook_lib.models.layout import model_layout
    from handbook_lib.models.traffic import estimate_held_between_micro_steps

    units = model_layout(TINY).units()
    # gradient sync off: every unsharded gradient, one storage each, as estimate_accumulation_bytes
    grads = estimate_held_between_micro_steps(units, 2, "FULL_SHARD", device="cuda")
    assert grads == MODEL == estimate_accumulation_bytes(TINY, "FULL_SHARD", "fp32", device="cuda")
    assert estimate_held_between_micro_steps(units, 2, "FULL_SHARD") == 4 * (2 * 64064 + 2 * 29344 + 1001)
    # gradients reduce-scattered each micro-step, parameters kept gathered: each parameter's
    # padded all-gather output (vocab 1001 -> 1002 rows on 2 ranks: 256,512 B, exactly 501
    # blocks; the output bias 4008 B -> 4096; a layer's tensors are even, as LAYER above)
    kept = estimate_held_between_micro_steps(units, 2, "FULL_SHARD", sync_every_micro_step=True,
                                             reshard_after_backward=False, device="cuda")
    assert kept == 501 * 512 + 2 * LAYER + 501 * 512 + 4096
    with pytest.raises(ValueError, match="device"):
        estimate_held_between_micro_steps(units, 2, "FULL_SHARD", device="tpu")


def test_ddp_buckets_are_grouped_as_torch_groups_them():
    """The bucket rounding needs DDP's grouping: check it against torch's own assignment
    (``_compute_bucket_assignment_by_size``, reverse order, 1 MiB then 25 MiB caps)."""
    import torch
    import torch.distributed as dist

    from handbook_lib.core.config import RunConfig
    from handbook_lib.models.init_bytes import DDP_BUCKET_CAPS, _ddp_bucket_bytes
    from handbook_lib.models.layout import model_layout

    assert DDP_BUCKET_CAPS == (dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 1024 * 1024)
    shapes = [shape for _, shape in model_layout(RunConfig().model_config()).tensors]
    tensors = [torch.empty(shape, device="meta") for shape in shapes]
    groups, _ = dist._compute_bucket_assignment_by_size(
        tensors, list(DDP_BUCKET_CAPS), [False] * len(tensors), list(reversed(range(len(tensors)))))
    assert len(groups) > 1  # the default model fills more than one bucket
    expected = sum(device_storage_bytes(sum(4 * tensors[i].numel() for i in g), "cuda") for g in groups)
    assert _ddp_bucket_bytes([4 * t.numel() for t in tensors]) == expected


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("init", ["meta", "full"])
def test_init_peak_as_fsdp2_makes_it(rank, init):
    """The GPU-side peak, measured: FSDP2 on a fake 2-rank process group in this process, under
    a ``StorageTracker`` (tests/storage_tracker.py) that counts every live storage the ops make,
    rounded as on CUDA, and takes the largest total on the host after any op. ``meta``:
    ``to_empty`` (rank 1 holds 500 of the tables' 501 rows, so FSDP2 re-pads its root tensors:
    the transient of S1-1). ``full``: ``fully_shard`` of a model already there (on CUDA it was
    built on the host and moved)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from handbook_lib.runtime.build import apply_fsdp2
    from handbook_lib.runtime.model import SimpleTransformer, TransformerLayer
    from tests.storage_tracker import StorageTracker

    dist.init_process_group("fake", rank=rank, world_size=2, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,))
        with torch.device("meta" if init == "meta" else "cpu"):
            model = SimpleTransformer(TINY)
        units = [m for m in model.modules() if isinstance(m, TransformerLayer)]
        if init == "meta":
            apply_fsdp2(model, mesh, units=units)
        tracker = StorageTracker(lambda n: device_storage_bytes(n, "cuda"))
        with tracker:
            if init == "meta":
                model.to_empty(device="cpu")
            else:
                apply_fsdp2(model, mesh, units=units)
        total = tracker.peak("cpu")
    finally:
        dist.destroy_process_group()
    assert total == estimate_init_bytes(TINY, 2, "FULL_SHARD", init, rank=rank, device="cuda")


def test_ddp_init_peak_as_ddp_makes_it():
    """DDP's replica and its buckets, measured as above on a fake 2-rank group (the model is
    built on the meta device inside the tracker; only the host's storages are read)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from handbook_lib.runtime.model import SimpleTransformer
    from tests.storage_tracker import StorageTracker

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        tracker = StorageTracker(lambda n: device_storage_bytes(n, "cuda"))
        with tracker:
            with torch.device("meta"):
                model = SimpleTransformer(TINY)
            model.to_empty(device="cpu")
            DistributedDataParallel(model, init_sync=False)
        total = tracker.peak("cpu")
    finally:
        dist.destroy_process_group()
    assert total == estimate_init_bytes(TINY, 2, "DDP", "meta", device="cuda") == MODEL + 1468 * 512


def test_accumulated_gradients_as_fsdp2_keeps_them():
    """S1-5 measured: with gradient sync off, FSDP2 on a fake 2-rank group keeps one unsharded
    gradient storage per parameter after backward; rounded as on CUDA, they are the prediction.
    Measured with a ``StorageTracker`` (tests/storage_tracker.py) given the sharded parameters
    and buffers first: the rounded bytes of the live host storages after one forward and
    backward, less those before (the all-gather buffers FSDP2 has resized to 0 count 0)."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from handbook_lib.runtime.build import apply_fsdp2
    from handbook_lib.runtime.model import SimpleTransformer, TransformerLayer
    from tests.storage_tracker import StorageTracker

    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,))
        with torch.device("meta"):
            model = SimpleTransformer(TINY)
        apply_fsdp2(model, mesh, units=[m for m in model.modules() if isinstance(m, TransformerLayer)])
        model.to_empty(device="cpu")
        for param in model.parameters():
            torch.nn.init.normal_(param.to_local(), std=0.02)
        model.set_requires_gradient_sync(False)
        tracker = StorageTracker(lambda n: device_storage_bytes(n, "cuda"))
        tracker.track(*model.parameters(), *model.buffers())
        with tracker, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FSDP2's note on the head's view output
            start = tracker.current("cpu")
            model(torch.randint(0, 1001, (2, 16))).pow(2).mean().backward()
            held = tracker.current("cpu") - start
    finally:
        dist.destroy_process_group()
    assert held == estimate_accumulation_bytes(TINY, "FULL_SHARD", "fp32", device="cuda") == MODEL
