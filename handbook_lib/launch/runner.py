"""Start a run of :mod:`handbook_lib.runs` on N processes with ``torchrun`` and get its result.

Chapter 1 introduces it; it is the one thing a notebook cell calls to run a real experiment::

    from handbook_lib.launch.runner import torchrun
    result = torchrun("fsdp_train", nproc=2, config={"steps": 3})
    result.checks          # predictions beside measurements

What it guarantees:

- in a terminal, every rank's output is streamed live, prefixed ``[rankR]``, through Python's
  ``sys.stdout``, and rank 0's progress bar, labelled with the run's name, redraws in place;
- in a notebook, a run is one line (what ran, on how many ranks, how its checks came out) that
  repeats on any machine; the ranks' whole output is folded under it (HTML ``<details>``);
- the rendezvous is on 127.0.0.1 with a port the OS picks, so runs never collide;
- the result comes back parsed from ``result.json`` (a :class:`~handbook_lib.core.results.RunResult`);
- a failing rank raises :class:`RunFailed` naming the rank that caused it, with its traceback;
- a run past ``timeout_s`` is stopped with every one of its processes, and raises
  :class:`RunTimeout` showing where each rank was; Ctrl-C stops them too and raises
  :class:`RunInterrupted` (a ``KeyboardInterrupt``) with a one-line message;
- without ``out``, the run's folder is a temporary one, removed when the run ends (however it
  ends); ``out`` is the caller's and is kept. ``out`` is never shared or silently reused: a run
  claims its folder with a marker file and a lock, records what it wrote in a manifest, refuses
  a folder holding anything else, and replaces an earlier run's files only with
  ``overwrite=True``;
- torchrun and its ranks stop within seconds of this process, even when it is killed outright
  (SIGKILL): the folder stays locked until they have;
- a run whose ``checks`` include one outside its own tolerance raises :class:`ChecksFailed`
  (the parsed result is attached): a model that disagrees with its measurement is a failure.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from handbook_lib.core.checks import check_int
from handbook_lib.core.config import FlatConfig
from handbook_lib.core.protocol import (
    BATCH_KEY,
    COLLECTIVE_TIMEOUT_ENV,
    DEADLINE_ENV,
    RESULT_FILE,
    RESULTS_LOG_ENV,
    batch_result_path,
    collective_timeout_s,
    node_config_file,
    rank_status_path,
)
from handbook_lib.core.results import RunResult, load_result
from handbook_lib.launch.diagnose import (
    diagnose_failure,
    failure_message,
    where_ranks_were,
)
from handbook_lib.launch.errors import (
    RunPreempted,
    ChecksFailed,
    RunFailed,
    RunInterrupted,
    RunTimeout,
    describe_failed_checks,
)
from handbook_lib.launch.gpus import gpus_hidden, rank_env
from handbook_lib.launch.nodes import Nodes, check_nodes
from handbook_lib.launch.outdir import OutDir, prepare_out_dir
from handbook_lib.launch.preflight import check_job_resources, check_run_config, shm_warning
from handbook_lib.launch.preempt import TORCHRUN_SIGNALS, forward_signals, raise_if_preempted
from handbook_lib.launch.processes import Agents, drain, exit_words, pump, start_agents, stop, sweep
from handbook_lib.launch.show import Show, Streamer, config_defaults
from handbook_lib.runs import available_runs, check_run_name, run_spec

__all__ = ["torchrun", "torchrun_batch", "torchrun_batches"]

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
"""The folder holding ``handbook_lib``: put on the ranks' ``PYTHONPATH``."""


def _check_call(config: Any, timeout_s: Any, env: Any, overwrite: Any) -> None:
    """Reject arguments of the wrong type before anything is created or started."""
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"config must be a dict of key -> value (e.g. {{'mode': 'none'}}), got "
                         f"{type(config).__name__} {config!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"timeout_s (--timeout) must be a finite number of seconds > 0, got {timeout_s!r}")
    if env is not None:
        if not isinstance(env, dict):
            raise ValueError(f"env must be a dict of str -> str, got {type(env).__name__}")
        bad = {k: v for k, v in env.items() if not (isinstance(k, str) and isinstance(v, str))}
        if bad:
            raise ValueError(f"env must map str to str (environment variables are text); not: "
                             f"{', '.join(f'{k!r}: {v!r}' for k, v in bad.items())}")
    if not isinstance(overwrite, bool):
        raise ValueError(f"overwrite must be True or False, got {overwrite!r}")


def torchrun(
    run: str, nproc: int = 2, config: dict[str, Any] | None = None, *,
    out: str | os.PathLike[str] | None = None, timeout_s: float = 600.0, stream: bool = True,
    env: dict[str, str] | None = None, allow_failed_checks: bool = False, overwrite: bool = False,
    nnodes: int = 1, node_rank: int | None = None, rdzv_endpoint: str | None = None,
    force_resources: bool = False,
) -> RunResult | None:
    """Run ``handbook_lib.runs.<run>`` on ``nproc`` processes and return its parsed result.

    Several nodes, two ways. With ``nnodes > 1`` and no ``node_rank``, all the nodes are on this
    machine: one torchrun agent per node, started together, meeting at a c10d rendezvous on
    127.0.0.1 (how chapter 8 and the tests run a 2-node job on one box). With ``node_rank``, this
    call is one node of a real multi-node job: it starts this node's agent only, which meets the
    others at ``rdzv_endpoint`` (``host:port`` of a machine every node can reach); run the same
    call on every node, each with its own ``node_rank``, and one ``out`` on a shared disk or an
    ``out`` per node: each node claims only its own files in it
    (:func:`~handbook_lib.core.protocol.node_files`). Either way torchrun's c10d rendezvous
    forms the job and numbers the nodes itself, in the sorted order of their descriptors
    (``node_rank`` names this node's files, not its place), and each rank records its host,
    node rank and local rank.

    Args:
        run: Name of a run module (see :func:`handbook_lib.runs.available_runs`).
        nproc: Number of processes (ranks) per node. With GPUs, at most one per visible GPU.
        config: Config keys for the run; unknown keys or bad values raise before anything starts.
        out: Directory for ``result.json``, the rank logs and states, kept after the run; if
            ``None``, a fresh temporary directory, removed when the run ends (the returned
            result's ``path`` is then ``None``): pass ``out`` to keep files for later. It must
            not exist yet, be empty, or be an earlier run's folder (it holds the
            :data:`~handbook_lib.core.protocol.RUN_MARKER` file) — the last only with ``overwrite``. A folder holding
            anything that run did not write is refused, naming it, and no file a run did not
            write is ever removed. The folder is locked while any process of the run lives: a
            second run given it meanwhile is refused, naming the process.
        timeout_s: Seconds the whole run may take before all its processes are killed (finite).
        stream: Show the run: in a terminal, the ranks' output live (prefixed ``[rankR]``) and a
            closing line; in a notebook, one line with the ranks' output folded under it.
            ``False`` shows nothing.
        env: Extra environment variables for the ranks.
        allow_failed_checks: Return the result even if a check is outside its tolerance (for
            code that studies a failing model); by default that raises :class:`ChecksFailed`.
        overwrite: Reuse an earlier run's ``out`` folder: the files its manifest lists (its
            ``result.json``, ``config.json``, rank states and torchrun's logs) are removed first,
            and the folders they leave empty; nothing else is. One line on stderr says how many.
        nnodes: Nodes in the job (each runs ``nproc`` ranks): the world size is
            ``nnodes * nproc``.
        node_rank: This machine's node in a real multi-node job (``0 .. nnodes-1``), naming its
            files in ``out``; ``None`` runs every node here.
        rdzv_endpoint: ``host:port`` of the c10d rendezvous, required with ``node_rank``.
        force_resources: Start even a job this machine cannot hold, which is otherwise refused
            before anything starts (:func:`~handbook_lib.launch.preflight.check_job_resources`).

    Returns:
        The run's ``result.json``, parsed; ``None`` on a node of a real multi-node job that did
        not run rank 0 and whose ``out`` holds no ``result.json`` (rank 0 writes it into the
        ``out`` of the node it ran on).

    Raises:
        ValueError: for an unknown run, a bad ``nproc``, ``timeout_s``, ``env`` or ``out``, or a
            config the run rejects (all before any file is written or process started).
        RunFailed: if a rank failed; the message names the rank and carries its traceback.
        RunTimeout: if the run took longer than ``timeout_s``.
        RunPreempted: if the ranks saved and stopped on SIGTERM or SIGUSR1 (a run that can
            resume: this process passes both on to the ranks while it runs).
        ChecksFailed: if a check is outside its tolerance (unless ``allow_failed_checks``).
        RunInterrupted: on Ctrl-C (a :class:`KeyboardInterrupt`), once torchrun and every rank
            are stopped; its message is one line.
    """
    results = _job(run, nproc, {"": config}, out=out, timeout_s=timeout_s, stream=stream, env=env,
                   allow_failed_checks=allow_failed_checks, overwrite=overwrite, nnodes=nnodes,
                   node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, force_resources=force_resources)
    return None if results is None else results[""]


def torchrun_batch(
    run: str,
    nproc: int,
    configs: Mapping[str, dict[str, Any] | None],
    *,
    out: str | os.PathLike[str] | None = None,
    timeout_s: float = 600.0,
    stream: bool = True,
    env: dict[str, str] | None = None,
    allow_failed_checks: bool = False,
    overwrite: bool = False,
    nnodes: int = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    force_resources: bool = False,
) -> dict[str, RunResult] | None:
    """Run several configs of ``handbook_lib.runs.<run>`` in one job: one torchrun, one process
    group, the configs one after another on the same ranks, each with its own result.

    The results are those of separate :func:`torchrun` calls (each config builds its own seeded
    model and trains on its own batches); the job pays torchrun's start, every rank's imports
    and the process group's set-up once instead of once per config (about 3 s on 2 ranks and
    4 s on 4 of a CPU's time). Arguments are :func:`torchrun`'s, ``timeout_s`` for the whole
    batch; every config is checked before anything starts.

    Args:
        configs: Label -> config keys, in the order they run (labels are non-empty strings).

    Returns:
        Label -> parsed result, in the order given (``None`` on a node of a real multi-node job
        other than rank 0's).

    Raises:
        ValueError: as :func:`torchrun`, naming the label of a config the run rejects.
        RunFailed: if a rank failed; the message names the rank and the config it was running.
        ChecksFailed: if a check of any config is outside its tolerance (unless
            ``allow_failed_checks``); :attr:`ChecksFailed.results` holds every config's result.
    """
    _check_labels(configs)
    return _job(run, nproc, dict(configs), out=out, timeout_s=timeout_s, stream=stream, env=env,
                allow_failed_checks=allow_failed_checks, overwrite=overwrite, nnodes=nnodes,
                node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, force_resources=force_resources)


def _check_labels(configs: Any) -> None:
    """A batch's configs: a non-empty mapping whose labels are non-empty strings."""
    if not isinstance(configs, Mapping) or not configs:
        raise ValueError(f"configs must be a non-empty mapping of label -> config, got {configs!r}")
    bad = [label for label in configs if not isinstance(label, str) or not label.strip()]
    if bad:
        raise ValueError(f"configs' labels must be non-empty strings, got {bad[0]!r}")


def torchrun_batches(run: str, runs: Mapping[str, tuple[int, dict[str, Any] | None]], *, timeout_s: float = 600.0,
                     stream: bool = True, env: dict[str, str] | None = None,
                     allow_failed_checks: bool = False) -> dict[str, RunResult]:
    """Run ``runs`` (label -> ``(nproc, config)``) as one :func:`torchrun_batch` per number of
    ranks, in the order each number first appears; ``timeout_s`` for each batch.

    Returns:
        Label -> parsed result, in the order of ``runs``.

    Raises:
        ValueError: for an empty ``runs``, an entry that is not ``(nproc, config)``, or as
            :func:`torchrun_batch` (every batch is checked before the first starts).
    """
    if not isinstance(runs, Mapping) or not runs:
        raise ValueError(f"runs must be a non-empty mapping of label -> (nproc, config), got {runs!r}")
    groups: dict[int, dict[str, dict[str, Any] | None]] = {}
    for label, entry in runs.items():
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise ValueError(f"runs[{label!r}] must be (nproc, config), got {entry!r}")
        groups.setdefault(check_int(f"runs[{label!r}] nproc", entry[0], 1), {})[label] = entry[1]
    checked: dict[int, dict[str, FlatConfig]] = {}
    if run in available_runs():  # every config checked once, before the first batch starts
        for nproc, batch in groups.items():
            checked[nproc] = {label: check_run_config(run, config, nproc, label=label)
                              for label, config in batch.items()}
    results: dict[str, RunResult] = {}
    for nproc, batch in groups.items():  # torchrun_batch's job, its configs already checked
        _check_labels(batch)
        results.update(_job(run, nproc, batch, out=None, timeout_s=timeout_s, stream=stream, env=env,
                            allow_failed_checks=allow_failed_checks, overwrite=False, nnodes=1, node_rank=None,
                            rdzv_endpoint=None, checked=checked.get(nproc)) or {})
    return {label: results[label] for label in runs}


def _job(run: str, nproc: int, configs: dict[str, dict[str, Any] | None], *, out: str | os.PathLike[str] | None,
         timeout_s: float, stream: bool, env: dict[str, str] | None, allow_failed_checks: bool, overwrite: bool,
         nnodes: int, node_rank: int | None, rdzv_endpoint: str | None, force_resources: bool = False,
         checked: dict[str, FlatConfig] | None = None) -> dict[str, RunResult] | None:
    """:func:`torchrun` and :func:`torchrun_batch`: one job of one or several configs (a single
    run's label is ``""``). Each config is validated once, here, without importing torch
    (:func:`~handbook_lib.launch.preflight.check_run_config`), unless ``checked`` holds it already
    validated (:func:`torchrun_batches` checks every batch before the first starts)."""
    check_run_name(run)
    check_int("nproc", nproc, 1)
    for config in configs.values():
        _check_call(config, timeout_s, env, overwrite)
    nodes = check_nodes(nnodes, node_rank, rdzv_endpoint)
    spec = run_spec(run)
    cfgs = checked if checked is not None and list(checked) == list(configs) else {
        label: check_run_config(run, config, nnodes * nproc, label=label) for label, config in configs.items()}
    env = rank_env(env)  # HANDBOOK_DEVICE=cpu: the ranks see no GPU and run on the CPU with gloo
    if nodes.local_agents > 1:
        _check_gpus(nnodes * nproc, f"nnodes x nproc = {nnodes} x {nproc} ranks on this machine", env)
    else:
        _check_gpus(nproc, env=env)
    _warn_small_shm(nproc, env)
    check_job_resources(spec, list(cfgs.values()), nproc, world_size=nnodes * nproc,
                        local_ranks=nproc * nodes.local_agents, env=env, force=force_resources)

    defaults = config_defaults(run)
    single = list(cfgs) == [""]
    shown = cfgs[""].to_dict() if single else {}
    show = Show(run, nproc, shown, defaults, stream, kept=out is not None, nnodes=nnodes,
                batch=0 if single else len(cfgs))
    claimed = prepare_out_dir(run, out, overwrite, node=nodes.node_rank)
    if claimed.removed:
        print(f"out (--out) {str(claimed.path)!r}: removed the {claimed.removed} file{'s' * (claimed.removed != 1)} "
              f"of the earlier run (--overwrite); nothing else", file=sys.stderr)
    temporary = out is None
    try:
        results = _launch(run, nproc, cfgs, claimed, timeout_s, show, env, allow_failed_checks, nodes,
                          spec.preemptible)
        if results is None:
            return None
        return {k: dataclasses.replace(r, path=None) for k, r in results.items()} if temporary else results
    except (RunFailed, RunInterrupted) as err:
        if temporary:  # its folder is removed below: point at nothing
            err.out_dir = None
            if isinstance(err, ChecksFailed):
                err.results = {k: dataclasses.replace(r, path=None) for k, r in err.results.items()}
                err.result = next(r for r in err.results.values() if r.failed_checks())
        raise
    finally:
        claimed.release()
        if temporary:  # the folder mkdtemp made for this run, and nothing else
            shutil.rmtree(claimed.path, ignore_errors=True)


def _launch(run: str, nproc: int, cfgs: dict[str, FlatConfig], claimed: OutDir, timeout_s: float, show: Show,
            env: dict[str, str] | None, allow_failed_checks: bool, nodes: Nodes,
            preemptible: bool) -> dict[str, RunResult] | None:
    """:func:`torchrun` once its arguments are checked and its folder is claimed."""
    out_dir = claimed.path
    try:
        results = _launch_and_wait(run, nproc, cfgs, claimed, timeout_s, show, env, allow_failed_checks, nodes,
                                   preemptible)
    except RunFailed as err:
        failed = getattr(err, "results", None)
        outcome = ("" if failed is not None else "timed out" if isinstance(err, RunTimeout)
                   else f"preempted at step {err.step}, saved" if isinstance(err, RunPreempted)
                   else "failed" + (f" (rank {err.rank})" if err.rank is not None else ""))
        show.end(list(failed.values()) if failed else None, time.monotonic() - show.started, out_dir, outcome)
        raise
    except BaseException as err:  # Ctrl-C, or an error of the launcher itself
        outcome = "interrupted" if isinstance(err, KeyboardInterrupt) else f"stopped by {type(err).__name__}"
        show.end(None, time.monotonic() - show.started, out_dir, outcome)
        raise
    show.end(list(results.values()) if results else None, time.monotonic() - show.started, out_dir)
    return results


def _launch_and_wait(run: str, nproc: int, cfgs: dict[str, FlatConfig], claimed: OutDir, timeout_s: float,
                     show: Show, env: dict[str, str] | None, allow_failed_checks: bool,
                     nodes: Nodes, preemptible: bool) -> dict[str, RunResult] | None:
    """Start torchrun, stream its output through ``show``, and read the results or the failure."""
    out_dir = claimed.path
    config_path = out_dir / node_config_file(nodes.node_rank)
    written = (cfgs[""].to_dict() if list(cfgs) == [""] else
               {BATCH_KEY: [{"label": label, "config": cfg.to_dict()} for label, cfg in cfgs.items()]})
    config_path.write_text(json.dumps(written, indent=2) + "\n")
    deadline = time.time() + timeout_s
    child_env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")])),
        DEADLINE_ENV: f"{deadline:.3f}",
        COLLECTIVE_TIMEOUT_ENV: str(collective_timeout_s(timeout_s)),
        **TORCHRUN_SIGNALS,
        **(env or {}),
    }
    tail = ["-m", f"handbook_lib.runs.{run}", "--config", str(config_path), "--out", str(out_dir)]
    show.started = time.monotonic()
    streamer = show.start()
    proc = start_agents(nodes.commands(nproc, out_dir, tail),
                        [{**child_env, **({} if gpus_hidden(env) else nodes.agent_env(k, nproc))}
                         for k in range(nodes.local_agents)])
    timed_out = False
    killed = 0
    # this node's processes: its agent's and its ranks' command lines name its own config file
    # (in a folder shared by the nodes of a real multi-node job, the folder would name theirs too)
    mentions = (f"handbook_lib.runs.{run}", str(config_path))
    try:
        # the folder stays locked while an agent lives, even once this process is killed
        claimed.record_writers([p.pid for p in (proc.procs if isinstance(proc, Agents) else [proc])], "torchrun")
        with forward_signals(proc, preemptible):  # a preemption notice: the ranks save and stop
            timed_out = not pump(proc, streamer, deadline)
    except KeyboardInterrupt:  # Ctrl-C in a notebook or a terminal: leave nothing behind
        _, ranks = stop(proc, mentions)
        streamer.close()
        raise RunInterrupted(f"run {run!r} interrupted; torchrun and {ranks} rank{'s' * (ranks != 1)} "
                             f"stopped", run=run, out_dir=out_dir) from None
    except BaseException:
        stop(proc, mentions)
        streamer.close()
        raise
    finally:
        if timed_out:
            killed, _ = stop(proc, mentions)
        elif nodes.count > 1:  # a rank whose agent was killed is killed with it; make sure
            sweep(mentions)
        drain(proc, streamer)
        streamer.close()
        if proc.stdout:
            proc.stdout.close()
    common: dict[str, Any] = dict(run=run, out_dir=out_dir, returncode=proc.returncode, log_tail=list(streamer.tail))
    raise_if_preempted(run, out_dir, nodes.count * nproc, common)
    if timed_out:
        _, states = diagnose_failure(out_dir, nodes.count * nproc)
        lines = [f"run {run!r} did not finish within {timeout_s:g} s and was stopped "
                 f"({killed} process{'es' * (killed != 1)} killed). Where each rank was:"]
        raise RunTimeout("\n".join(lines + where_ranks_were(states)), rank=None, rank_traceback="", **common)
    if proc.returncode != 0:
        _raise_failure(run, nproc, proc, streamer, show, nodes, common)
    return _read_results(run, list(cfgs), out_dir, nodes, allow_failed_checks, common)


def _raise_failure(run: str, nproc: int, proc: subprocess.Popen | Agents, streamer: Streamer, show: Show,
                   nodes: Nodes, common: dict[str, Any]) -> None:
    """Raise :class:`RunFailed` for a run whose torchrun ended with an error, naming the rank."""
    out_dir = common["out_dir"]
    cause, states = diagnose_failure(out_dir, nodes.count * nproc)
    if cause is None:
        tail = "\n".join(list(streamer.tail)[-20:])
        raise RunFailed(f"run {run!r} failed (torchrun exit code {proc.returncode}) before any "
                        f"rank reported; last output:\n{tail}", rank=None, rank_traceback="", **common)
    agent = proc.failed_code if isinstance(proc, Agents) else None
    own = None
    if not show.kept:  # its logs/ go with the temporary folder: show its last lines instead
        own = [line for line in streamer.tail if line.startswith(f"[rank{cause.rank}] ")][-10:]
    message = failure_message(run, cause, states, where=nodes.where(cause.rank, nproc, out_dir),
                              agent_exit=exit_words(agent) if agent is not None else "", own_output=own)
    raise RunFailed(message, rank=cause.rank, rank_traceback=cause.traceback, **common)


def _read_results(run: str, labels: list[str], out_dir: Path, nodes: Nodes, allow_failed_checks: bool,
                  common: dict[str, Any]) -> dict[str, RunResult] | None:
    """The results of a job whose torchrun ended cleanly, by label (``None`` on a node other than
    rank 0's in a real multi-node job); :class:`ChecksFailed` if a check is off.

    torchrun's c10d rendezvous numbers the nodes itself (``--node-rank`` is ignored), so rank 0
    may run under any node's command: a node knows it hosted rank 0 from rank 0's state file in
    its folder."""
    paths = {label: batch_result_path(out_dir, k) if label else out_dir / RESULT_FILE
             for k, label in enumerate(labels)}
    missing = [p for p in paths.values() if not p.exists()]
    if missing and nodes.node_rank is not None and not rank_status_path(out_dir, 0).exists():
        return None  # one node of a real multi-node job: rank 0's node holds the result
    if missing:
        raise RunFailed(f"run {run!r} exited cleanly but wrote no {missing[0].relative_to(out_dir)} in {out_dir}",
                        rank=None, rank_traceback="", **common)
    results = {label: load_result(path) for label, path in paths.items()}
    _log_results(results)
    failed = {label: r for label, r in results.items() if r.failed_checks()}
    if failed and not allow_failed_checks:
        total = sum(len(r.checks) for r in results.values())
        bad = sum(len(r.failed_checks()) for r in failed.values())
        where = "" if labels == [""] else f" (in {', '.join(repr(k) for k in failed)})"
        text = "\n".join((f"{label}:\n" if label else "") + describe_failed_checks(r) for label, r in failed.items())
        raise ChecksFailed(f"run {run!r} finished, but {bad} of its {total} checks are outside their "
                           f"tolerance{where}:\n{text}", result=next(iter(failed.values())), results=results,
                           **common)
    return results


def _log_results(results: dict[str, RunResult]) -> None:
    """Append a line per result to the file :data:`~handbook_lib.core.protocol.RESULTS_LOG_ENV`
    names, if the caller set it."""
    path = os.environ.get(RESULTS_LOG_ENV)
    if not path:
        return
    with open(path, "a") as log:
        for label, result in results.items():
            log.write(json.dumps({"run": result.run, "label": label, "world_size": result.world_size,
                                  "checks": len(result.checks), "failed": len(result.failed_checks())}) + "\n")


def _warn_small_shm(nproc: int, env: dict[str, str] | None) -> None:
    """One line on stderr when NCCL ranks would share a container's 64 MB ``/dev/shm``."""
    import torch

    note = shm_warning(nproc, torch.cuda.is_available() and not gpus_hidden(env))
    if note:
        print(note, file=sys.stderr)


def _check_gpus(nproc: int, said: str = "", env: dict[str, str] | None = None) -> None:
    """Refuse more ranks on this machine than GPUs; ``said`` is how the caller asked for them
    (default ``nproc=N``). Ranks whose ``env`` hides the GPUs run on the CPU: any number fits."""
    import torch

    if gpus_hidden(env):
        return
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise ValueError(
            f"{said or f'nproc={nproc}'} but {torch.cuda.device_count()} GPU(s) are visible; "
            "NCCL needs one rank per GPU: use nproc <= the GPU count"
        )
