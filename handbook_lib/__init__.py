"""handbook_lib: the companion library of the FSDP Handbook.

A package in layers, each a folder, each importing only the ones below it (a test parses every
module to keep it so):

- ``core`` — the vocabulary: the run config, dtypes and precisions, the strategy table, the
  result shape, the launcher<->rank contract, argument checks (pure);
- ``models`` — what training costs, predicted: parameter counts, the model's layout, memory by
  phase, collectives and step time, ZeRO, checkpoints, hardware, the planner (pure);
- ``runtime`` — what a rank does: build, shard, train, measure, checkpoint (``torch``);
- ``integrations`` — Accelerate, the Transformers Trainer and DeepSpeed in the book's words;
- ``lessons`` — single-process demonstrations a chapter calls;
- ``runs`` — one ``torchrun`` entry point per experiment (``python -m handbook_lib.runs.NAME``);
- ``launch`` — starting runs on one or many nodes, Slurm, the GPU hub (no ``torch`` at import);
- ``face`` — tables, figures and the command line (``python -m handbook_lib``).

The names a learner uses first are importable from here (on first use, so ``import
handbook_lib`` loads nothing heavy)::

    from handbook_lib import ModelConfig, estimate_memory, plan, torchrun

Each module's docstring names the chapter that teaches it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from handbook_lib.core.lazy import lazy_exports

__version__ = "0.1.0"

if TYPE_CHECKING:  # the first names of each layer a learner meets (chapters 1-4), and that layer
    from handbook_lib.core import ModelConfig, RunConfig, load_result, param_count
    from handbook_lib.launch import ranks_for, torchrun
    from handbook_lib.models import (
        estimate_memory,
        estimate_model_state_bytes,
        estimate_shard_bytes,
        estimate_step_time,
        estimate_step_traffic,
        get_shape,
        model_layout,
        plan,
    )

__getattr__, __dir__, _FIRST = lazy_exports(__name__)
__all__ = ["__version__", *_FIRST]  # noqa: PLE0604 - names read from the block above
