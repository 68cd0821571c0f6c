"""Non-finite numbers never pass silently: refused in the config, and a NaN loss stops training.

In one process; the table of bad inputs (``tests/bad_inputs_runs.py``) launches the same
divergence on 2 ranks and checks the CLI's exit code 1.
"""

import math
import re

import pytest
import torch

from handbook_lib.core import RunConfig
from handbook_lib.runs.fault import FaultConfig
from handbook_lib.runtime import (
    NonFiniteLoss,
    RankContext,
    build_model,
    build_optimizer,
    check_loss_finite,
    train,
)


@pytest.mark.parametrize("key, value", [
    ("lr", "inf"), ("lr", "nan"), ("lr", "-inf"), ("lr", "Infinity"), ("lr", "1e400"), ("lr", math.inf),
    ("grad_scale_init", "nan"), ("grad_scale_init", math.inf),
])
def test_non_finite_config_values_are_refused_naming_the_key(key, value):
    """Typed as text (a ``--set``), the message echoes the text and the key's range; as a float,
    the key and the value."""
    expected = (rf"^--set {key}={re.escape(value)}: {key} takes a finite number > 0$" if isinstance(value, str)
                else rf"^config key '{key}' must be a finite number, got (-?inf|nan)$")
    with pytest.raises(ValueError, match=expected):
        RunConfig.from_mapping({key: value})


def test_every_float_key_of_every_config_is_checked():
    with pytest.raises(ValueError, match="config key 'sleep_s' must be a finite number"):
        FaultConfig(sleep_s=math.nan)
    assert RunConfig.from_mapping({"lr": "1e-2"}).lr == 0.01  # finite values still parse


def test_a_diverging_run_stops_at_the_first_nan_loss_naming_step_and_rank():
    config = RunConfig(vocab_size=50, d_model=32, nhead=2, dim_feedforward=64, num_layers=1,
                       batch_size=4, seq_len=8, steps=6, lr=1e6)
    model = build_model(config.model_config(), seed=0)
    ctx = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(NonFiniteLoss, match=r"^loss is nan at step 2 on rank 0: training diverged \(lr too large\?"):
        train(model, build_optimizer(model.parameters(), "adamw", config.lr), config, ctx, progress=False)


def test_check_loss_finite():
    check_loss_finite(2.5, 1, 0)
    with pytest.raises(NonFiniteLoss, match="^loss is inf at step 7 on rank 3:"):
        check_loss_finite(math.inf, 7, 3)
    with pytest.raises(NonFiniteLoss, match="^loss is nan on rank 0:"):  # no step known, no process group
        check_loss_finite(math.nan)
    assert issubclass(NonFiniteLoss, FloatingPointError)


def test_a_custom_loss_function_s_reported_loss_is_the_one_checked():
    """With a loss function, the reported loss is what train logs and checks: a NaN there stops
    the run at its step (1-based), even though the loss backpropagated is finite."""
    from torch.nn import functional as F

    config = RunConfig(vocab_size=50, d_model=32, nhead=2, dim_feedforward=64, num_layers=1,
                       batch_size=4, seq_len=8, steps=6)
    calls = []

    def loss_fn(logits, targets):
        calls.append(1)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return loss, loss.detach() if len(calls) < 3 else torch.tensor(math.nan)

    model = build_model(config.model_config(), seed=0)
    ctx = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none")
    with pytest.raises(NonFiniteLoss, match=r"^loss is nan at step 3 on rank 0:"):
        train(model, build_optimizer(model.parameters(), "adamw", config.lr), config, ctx, progress=False,
              loss_fn=loss_fn)
