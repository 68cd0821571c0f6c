"""The harness every run's ``__main__`` goes through, on every rank.

Chapter 1 introduces it. A run module defines ``CONFIG`` (a :class:`~handbook_lib.core.config.FlatConfig`
subclass) and ``run(config, ctx) -> RankReport``, and ends with::

    if __name__ == "__main__":
        main(sys.modules[__name__])

so it can be started as ``torchrun --nproc-per-node N -m handbook_lib.runs.NAME --config cfg.json
--out DIR``. The harness turns what the ranks do into files the launcher can read:

- ``DIR/result.json`` — written by rank 0 once every rank's report is gathered (atomic); a
  *batch* (several configs in one job, one after another on the same process group:
  :func:`handbook_lib.launch.torchrun_batch`) writes ``DIR/results/{k}.json``, one per config;
- ``DIR/ranks/rank{R}.json`` — each rank's end state: ``ok``, or ``error`` with the traceback,
  and where it ran (host, node rank, local rank); the same three keys are in its ``result.json``
  record;
- ``DIR/ranks/rank{R}.stacks.txt`` — Python stacks of a rank stopped by a signal or about to
  miss the launcher's deadline, so a hang shows where it hung.

A rank stopped by :class:`~handbook_lib.runtime.preemption.Preempted` (it saved, on a signal)
writes the state ``preempted`` and exits with
:data:`~handbook_lib.core.protocol.PREEMPTED_EXIT`; rank 0 writes no ``result.json`` then.

Every rank ends with ``os._exit``, after flushing and destroying the process group: this avoids
an abort at interpreter exit in the gloo backend (upstream pytorch#190489).
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import gc
import json
import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, TextIO

import torch
import torch.distributed as dist

from handbook_lib.core.config import RunConfig, parse_overrides
from handbook_lib.core.files import write_json_atomic
from handbook_lib.core.protocol import (
    BATCH_KEY,
    DEADLINE_ENV,
    PREEMPTED_EXIT,
    RANKS_DIR,
    RESULT_FILE,
    RankStatus,
    batch_result_path,
    rank_stacks_path,
    rank_status_path,
)
from handbook_lib.core.results import SCHEMA, Check, RunResult
from handbook_lib.runtime.distributed import (
    RankContext,
    init_distributed,
    shutdown_distributed,
)
from handbook_lib.runtime.preemption import Preempted

__all__ = ["RankReport", "main", "placement", "one_process_loss_checks"]


@dataclass
class RankReport:
    """What one rank hands back from ``run``."""

    metrics: dict[str, Any]
    """This rank's measurements (JSON-ready), e.g. ``losses``, ``param_shard_bytes``."""
    checks: list[Check] = field(default_factory=list)
    """Predictions beside measurements made on this rank."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Top-level result keys (only rank 0's are kept)."""


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank if its torchrun agent dies, so no rank is orphaned."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - non-glibc systems
            pass


def _arm_stack_dumps(stacks_path: Path):
    """Dump all threads' stacks on SIGTERM, and shortly before the launcher's deadline."""
    handle = open(stacks_path, "w")  # noqa: SIM115 - must outlive this function
    _dump_on_sigterm(handle)
    faulthandler.enable(file=handle, all_threads=True)  # SIGABRT (NCCL's watchdog), SIGSEGV: stacks
    deadline = os.environ.get(DEADLINE_ENV)
    if deadline:
        seconds = float(deadline) - time.time() - 3.0
        if seconds > 0:
            faulthandler.dump_traceback_later(seconds, exit=False, file=handle)
    return handle


def _dump_on_sigterm(handle: TextIO) -> None:
    """On SIGTERM, dump every thread's stack to ``handle``, then take the signal's previous action.
    Armed again after each run's code: a run that watched for SIGTERM itself (a preemption
    watch) can only put back Python's default, not faulthandler's C handler."""
    faulthandler.unregister(signal.SIGTERM)  # registering again alone would not reinstall it
    faulthandler.register(signal.SIGTERM, file=handle, all_threads=True, chain=True)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Run one handbook experiment on this rank.")
    parser.add_argument("--config", type=Path, help="JSON file with config keys")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override one config key (repeatable)")
    parser.add_argument("--out", type=Path, required=True, help="directory for result.json")
    return parser.parse_args(argv)


def placement() -> dict[str, Any]:
    """Where this rank runs: ``host`` (its machine's name), ``node_rank`` (torchrun's
    ``GROUP_RANK``: which agent started it) and ``local_rank`` (its index on that node)."""
    return {"host": socket.gethostname(), "node_rank": int(os.environ.get("GROUP_RANK", "0")),
            "local_rank": int(os.environ.get("LOCAL_RANK", "0"))}


def _write_status(out_dir: Path, rank: int, status: Literal["ok", "error", "preempted"], stacks: TextIO,
                  **error: Any) -> None:
    """This rank's :class:`~handbook_lib.core.protocol.RankStatus`, where the launcher reads it.

    A SIGTERM waits until it is written: torchrun stops a failed job's other ranks with SIGTERM,
    which must not kill a rank between writing its status and renaming it into place (the
    launcher would find no status, and blame that rank as one that died silently). The signal
    is taken afterwards, with the stacks dumped to ``stacks`` as at any other time.
    """
    state = RankStatus(rank=rank, status=status, time=time.time(), **placement(), **error)
    came: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _: came.append(signum))  # any thread's
    try:
        write_json_atomic(rank_status_path(out_dir, rank), state.to_dict())
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        _dump_on_sigterm(stacks)  # faulthandler's (C) handler, which Python's table does not know
        if came:
            signal.raise_signal(signal.SIGTERM)


def _collect(report: RankReport, ctx: RankContext) -> list[RankReport] | None:
    """Gather every rank's report on rank 0 (``None`` elsewhere)."""
    if ctx.world_size == 1:
        return [report]
    gathered: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(report, gathered, dst=0)
    return gathered


def _configs(module: ModuleType, args: argparse.Namespace) -> list[tuple[str, Any]]:
    """``(label, config)`` of every config this job runs: one (label ``""``), or a batch's, in
    order; ``--set`` overrides apply to each."""
    mapping = json.loads(args.config.read_text()) if args.config else {}
    overrides = parse_overrides(args.overrides)
    if BATCH_KEY not in mapping:
        return [("", module.CONFIG.from_mapping({**mapping, **overrides}))]
    return [(entry["label"], module.CONFIG.from_mapping({**entry["config"], **overrides}))
            for entry in mapping[BATCH_KEY]]


def _run_one(module: ModuleType, config: Any, ctx: RankContext) -> RankReport:
    """``module.run(config, ctx)``, with where this rank ran added to its metrics."""
    report = module.run(config, ctx)
    report.metrics.update(placement())
    return report


def _result(module: ModuleType, config: Any, ctx: RankContext, reports: list[RankReport]) -> RunResult:
    """The result of one config from every rank's report (rank 0 holds them all)."""
    return RunResult(
        schema=SCHEMA, run=(module.__spec__.name if module.__spec__ else module.__name__).rsplit(".", 1)[-1],
        config=config.to_dict(),
        world_size=ctx.world_size, backend=ctx.backend, device=ctx.device.type, torch_version=torch.__version__,
        ranks=[{"rank": r, **rep.metrics} for r, rep in enumerate(reports)],
        checks=[c for rep in reports for c in rep.checks], extra=reports[0].extra,
    )


def main(module: ModuleType, argv: list[str] | None = None) -> None:
    """Run ``module.run`` on this rank and report; never returns (ends the process)."""
    args = _parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    (args.out / RANKS_DIR).mkdir(parents=True, exist_ok=True)
    _die_with_parent()
    stacks = _arm_stack_dumps(rank_stacks_path(args.out, rank))
    code = 0
    stage = ""
    try:
        configs = _configs(module, args)
        ctx = init_distributed()
        gc.freeze()  # torch's modules and the process group: the collections below skip them
        for index, (stage, config) in enumerate(configs):
            try:
                report = _run_one(module, config, ctx)
            finally:
                _dump_on_sigterm(stacks)
            reports = _collect(report, ctx)
            if reports is not None:
                path = batch_result_path(args.out, index) if stage else args.out / RESULT_FILE
                path.parent.mkdir(exist_ok=True)
                write_json_atomic(path, _result(module, config, ctx, reports).to_dict())
            gc.collect()  # the config's model and buffers, before the next one's measurements
        _write_status(args.out, rank, "ok", stacks)
    except Preempted as exc:  # every rank saved at the same step: a stop, to be resumed
        code = PREEMPTED_EXIT
        print(f"rank {rank}: {exc}", flush=True)
        _write_status(args.out, rank, "preempted", stacks, error_type=type(exc).__name__, message=str(exc),
                      stage=stage, step=exc.step)
        shutdown_distributed()
    except BaseException as exc:  # noqa: BLE001 - every failure must be reported, then exit
        code = 1
        traceback.print_exc()
        _write_status(args.out, rank, "error", stacks, error_type=type(exc).__name__, message=str(exc),
                      traceback=traceback.format_exc(), distributed_error=isinstance(exc, dist.DistError),
                      stage=stage)
    finally:
        faulthandler.cancel_dump_traceback_later()
        faulthandler.unregister(signal.SIGTERM)
        faulthandler.disable()  # before its file is closed
        if code == 0:
            shutdown_distributed()
        sys.stdout.flush()
        sys.stderr.flush()
        stacks.close()
        os._exit(code)


def one_process_loss_checks(config: RunConfig, losses: list[float], tolerance: float,
                            device: str = "cpu") -> tuple[list[float], list[Check]]:
    """:func:`~handbook_lib.runtime.training.train_one_process`'s losses for ``config``, trained
    on ``device`` (the rank's own: a GPU job is compared with a GPU reference), and one check per
    step of the run's ``losses`` against them (``loss_step1`` ..., nats, relative ``tolerance``,
    of the whole job).
    Called by a run on rank 0 (training imported then, not by every rank's harness)."""
    from handbook_lib.runtime.training import train_one_process

    reference = train_one_process(config, device).losses
    return reference, [Check(f"loss_step{i + 1}", None, want, got, "nats", tolerance)
                       for i, (want, got) in enumerate(zip(reference, losses))]
