"""Checks the launcher makes before it starts a job's ranks, each one line.

NCCL moves data between the GPUs of one node through shared memory (``/dev/shm``); in a
container that is often 64 MB (Docker's default, many Kubernetes pods), and a multi-GPU job then
dies at its first collective with "unhandled system error". :func:`shm_warning` says so before
the job starts.

A job this machine cannot hold is refused before it starts instead of climbing toward the
out-of-memory killer (:func:`check_resources`, :func:`check_job_resources`): more ranks than
:data:`RANKS_PER_CORE` per CPU core, or more host memory than is available by the book's own
memory model of the run's config (chapter 2's :func:`~handbook_lib.models.memory.estimate_memory`,
per rank, times the ranks on this machine; a benchmark prices its own buffers). Both figures are
in the refusal, and ``--force-resources`` (``force_resources=True``) goes ahead anyway.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["SHM_MIN_BYTES", "shm_warning", "RANKS_PER_CORE", "check_resources", "check_job_resources",
           "check_run_config",
           "predicted_rank_bytes", "host_cores", "available_memory"]

SHM_MIN_BYTES = 256 * 1024 * 1024
"""Below this size of ``/dev/shm`` (bytes) a multi-GPU NCCL job is warned about; Docker's
default, 64 MiB, is well below it."""


def shm_warning(nproc: int, cuda: bool, path: str = "/dev/shm",
                statvfs: Callable[[str], os.statvfs_result] = os.statvfs) -> str | None:
    """One line when ``nproc`` NCCL ranks on this node would share a ``/dev/shm`` smaller than
    :data:`SHM_MIN_BYTES` (``cuda``: the ranks see GPUs), else ``None`` (also when ``path``
    cannot be read: nothing to say)."""
    if nproc < 2 or not cuda:
        return None
    try:
        stat = statvfs(path)
    except OSError:
        return None
    size = stat.f_frsize * stat.f_blocks
    if size >= SHM_MIN_BYTES:
        return None
    return f"{path} is {size / 2**20:.0f} MiB: NCCL may fail; run the container with --shm-size=1g"


RANKS_PER_CORE = 8
"""Most ranks a job may start per CPU core of this machine before it is refused (unless forced).

The book's chapters and tests start at most 8 ranks, which on the 2-core machines they are
checked on is 4 per core; 8 per core leaves that a factor of two. Past it each rank gets under an
eighth of a core, every step waits on the slowest of many time-sliced ranks, and the job crawls
toward its collectives' timeouts instead of teaching anything (64 ranks on 2 cores is 32 per
core)."""

FORCE_WORDS = "--force-resources (force_resources=True) starts it anyway"
"""How a refusal says to go ahead: the CLI's flag and :func:`~handbook_lib.launch.torchrun`'s
keyword."""


def host_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def available_memory() -> int:
    """Bytes of host memory available to new processes now (``psutil.virtual_memory().available``)."""
    import psutil

    return int(psutil.virtual_memory().available)


def predicted_rank_bytes(module: object, config: object, world_size: int, local_ranks: int,
                         cuda: bool) -> int | None:
    """Host bytes one rank of ``module``'s run will hold by the book's own models, or ``None``
    when the run has no prediction.

    ``module``: the run's :class:`~handbook_lib.core.run_spec.RunSpec` (or its module). A run may
    define ``host_bytes(config, world_size) -> int`` (the benchmark's buffers);
    a run of the handbook's model (a :class:`~handbook_lib.core.config.RunConfig`) is priced by
    :func:`~handbook_lib.models.memory.estimate_memory` for its own config: the step's peak
    (device memory, which on the CPU is host memory) plus what CPU offload keeps on the host. On
    GPUs only the offloaded part is host memory.
    """
    own = getattr(module, "host_bytes", None)
    if callable(own):
        return int(own(config, world_size))
    from handbook_lib.core.config import RunConfig
    from handbook_lib.core.strategies import get_strategy
    from handbook_lib.models.memory import estimate_memory

    if not isinstance(config, RunConfig):
        return None
    try:
        row = get_strategy(config.strategy)
        per_rank_batch = config.batch_size // max(1, world_size) // config.grad_accum_steps
        est = estimate_memory(
            config.model_config(), world_size, config.strategy, config.precision, config.optimizer,
            micro_batch=per_rank_batch, seq_len=config.seq_len if per_rank_batch else 0,
            shard_group_size=(config.shard_group_size or local_ranks) if row.hybrid else None,
            activation_checkpointing=config.activation_checkpointing, cpu_offload=config.cpu_offload,
            backend="nccl" if cuda else "gloo", grad_accum_steps=config.grad_accum_steps,
            sync_every_micro_step=config.sync_every_micro_step)
    except (ValueError, TypeError, KeyError):  # a combination the models do not price: no figure
        return None
    return est.host + (0 if cuda else est.peak)


def check_resources(ranks: int, rank_bytes: int | None, *, cores: int | None = None,
                    available: int | None = None, force: bool = False) -> None:
    """Refuse, in one line with both figures, a job this machine cannot hold: more than
    :data:`RANKS_PER_CORE` ranks per core, or ``ranks`` x ``rank_bytes`` (the book's own
    prediction of one rank's host bytes) more than the memory available now. ``force`` skips it.

    Args:
        ranks: Ranks this machine starts.
        rank_bytes: Predicted host bytes of one rank (``None``: no prediction, not checked).
        cores: CPU cores (default :func:`host_cores`).
        available: Bytes of host memory available (default :func:`available_memory`).
        force: Go ahead anyway.

    Raises:
        ValueError: e.g. ``"64 ranks on this machine's 2 CPU cores (nproc): more than 8 per
            core, at most 16 here; --force-resources (force_resources=True) starts it anyway"``.
    """
    if force:
        return
    cores = host_cores() if cores is None else cores
    if ranks > RANKS_PER_CORE * cores:
        raise ValueError(f"{ranks} ranks on this machine's {cores} CPU core{'s' * (cores != 1)} (nproc): more "
                         f"than {RANKS_PER_CORE} per core, at most {RANKS_PER_CORE * cores} here; {FORCE_WORDS}")
    if rank_bytes is None or rank_bytes <= 0:
        return
    available = available_memory() if available is None else available
    need = ranks * rank_bytes
    if need > available:
        raise ValueError(f"the run needs {_gb(need)} of host memory by its own prediction ({ranks} "
                         f"rank{'s' * (ranks != 1)} x {_gb(rank_bytes)}), {_gb(available)} is available; "
                         f"{FORCE_WORDS}")


def _gb(n: int) -> str:
    """Bytes as GB, three significant figures or whole (``54.2 GB``, ``5,000 GB``), for a one-line refusal."""
    return f"{n / 1e9:,.0f} GB" if n >= 1e11 else f"{n / 1e9:.3g} GB"


def check_job_resources(module: object, configs: list[object], nproc: int, *, world_size: int, local_ranks: int,
                        env: dict[str, str] | None = None, force: bool = False) -> None:
    """:func:`check_resources` for a job of ``module``'s run whose configs are already checked:
    ``local_ranks`` ranks on this machine (every node's, or only this node's in a real multi-node
    job) of ``world_size``, each holding what the largest of ``configs`` predicts
    (:func:`predicted_rank_bytes`); ``env`` is the ranks' extra environment (GPUs hidden: the
    ranks run on the CPU). The launcher calls it before it claims a folder or starts anything.

    Costs one ``psutil`` call and one memory estimate per config (milliseconds).

    Raises:
        ValueError: ``force`` is not a bool (named as ``torchrun``'s ``force_resources``), or
            the job does not fit (:func:`check_resources`).
    """
    if not isinstance(force, bool):
        raise ValueError(f"force_resources must be True or False, got {force!r}")
    if force:
        return
    check_resources(local_ranks, None)  # the cores first: no estimate needed
    cuda = False
    if not (env or {}).get("CUDA_VISIBLE_DEVICES") == "":
        import torch

        cuda = torch.cuda.is_available()
    predicted = [predicted_rank_bytes(module, cfg, world_size, nproc, cuda) for cfg in configs]
    known = [b for b in predicted if b is not None]
    check_resources(local_ranks, max(known) if known else None)


def check_run_config(run: str, config: Mapping[str, Any] | None, world_size: int, *, label: str = "") -> Any:
    """The launcher's one check of a config, before anything starts, without importing torch:
    ``run`` is a run, ``config`` its config class accepts (every key and value), and the run's
    ``validate`` accepts it on ``world_size`` ranks (the run's spec,
    :func:`handbook_lib.runs.run_spec`). The CLI's ``run``, :func:`~handbook_lib.launch.torchrun`
    and its batches all come through here, once per config.

    Args:
        label: A batch's label for this config, prefixed to its error (``""``: none).

    Returns:
        The config, as the run's config dataclass.

    Raises:
        ValueError: one line naming the run, key or value and what is accepted (``config
            'label': ...`` in a batch).
    """
    from handbook_lib.runs import run_spec

    spec = run_spec(run)
    try:
        return spec.check(config, world_size)
    except ValueError as err:
        if not label:
            raise
        raise ValueError(f"config {label!r}: {err}") from None
