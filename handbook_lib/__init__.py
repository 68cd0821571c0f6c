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

from handbook_lib.core.lazy import lazy_exports

__version__ = "0.1.0"

_FIRST = {
    "ModelConfig": "core", "RunConfig": "core", "param_count": "core", "load_result": "core",
    "get_shape": "models", "model_layout": "models", "estimate_model_state_bytes": "models",
    "estimate_shard_bytes": "models", "estimate_memory": "models", "estimate_step_traffic": "models",
    "estimate_step_time": "models", "plan": "models", "torchrun": "launch", "ranks_for": "launch",
}
"""The first names of each layer a learner meets (chapters 1-4), and the layer that exports each."""

__all__ = ["__version__", *_FIRST]


__getattr__, __dir__ = lazy_exports(__name__, _FIRST)
