"""Train the handbook's model through Accelerate's FSDP config, and report the sharding Accelerate really applied.

Chapter 7 launches it. Each rank gets the environment ``accelerate launch`` would set for the
run config (:func:`handbook_lib.integrations.accelerate_job.launch_env`), builds ``Accelerator()`` from it,
prepares the seeded model and its optimizer, and trains in the book's loop. Then it reports what
it got — Accelerate's distributed type, the wrapper, whether the parameters are sharded, the
bytes each rank holds — beside what was asked for.

*Verify the sharding you asked for.* Each rank's parameter bytes are checked against what FSDP2
holds (:func:`handbook_lib.models.layout.estimate_shard_bytes`), and its losses against the book's own
FSDP2 run of the same config, trained first in the same job. On GPUs Accelerate applies FSDP and
the checks hold. Without a GPU, Accelerate 1.x finds no distributed backend for processes it
did not start with ``--cpu``: its distributed type is ``NO``, the model is left unwrapped, and
each process trains its own whole copy on its share of each batch. The run says so in its
``verdict`` and fails: the bytes are the whole model's and the losses part after the first step.

Launch::

    python -m handbook_lib run accelerate_fsdp --nproc 2 --out runs/accel
"""

from __future__ import annotations

import os
import sys

from handbook_lib.core.config import RunConfig
from handbook_lib.core.results import Check
from handbook_lib.models.layout import estimate_shard_bytes
from handbook_lib.runs.entry import RankReport, main
from handbook_lib.runs.specs.accelerate_fsdp import CONFIG as CONFIG, validate  # the spec: one home
from handbook_lib.runtime.build import parallelize
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.model import build_model
from handbook_lib.runtime.optimization import build_optimizer
from handbook_lib.runtime.training import train


LOSS_TOLERANCE = 1e-6
"""Relative tolerance of Accelerate's losses against the book's FSDP2 run (fp32)."""


def run(config: RunConfig, ctx: RankContext) -> RankReport:
    validate(config, ctx.world_size)
    from accelerate import Accelerator

    from handbook_lib.integrations.accelerate_job import launch_env, what_accelerate_did

    reference = parallelize(config, ctx)  # the book's own FSDP2 run of the same config
    reference_optimizer = build_optimizer(reference.parameters(), config.optimizer, config.lr, config.optimizer_impl)
    fsdp_log = train(reference, reference_optimizer, config, ctx, progress=False)
    del reference, reference_optimizer

    env = launch_env(config, ctx.world_size)
    os.environ.update(env)
    accelerator = Accelerator()
    model = build_model(config.model_config(), seed=config.seed).to(accelerator.device)
    optimizer = build_optimizer(model.parameters(), config.optimizer, config.lr, config.optimizer_impl)
    model, optimizer = accelerator.prepare(model, optimizer)
    log = train(model, optimizer, config, ctx)
    got = what_accelerate_did(accelerator, model)

    shape = config.model_config()
    # what FSDP2 would hold, beside what this rank holds: never an FSDP figure reported as measured
    checks = [Check("param_bytes", ctx.rank, estimate_shard_bytes(shape, ctx.world_size, ctx.rank).shard_bytes,
                    got["param_bytes"], "bytes")]
    checks += [Check(f"loss_step{i + 1}_vs_fsdp2", ctx.rank, a, b, "nats", LOSS_TOLERANCE)
               for i, (a, b) in enumerate(zip(fsdp_log.losses, log.losses))]
    verdict = f"asked for FSDP2 {config.strategy}; got {got['distributed_type']} ({got['wrapper']}): " + (
        "sharded" if got["sharded"] else
        "NOT distributed: each process trained its own whole copy on its share of each batch, gradients "
        "never averaged" if got["distributed_type"] == "NO" else
        "NOT sharded: every rank holds the whole model")
    metrics = {"losses": log.losses, "fsdp2_losses": fsdp_log.losses, "step_time_s": log.step_time_s,
               "asked": {"strategy": config.strategy, **{k: env[k] for k in sorted(env) if k.startswith("FSDP_")}},
               **got, "verdict": verdict}
    return RankReport(metrics=metrics, checks=checks, extra={"accelerate_env": env})


if __name__ == "__main__":
    main(sys.modules[__name__])
