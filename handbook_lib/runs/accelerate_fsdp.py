"""Train the handbook's model through Accelerate's FSDP config, and report the sharding Accelerate really applied.

Chapter 7 launches it. Each rank gets the environment ``accelerate launch`` would set for the
run config (:func:`handbook_lib.integrations.accelerate_job.launch_env`) and runs
:func:`~handbook_lib.integrations.accelerate_job.train_with_accelerate`, the ``train.py`` the
chapter shows: prepare, train in the book's loop, ``save_state``, one more step,
``load_state``, and the whole model exported. Then it reports what Accelerate built (its
distributed type, the wrapper, whether the parameters are sharded, the bytes each rank holds)
beside what was asked for.

*Verify the sharding you asked for.* Accelerate's FSDP exists for accelerator devices only
(``AcceleratorState``: the FSDP type is set for the ``MULTI_GPU`` family). On GPUs each rank's
parameter bytes are checked against FSDP2's shard
(:func:`handbook_lib.models.layout.estimate_shard_bytes`); on CPU ranks, where
``Accelerator(cpu=True)`` makes the job DDP over gloo and leaves the FSDP settings unused,
against the whole model. Either way the losses are checked against the book's own FSDP2 run of
the same config, trained first in the same job (the same gradients, averaged), ``load_state``
must restore the saved parameters exactly, and the export must hold the whole model. The run
also records the type ``Accelerator()`` sees without ``cpu=True``: ``NO`` on a CPU, where every
process trains alone.

Launch::

    python -m handbook_lib run accelerate_fsdp --nproc 2 --out runs/accel
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from handbook_lib.core.config import RunConfig
from handbook_lib.core.architecture import param_count
from handbook_lib.core.results import Check
from handbook_lib.models.layout import estimate_shard_bytes
from handbook_lib.runs.entry import RankReport, main
from handbook_lib.runs.specs.accelerate_fsdp import CONFIG as CONFIG, validate  # the spec: one home
from handbook_lib.runtime.build import parallelize
from handbook_lib.runtime.distributed import RankContext, shared_temp_dir
from handbook_lib.runtime.optimization import build_optimizer
from handbook_lib.runtime.training import train


LOSS_TOLERANCE = 1e-6
"""Relative tolerance of Accelerate's losses against the book's FSDP2 run (fp32)."""


def run(config: RunConfig, ctx: RankContext) -> RankReport:
    validate(config, ctx.world_size)
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    from handbook_lib.integrations.accelerate_job import launch_env, train_with_accelerate

    reference = parallelize(config, ctx)  # the book's own FSDP2 run of the same config
    reference_optimizer = build_optimizer(reference.parameters(), config.optimizer, config.lr, config.optimizer_impl)
    fsdp_log = train(reference, reference_optimizer, config, ctx, progress=False)
    del reference, reference_optimizer

    env = launch_env(config, ctx.world_size)
    os.environ.update(env)
    plain_type = str(PartialState().distributed_type).rsplit(".", 1)[-1]  # what Accelerator() would see
    AcceleratorState._reset_state(reset_partial_state=True)
    folder = Path(shared_temp_dir("handbook-accelerate-", ctx))
    try:
        job = train_with_accelerate(config, ctx, folder)
    finally:
        if ctx.is_main:  # the folder this run made, and nothing else
            shutil.rmtree(folder, ignore_errors=True)
    got = job.did

    shape = config.model_config()
    fsdp = ctx.device.type == "cuda"  # Accelerate's FSDP exists for accelerator devices only
    expected = estimate_shard_bytes(shape, ctx.world_size if fsdp else 1, ctx.rank if fsdp else 0).shard_bytes
    checks = [Check("param_bytes", ctx.rank, expected, got["param_bytes"], "bytes")]
    checks += [Check(f"loss_step{i + 1}_vs_fsdp2", ctx.rank, a, b, "nats", LOSS_TOLERANCE)
               for i, (a, b) in enumerate(zip(fsdp_log.losses, job.log.losses))]
    checks.append(Check("load_state_max_abs_diff", ctx.rank, 0.0, job.reload_max_abs_diff, "values"))
    if ctx.is_main:
        checks.append(Check("exported_elements", ctx.rank, param_count(shape), job.exported_elements, "elements"))
    verdict = f"asked for FSDP2 {config.strategy}; got {got['distributed_type']} ({got['wrapper']}): " + (
        "sharded" if got["sharded"] else "NOT sharded: every rank holds the whole model")
    metrics = {"losses": job.log.losses, "fsdp2_losses": fsdp_log.losses, "step_time_s": job.log.step_time_s,
               "asked": {"strategy": config.strategy, **{k: env[k] for k in sorted(env) if k.startswith("FSDP_")}},
               **got, "type_without_cpu_flag": plain_type,
               "moved_before_load": job.moved_max_abs_diff, "verdict": verdict}
    return RankReport(metrics=metrics, checks=checks, extra={"accelerate_env": env})


if __name__ == "__main__":
    main(sys.modules[__name__])
