"""handbook_lib.lessons.causality: without the mask, next-token training reads the answer."""

import itertools
import math
from collections import Counter, defaultdict

import pytest
import torch

from handbook_lib.core import ModelConfig, RunConfig
from handbook_lib.lessons import (
    CAUSALITY_SETUP,
    MASK_VARIANTS,
    estimate_position_blind_loss,
    measure_causality,
    measure_future_gradient_share,
    random_batch,
)
from handbook_lib.runtime import build_model, build_optimizer, data_seed, one_thread


@pytest.fixture(scope="module")
def result():
    return measure_causality()


def test_causal_model_cannot_beat_chance_on_random_tokens(result):
    causal = result.runs["causal"]
    # Uniform random tokens: no honest model does better than ln V on average.
    assert abs(causal.final_loss() - math.log(CAUSALITY_SETUP["vocab_size"])) < 0.05
    assert causal.future_gradient_share == 0.0


def test_unmasked_model_reads_its_targets(result):
    unmasked, chance = result.runs["no mask"], math.log(CAUSALITY_SETUP["vocab_size"])
    assert unmasked.final_loss() < chance - 0.8
    # ...but it cannot see positions, so it stays above the position-blind optimum (about 2.6).
    assert unmasked.final_loss() > result.position_blind_loss - 0.1
    assert unmasked.future_gradient_share > 0.2
    # Same seed, same weights at the start: the first losses agree.
    assert unmasked.losses[0] == pytest.approx(result.runs["causal"].losses[0], abs=0.05)


def test_future_gradient_share_of_an_untrained_model():
    config = RunConfig.from_mapping({**CAUSALITY_SETUP, "steps": 1})
    inputs, targets = random_batch(config, 0)
    with one_thread():
        assert measure_future_gradient_share(build_model(config.model_config(), seed=0), inputs, targets) == 0.0
        share = measure_future_gradient_share(build_model(config.model_config(), seed=0, causal=False),
                                              inputs, targets)
    assert 0 < share < 1


def test_random_batch_is_shifted_and_seeded():
    config = RunConfig.from_mapping({"vocab_size": 50, "batch_size": 3, "seq_len": 7, "seed": 2})
    inputs, targets = random_batch(config, 4)
    assert inputs.shape == targets.shape == (3, 7)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(random_batch(config, 4)[0], inputs)
    assert not torch.equal(random_batch(config, 5)[0], inputs)


def _brute_force_position_blind_loss(v: int, t: int) -> float:
    """H(target | own token, set of the window's tokens), by enumerating every sequence whose
    T inputs are distinct (the estimate's assumption); each (sequence, position) equally likely."""
    counts: dict[tuple, Counter] = defaultdict(Counter)
    for seq in itertools.product(range(v), repeat=t + 1):
        if len(set(seq[:t])) < t:
            continue
        for pos in range(t):
            counts[(seq[pos], frozenset(seq[:t]))][seq[pos + 1]] += 1
    total = sum(sum(c.values()) for c in counts.values())
    return -sum(n * math.log(n / sum(c.values())) for c in counts.values() for n in c.values()) / total


@pytest.mark.parametrize("v, t", [(5, 2), (6, 3), (7, 4)])
def test_position_blind_loss_matches_brute_force(v, t):
    assert estimate_position_blind_loss(v, t) == pytest.approx(_brute_force_position_blind_loss(v, t), rel=1e-12)


def test_position_blind_loss_is_about_ln_t_plus_ln_v_over_t():
    assert estimate_position_blind_loss(10**6, 8) == pytest.approx(math.log(8) + math.log(10**6) / 8, abs=1e-4)
    assert estimate_position_blind_loss(128, 8) < math.log(128)


@pytest.mark.parametrize("v, t", [(5, 1), (3, 4), (10, 2.0)])
def test_position_blind_loss_rejects_bad_sizes(v, t):
    with pytest.raises(ValueError, match="vocab_size >= seq_len >= 2"):
        estimate_position_blind_loss(v, t)


def test_bad_setup_key_is_named():
    with pytest.raises(ValueError, match="stepz"):
        measure_causality({"stepz": 3})


def test_model_config_of_the_setup():
    assert RunConfig.from_mapping(CAUSALITY_SETUP).model_config() == ModelConfig(
        vocab_size=128, d_model=64, nhead=4, dim_feedforward=128, num_layers=1)


def test_the_runs_are_the_plain_loop_on_random_batches():
    """measure_causality trains through runtime.training.train; its losses and shares are, to the
    bit, those of the plain loop the lesson was written with (plain cross-entropy, gradients freed)."""
    from torch.nn import functional as F

    setup = {"steps": 4, "seed": 3}
    result = measure_causality(setup)
    config = RunConfig.from_mapping({**CAUSALITY_SETUP, **setup})
    for label, causal in MASK_VARIANTS.items():
        with one_thread():
            model = build_model(config.model_config(), seed=config.seed, causal=causal)
            optimizer = build_optimizer(model.parameters(), config.optimizer, config.lr)
            losses = []
            for step in range(config.steps):
                inputs, targets = random_batch(config, step)
                loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            share = measure_future_gradient_share(model, *random_batch(config, config.steps))
        run = result.runs[label]
        assert run.losses == losses and run.future_gradient_share == share and run.causal is causal


def test_random_batch_is_seeded_by_the_books_data_seed():
    config = RunConfig.from_mapping({"vocab_size": 50, "batch_size": 3, "seq_len": 7, "seed": 2})
    gen = torch.Generator().manual_seed(data_seed(config, 4))
    expected = torch.randint(0, 50, (3, 8), generator=gen)
    inputs, targets = random_batch(config, 4)
    assert torch.equal(inputs, expected[:, :-1]) and torch.equal(targets, expected[:, 1:])
