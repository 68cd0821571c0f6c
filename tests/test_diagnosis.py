"""handbook_lib.runtime.diagnosis: each diagnosis on the failing and the fixed case, on one rank.

The process holds a gloo group of one rank, so FSDP2 and FSDP1 wrap for real; what needs two
ranks (a norm of the local shard only) is checked by the clinic's run (tests/test_runs_clinic.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from handbook_lib.core.architecture import ModelConfig, param_count, param_shapes
from handbook_lib.runtime.diagnosis import (
    Finding,
    diagnose_accumulation,
    diagnose_grad_norm,
    diagnose_tied_weights,
    diagnose_wrapping,
    repeated_block,
)
from handbook_lib.runtime.model import TransformerLayer, build_model

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")

SMALL = ModelConfig(vocab_size=64, d_model=16, nhead=2, dim_feedforward=32, num_layers=3)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _sharded(mesh, layers: bool = True) -> nn.Module:
    model = build_model(SMALL, seed=0)
    if layers:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _backward(model: nn.Module) -> None:
    tokens = torch.randint(0, SMALL.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()


def test_repeated_block_names_the_layer_class_and_its_count():
    assert repeated_block(build_model(SMALL)) == ("TransformerLayer", 3)
    assert repeated_block(nn.Sequential(nn.Linear(2, 2))) is None  # one block: nothing repeats
    assert repeated_block(nn.Linear(2, 2)) is None


def test_repeated_block_sees_through_fsdp2s_class(mesh):
    model = _sharded(mesh)
    assert type(model.layers[0]).__name__ == "FSDPTransformerLayer"
    assert repeated_block(model) == ("TransformerLayer", 3)


def test_one_unit_for_the_whole_model_is_found_and_per_layer_units_are_not(mesh):
    finding = diagnose_wrapping(_sharded(mesh, layers=False))
    assert isinstance(finding, Finding) and finding.kind == "one_unit"
    assert (finding.measured, finding.healthy, finding.unit) == (1, 4, "units")
    assert f"all {param_count(SMALL):,} parameters" in finding.message
    assert "wrap each TransformerLayer (3 of them)" in finding.message and "\n" not in finding.message
    assert diagnose_wrapping(_sharded(mesh)) is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        finding.measured = 2


def test_wrapping_is_diagnosed_before_wrapping_from_the_units_a_policy_chose():
    model = build_model(SMALL)
    assert diagnose_wrapping(model, units=[]).kind == "one_unit"
    assert diagnose_wrapping(model, units=list(model.layers)) is None
    assert diagnose_wrapping(model) is None  # not wrapped, no units given: nothing to say
    assert diagnose_wrapping(nn.Linear(4, 4), units=[]) is None  # one block: one unit is right


def test_fsdp1_units_are_read_too(mesh):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = FSDP1(build_model(SMALL), device_id=torch.device("cpu"))
        layered = FSDP1(build_model(SMALL), device_id=torch.device("cpu"), auto_wrap_policy=policy)
    assert diagnose_wrapping(one).message.startswith(f"one FSDP unit holds all {param_count(SMALL):,}")
    assert diagnose_wrapping(layered) is None


def _tied():
    model = build_model(SMALL)
    model.output.weight = model.embedding.weight
    return model


def test_tied_weights_in_two_units_are_found_before_wrapping():
    model = _tied()
    finding = diagnose_tied_weights(model, [model.embedding, model.output, *model.layers])
    assert finding.kind == "tied_weights_split" and (finding.measured, finding.healthy) == (2, 1)
    assert "embedding.weight and output.weight are one tensor" in finding.message
    assert "units embedding and output" in finding.message
    assert "fully_shard([embedding, output])" in finding.message
    assert diagnose_tied_weights(model, ["embedding", "output"]).kind == "tied_weights_split"  # by name
    assert diagnose_tied_weights(model, ["embedding"]).message.count("root") >= 1  # one in the root
    assert diagnose_tied_weights(model, list(model.layers)) is None  # both left to the root
    untied = build_model(SMALL)
    assert diagnose_tied_weights(untied, [untied.embedding, untied.output]) is None


def test_the_tie_is_lost_once_fsdp2_wraps_the_two_units(mesh):
    """What the diagnosis warns of: after wrapping, one tensor more than the tied model has."""
    model = _tied()
    assert len(list(model.parameters())) == len(param_shapes(SMALL)) - 1
    for module in (model.embedding, model.output):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert model.output.weight is not model.embedding.weight
    assert len(list(model.parameters())) == len(param_shapes(SMALL))


def _whole_norm(model: nn.Module) -> float:
    return math.sqrt(sum(float(p.grad.full_tensor().double().norm()) ** 2 for p in model.parameters()))


def test_the_whole_norm_is_healthy_and_another_is_not(mesh):
    model = _sharded(mesh)
    _backward(model)
    whole = _whole_norm(model)
    assert diagnose_grad_norm(model, whole) is None
    assert diagnose_grad_norm(model, whole * (1 + 1e-6)) is None  # within rtol
    finding = diagnose_grad_norm(model, whole / 2)
    assert finding.kind == "grad_norm_mismatch" and finding.unit == "norm"
    assert finding.measured == whole / 2 and finding.healthy == pytest.approx(whole, rel=1e-12)
    plain = build_model(SMALL, seed=0)
    _backward(plain)
    plain_norm = math.sqrt(sum(float(p.grad.double().norm()) ** 2 for p in plain.parameters()))
    assert plain_norm == pytest.approx(whole, rel=1e-5)  # one rank: the same gradient
    assert diagnose_grad_norm(plain, plain_norm) is None
    assert diagnose_grad_norm(build_model(SMALL), 1.0) is None  # no gradient yet


def test_unsharded_gradients_held_with_sync_off_are_found_and_counted(mesh):
    model = _sharded(mesh)
    model.set_requires_gradient_sync(False)
    _backward(model)
    finding = diagnose_accumulation(model)
    assert finding.kind == "unsharded_grads_held"
    assert (finding.measured, finding.healthy, finding.unit) == (4 * param_count(SMALL), 0, "bytes")
    assert f"{4 * param_count(SMALL):,} bytes of unsharded gradients" in finding.message
    synced = _sharded(mesh)
    _backward(synced)
    assert diagnose_accumulation(synced) is None
    assert diagnose_accumulation(_sharded(mesh)) is None  # nothing accumulated yet


def test_accumulation_refuses_fsdp1(mesh):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FSDP1(build_model(SMALL), device_id=torch.device("cpu"))
    with pytest.raises(TypeError, match="reads FSDP2's units"):
        diagnose_accumulation(model)
