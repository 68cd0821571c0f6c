"""Train a Transformers model with the Trainer and DeepSpeed ZeRO, save it whole, load it back, and resume.

Chapter 7 launches it. The Trainer gets :func:`handbook_lib.integrations.frameworks.trainer_deepspeed_args`
(the run config as ``TrainingArguments`` and a DeepSpeed config) and a GPT-2 built from the run
config (:mod:`handbook_lib.integrations.hf_trainer`). The run then checks three promises:

1. **A whole model comes out.** After ``steps`` steps, ``save_model`` writes the weights
   gathered into one file (ZeRO-3: ``stage3_gather_16bit_weights_on_model_save``), and
   ``from_pretrained``, in a plain Python process started for it, gives the logits of the
   trained model, bit for bit.
2. **Resume is exact.** A second Trainer resumes from ``checkpoint-<save_every>`` and its
   losses for the remaining steps equal the first one's.
3. **The job is what it claims to be.** The Trainer's world size must be the job's, and under
   ZeRO-3 each rank holds its partition of every parameter, ``⌈numel / N⌉`` elements
   (DeepSpeed pads each tensor to a multiple of the ranks). On ranks without a GPU the Trainer
   is given a DeepSpeed state over gloo (:func:`~handbook_lib.integrations.hf_trainer.deepspeed_state_over_gloo`);
   without it, Accelerate counts one process and DeepSpeed's batch check stops the job.

Launch::

    python -m handbook_lib run trainer_deepspeed --nproc 2 --set trainer_dir=runs/trainer --out runs/t
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import torch

from handbook_lib.core.results import Check
from handbook_lib.core.strategies import get_strategy
from handbook_lib.runs.entry import RankReport, main
from handbook_lib.runs.specs.trainer_deepspeed import CONFIG as CONFIG, TrainerRunConfig, validate
from handbook_lib.runtime.distributed import RankContext


def run(config: TrainerRunConfig, ctx: RankContext) -> RankReport:
    validate(config, ctx.world_size)
    from transformers import TrainingArguments

    from handbook_lib.integrations.frameworks import trainer_deepspeed_args
    from handbook_lib.integrations.hf_trainer import (
        RecordingTrainer,
        SyntheticLM,
        build_gpt2,
        deepspeed_state_over_gloo,
        probe_logits_on_cpu,
        zero3_partition_elements,
    )
    from handbook_lib.integrations.zero_engine import import_deepspeed

    deepspeed = import_deepspeed()
    folder = Path(config.trainer_dir)

    def own_state() -> dict:  # the Trainer's own on a GPU; a fresh one over gloo on CPU ranks
        return deepspeed_state_over_gloo() if ctx.device.type != "cuda" else {}

    numels = [p.numel() for p in build_gpt2(config).parameters()]  # tied: the embedding once

    common = dict(output_dir=str(folder), save_strategy="steps", save_steps=config.save_every, logging_steps=1,
                  report_to=[], seed=config.seed, data_seed=config.seed, disable_tqdm=not ctx.is_main,
                  dataloader_drop_last=True, **trainer_deepspeed_args(config, ctx.world_size))
    first = RecordingTrainer(model=build_gpt2(config), args=TrainingArguments(**common, **own_state()),
                             train_dataset=SyntheticLM(config))
    state = first.accelerator.state
    first.train()
    held = zero3_partition_elements(first.model)
    final = folder / "final"
    first.save_model(str(final))
    with deepspeed.zero.GatheredParameters(list(first.model.parameters())):  # whole again (ZeRO-3)
        trained = probe_logits_on_cpu(first.model, config)  # CPU against the CPU, on any device
    losses = first.step_losses()

    second = RecordingTrainer(model=build_gpt2(config), args=TrainingArguments(**common, **own_state()),
                              train_dataset=SyntheticLM(config))
    second.train(resume_from_checkpoint=str(folder / f"checkpoint-{config.save_every}"))
    resumed = second.step_losses()

    checks = [Check("trainer_world_size", ctx.rank, ctx.world_size, first.args.world_size, "processes")]
    if get_strategy(config.strategy).shards_params:  # ZeRO-3: each tensor's partition, padded to N
        checks.append(Check("param_elements", ctx.rank, sum(math.ceil(n / ctx.world_size) for n in numels), held,
                            "elements"))
    checks += [Check(f"resumed_loss_step{config.save_every + i + 1}", ctx.rank, a, b, "nats")
               for i, (a, b) in enumerate(zip(losses[config.save_every:], resumed))]
    checks.append(Check("resumed_steps", ctx.rank, config.steps - config.save_every, len(resumed), "steps"))
    metrics = {"losses": losses, "resumed_losses": resumed, "distributed_type": str(state.distributed_type),
               "trainer_world_size": first.args.world_size}
    if ctx.is_main:  # a plain process loads the saved model, as any user would
        logits_file = folder / "probe_logits.pt"
        torch.save(trained, logits_file)
        plain = subprocess.run([sys.executable, "-m", "handbook_lib.integrations.hf_trainer", str(final),
                                str(logits_file), json.dumps(config.to_dict())],
                               capture_output=True, text=True, check=True)
        diff = json.loads(plain.stdout.strip().splitlines()[-1])["max_abs_diff"]
        checks.append(Check("from_pretrained_logits_max_abs_diff", ctx.rank, 0.0, diff, "logit"))
        metrics["saved_files"] = sorted(p.name for p in final.iterdir())
    return RankReport(metrics=metrics, checks=checks)


if __name__ == "__main__":
    main(sys.modules[__name__])
