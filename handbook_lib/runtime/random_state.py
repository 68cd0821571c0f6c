"""Every random generator a rank draws from, as state to save and restore.

Chapter 6 saves it in every checkpoint (:func:`~handbook_lib.runtime.checkpoint.save_checkpoint`):
resuming exactly needs the generators where the saved job left them, not only the weights. Each
rank's generators are its own (a rank may draw dropout masks no other rank draws), so a
checkpoint keeps one state per rank, restored only at the world size that saved it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state", "seed_generators"]


def seed_generators(seed: int, rank: int = 0) -> None:
    """Seed Python's ``random`` and NumPy's global generator from ``(seed, rank)``: each rank its
    own stream, the same in every run (their saved state, and so a checkpoint's bytes, too).
    torch's generator is the model's: :func:`~handbook_lib.runtime.model.build_model` seeds it."""
    value = (seed * 1_000_003 + rank) % 2**32
    random.seed(value)
    np.random.seed(value)


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """Every random generator this process draws from: torch's CPU generator (``cpu``), the CUDA
    generator of ``device`` when it is a GPU (``cuda``: dropout on a GPU draws from it), Python's
    ``random`` (``python``) and NumPy's global generator (``numpy``).

    Restored by :func:`set_rng_state`; saved per rank (each rank's generators are its own).
    """
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: Mapping[str, Any], device: torch.device | None = None) -> None:
    """Restore what :func:`rng_state` returned (the CUDA generator only onto a GPU ``device``).

    Raises:
        ValueError: if ``state`` lacks the CUDA generator a GPU ``device`` needs (a
            checkpoint saved on the CPU, resumed on a GPU).
    """
    gpu = device is not None and device.type == "cuda"
    if gpu and "cuda" not in state:
        raise ValueError("this checkpoint holds no CUDA generator state (saved on the CPU); "
                         "resume it on the CPU, or with restore_rng=False")
    torch.set_rng_state(state["cpu"])
    random.setstate(_python_rng(state["python"]))
    np.random.set_state(state["numpy"])
    if gpu:
        torch.cuda.set_rng_state(state["cuda"], device)


def _python_rng(state: Any) -> tuple:
    """Python's ``random`` state as ``setstate`` wants it: a pickle round trip may give lists."""
    version, internal, gauss = state
    return version, tuple(internal), gauss
