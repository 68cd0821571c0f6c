"""Why a language model needs its causal mask: the seed's unmasked layer, if trained on next tokens.

Chapter 1 shows it, in an aside. The course's seed calls self-attention with no mask. Its own
loop cannot show the harm (its targets are random tokens drawn independently of its inputs, and
it fits one fixed batch), but trained as a causal language model, as its "language modeling"
loss suggests, every position would see the whole sequence, including the token it is asked to
predict. The handbook's
:class:`~handbook_lib.runtime.model.SimpleTransformer` masks attention to later positions; built with
``causal=False`` it is the seed's bidirectional variant, with the same weights.

:func:`measure_causality` trains both, from the same seed, through the book's training loop
(:func:`handbook_lib.runtime.training.train`), on next-token prediction over tokens drawn
uniformly at random (:func:`random_batch`): the next token cannot be predicted from the past, so an
honest model's loss can only fall to ln(vocab_size) nats per token. The causal model's stays
there; the unmasked model's falls far below it, because it reads the answer. The model has no
positional embedding, so the unmasked model cannot tell *which* token of the window is its
target, only that it is one of them: its loss falls toward :func:`estimate_position_blind_loss`,
about ln(seq_len), not to 0. :func:`measure_future_gradient_share` shows the leak directly:
how much of the gradient of position t's loss flows to the inputs at positions after t.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from handbook_lib.core.config import RunConfig
from handbook_lib.runtime.data import data_seed
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.model import build_model
from handbook_lib.runtime.optimization import build_optimizer
from handbook_lib.runtime.training import one_thread, train

__all__ = ["CAUSALITY_SETUP", "MASK_VARIANTS", "random_batch", "measure_future_gradient_share",
           "estimate_position_blind_loss", "CausalityRun", "CausalityResult", "measure_causality"]

CAUSALITY_SETUP: dict[str, int | float | str] = {
    "vocab_size": 128, "d_model": 64, "nhead": 4, "dim_feedforward": 128, "num_layers": 1,
    "batch_size": 32, "seq_len": 8, "steps": 300, "seed": 0, "optimizer": "adamw", "lr": 1e-2,
}
"""The run config of the demonstration (the book's vocabulary): a one-layer handbook model,
a fresh batch of 32 random sequences of 8 tokens per step (nothing to memorise), 300 steps."""

MASK_VARIANTS = {"causal": True, "no mask": False}
"""The two runs of :func:`measure_causality`: label and the model's ``causal`` flag."""


def random_batch(config: RunConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step`` of uniformly random tokens: ``(inputs, targets)``, int64, each
    (batch_size, seq_len), the targets being the inputs shifted by one (next-token prediction).

    Deterministic in ``(config.seed, step)`` (seeded by :func:`~handbook_lib.runtime.data.data_seed`,
    as the book's own batches are); every token is independent of all the others. A
    :data:`~handbook_lib.runtime.data.BatchSource` for :func:`~handbook_lib.runtime.training.train`.
    """
    gen = torch.Generator().manual_seed(data_seed(config, step))
    seq = torch.randint(0, config.vocab_size, (config.batch_size, config.seq_len + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


def measure_future_gradient_share(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Share (0-1) of the gradient that flows from each position's loss to later positions.

    For each position t, the loss at t (the mean over the batch of its cross-entropy) is
    differentiated with respect to the token embeddings of all positions; the squared norm of
    the part at positions t+1.. is summed over t and divided by the squared norm of the whole.
    With the causal mask it is exactly 0: position t's output does not depend on later inputs.

    Args:
        model: A :class:`~handbook_lib.runtime.model.SimpleTransformer` (it must have ``embedding``).
        inputs: Token ids, (batch, seq).
        targets: The next tokens, (batch, seq).
    """
    captured: list[torch.Tensor] = []
    hook = model.embedding.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        logits = model(inputs)
    finally:
        hook.remove()
    embedded = captured[0]
    future = total = 0.0
    for t in range(inputs.shape[1]):
        loss_t = F.cross_entropy(logits[:, t].float(), targets[:, t])
        (grad,) = torch.autograd.grad(loss_t, embedded, retain_graph=True)
        squares = grad.double().pow(2).sum(dim=(0, 2))  # per position
        future += float(squares[t + 1:].sum())
        total += float(squares.sum())
    return future / total


def estimate_position_blind_loss(vocab_size: int, seq_len: int) -> float:
    """The lowest expected loss (nats per token) of a model that sees the whole window of
    ``seq_len`` random tokens but not their positions, on next-token prediction.

    Such a model (the handbook's, unmasked: it has no positional embedding) knows its own token
    and the set of the window's tokens. Assuming the window's tokens are distinct: with
    probability (T-1)/T its target is one of the T-1 other tokens, equally likely; with
    probability 1/T it is the last position, whose target is a fresh token, uniform over V.
    The best prediction mixes the two; its cross-entropy is about ln T + (ln V)/T.

    Raises:
        ValueError: unless ``vocab_size`` >= ``seq_len`` >= 2.
    """
    t, v = seq_len, vocab_size
    if not (isinstance(t, int) and isinstance(v, int) and v >= t >= 2):
        raise ValueError(f"need vocab_size >= seq_len >= 2, got vocab_size={v!r}, seq_len={t!r}")
    seen = 1 / t + 1 / (t * v)  # probability given to each of the other T-1 tokens of the window
    fresh = 1 / (t * v)  # to any other token
    last = (t - 1) / v * -math.log(seen) + (1 - (t - 1) / v) * -math.log(fresh)
    return (t - 1) / t * -math.log(seen) + last / t


@dataclass(frozen=True)
class CausalityRun:
    """One of the two runs of :func:`measure_causality`."""

    label: str
    """A key of :data:`MASK_VARIANTS`."""
    causal: bool
    """Whether attention was masked."""
    losses: list[float]
    """Per step, the batch's mean next-token cross-entropy (nats per token), before the update."""
    future_gradient_share: float
    """:func:`measure_future_gradient_share` of the trained model on a batch it never saw."""
    seconds: float
    """Wall time of the run, seconds (varies from machine to machine)."""

    def final_loss(self, last: int = 20) -> float:
        """Mean loss of the last ``last`` steps (nats per token): fresh random batches make
        single steps noisy."""
        return sum(self.losses[-last:]) / len(self.losses[-last:])


@dataclass(frozen=True)
class CausalityResult:
    """The two runs and the reference losses they are read against."""

    config: RunConfig
    """The run config (model, data, optimizer)."""
    runs: dict[str, CausalityRun]
    """Keyed by :data:`MASK_VARIANTS`."""

    @property
    def chance_loss(self) -> float:
        """ln(vocab_size): the best expected loss of any model that does not see its target."""
        return math.log(self.config.vocab_size)

    @property
    def position_blind_loss(self) -> float:
        """:func:`estimate_position_blind_loss` for this config."""
        return estimate_position_blind_loss(self.config.vocab_size, self.config.seq_len)


def _train(config: RunConfig, label: str, causal: bool,
           held_out: tuple[torch.Tensor, torch.Tensor]) -> CausalityRun:
    """Train one variant through the book's training loop, in this process, on random tokens."""
    start = time.perf_counter()
    model = build_model(config.model_config(), seed=config.seed, causal=causal)
    optimizer = build_optimizer(model.parameters(), config.optimizer, config.lr, config.optimizer_impl)
    # one process, the whole batch: no process group exists
    one = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none")
    log = train(model, optimizer, config, one, progress=False, batches=random_batch)
    share = measure_future_gradient_share(model, *held_out)
    return CausalityRun(label, causal, log.losses, share, time.perf_counter() - start)


def measure_causality(setup: dict[str, int | float | str] | None = None) -> CausalityResult:
    """Train the causal model and the unmasked one, from the same seed, on random tokens.

    Args:
        setup: Run-config keys (:data:`CAUSALITY_SETUP` by default, which these update).

    Returns:
        Both runs, deterministic in the setup; about two seconds each on one CPU core.

    Raises:
        ValueError: on a bad setup key or value, as :class:`RunConfig` reports it.
    """
    config = RunConfig.from_mapping({**CAUSALITY_SETUP, **(setup or {})})
    held_out = random_batch(config, config.steps)  # a batch no step trained on
    runs = {}
    with one_thread():
        for label, causal in MASK_VARIANTS.items():
            runs[label] = _train(config, label, causal, held_out)
    return CausalityResult(config, runs)

