"""handbook_lib.runtime.data_loader: a shuffled dataset whose loader's position is state."""

from __future__ import annotations

import copy

import pytest
import torch

from handbook_lib.core import RunConfig
from handbook_lib.runtime.data_loader import LoaderBatches, SequenceDataset

CONFIG = RunConfig.from_mapping({"batch_size": 4, "seq_len": 8, "vocab_size": 50, "steps": 12})


def _firsts(batches: list[torch.Tensor]) -> list[list[int]]:
    return [b[:, 0].tolist() for b in batches]


def test_each_epoch_is_the_whole_dataset_in_a_new_order():
    loader = LoaderBatches(CONFIG, 12)
    drawn = [loader(CONFIG, step)[0] for step in range(9)]  # 3 epochs of 3 batches
    every = {tuple(SequenceDataset(CONFIG, 12)[i][:-1].tolist()) for i in range(12)}
    epochs = [torch.cat(drawn[k:k + 3]) for k in (0, 3, 6)]
    for epoch in epochs:
        assert {tuple(row.tolist()) for row in epoch} == every  # each sequence once
    assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[1], epochs[2])
    assert loader.epoch == 2 and loader.position == 9


def test_targets_are_the_inputs_shifted_by_one():
    inputs, targets = LoaderBatches(CONFIG, 8)(CONFIG, 0)
    assert inputs.shape == targets.shape == (4, 8)
    assert torch.equal(targets[:, :-1], inputs[:, 1:])
    assert torch.equal(targets, (3 * inputs + 1) % 50)


@pytest.mark.parametrize("stop", range(12))
def test_a_restored_loader_continues_with_the_saved_jobs_batches(stop):
    """At every position, mid-epoch and at an epoch's end: the next batches are those an
    uninterrupted loader hands out, and torch's global generator is not touched."""
    uninterrupted = LoaderBatches(CONFIG, 12)
    expected = [uninterrupted(CONFIG, step)[0] for step in range(12)]
    saved = LoaderBatches(CONFIG, 12)
    for step in range(stop):
        saved(CONFIG, step)
    state = copy.deepcopy(saved.state_dict())
    before = torch.get_rng_state()
    restored = LoaderBatches(CONFIG, 12)
    restored.load_state_dict(state)
    assert _firsts([restored(CONFIG, step)[0] for step in range(stop, 12)]) == _firsts(expected[stop:])
    assert torch.equal(torch.get_rng_state(), before)


def test_a_fresh_loader_without_the_state_would_repeat_the_first_batches():
    """Why the state matters: the step number alone does not say where a shuffled loader is."""
    saved = LoaderBatches(CONFIG, 12)
    for step in range(4):
        saved(CONFIG, step)
    fresh = LoaderBatches(CONFIG, 12)
    with pytest.raises(RuntimeError, match="the data loader is at batch 0, but step 4 asked for one"):
        fresh(CONFIG, 4)


def test_bad_sizes_and_another_batch_size_are_refused():
    with pytest.raises(ValueError, match="dataset_size must be a multiple of batch_size=4"):
        LoaderBatches(CONFIG, 10)
    other = RunConfig.from_mapping({"batch_size": 2, "seq_len": 8, "vocab_size": 50})
    with pytest.raises(ValueError, match="saved with batch_size=4, this run has 2"):
        LoaderBatches(other, 12).load_state_dict(LoaderBatches(CONFIG, 12).state_dict())
    with pytest.raises(IndexError):
        SequenceDataset(CONFIG, 3)[3]
