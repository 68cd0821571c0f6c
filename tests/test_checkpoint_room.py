"""handbook_lib.runtime.checkpoint_room: a save that would not fit is refused before it writes."""

from __future__ import annotations

import resource
import shutil
from collections import namedtuple

import pytest
import torch

from handbook_lib.core import RunConfig
from handbook_lib.runtime import CheckpointError, build_model, build_optimizer, make_batch, save_checkpoint
from handbook_lib.runtime.checkpoint_room import ITEM_BYTES, check_room, local_state_size

SHAPES = [{"vocab_size": 1001, "d_model": 64, "nhead": 2, "dim_feedforward": 96, "num_layers": 2},
          {"vocab_size": 50, "d_model": 16, "nhead": 2, "dim_feedforward": 16, "num_layers": 1}]


def _trained(shape):
    config = RunConfig.from_mapping(shape)
    model = build_model(config.model_config())
    opt = build_optimizer(model.parameters(), "adamw", 1e-3)
    inputs, targets = make_batch(config, 0)
    torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    opt.step()
    return model, opt


def _state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from handbook_lib.runtime import rng_state

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "rng": {"rank0": rng_state()}}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_estimate_covers_the_file_within_two_percent(shape, tmp_path):
    model, opt = _trained(shape)
    import pickle
    import random

    import numpy as np

    state = _state(model, opt)
    data, items = local_state_size(state)
    tensors = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 + sum(
        4 for _ in model.parameters()) + torch.get_rng_state().numel()  # + AdamW's step scalars, the RNG
    # the hyperparameters and the parameters' names: DCP pickles each value as its own item
    hyper = sum(len(pickle.dumps(v)) for v in state["optim"]["param_groups"][0].values())
    others = len(pickle.dumps(random.getstate())) + len(pickle.dumps(np.random.get_state()))
    assert data == tensors + hyper + others
    from handbook_lib.runtime import checkpoint_items
    saved = save_checkpoint(tmp_path, 1, model, opt)
    written = saved.files["__0_0.distcp"]
    assert checkpoint_items(saved.path)["__0_0.distcp"][0] == items  # DCP's items, counted alike
    estimate = data + ITEM_BYTES * items
    assert written <= estimate <= written * 1.02 + 4096, (written, estimate)


def test_a_file_size_limit_refuses_the_save_in_one_line(tmp_path):
    model, opt = _trained(SHAPES[0])
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        with pytest.raises(CheckpointError, match=r"^cannot save step_000001: rank 0 would write about [\d,]+ B "
                           r"into one file, over the file-size limit of 100,000 B \(ulimit -f\); nothing was "
                           r"written, the previous checkpoint is still latest$"):
            save_checkpoint(tmp_path / "ck", 1, model, opt)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert not (tmp_path / "ck").exists()  # not even the folder


def test_a_full_disk_refuses_the_save(tmp_path, monkeypatch):
    model, opt = _trained(SHAPES[1])
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(CheckpointError, match=r"it needs about [\d,]+ B and .* has 1,000 B free"):
        check_room(tmp_path / "not" / "yet", "step_000003", _state(model, opt))


def test_a_stateful_part_counts_as_its_state_dict():
    from handbook_lib.runtime import LoaderBatches

    config = RunConfig.from_mapping({"batch_size": 4, "seq_len": 8, "vocab_size": 50})
    loader = LoaderBatches(config, 8)
    loader(config, 0)
    assert local_state_size({"data": loader}) == local_state_size({"data": loader.state_dict()})
    assert local_state_size({"data": loader})[0] > 5000  # its sampler's generator: 5,056 B of state
