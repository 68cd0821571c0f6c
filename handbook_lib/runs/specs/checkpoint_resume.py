"""Train with FSDP2, save sharded checkpoints, get killed, resume: the proof behind chapter 6.

The torch-free half of :mod:`handbook_lib.runs.checkpoint_resume`: its config and the checks the
launcher makes before any process starts (:class:`~handbook_lib.core.run_spec.RunSpec`). A
``ckpt_dir`` of another job is refused by its ``job.json`` (plain JSON,
:mod:`handbook_lib.core.checkpoint_job`). Only when the folder holds a checkpoint that must be
read — one saved without ``job.json``, or the one ``resume=true`` would load — does the check
import the runtime's reader (torch: DCP's ``.metadata`` is a pickle of torch's classes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from handbook_lib.core.architecture import param_shapes
from handbook_lib.core.checkpoint_job import job_identity, read_job, recorded_job_refusal
from handbook_lib.core.config import RunConfig
from handbook_lib.core.files import check_writable_dir
from handbook_lib.core.run_spec import RunSpec
from handbook_lib.core.strategies import STRATEGIES, get_strategy
from handbook_lib.models.checkpoint import LATEST, checkpoint_name

PREEMPTIBLE = True
"""This run saves and stops on SIGTERM or SIGUSR1: the launcher forwards them to its ranks."""


@dataclass(frozen=True)
class CheckpointRunConfig(RunConfig):
    """A training run with checkpoints, and the ways to interrupt and resume it."""

    MINIMUMS: ClassVar[Mapping[str, int]] = {**RunConfig.MINIMUMS, "save_every": 0, "keep_last": 0,
                                             "dataset_size": 1}

    ckpt_dir: str = ""
    """Root directory of the checkpoints (required)."""
    save_every: int = 0
    """Save after every this many steps (0: never)."""
    keep_last: int = 0
    """Keep only this many newest checkpoints (0: all)."""
    resume: bool = False
    """Start from a checkpoint under ``ckpt_dir`` (``latest``, or ``resume_step``); refused if
    there is none, unless ``resume_if_present``."""
    resume_if_present: bool = False
    """With ``resume``: start from step 0 when ``ckpt_dir`` holds no checkpoint yet, instead of
    failing (for a job relaunched with the same command until it finishes)."""
    resume_step: int = -1
    """With ``resume``: the step of the checkpoint to load (-1: the one ``latest`` names)."""
    kill_at_step: int = -1
    """Rank ``kill_rank`` SIGKILLs itself after this step (and its save); -1: never."""
    kill_in_save: bool = False
    """Kill during the save of ``kill_at_step`` instead: shard written, save not committed."""
    kill_rank: int = 1
    """The rank that kills itself."""
    kill_signal: Literal["SIGKILL", "SIGTERM", "SIGUSR1"] = "SIGKILL"
    """What rank ``kill_rank`` sends itself after ``kill_at_step``: SIGKILL (it dies at once) or a
    preemption notice, SIGTERM or SIGUSR1 (every rank saves at that step's end and stops)."""
    kill_node: bool = False
    """With ``kill_signal=SIGKILL``: kill rank ``kill_rank``'s whole node instead, its torchrun
    agent (the agent and every rank it started die at once, as a node that loses power), in the
    middle of step ``kill_at_step`` (after its backward, before its optimizer step), or with
    ``kill_in_save`` during that step's save."""
    dataset_size: int = 24
    """Sequences in the dataset the data loader shuffles each epoch (a multiple of batch_size)."""
    async_checkpoint: bool = False
    """Save with DCP's ``async_save``: the loop waits only while the state is copied to host
    memory; the files are written in the background and committed (verified, renamed, pointed
    to) at the next save, a preemption or the end."""
    export: bool = False
    """After training, gather the full state dict to rank 0 and save it as ``ckpt_dir/export.pt``."""


CONFIG = CheckpointRunConfig


def validate(config: CheckpointRunConfig, world_size: int) -> None:
    """Reject, before any process starts, a config this run cannot execute.

    Raises:
        ValueError: naming the key and the values this run accepts.
    """
    if not config.ckpt_dir:
        raise ValueError("checkpoint_resume needs ckpt_dir (the root directory of the checkpoints)")
    check_writable_dir("ckpt_dir", config.ckpt_dir)
    row = get_strategy(config.strategy)
    if config.api != "fsdp2" or not row.fsdp2 or row.hybrid:
        accepted = [s for s in STRATEGIES if get_strategy(s).fsdp2 and not get_strategy(s).hybrid]
        raise ValueError(f"checkpoint_resume supports api='fsdp2' with strategy {' or '.join(accepted)}; "
                         f"got api={config.api!r}, strategy={config.strategy!r}")
    if config.cpu_offload:
        raise ValueError("checkpoint_resume runs without cpu_offload")
    config.check_batch(world_size)
    if config.dataset_size % config.batch_size:
        raise ValueError(f"dataset_size must be a multiple of batch_size={config.batch_size} (whole batches "
                         f"per epoch), got {config.dataset_size}")
    if config.resume_step != -1 and (not config.resume or config.resume_step < 0):
        raise ValueError("resume_step must be -1, or >= 0 together with resume=true")
    if config.resume_if_present and not config.resume:
        raise ValueError("resume_if_present=true needs resume=true")
    _check_job(config)
    if config.resume:
        _check_resumable(config)
    if config.kill_at_step != -1:
        if not 1 <= config.kill_at_step <= config.steps:
            raise ValueError(f"kill_at_step must be -1 or in [1, steps={config.steps}], got {config.kill_at_step}")
        if not 0 <= config.kill_rank < world_size:
            raise ValueError(f"kill_rank must be in [0, {world_size}), got {config.kill_rank}")
    if config.kill_in_save and not (config.kill_at_step > 0 and config.save_every
                                    and config.kill_at_step % config.save_every == 0):
        raise ValueError("kill_in_save needs kill_at_step to be a step that saves (a multiple of save_every)")
    if (config.kill_in_save or config.kill_node) and config.kill_signal != "SIGKILL":
        raise ValueError(f"kill_in_save and kill_node need kill_signal='SIGKILL' (a preemption notice is "
                         f"answered at the step's end), got {config.kill_signal!r}")
    if config.kill_node and config.kill_at_step == -1:
        raise ValueError("kill_node needs kill_at_step (the step in which the node is lost)")


def resume_path(config: CheckpointRunConfig, root: Path) -> Path | None:
    """The checkpoint ``resume`` names, or ``None`` when there is none (see :func:`_check_resumable`)."""
    if config.resume_step >= 0:
        path = root / checkpoint_name(config.resume_step)
        return path if path.is_dir() else None
    return root if (root / LATEST).exists() else None


def job_of(config: CheckpointRunConfig) -> dict[str, Any]:
    """This job's identity, recorded in ``ckpt_dir`` by its first save."""
    return job_identity("checkpoint_resume", config.model_config(), config.optimizer)


def _check_job(config: CheckpointRunConfig) -> None:
    """Refuse a ``ckpt_dir`` that holds another job's checkpoints (resumed or not)."""
    root = Path(config.ckpt_dir)
    try:
        if read_job(root) is None and (root / LATEST).is_file():  # saved without job.json: DCP's index
            from handbook_lib.runtime.checkpoint_job import job_refusal  # torch, only for such a folder

            refusal = job_refusal(root, job_of(config), dict(param_shapes(config.model_config())))
        else:
            refusal = recorded_job_refusal(root, job_of(config))
    except ValueError as err:  # an unreadable job.json
        refusal = str(err)
    if refusal is not None:
        raise ValueError(refusal)


def _check_resumable(config: CheckpointRunConfig) -> None:
    """With ``resume``: refuse a ``ckpt_dir`` with nothing to resume (unless ``resume_if_present``)
    and a checkpoint of another model (its tensor names and shapes, from DCP's index)."""
    root = Path(config.ckpt_dir)
    path = resume_path(config, root)
    if path is None:
        if config.resume_if_present:
            return
        what = ("does not exist" if not root.is_dir()
                else f"has no checkpoint {checkpoint_name(config.resume_step)!r}" if config.resume_step >= 0
                else f"has no {LATEST!r} pointer" if any(root.iterdir()) else "is empty")
        raise ValueError(f"resume=true but ckpt_dir {config.ckpt_dir!r} {what}: check the path, or add "
                         f"resume_if_present=true to start from step 0 when there is no checkpoint")
    # a checkpoint to read: the runtime's reader (torch), imported only now
    from handbook_lib.runtime.checkpoint_verify import CheckpointError, check_model_shapes, validate_checkpoint

    try:
        validate_checkpoint(path, verify_checksums=False)  # complete? (checksums: at load, once)
        check_model_shapes(path, dict(param_shapes(config.model_config())))
    except CheckpointError as err:
        raise ValueError(f"resume=true: {err}") from None


SPEC = RunSpec("checkpoint_resume", __doc__, CONFIG, validate, preemptible=PREEMPTIBLE)
