"""A dataset shuffled every epoch and handed out by a data loader whose position is state.

Chapter 6 trains from it: a checkpoint must hold where the data stands, and for a real loader
that is not the step number but the loader's own state (the epoch's order, how far into it).
The loader is torchdata's ``StatefulDataLoader``, a drop-in ``DataLoader`` with ``state_dict()``
and ``load_state_dict()``. It hands out *global* batches, the same on every rank (each rank
takes its slice, :func:`~handbook_lib.runtime.data.local_batch`), so its state does not depend
on the world size: a job resumed on another number of ranks continues with the same batches.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset

from handbook_lib.core.config import RunConfig
from handbook_lib.runtime.data import data_seed, sequences_from

__all__ = ["SequenceDataset", "LoaderBatches"]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torchdata 0.11 calls ``torch.set_vital``, deprecated: silence that warning only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        yield


class SequenceDataset(Dataset):
    """``size`` of the book's synthetic sequences; sequence ``i`` (int64, ``seq_len + 1`` tokens)
    depends only on ``(config.seed, i)``."""

    def __init__(self, config: RunConfig, size: int) -> None:
        self.config, self.size = config, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.size:
            raise IndexError(f"sequence {index} of a dataset of {self.size}")
        gen = torch.Generator().manual_seed(data_seed(self.config, -1 - index))  # never a step's seed
        start = torch.randint(0, self.config.vocab_size, (1, 1), generator=gen)
        return sequences_from(start, self.config.seq_len, self.config.vocab_size)[0]


class LoaderBatches:
    """The global batches of a :class:`SequenceDataset` of ``dataset_size`` sequences, shuffled
    each epoch (a generator seeded from ``config.seed``), epoch after epoch.

    A :data:`~handbook_lib.runtime.data.BatchSource` (``batches(config, step)``) for the
    training loop, and a ``Stateful`` for a checkpoint: ``state_dict()`` holds the epoch, the
    batches handed out so far and the loader's own state; after ``load_state_dict`` the next
    batch is the one the saved job would have drawn next.

    Raises:
        ValueError: if ``dataset_size`` is not a positive multiple of ``config.batch_size``.
    """

    def __init__(self, config: RunConfig, dataset_size: int) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader.sampler import RandomSampler

        if dataset_size < config.batch_size or dataset_size % config.batch_size:
            raise ValueError(f"dataset_size must be a multiple of batch_size={config.batch_size} (whole "
                             f"batches per epoch), got {dataset_size}")
        self.config = config
        self.batches_per_epoch = dataset_size // config.batch_size
        dataset = SequenceDataset(config, dataset_size)
        # the order's own generator (its state is the sampler's); the loader draws a worker seed
        # from another each epoch, which must neither touch the order nor torch's global one
        order = RandomSampler(dataset, generator=torch.Generator().manual_seed(data_seed(config, -1)))
        with _quiet():
            self.loader = StatefulDataLoader(dataset, batch_size=config.batch_size, sampler=order,
                                             drop_last=True, generator=torch.Generator().manual_seed(0))
        self.epoch = 0
        """Epochs begun before the current one."""
        self.position = 0
        """Batches handed out, over all epochs: the 0-based step the next one is for."""
        self._batches: Iterator[torch.Tensor] | None = None

    def __call__(self, config: RunConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next global batch ``(inputs, targets)``, for 0-based step ``step``.

        Raises:
            RuntimeError: if ``step`` is not the loader's position (a loop that skipped or
                repeated a step would train on other data than it says).
        """
        if step != self.position:
            raise RuntimeError(f"the data loader is at batch {self.position}, but step {step} asked for one: "
                               "batches are handed out in order (restore the loader's state to resume)")
        if self._batches is None:
            self._batches = self._iterate()
        try:
            seq = next(self._batches)
        except StopIteration:  # the epoch is over: the next one, in a new order
            self.epoch += 1
            self._batches = self._iterate()
            seq = next(self._batches)
        self.position += 1
        return seq[:, :-1], seq[:, 1:]

    def _iterate(self) -> Iterator[torch.Tensor]:
        return iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "batch_size": self.config.batch_size,
                "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved ``state_dict()``.

        Raises:
            ValueError: if it was saved with another global batch size (the batches would differ).
        """
        if state["batch_size"] != self.config.batch_size:
            raise ValueError(f"the data loader's state was saved with batch_size={state['batch_size']}, this "
                             f"run has {self.config.batch_size}: its batches would not be the saved job's")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.loader.load_state_dict(state["loader"])
        self._batches = None
