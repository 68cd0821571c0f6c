"""Train with FSDP2, save sharded checkpoints, get killed, resume: the proof behind chapter 6.

Each rank builds the seeded model and shards it (:func:`~handbook_lib.runtime.build.parallelize`),
then trains in the one training loop (:func:`~handbook_lib.runtime.training.train`) from step 0 — or,
with ``resume``, from the newest complete checkpoint under ``ckpt_dir`` (any world size: DCP
reshards), continuing with the very batch where the saved job
stopped. Every ``save_every`` steps all ranks save a checkpoint (:mod:`handbook_lib.runtime.checkpoint`).
To interrupt the job for real, rank ``kill_rank`` sends itself SIGKILL after step
``kill_at_step`` (and after that step's save), or — with ``kill_in_save`` — during that step's
save, once its shard file is on disk but before the save is committed. The launcher then raises
``RunFailed``; a second launch with ``resume=true`` continues. With ``export`` the trained model
is also gathered to rank 0 and written as one plain ``torch.save`` file.

Resuming never starts over silently. ``resume=true`` with a ``ckpt_dir`` that holds no checkpoint
(a typo in the path, an empty folder) is refused before any process starts; add
``resume_if_present=true`` to mean "resume if there is a checkpoint, else start from step 0" (a
job that is simply relaunched until it finishes). A checkpoint of another model (say 6 layers,
resumed into a 2-layer config) is refused before anything is loaded, naming the tensors that
differ (read from DCP's ``.metadata``); every file's checksum is verified at load.

A ``ckpt_dir`` holds one job's checkpoints: the first save records the job (the run, the model's
shape, the optimizer) in ``ckpt_dir/job.json``, and a run of another shape into it, resumed or
not, is refused before any process starts, naming the key that differs (the world size is free:
a checkpoint reshards). ``keep_last`` deletes only the saves it wrote; a folder of yours named
``step_*`` is left (:mod:`handbook_lib.runtime.checkpoint_job`).

A checkpoint holds the job's whole state, through DCP's ``Stateful`` protocol: the model, the
optimizer, the LR scheduler (``lr_schedule``, ``warmup_steps``), the gradient scaler (fp16), the
data loader (a dataset of ``dataset_size`` sequences shuffled each epoch by torchdata's
``StatefulDataLoader``: its position is its own state, not the step number) and every
generator of every rank. Resuming at the same world size is bit-identical to the
uninterrupted job.

Preemption: SIGTERM or SIGUSR1 to any rank (Slurm's notice before it kills a job; the CLI
forwards its own) makes every rank save at the next step boundary and stop, exiting with
:data:`~handbook_lib.core.protocol.PREEMPTED_EXIT`; the launcher raises ``RunPreempted``
("preempted by SIGTERM at step 3; saved step_000003 in …"), and the CLI says how to resume. With
``kill_signal=SIGTERM`` or ``SIGUSR1``, rank ``kill_rank`` sends itself that signal after step
``kill_at_step`` instead of SIGKILL, as chapter 6 shows.

``result.json`` holds the losses with their global step numbers, save and load times (seconds),
each checkpoint's files and bytes, and ``checks``: the tensors and bytes the newest checkpoint
holds (read from DCP's metadata) beside their prediction from the model's shape — exact.

Launch::

    python -m handbook_lib run checkpoint_resume --nproc 2 --set ckpt_dir=/tmp/ck --set save_every=2
    python -m handbook_lib run checkpoint_resume --nproc 4 --set ckpt_dir=/tmp/ck --set resume=true
    python -m handbook_lib run checkpoint_resume --nproc 2 --set ckpt_dir=/tmp/ck --set resume=true \
        --set resume_if_present=true   # the same command for the first launch and every relaunch
"""
# (its spec's PREEMPTIBLE tells the launcher to forward SIGTERM and SIGUSR1 to the ranks)

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from handbook_lib.core.results import Check
from handbook_lib.models.checkpoint import (
    checkpoint_name,
    estimate_checkpoint_count,
)
from handbook_lib.runs.entry import RankReport, main
from handbook_lib.runs.specs.checkpoint_resume import (
    CONFIG as CONFIG,
    CheckpointRunConfig,
    job_of,
    resume_path,
    validate,
)
from handbook_lib.runtime.build import parallelize
from handbook_lib.runtime.checkpoint import (
    PendingCheckpoint,
    SavedCheckpoint,
    export_full_state_dict,
    load_checkpoint,
    save_checkpoint,
)
from handbook_lib.runtime.checkpoint_inspect import count_checkpoint
from handbook_lib.runtime.data import make_batch
from handbook_lib.runtime.data_loader import LoaderBatches
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.optimization import build_grad_scaler, build_lr_scheduler, build_optimizer
from handbook_lib.runtime.preemption import Preempted, PreemptionWatch
from handbook_lib.runtime.random_state import seed_generators
from handbook_lib.runtime.training import StepEnd, train

EXPORT_FILE = "export.pt"
"""File name, under ``ckpt_dir``, of the exported full state dict."""
PROBE_FILE = "export_probe.pt"
"""File name, under ``ckpt_dir``, of the probe batch, the sharded model's logits on it, and the
device type they were computed on (read by
:func:`handbook_lib.runtime.checkpoint_inspect.reproduces_probe`)."""


def _kill(ctx: RankContext, where: str, node: bool = False) -> None:
    """SIGKILL this rank, or (``node``) its torchrun agent: the rank dies with it (the harness
    asked Linux for that), and so does every other rank of its node."""
    print(f"rank {ctx.rank}: SIGKILL {'to its node (torchrun agent) ' if node else ''}{where}", flush=True)
    sys.stderr.flush()
    os.kill(os.getppid() if node else os.getpid(), signal.SIGKILL)
    time.sleep(60)  # (a node's rank waits for the death its agent's brings)


def _export(config: CheckpointRunConfig, ctx: RankContext, model: torch.nn.Module, root: Path) -> dict:
    """Export the full state dict, and save the sharded model's logits on an unseen batch."""
    start = time.perf_counter()
    size = export_full_state_dict(model, root / EXPORT_FILE)
    seconds = time.perf_counter() - start
    inputs, _ = make_batch(config, config.steps)  # a batch of no epoch: not one it trained on
    with torch.no_grad():
        logits = model(inputs.to(ctx.device)).cpu()  # every rank: the whole probe batch
    if ctx.is_main:
        torch.save({"inputs": inputs, "logits": logits, "device": ctx.device.type}, root / PROBE_FILE)
    return {"file": EXPORT_FILE, "bytes": size, "seconds": seconds}


def _constant(step: int) -> float:
    return 1.0


def _job_state(config: CheckpointRunConfig, ctx: RankContext, optimizer: torch.optim.Optimizer,
               ) -> tuple[dict[str, Any], LoaderBatches, torch.amp.GradScaler | None]:
    """The parts of the job a checkpoint holds besides the model, the optimizer and the
    generators (DCP ``Stateful`` objects, by name), the data loader and the scaler among them."""
    scheduler = build_lr_scheduler(optimizer, config) or torch.optim.lr_scheduler.LambdaLR(optimizer, _constant)
    loader = LoaderBatches(config, config.dataset_size)
    scaler = build_grad_scaler(config, ctx)
    parts: dict[str, Any] = {"scheduler": scheduler, "data": loader}
    if scaler is not None:
        parts["scaler"] = scaler
    return parts, loader, scaler


class _Saves:
    """The run's saves, each as one record: synchronous, or (``async_checkpoint``) started by
    DCP's ``async_save`` and committed at the next save, at a preemption or at the end."""

    def __init__(self, config: CheckpointRunConfig, ctx: RankContext, root: Path, parts: dict[str, Any]) -> None:
        self.config, self.ctx, self.root, self.parts = config, ctx, root, parts
        self.records: list[dict[str, Any]] = []
        self.pending: PendingCheckpoint | None = None

    def save(self, end: StepEnd, hook: Any = None) -> None:
        self.commit()
        saved = save_checkpoint(self.root, end.step, end.model, end.optimizer, keep_last=self.config.keep_last,
                                after_shard_written=hook, stateful=self.parts, device=self.ctx.device,
                                asynchronous=self.config.async_checkpoint, job=job_of(self.config))
        if isinstance(saved, PendingCheckpoint):
            self.pending = saved
        else:
            self._record(saved)

    def commit(self) -> None:
        """Wait for an asynchronous save and commit it (collective: every rank calls it)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._record(pending.wait())

    def _record(self, saved: SavedCheckpoint) -> None:
        blocked = saved.blocked_s + saved.wait_s if saved.asynchronous else saved.seconds
        self.records.append({"name": saved.path.name, "step": saved.step, "save_s": saved.seconds,
                             "blocked_s": blocked, "files": saved.files})
        if self.ctx.is_main:
            print(f"saved {saved.path.name} in {saved.seconds:.2f} s (the loop blocked {blocked:.2f} s)", flush=True)

    @property
    def last_step(self) -> int:
        """The step of the newest save, committed or pending (-1: none)."""
        return self.pending.step if self.pending else self.records[-1]["step"] if self.records else -1


def _resume(config: CheckpointRunConfig, ctx: RankContext, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer, parts: dict[str, Any], loader: LoaderBatches,
            ) -> tuple[int, dict[str, Any] | None]:
    """Load the checkpoint ``resume`` names, if any: ``(start step, what was loaded)``."""
    path = resume_path(config, Path(config.ckpt_dir)) if config.resume else None
    if path is None:
        return 0, None
    info = load_checkpoint(path, model, optimizer, stateful=parts, device=ctx.device)
    if loader.position != info.step:
        raise RuntimeError(f"checkpoint {info.path} is at step {info.step} but its data loader is at "
                           f"batch {loader.position}")
    if ctx.is_main:
        print(f"resumed from {info.path.name} (saved by {info.world_size} ranks) in {info.seconds:.2f} s",
              flush=True)
    return info.step, {"name": info.path.name, "step": info.step, "saved_world_size": info.world_size,
                       "rng_restored": info.rng_restored, "load_s": info.seconds, "epoch": loader.epoch,
                       "read_bytes": sum(info.read.values())}


def _count_checks(config: CheckpointRunConfig, root: Path, newest: str, exported: dict | None,
                  ) -> tuple[list[Check], dict[str, Any]]:
    """The newest checkpoint's tensors and bytes, read from DCP's index, beside their prediction
    (and the export's tensor bytes): rank 0's checks."""
    counted = count_checkpoint(root / newest)
    predicted = estimate_checkpoint_count(config.model_config(), config.optimizer)
    checks = []
    for group in ("model", "optim"):
        checks += [
            Check(f"checkpoint_{group}_tensors", None, predicted[group].tensors, counted[group].tensors, "tensors"),
            Check(f"checkpoint_{group}_bytes", None, predicted[group].bytes, counted[group].bytes, "bytes"),
        ]
    if exported is not None:
        checks.append(Check("export_tensor_bytes", None, predicted["model"].bytes,
                            _exported_tensor_bytes(root / EXPORT_FILE), "bytes"))
    return checks, {k: vars(v) for k, v in counted.items()}


def run(config: CheckpointRunConfig, ctx: RankContext) -> RankReport:
    validate(config, ctx.world_size)
    seed_generators(config.seed, ctx.rank)  # Python's and NumPy's too: their state is saved
    root = Path(config.ckpt_dir)
    model = parallelize(config, ctx)
    optimizer = build_optimizer(model.parameters(), config.optimizer, config.lr, config.optimizer_impl)
    parts, loader, scaler = _job_state(config, ctx, optimizer)
    start_step, loaded = _resume(config, ctx, model, optimizer, parts, loader)
    saves = _Saves(config, ctx, root, parts)

    def after_step(end: StepEnd) -> None:
        """Print the loss, save every ``save_every`` steps, kill or signal this rank where asked,
        and stop every rank, saved, once any rank got a preemption signal."""
        if ctx.is_main:
            print(f"step {end.step}: loss {end.loss:.4f}", flush=True)
        killing = end.step == config.kill_at_step and ctx.rank == config.kill_rank
        if config.save_every and end.step % config.save_every == 0:
            saves.save(end, functools.partial(_kill, ctx, f"during the save of step {end.step}, its shard "
                                              "written", config.kill_node) if killing and config.kill_in_save else None)
        if killing and config.kill_signal == "SIGKILL":
            _kill(ctx, f"after step {end.step}")
        if killing:  # a preemption notice, as Slurm sends one
            print(f"rank {ctx.rank}: {config.kill_signal} to itself after step {end.step}", flush=True)
            os.kill(os.getpid(), getattr(signal, config.kill_signal))
        stop = watch.agreed()
        if stop is not None:
            if saves.last_step != end.step:
                saves.save(end)
            saves.commit()
            raise Preempted(end.step, stop, f"{checkpoint_name(end.step)} in {root}")

    def mid_step(model: torch.nn.Module, step: int) -> None:
        if not config.kill_in_save and step == config.kill_at_step and ctx.rank == config.kill_rank:
            _kill(ctx, f"in step {step}, after its backward", node=True)

    with PreemptionWatch(ctx.device) as watch:
        log = train(model, optimizer, config, ctx, start_step=start_step, on_step=after_step, progress=False,
                    scaler=scaler, batches=loader, scheduler=parts["scheduler"],
                    after_backward=mid_step if config.kill_node else None)
    saves.commit()
    exported = _export(config, ctx, model, root) if config.export else None
    newest = saves.records[-1]["name"] if saves.records else loaded["name"] if loaded else None
    checks, counted = _count_checks(config, root, newest, exported) if ctx.is_main and newest else ([], None)
    metrics = {
        "steps": log.steps, "losses": log.losses, "step_time_s": log.step_time_s,
        "save_s": [s["save_s"] for s in saves.records],
        "save_blocked_s": [s["blocked_s"] for s in saves.records],
        "load_s": loaded["load_s"] if loaded else None,
        "rng_restored": loaded["rng_restored"] if loaded else None,
        "read_bytes": loaded["read_bytes"] if loaded else None,
        "lr": log.lr, "grad_scale": log.grad_scale,
    }
    extra = {"start_step": start_step, "loaded": loaded, "epochs_begun": loader.epoch + 1, "saves": saves.records,
             "export": exported, "checkpoint_count": counted}
    return RankReport(metrics=metrics, checks=checks, extra=extra)


def _exported_tensor_bytes(path: Path) -> int:
    state = torch.load(path, map_location="cpu", weights_only=True)
    return sum(t.numel() * t.element_size() for t in state.values())


if __name__ == "__main__":
    main(sys.modules[__name__])
