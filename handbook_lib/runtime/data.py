"""The book's data: synthetic token sequences made in code, the same on every machine, and each
rank's share of a global batch.

Chapter 1 introduces it. Each sequence follows ``next = (3 * token + 1) mod vocab_size`` from a
random start, so the loss has something to learn and falls within a few steps. A global batch is
a function of ``(seed, step)`` alone, never of the world size: runs on any number of ranks (and
one process, :func:`handbook_lib.runtime.training.train_one_process`) see the same data.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from handbook_lib.core.config import RunConfig
from handbook_lib.runtime.distributed import RankContext

__all__ = ["BatchSource", "data_seed", "make_batch", "sequences_from", "local_slice", "local_batch"]

BatchSource = Callable[[RunConfig, int], tuple[torch.Tensor, torch.Tensor]]
"""Where a training loop's data comes from: ``(config, step) -> (inputs, targets)``, the *global*
batch of 0-based step ``step`` (token ids, int64, each (batch_size, seq_len)), a function of
``(config.seed, step)`` alone so that every rank draws the same one. :func:`make_batch` is the
book's; chapter 1's causality demonstration passes uniformly random tokens instead."""


def data_seed(config: RunConfig, step: int) -> int:
    """The seed of step ``step``'s batch: one per ``(config.seed, step)``, never repeated for
    another step (the data of every run and demonstration is drawn with it)."""
    return config.seed * 1_000_003 + step


def make_batch(config: RunConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``(inputs, targets)``, int64, each (batch_size, seq_len).

    Deterministic in ``(config.seed, step)`` and independent of the world size, so runs with any
    number of ranks see the same data.
    """
    gen = torch.Generator().manual_seed(data_seed(config, step))
    start = torch.randint(0, config.vocab_size, (config.batch_size, 1), generator=gen)
    seq = sequences_from(start, config.seq_len, config.vocab_size)
    return seq[:, :-1], seq[:, 1:]


def sequences_from(start: torch.Tensor, seq_len: int, vocab_size: int) -> torch.Tensor:
    """The book's sequences that begin with the tokens ``start`` (int64, (n, 1)): each next token
    is ``(3 * token + 1) mod vocab_size``; ``seq_len + 1`` tokens each, shape (n, seq_len + 1)."""
    tokens = [start]
    for _ in range(seq_len):
        tokens.append((3 * tokens[-1] + 1) % vocab_size)
    return torch.cat(tokens, dim=1)


def local_slice(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s equal share of a global batch (rows ``rank*b : (rank+1)*b``).

    Raises:
        ValueError: if the batch does not divide evenly across ``world_size`` ranks.
    """
    if batch.shape[0] % world_size:
        raise ValueError(
            f"batch_size={batch.shape[0]} must be divisible by the world size {world_size}"
        )
    per_rank = batch.shape[0] // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]


def local_batch(config: RunConfig, step: int, ctx: RankContext, source: BatchSource = make_batch,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(inputs, targets)`` of global batch ``step`` (0-based) drawn from ``source``,
    on the rank's device.

    Raises:
        ValueError: if the batch does not divide evenly across the ranks (see :func:`local_slice`).
    """
    inputs, targets = source(config, step)
    return (local_slice(inputs, ctx.rank, ctx.world_size).to(ctx.device),
            local_slice(targets, ctx.rank, ctx.world_size).to(ctx.device))
