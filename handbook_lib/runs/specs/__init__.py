"""Each run's spec, torch-free: its config class, its ``validate``, its one-line description.

One module per run of :mod:`handbook_lib.runs`, of the same name, each ending with a
:class:`~handbook_lib.core.run_spec.RunSpec` named ``SPEC``; the run module imports its config
and checks from there (one home). These modules import only ``core``, ``models`` and the
framework-config writer at import, so the launcher, the CLI and the Slurm writer check a config
without importing torch.
"""

from __future__ import annotations

from handbook_lib.core.run_spec import RunSpec
from handbook_lib.runs.specs import (
    accelerate_fsdp,
    checkpoint_cost,
    checkpoint_resume,
    clinic,
    comm_bench,
    deepspeed_zero,
    fault,
    fsdp_train,
    hf_weights,
    pipeline,
    sequence_parallel,
    step_time,
    tensor_parallel,
    trace_step,
    trainer_deepspeed,
)

__all__ = ["SPECS"]

SPECS: dict[str, RunSpec] = {module.SPEC.name: module.SPEC for module in (
    accelerate_fsdp, checkpoint_cost, checkpoint_resume, clinic, comm_bench, deepspeed_zero, fault, fsdp_train,
    hf_weights, pipeline, sequence_parallel, step_time, tensor_parallel, trace_step, trainer_deepspeed,
)}
"""Run name -> its spec, sorted by name (a test keeps it equal to the run modules)."""
