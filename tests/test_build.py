"""handbook_lib.runtime.build: built once on the meta device, wrapped once, the same weights.

Single-process checks (a gloo group of one rank); the multi-rank runs of
``tests/test_runs_fsdp_train.py`` and the notebooks check the losses of every strategy.
"""

import pytest
import torch
import torch.distributed as dist

from handbook_lib.core import RunConfig
from handbook_lib.runtime import (
    RankContext,
    SeededInit,
    build_model,
    check_runnable,
    measure_init_bytes,
    parallelize,
    seeded_parts,
)

SMALL = {"vocab_size": 101, "d_model": 32, "nhead": 2, "dim_feedforward": 48, "num_layers": 3, "seed": 7}


@pytest.fixture(scope="module")
def ctx():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    finally:
        dist.destroy_process_group()


def _reference(config: RunConfig) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in build_model(config.model_config(), seed=config.seed).state_dict().items()}


def _full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's parameters by their plain names, gathered where sharded."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    if isinstance(model, FSDP1):
        with FSDP1.summon_full_params(model):
            return _full_weights(model.module)
    out = {}
    for name, p in model.named_parameters():
        plain = ".".join(x for x in name.split(".") if x not in ("_checkpoint_wrapped_module", "module",
                                                                    "_fsdp_wrapped_module"))
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[plain] = value.detach().clone()
    return out


def test_seeded_parts_replay_build_model_exactly():
    config = RunConfig(**SMALL)
    reference = _reference(config)
    torch.manual_seed(12345)  # the caller's generator must not matter, nor be changed
    before = torch.get_rng_state()
    parts = {f"{name}.{k}": v for name, part in seeded_parts(config) for k, v in part.state_dict().items()}
    assert torch.equal(torch.get_rng_state(), before)
    assert parts.keys() == reference.keys()
    assert all(torch.equal(parts[k], reference[k]) for k in reference)


@pytest.mark.parametrize("overrides", [
    {"strategy": "NONE"},
    {"strategy": "NONE", "activation_checkpointing": True},
    {"strategy": "DDP"},
    {"strategy": "FULL_SHARD"},
    {"strategy": "SHARD_GRAD_OP", "activation_checkpointing": True},
    {"strategy": "FULL_SHARD", "wrap": "model"},
    {"strategy": "FULL_SHARD", "cpu_offload": True},
    {"strategy": "FULL_SHARD", "api": "fsdp1"},
    {"strategy": "NO_SHARD", "api": "fsdp1", "activation_checkpointing": True},
])
def test_meta_build_gives_the_seeded_weights(ctx, overrides):
    """Every wrapper, materialised from the meta device, holds exactly build_model's weights,
    and so does the full build."""
    config = RunConfig(**SMALL, **overrides)
    reference = _reference(config)
    for init in ("meta", "full"):
        weights = _full_weights(parallelize(config, ctx, init=init))
        assert weights.keys() == reference.keys(), init
        assert all(torch.equal(weights[k], reference[k]) for k in reference), (init, overrides)
        assert not any(w.is_meta for w in weights.values())


def test_seeded_init_holds_only_parts_asked_for_out_of_order():
    """FSDP1 fills layers before the root's embedding: the embedding waits, layers pass."""
    config = RunConfig(**SMALL)
    reference = _reference(config)
    init = SeededInit(config)
    with torch.device("meta"):
        from handbook_lib.runtime import SimpleTransformer
        model = SimpleTransformer(config.model_config())
    model.to_empty(device="cpu")
    init.fill_module("layers.1.linear1", model.get_submodule("layers.1.linear1"))
    assert sorted(init._built) == ["embedding", "layers.0", "layers.1"]  # built in order, held
    layer1 = [n for n, _ in model.named_modules() if n.startswith("layers.1.") and n != "layers.1.linear1"]
    for name in layer1:
        init.fill_module(name, model.get_submodule(name))
    assert sorted(init._built) == ["embedding", "layers.0"]  # layers.1 done, so dropped
    with pytest.raises(KeyError, match="belongs to no part"):
        init._take("nonsense.weight")
    for name, module in model.named_modules():
        if not name.startswith("layers.1"):
            init.fill_module(name, module)
    assert init._built == {}
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())


def test_check_runnable_names_what_each_api_accepts():
    assert check_runnable(RunConfig(strategy="NO_SHARD", api="fsdp1"), 2).name == "NO_SHARD"
    with pytest.raises(ValueError, match=r"not available with api='fsdp2'; accepted: SHARD_GRAD_OP, FULL_SHARD"):
        check_runnable(RunConfig(strategy="NO_SHARD"), 2)
    with pytest.raises(ValueError, match="one plain process; got 2 ranks"):
        check_runnable(RunConfig(strategy="NONE"), 2)


def test_init_bytes_of_one_process_count_the_whole_model(ctx):
    """On one rank nothing is sharded: the full build holds the model (4 bytes per parameter),
    the meta build the model plus the part being copied in."""
    from handbook_lib.core import param_count

    config = RunConfig(**SMALL, strategy="NONE")
    full_bytes = 4 * param_count(config.model_config())
    _, full = measure_init_bytes(config, ctx, "full")
    _, meta = measure_init_bytes(config, ctx, "meta")
    assert full == full_bytes
    largest_part = 4 * max(sum(p.numel() for p in part.parameters()) for _, part in seeded_parts(config))
    assert meta == full_bytes + largest_part
