"""handbook_lib.models.lr_schedule and the scheduler the training loop steps."""

from __future__ import annotations

import pytest
import torch

from handbook_lib.core import LR_SCHEDULES, RunConfig
from handbook_lib.models import lr_factor
from handbook_lib.runtime import (
    RankContext,
    build_lr_scheduler,
    build_model,
    build_optimizer,
    train,
    train_one_process,
)

transformers_optimization = pytest.importorskip("transformers.optimization")

HF = {  # Hugging Face's schedules of the same names: an independent computation of the rates
    "constant": lambda opt, w, n: transformers_optimization.get_constant_schedule_with_warmup(opt, w),
    "cosine": transformers_optimization.get_cosine_schedule_with_warmup,
    "linear": transformers_optimization.get_linear_schedule_with_warmup,
}


@pytest.mark.parametrize("schedule", LR_SCHEDULES)
@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_every_rate_is_hugging_faces(schedule, warmup):
    total = 10
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    hf = HF[schedule](opt, warmup, total)
    for step in range(total):
        assert lr_factor(step, schedule, warmup, total) == pytest.approx(opt.param_groups[0]["lr"], abs=1e-12)
        opt.step()
        hf.step()


def test_the_shapes_by_hand():
    assert [lr_factor(s, "constant", 2, 6) for s in range(6)] == [0, 0.5, 1, 1, 1, 1]
    assert [lr_factor(s, "linear", 0, 4) for s in range(4)] == [1, 0.75, 0.5, 0.25]
    assert lr_factor(2, "cosine", 0, 4) == pytest.approx(0.5)  # half way down half a cosine


@pytest.mark.parametrize("args, words", [
    ((0, "step", 0, 5), "lr_schedule must be one of constant, cosine, linear; got 'step'"),
    ((-1, "cosine", 0, 5), "must be >= 0"),
])
def test_bad_arguments_are_named(args, words):
    with pytest.raises(ValueError, match=words):
        lr_factor(*args)


def test_config_refuses_a_warmup_as_long_as_the_run():
    with pytest.raises(ValueError, match=r"'warmup_steps' must be < steps=3"):
        RunConfig.from_mapping({"steps": 3, "warmup_steps": 3})
    with pytest.raises(ValueError, match="lr_schedule"):
        RunConfig.from_mapping({"lr_schedule": "exponential"})


def test_a_constant_rate_without_warmup_needs_no_scheduler():
    opt = build_optimizer(build_model(RunConfig().model_config()).parameters(), "adamw", 1e-3)
    assert build_lr_scheduler(opt, RunConfig()) is None


def test_the_training_loop_follows_the_schedule():
    config = RunConfig.from_mapping({"num_layers": 1, "d_model": 32, "nhead": 2, "dim_feedforward": 48,
                                     "vocab_size": 50, "seq_len": 8, "steps": 5, "lr": 0.01,
                                     "lr_schedule": "cosine", "warmup_steps": 2})
    log = train_one_process(config)
    assert log.lr == pytest.approx([0.01 * lr_factor(s, "cosine", 2, 5) for s in range(5)], abs=1e-15)

    model = build_model(config.model_config(), seed=config.seed)
    built = {k: v.clone() for k, v in model.state_dict().items()}
    after = []
    one = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none")
    train(model, build_optimizer(model.parameters(), "adamw", config.lr), config, one, progress=False,
          on_step=lambda end: after.append({k: v.clone() for k, v in end.model.state_dict().items()}))
    # the first step of a warm-up has rate 0: AdamW moves nothing; the second moves every weight
    assert all(torch.equal(after[0][k], built[k]) for k in built)
    assert not any(torch.equal(after[1][k], built[k]) for k in built if k.endswith("weight"))


@pytest.mark.parametrize("schedule, warmup", [("constant", 2), ("cosine", 2), ("linear", 0)])
def test_the_trainer_is_given_the_same_schedule(schedule, warmup):
    """The Trainer's arguments name a scheduler of Hugging Face's that follows lr_factor."""
    from handbook_lib.integrations import trainer_fsdp_args

    config = RunConfig.from_mapping({"steps": 6, "lr_schedule": schedule, "warmup_steps": warmup})
    kwargs = trainer_fsdp_args(config, reduce_in_compute_dtype=True)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    hf = transformers_optimization.get_scheduler(kwargs["lr_scheduler_type"], opt,
                                                 num_warmup_steps=kwargs["warmup_steps"],
                                                 num_training_steps=config.steps)
    rates = []
    for _ in range(config.steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        hf.step()
    assert rates == pytest.approx([lr_factor(s, schedule, warmup, 6) for s in range(6)], abs=1e-12)


def test_runs_with_their_own_loop_refuse_a_schedule():
    from handbook_lib.runs import deepspeed_zero, step_time

    for module, name in ((deepspeed_zero, "deepspeed_zero"), (step_time, "step_time")):
        config = module.CONFIG.from_mapping({"strategy": "ZERO2" if name == "deepspeed_zero" else "FULL_SHARD",
                                             "lr_schedule": "cosine", "init": "full"}
                                            if name == "deepspeed_zero" else {"lr_schedule": "cosine"})
        with pytest.raises(ValueError, match=f"{name} keeps the learning rate constant"):
            module.validate(config, 2)
