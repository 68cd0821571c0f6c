"""Start a run of :mod:`handbook_lib.runs` on N processes with ``torchrun`` and get its result.

Chapter 1 introduces it; it is the one thing a notebook cell calls to run a real experiment::

    from handbook_lib.launch import torchrun
    result = torchrun("fsdp_train", nproc=2, config={"steps": 3})
    result.checks          # predictions beside measurements

What it guarantees:

- in a terminal, every rank's output is streamed live, prefixed ``[rankR]``, through Python's
  ``sys.stdout``, and rank 0's progress bar, labelled with the run's name, redraws in place;
- in a notebook, a run is one line (what ran, on how many ranks, how its checks came out) that
  repeats on any machine; the ranks' whole output is folded under it (HTML ``<details>``);
- the rendezvous is on 127.0.0.1 with a port the OS picks, so runs never collide;
- the result comes back parsed from ``result.json`` (a :class:`~handbook_lib.results.RunResult`);
- a failing rank raises :class:`RunFailed` naming the rank that caused it, with its traceback;
- a run past ``timeout_s`` is stopped with every one of its processes, and raises
  :class:`RunTimeout` showing where each rank was; Ctrl-C stops them too and raises
  :class:`RunInterrupted` (a ``KeyboardInterrupt``) with a one-line message;
- without ``out``, the run's folder is a temporary one, removed when the run ends (however it
  ends); ``out`` is the caller's and is kept. ``out`` is never shared or silently reused: a run
  claims its folder with a marker file and a lock, refuses a folder holding anything else, and
  replaces an earlier run's files only with ``overwrite=True``;
- a run whose ``checks`` include one outside its own tolerance raises :class:`ChecksFailed`
  (the parsed result is attached): a model that disagrees with its measurement is a failure.
"""

from __future__ import annotations

import dataclasses
import fcntl
import importlib
import json
import math
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import psutil

from handbook_lib.display import WIDTH, RunReport, describe_run
from handbook_lib.results import RunResult, load_result
from handbook_lib.runs import available_runs

__all__ = ["RunFailed", "RunTimeout", "ChecksFailed", "RunInterrupted", "torchrun", "diagnose_failure",
           "RankFailure", "describe_failed_checks", "RUN_MARKER", "RUN_FILES"]

_RANK_PREFIX = re.compile(r"^\[default(\d+)\]:")
_PROGRESS = re.compile(r"\d+%\|")
_CONSEQUENTIAL = re.compile(
    r"closed by peer|reset by peer|Broken pipe|remote worker|timed out|timeout|"
    r"communicator was aborted|NCCL error",
    re.IGNORECASE,
)
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)
RUN_MARKER = ".handbook-run"
"""File a run writes into its ``out`` folder: it names the run, marks the folder as a run's, and is
the lock (``fcntl.flock``) held for the whole run so two runs never share a folder."""
RUN_FILES = ("result.json", "config.json", "ranks", "logs")
"""What a run writes into its ``out`` folder (besides :data:`RUN_MARKER`); only these are removed
when a run overwrites an earlier run's folder."""


class RunFailed(RuntimeError):
    """A run ended without a result. ``str(err)`` says which rank failed and why.

    Attributes:
        run: The run's name.
        rank: The rank found to have caused the failure, or ``None`` if none could be named.
        rank_traceback: That rank's Python traceback (``""`` if it died without one).
        out_dir: The run's directory (logs under ``logs/``, rank states under ``ranks/``), or
            ``None`` when it was a temporary one (no ``out`` given): removed once the run ended.
        returncode: torchrun's exit status (``None`` if it was killed).
        log_tail: The last lines of output (all ranks and torchrun itself).
    """

    def __init__(self, message: str, *, run: str, rank: int | None, rank_traceback: str,
                 out_dir: Path | None, returncode: int | None, log_tail: list[str]) -> None:
        super().__init__(message)
        self.run = run
        self.rank = rank
        self.rank_traceback = rank_traceback
        self.out_dir = out_dir
        self.returncode = returncode
        self.log_tail = log_tail


class RunTimeout(RunFailed):
    """A run did not finish within its timeout; all its processes were killed."""


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C (SIGINT in the launching process); torchrun and its ranks were killed.

    A :class:`KeyboardInterrupt` (so ``except Exception`` does not swallow a user's Ctrl-C), whose
    message is one line, e.g. ``run 'fsdp_train' interrupted; torchrun and 2 ranks stopped``.
    IPython and Jupyter show only that line (``_render_traceback_``), not the launcher's frames.

    Attributes:
        run: The run's name.
        out_dir: The run's directory (whatever the ranks wrote before they were stopped), or
            ``None`` when it was a temporary one, removed.
    """

    def __init__(self, message: str, *, run: str, out_dir: Path | None) -> None:
        super().__init__(message)
        self.run = run
        self.out_dir = out_dir

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class ChecksFailed(RunFailed):
    """A run finished and wrote its result, but at least one check is outside its tolerance.

    Attributes:
        result: The parsed ``result.json`` (every check, passed or not).
        failed: The checks outside their tolerance.
    """

    def __init__(self, message: str, *, result: RunResult, **kwargs: Any) -> None:
        super().__init__(message, rank=None, rank_traceback="", **kwargs)
        self.result = result
        self.failed = result.failed_checks()


def describe_failed_checks(result: RunResult, limit: int = 10) -> str:
    """One line per failed check (the first ``limit``): quantity, rank, prediction, measurement,
    relative error and the tolerance it broke; ``""`` when every check passed."""
    failed = result.failed_checks()
    lines = []
    for c in failed[:limit]:
        allowed = "exact" if c.tolerance == 0 else f"within {c.tolerance:.0%}"
        rel = "" if c.predicted == 0 else f", {c.relative_error:+.2%}"
        lines.append(f"  {c.quantity} (rank {c.rank}): predicted {c.predicted:,}, measured "
                     f"{c.measured:,} {c.unit}{rel}; the check is {allowed}")
    if len(failed) > limit:
        lines.append(f"  ... and {len(failed) - limit} more")
    return "\n".join(lines)


@dataclass(frozen=True)
class RankFailure:
    """How one rank ended, as read from its files in ``DIR/ranks``."""

    rank: int
    status: str
    """``ok``; ``error`` (raised a Python exception); ``stopped`` (killed by a signal, stacks
    dumped); ``silent`` (died without a word: ``os._exit``, a segfault, SIGKILL, out of memory);
    ``starting`` (never reached the run's code: still starting, or died while importing)."""
    summary: str
    traceback: str = ""
    consequential: bool = False
    """True for errors that follow from another rank's failure (a peer gone, a collective timeout)."""


def _read_rank(ranks_dir: Path, rank: int) -> RankFailure:
    status_file = ranks_dir / f"rank{rank}.json"
    stacks_file = ranks_dir / f"rank{rank}.stacks.txt"
    if status_file.exists():
        info = json.loads(status_file.read_text())
        if info["status"] == "ok":
            return RankFailure(rank, "ok", "finished")
        summary = f"{info['error_type']}: {info['message']}".strip()
        consequential = bool(info.get("distributed_error")) or bool(_CONSEQUENTIAL.search(summary))
        return RankFailure(rank, "error", summary, info.get("traceback", ""), consequential)
    if not stacks_file.exists():  # the harness creates it first thing: this rank never got there
        return RankFailure(
            rank, "starting",
            "ended before reaching the run's code (while Python started or imported torch and the "
            "run's modules); its own output is under logs/",
        )
    stacks = stacks_file.read_text()
    if stacks.strip():
        return RankFailure(rank, "stopped", "stopped by a signal; its Python stacks follow", stacks)
    return RankFailure(
        rank, "silent",
        "died without a Python traceback (os._exit, a signal such as SIGKILL, a crash in C++ "
        "code, or the out-of-memory killer)",
    )


def diagnose_failure(out_dir: Path, world_size: int) -> tuple[RankFailure | None, list[RankFailure]]:
    """Find the rank that caused a failed run, from the files its ranks left in ``out_dir/ranks``.

    The cause is, in this order: the first rank (by time) that raised an exception of its own;
    else a rank that died silently; else the first rank whose error was a consequence of
    another's (a lost peer, a collective timeout); else a rank stopped by a signal.

    Returns:
        ``(cause, all_ranks)``: the cause (``None`` if no rank failed) and every rank's state.
    """
    ranks_dir = Path(out_dir) / "ranks"
    states = [_read_rank(ranks_dir, r) for r in range(world_size)]

    def when(state: RankFailure) -> float:
        path = ranks_dir / f"rank{state.rank}.json"
        return json.loads(path.read_text()).get("time", 0.0) if path.exists() else 0.0

    errors = sorted((s for s in states if s.status == "error"), key=when)
    for group in (
        [s for s in errors if not s.consequential],
        [s for s in states if s.status in ("silent", "starting")],
        _hung(errors, states),
        errors,
        [s for s in states if s.status == "stopped"],
    ):
        if group:
            return group[0], states
    return None, states


_SELF_EXPLAINED = ("NonFiniteLoss:",)
"""Errors whose message says all (which step, which rank, why): their traceback is kept on
:attr:`RunFailed.rank_traceback` and in ``logs/``, not printed in the message."""
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def _hung(errors: list[RankFailure], states: list[RankFailure]) -> list[RankFailure]:
    """A rank that hung: others timed out waiting in a collective while it, still running, was
    stopped. It is the cause, not the ranks that waited for it."""
    if not errors or not all(e.consequential and _TIMED_OUT.search(e.summary) for e in errors):
        return []
    waited = errors[0]
    first_line = waited.summary.splitlines()[0][:200]
    stopped = [s for s in states if s.status == "stopped"]
    # a rank stopped inside a collective was waiting too: blame first one stopped elsewhere
    stopped.sort(key=lambda s: "torch/distributed" in _first_stack(s.traceback))
    return [
        dataclasses.replace(s, summary=(
            f"hung: it never joined the collective that rank {waited.rank} waited in until it "
            f"timed out ({first_line}); rank {s.rank} was still running when it was stopped, at:"))
        for s in stopped
    ]


def _kill_tree(proc: subprocess.Popen, grace_s: float = 5.0, *, mentions: tuple[str, ...] = ()
               ) -> tuple[int, int]:
    """Stop torchrun and all its ranks; return ``(processes signalled, ranks among them)``.

    torchrun starts each rank in a session of its own, so signalling torchrun's process group is
    not enough, and a rank it starts while the tree is walked would be missed (and orphaned once
    torchrun dies). So torchrun is first frozen (SIGSTOP: it starts nothing more), then the tree
    is walked again and again until no new process appears; every rank gets SIGTERM (it dumps
    its stacks), whatever survives ``grace_s`` gets SIGKILL, and torchrun last. A final sweep
    kills any process whose command line holds every string of ``mentions`` (this run's module
    and output folder), should one have escaped the tree.
    """
    try:
        agent: psutil.Process | None = psutil.Process(proc.pid)
        agent.suspend()
    except psutil.NoSuchProcess:
        agent = None
    seen: dict[int, psutil.Process] = {}
    ranks = 0
    quiet_walks = 0
    try:
        while agent is not None and quiet_walks < 3:  # three walks in a row without a new process
            try:
                children = agent.children(recursive=True)
                direct = {p.pid for p in agent.children()}
            except psutil.NoSuchProcess:
                break
            fresh = [p for p in children if p.pid not in seen]
            for p in fresh:
                seen[p.pid] = p
                ranks += p.pid in direct
                try:
                    p.send_signal(signal.SIGTERM)
                except psutil.NoSuchProcess:
                    pass
            quiet_walks = 0 if fresh else quiet_walks + 1
            time.sleep(0.02)
        _kill_and_wait(_wait_gone(list(seen.values()), grace_s), grace_s)
    finally:
        # Whatever happened above (even a second Ctrl-C), the frozen agent must not outlive this
        # call: SIGKILL ends a stopped process too, and its ranks die with it (PR_SET_PDEATHSIG).
        if agent is not None:
            try:
                agent.kill()
            except psutil.NoSuchProcess:
                pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
        pass
    if mentions:
        escaped = _processes_mentioning(mentions, exclude=set(seen) | {proc.pid})
        _kill_and_wait(escaped, grace_s)
        seen.update({p.pid: p for p in escaped})
    return len(seen) + (agent is not None), ranks


def _kill_and_wait(procs: list[psutil.Process], timeout_s: float) -> None:
    """SIGKILL every process of ``procs`` still there, and wait up to ``timeout_s`` seconds for
    them to be gone."""
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _wait_gone(procs, timeout_s)


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait up to ``timeout_s`` seconds for processes to end; return those still running.

    A zombie counts as ended: the ranks' parent (torchrun, frozen) cannot reap them yet, and
    ``psutil.wait_procs`` would wait the whole timeout for them.
    """
    deadline = time.monotonic() + timeout_s
    alive = list(procs)
    while True:
        still = []
        for p in alive:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    still.append(p)
            except psutil.NoSuchProcess:
                pass
        alive = still
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def _processes_mentioning(mentions: tuple[str, ...], exclude: set[int]) -> list[psutil.Process]:
    """Live processes (not this one or its ancestors) whose command line holds every string."""
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.pid in mine or p.pid in exclude or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            line = " ".join(p.info["cmdline"] or [])
            if all(m in line for m in mentions):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def in_notebook() -> bool:
    """True inside a Jupyter kernel (JupyterLab, nbclient, nbval): a run is then shown as one
    line with its log folded under it, not as streamed lines."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


class _NotebookView:
    """One output in a notebook cell, updated in place: the run's line and its latest log line
    while it runs, then its :class:`~handbook_lib.display.RunReport`."""

    def __init__(self, line: str, display: Any = None) -> None:
        if display is None:
            from IPython.display import display
        self._line = line
        self._shown = 0.0
        self.handle = display(RunReport(f"{line}: starting"), display_id=True)

    def status(self, latest: str) -> None:
        now = time.monotonic()
        if now - self._shown >= 0.25:  # a redraw per step is plenty
            self._shown = now
            self.handle.update(RunReport(f"{self._line}: running\n  {latest[:WIDTH - 2]}"))

    def finish(self, report: RunReport) -> None:
        self.handle.update(report)


class _Streamer:
    """Turn torchrun's ``--tee`` output into ``[rankR] line``: echoed live on ``sys.stdout`` (a
    terminal: rank 0's progress bar redrawn in place, labelled ``label``), or shown as the latest
    line of a :class:`_NotebookView`; kept whole in :attr:`log` either way."""

    def __init__(self, echo: bool, out: TextIO | None = None, *, label: str = "",
                 view: _NotebookView | None = None) -> None:
        self.echo = echo
        self.out = out
        self.label = label
        self.view = view
        self.tail: deque[str] = deque(maxlen=200)
        self.log: deque[str] = deque(maxlen=5000)
        self._pending = b""
        self._in_progress = False
        self._log_progress = False

    def feed(self, data: bytes) -> None:
        self._pending += data
        *lines, self._pending = self._pending.split(b"\n")
        for raw in lines:
            self._line(raw.decode(errors="replace").rstrip("\r"))

    def close(self) -> None:
        if self._pending:
            self._line(self._pending.decode(errors="replace"))
            self._pending = b""
        if self._in_progress:
            self._write("\n")
            self._in_progress = False

    def _write(self, text: str) -> None:
        out = self.out or sys.stdout
        out.write(text)
        out.flush()

    def _labelled(self, body: str) -> str:
        """A progress bar's line with the run's label in place of its own (``train:`` or none)."""
        bar = _PROGRESS.search(body)
        assert bar is not None
        own = body[:bar.start()].strip().rstrip(":").strip()
        name = " ".join(x for x in (self.label, "" if own in ("", "train") else own) if x)
        return f"{name}: {body[bar.start():]}" if name else body

    def _line(self, line: str) -> None:
        match = _RANK_PREFIX.match(line)
        body = ""
        if match:
            body = line[match.end():]
            if not body.strip():
                return
            line = f"[rank{match.group(1)}] {body}"
        self.tail.append(line)
        progress = bool(match and _PROGRESS.search(body))
        if progress and self._log_progress:
            self.log[-1] = line  # a bar's redraw replaces its last state in the log
        else:
            self.log.append(line)
        self._log_progress = progress
        if self.view is not None and match:
            self.view.status(line)
        if not self.echo or not match:
            return  # torchrun's own chatter is kept for the log and the error message, not shown
        if progress:
            self._write(("\r" if self._in_progress else "") + self._labelled(body))
            self._in_progress = True
            return
        if self._in_progress:
            self._write("\n")
            self._in_progress = False
        self._write(line + "\n")


_OUT_ACCEPTS = "accepted: a new or empty folder, or a run's (overwrite=True, --overwrite)"


class _OutDir:
    """A run's output folder, claimed: its marker written and its lock held until :meth:`release`."""

    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self._fd: int | None = lock_fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None


def _marked_run(marker: Path) -> str:
    """The run named in a marker file (``"?"`` when it cannot be read)."""
    try:
        return str(json.loads(marker.read_text()).get("run", "?"))
    except (OSError, ValueError, AttributeError):
        return "?"


def _prepare_out_dir(run: str, out: str | os.PathLike[str] | None, overwrite: bool = False) -> _OutDir:
    """Create or claim the folder a run writes into, and lock it for the whole run.

    A folder is accepted when it does not exist yet, is empty, or carries :data:`RUN_MARKER`
    (an earlier run's folder: only with ``overwrite``, and then only :data:`RUN_FILES` are
    removed). A folder locked by a running run is refused at once. Nothing is created or removed
    in a folder that is refused.

    Raises:
        ValueError: one line naming ``out`` (``--out``) and what is accepted.
    """
    if out is None:
        out_dir = Path(tempfile.mkdtemp(prefix=f"handbook-{run}-"))
    else:
        if not isinstance(out, (str, os.PathLike)) or not str(out).strip():
            raise ValueError(f"out (--out) must be a folder path, got {out!r}")
        out_dir = Path(out)
        if out_dir.exists() and not out_dir.is_dir():
            raise ValueError(f"out (--out) {str(out_dir)!r} is a file, not a folder; {_OUT_ACCEPTS}")
        marker = out_dir / RUN_MARKER
        if out_dir.is_dir() and not marker.is_file() and any(out_dir.iterdir()):
            raise ValueError(f"out (--out) {str(out_dir)!r} is not empty and no run wrote it; {_OUT_ACCEPTS}")
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"out (--out) {str(out_dir)!r} cannot be created: {err.strerror or err}") from None
    marker = out_dir / RUN_MARKER
    try:
        fd = os.open(marker, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise ValueError(f"out (--out) {str(out_dir)!r} cannot be written: {err.strerror or err}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"out (--out) {str(out_dir)!r} is in use by another run (run "
                         f"{_marked_run(marker)!r} holds its lock): give each run its own folder") from None
    claimed = _OutDir(out_dir, fd)
    try:
        earlier = [name for name in RUN_FILES if (out_dir / name).exists()]
        if earlier and not overwrite:
            raise ValueError(f"out (--out) {str(out_dir)!r} holds the files of an earlier run "
                             f"{_marked_run(marker)!r} ({', '.join(earlier)}); pass overwrite=True "
                             f"(--overwrite) to replace them")
        for name in earlier:  # only what a run writes: a user's own files are never touched
            target = out_dir / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink()
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps({"run": run, "pid": os.getpid(), "started": time.time()}) + "\n").encode(), 0)
    except BaseException:
        claimed.release()
        raise
    return claimed


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
    run: str,
    nproc: int = 2,
    config: dict[str, Any] | None = None,
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
) -> RunResult | None:
    """Run ``handbook_lib.runs.<run>`` on ``nproc`` processes and return its parsed result.

    Several nodes, two ways. With ``nnodes > 1`` and no ``node_rank``, all the nodes are on this
    machine: one torchrun agent per node, started together, meeting at a c10d rendezvous on
    127.0.0.1 (how chapter 8 and the tests run a 2-node job on one box). With ``node_rank``, this
    call is one node of a real multi-node job: it starts this node's agent only, which meets the
    others at ``rdzv_endpoint`` (``host:port`` of a machine every node can reach); run the same
    call on every node, each with its own ``node_rank``. Either way torchrun's c10d rendezvous
    forms the job (it numbers the nodes in the order they join), and each rank records its host,
    node rank and local rank.

    Args:
        run: Name of a run module (see :func:`handbook_lib.runs.available_runs`).
        nproc: Number of processes (ranks) per node. With GPUs, at most one per visible GPU.
        config: Config keys for the run; unknown keys or bad values raise before anything starts.
        out: Directory for ``result.json``, the rank logs and states, kept after the run; if
            ``None``, a fresh temporary directory, removed when the run ends (the returned
            result's ``path`` is then ``None``): pass ``out`` to keep files for later. It must
            not exist yet, be empty, or be an earlier run's folder (it holds the
            :data:`RUN_MARKER` file) — the last only with ``overwrite``. A folder holding
            other files is refused, and no file a run did not write is ever removed. The folder
            is locked for the whole run: a second run given it at the same time is refused.
        timeout_s: Seconds the whole run may take before all its processes are killed (finite).
        stream: Show the run: in a terminal, the ranks' output live (prefixed ``[rankR]``) and a
            closing line; in a notebook, one line with the ranks' output folded under it.
            ``False`` shows nothing.
        env: Extra environment variables for the ranks.
        allow_failed_checks: Return the result even if a check is outside its tolerance (for
            code that studies a failing model); by default that raises :class:`ChecksFailed`.
        overwrite: Reuse an earlier run's ``out`` folder: its ``result.json``, ``config.json``,
            ``ranks/`` and ``logs/`` are removed first (nothing else is).
        nnodes: Nodes in the job (each runs ``nproc`` ranks): the world size is
            ``nnodes * nproc``.
        node_rank: This machine's node in a real multi-node job (``0 .. nnodes-1``); ``None``
            runs every node here.
        rdzv_endpoint: ``host:port`` of the c10d rendezvous, required with ``node_rank``.

    Returns:
        The run's ``result.json``, parsed; ``None`` on a node of a real multi-node job whose
        ``out`` holds no ``result.json`` (rank 0 writes it, on the node it runs on).

    Raises:
        ValueError: for an unknown run, a bad ``nproc``, ``timeout_s``, ``env`` or ``out``, or a
            config the run rejects (all before any file is written or process started).
        RunFailed: if a rank failed; the message names the rank and carries its traceback.
        RunTimeout: if the run took longer than ``timeout_s``.
        ChecksFailed: if a check is outside its tolerance (unless ``allow_failed_checks``).
        RunInterrupted: on Ctrl-C (a :class:`KeyboardInterrupt`), once torchrun and every rank
            are stopped; its message is one line.
    """
    runs = available_runs()
    if run not in runs:
        raise ValueError(f"unknown run {run!r}; available runs: {', '.join(runs)}")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be an int >= 1, got {nproc!r}")
    _check_call(config, timeout_s, env, overwrite)
    nodes = _check_nodes(nnodes, node_rank, rdzv_endpoint)
    module = importlib.import_module(f"handbook_lib.runs.{run}")
    cfg = module.CONFIG.from_mapping(config)
    if hasattr(module, "validate"):
        module.validate(cfg, nnodes * nproc)
    if nodes.local_agents > 1:
        _check_gpus(nnodes * nproc, f"nnodes x nproc = {nnodes} x {nproc} ranks on this machine")
    else:
        _check_gpus(nproc)

    defaults = module.CONFIG.from_mapping({}).to_dict()
    show = _Show(run, nproc, cfg.to_dict(), defaults, stream, kept=out is not None, nnodes=nnodes)
    claimed = _prepare_out_dir(run, out, overwrite)
    temporary = out is None
    try:
        result = _launch(run, nproc, cfg, claimed.path, timeout_s, show, env, allow_failed_checks, nodes)
        if result is None:
            return None
        return dataclasses.replace(result, path=None) if temporary else result
    except (RunFailed, RunInterrupted) as err:
        if temporary:  # its folder is removed below: point at nothing
            err.out_dir = None
            if isinstance(err, ChecksFailed):
                err.result = dataclasses.replace(err.result, path=None)
        raise
    finally:
        claimed.release()
        if temporary:  # the folder mkdtemp made for this run, and nothing else
            shutil.rmtree(claimed.path, ignore_errors=True)


class _Show:
    """How a run shows itself: nothing (``stream=False``); in a notebook, one line updated in
    place then a :class:`~handbook_lib.display.RunReport` (its log folded in HTML); in a
    terminal, its description, the ranks' output live with a labelled progress bar, and a
    closing line."""

    def __init__(self, run: str, nproc: int, config: dict[str, Any], defaults: dict[str, Any], stream: bool,
                 kept: bool, nnodes: int = 1) -> None:
        self.run, self.nproc, self.config, self.defaults = run, nproc, config, defaults
        self.nnodes = nnodes
        self.stream, self.kept = stream, kept
        self.notebook = stream and in_notebook()
        self.streamer: _Streamer | None = None
        self.started = time.monotonic()

    def start(self) -> _Streamer:
        line = describe_run(self.run, self.nproc, self.config, self.defaults, nnodes=self.nnodes)
        view = _NotebookView(line) if self.notebook else None
        terminal = self.stream and not self.notebook
        if terminal:
            print(f"{line}: starting", flush=True)
        self.streamer = _Streamer(echo=terminal, label=self.run, view=view)
        return self.streamer

    def end(self, result: RunResult | None, wall_s: float, out_dir: Path, outcome: str = "") -> None:
        """Show how the run ended: ``result``, or ``outcome`` (a failure) when there is none."""
        if not self.stream or self.streamer is None:
            return
        line = describe_run(self.run, self.nproc, self.config, self.defaults, result, outcome,
                            nnodes=self.nnodes)
        detail = f"{wall_s:.1f} s wall" + (f"; result in {out_dir}" if self.kept else "")
        if self.streamer.view is not None:
            self.streamer.view.finish(RunReport(line, tuple(self.streamer.log), detail))
        else:
            print(f"{line}; {detail}", flush=True)


def _launch(run: str, nproc: int, cfg: Any, out_dir: Path, timeout_s: float, show: _Show,
            env: dict[str, str] | None, allow_failed_checks: bool, nodes: _Nodes) -> RunResult | None:
    """:func:`torchrun` once its arguments are checked and ``out_dir`` is claimed."""
    try:
        result = _launch_and_wait(run, nproc, cfg, out_dir, timeout_s, show, env, allow_failed_checks, nodes)
    except RunFailed as err:
        result = getattr(err, "result", None)
        outcome = ("" if result is not None else "timed out" if isinstance(err, RunTimeout)
                   else "failed" + (f" (rank {err.rank})" if err.rank is not None else ""))
        show.end(result, time.monotonic() - show.started, out_dir, outcome)
        raise
    except BaseException as err:  # Ctrl-C, or an error of the launcher itself
        outcome = "interrupted" if isinstance(err, KeyboardInterrupt) else f"stopped by {type(err).__name__}"
        show.end(None, time.monotonic() - show.started, out_dir, outcome)
        raise
    show.end(result, time.monotonic() - show.started, out_dir)
    return result


def _launch_and_wait(run: str, nproc: int, cfg: Any, out_dir: Path, timeout_s: float, show: _Show,
                     env: dict[str, str] | None, allow_failed_checks: bool, nodes: _Nodes) -> RunResult | None:
    """Start torchrun, stream its output through ``show``, and read the result or the failure."""
    config_path = out_dir / "config.json"
    config_path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    deadline = time.time() + timeout_s
    child_env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")])),
        "HANDBOOK_DEADLINE": f"{deadline:.3f}",
        "HANDBOOK_COLLECTIVE_TIMEOUT_S": str(max(5.0, min(300.0, 0.8 * timeout_s))),
        **(env or {}),
    }
    tail = ["-m", f"handbook_lib.runs.{run}", "--config", str(config_path), "--out", str(out_dir)]
    show.started = time.monotonic()
    streamer = show.start()
    proc = _start_agents(nodes.commands(nproc, out_dir, tail),
                         [{**child_env, **nodes.agent_env(k, nproc)} for k in range(nodes.local_agents)])
    timed_out = False
    killed = 0
    mentions = (f"handbook_lib.runs.{run}", str(out_dir))
    try:
        timed_out = not _pump(proc, streamer, deadline)
    except KeyboardInterrupt:  # Ctrl-C in a notebook or a terminal: leave nothing behind
        _, ranks = _stop(proc, mentions)
        streamer.close()
        raise RunInterrupted(f"run {run!r} interrupted; torchrun and {ranks} rank{'s' * (ranks != 1)} "
                             f"stopped", run=run, out_dir=out_dir) from None
    except BaseException:
        _stop(proc, mentions)
        streamer.close()
        raise
    finally:
        if timed_out:
            killed, _ = _stop(proc, mentions)
        elif nodes.count > 1:  # a rank whose agent was killed is killed with it; make sure
            _sweep(mentions)
        _drain(proc, streamer)
        streamer.close()
        if proc.stdout:
            proc.stdout.close()

    world = nodes.count * nproc
    common = dict(run=run, out_dir=out_dir, returncode=proc.returncode, log_tail=list(streamer.tail))
    if timed_out:
        _, states = diagnose_failure(out_dir, world)
        lines = [f"run {run!r} did not finish within {timeout_s:g} s and was stopped "
                 f"({killed} process{'es' * (killed != 1)} killed). Where each rank was:"]
        lines += _where_ranks_were(states)
        raise RunTimeout("\n".join(lines), rank=None, rank_traceback="", **common)
    if proc.returncode != 0:
        cause, states = diagnose_failure(out_dir, world)
        if cause is None:
            tail = "\n".join(list(streamer.tail)[-20:])
            raise RunFailed(f"run {run!r} failed (torchrun exit code {proc.returncode}) before any "
                            f"rank reported; last output:\n{tail}", rank=None, rank_traceback="",
                            **common)
        where = nodes.where(cause.rank, nproc, out_dir)
        message = f"run {run!r} failed: rank {cause.rank}{where} {_verb(cause)}{cause.summary}"
        if isinstance(proc, _Agents) and proc.failed_code is not None:
            # (agents are numbered by the rendezvous as they join, so name the rank's node only)
            message += f"\n(the first torchrun agent to end was {_exit_words(proc.failed_code)})"
        if not show.kept and cause.status in ("starting", "silent"):  # its logs/ go with the folder
            own = [line for line in streamer.tail if line.startswith(f"[rank{cause.rank}] ")][-10:]
            message = message.replace("its own output is under logs/", "its last output follows")
            if own:
                message += f"\n\n--- last output of rank {cause.rank}:\n" + "\n".join(own)
        if cause.status == "stopped":
            message += f"\n{_first_stack(cause.traceback)}"
        elif cause.traceback and not cause.summary.startswith(_SELF_EXPLAINED):
            message += f"\n\n--- traceback of rank {cause.rank} ---\n{cause.traceback.rstrip()}"
        for s in states:
            if s.rank == cause.rank or s.status == "ok":
                continue
            if s.status == "stopped":
                message += f"\n\n--- rank {s.rank} was still running, at:\n{_first_stack(s.traceback)}"
            else:
                message += f"\n\n--- then rank {s.rank}: {s.summary.splitlines()[0][:300]}"
        raise RunFailed(message, rank=cause.rank, rank_traceback=cause.traceback, **common)
    if not (out_dir / "result.json").exists() and nodes.node_rank not in (None, 0):
        return None  # one node of a real multi-node job: rank 0's node holds the result
    if not (out_dir / "result.json").exists():
        raise RunFailed(f"run {run!r} exited cleanly but wrote no result.json in {out_dir}",
                        rank=None, rank_traceback="", **common)
    result = load_result(out_dir)
    if result.failed_checks() and not allow_failed_checks:
        raise ChecksFailed(
            f"run {run!r} finished, but {len(result.failed_checks())} of its {len(result.checks)} "
            f"checks are outside their tolerance:\n{describe_failed_checks(result)}",
            result=result, **common)
    return result


def _where_ranks_were(states: list[RankFailure]) -> list[str]:
    """Timeout report lines: each stopped rank's stack; ranks in any other state grouped."""
    lines: list[str] = []
    others: dict[str, list[int]] = {}
    for s in states:
        if s.status == "stopped":
            lines.append(f"--- rank {s.rank}:\n{_first_stack(s.traceback)}")
        else:
            summary = s.summary
            if s.status == "starting":
                summary = ("still starting (Python start-up or importing torch): it had not reached "
                           "the run's code when the run was stopped")
            elif s.status == "silent":
                summary = "stopped before it could dump its stacks (killed while unresponsive)"
            others.setdefault(summary, []).append(s.rank)
    for summary, ranks in others.items():
        label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranges(ranks)}"
        lines.append(f"--- {label}: {summary}")
    return lines


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(parts)


def _verb(state: RankFailure) -> str:
    return "raised " if state.status == "error" else ""


def _first_stack(stacks: str) -> str:
    """The first thread stack of a faulthandler dump, without interpreter start-up frames."""
    kept: list[str] = []
    for line in stacks.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            if kept:
                break
            kept.append("  (most recent call first)")
        elif line.startswith("  File") and "<frozen runpy>" not in line and "<module>" not in line:
            kept.append(line)
    return "\n".join(kept)


def _pump(proc: subprocess.Popen, streamer: _Streamer, deadline: float) -> bool:
    """Stream output until the process exits (True) or the deadline passes (False)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.time()
            if remaining <= 0:
                return False
            if sel.select(timeout=min(remaining, 0.2)):
                data = os.read(fd, 65536)
                if data:
                    streamer.feed(data)
                    continue
                # EOF: torchrun closed its output; wait for its exit within the deadline.
                while proc.poll() is None:
                    if time.time() >= deadline:
                        return False
                    time.sleep(0.05)
                return True
            if proc.poll() is not None and not sel.select(timeout=0):
                return True


def _drain(proc: subprocess.Popen, streamer: _Streamer) -> None:
    """Read what is left in the pipe after the process ended (non-blocking)."""
    if proc.stdout is None or proc.poll() is None:
        return
    os.set_blocking(proc.stdout.fileno(), False)
    try:
        while data := os.read(proc.stdout.fileno(), 65536):
            streamer.feed(data)
    except (BlockingIOError, OSError):
        pass


@dataclass(frozen=True)
class _Nodes:
    """The nodes of a job and how their torchrun agents meet (see :func:`torchrun`)."""

    count: int = 1
    node_rank: int | None = None
    """This machine's node in a real multi-node job; ``None``: every node runs here."""
    endpoint: str = "127.0.0.1:0"

    def commands(self, nproc: int, out_dir: Path, tail: list[str]) -> list[list[str]]:
        """One torchrun command per agent this machine starts."""
        def agent(node: int | None, conf: list[str], logs: Path) -> list[str]:
            rank = [] if node is None else ["--node-rank", str(node)]
            return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.count),
                    *rank, "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.rdzv_id(out_dir), *conf,
                    "--max-restarts", "0", "--tee", "3", "--log-dir", str(logs), *tail]

        if self.count == 1:
            return [agent(None, [], out_dir / "logs")]
        if self.node_rank is not None:
            return [agent(self.node_rank, [], out_dir / "logs" / f"node{self.node_rank}")]
        # every node here: node 0's agent hosts the rendezvous store, the others join it
        return [agent(k, ["--rdzv-conf", f"is_host={'true' if k == 0 else 'false'}"],
                      out_dir / "logs" / f"node{k}") for k in range(self.count)]

    @property
    def local_agents(self) -> int:
        """Agents this machine starts: every node's, or only its own."""
        return self.count if self.node_rank is None else 1

    def agent_env(self, agent: int, nproc: int) -> dict[str, str]:
        """Extra environment of this machine's ``agent``-th agent. With every node here and
        GPUs visible, each agent gets its own ``nproc`` of them (``CUDA_VISIBLE_DEVICES``), as
        separate machines would: rank ``cuda:LOCAL_RANK`` of two agents must not share a GPU."""
        if self.node_rank is not None or self.count == 1:
            return {}
        import torch

        if not torch.cuda.is_available():
            return {}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        return {"CUDA_VISIBLE_DEVICES": ",".join(ids[agent * nproc:(agent + 1) * nproc])}

    def rdzv_id(self, out_dir: Path) -> str:
        """The job's name at the rendezvous: the same on every node of one job."""
        if self.node_rank is not None:
            return "handbook-" + re.sub(r"[^A-Za-z0-9]+", "-", self.endpoint)
        return f"handbook-{os.getpid()}-{out_dir.name}"

    def where(self, rank: int, nproc: int, out_dir: Path) -> str:
        """`` (node N, local rank L)`` for a job over several nodes, else ``""``. Read from the
        rank's own state file; a rank that left none (its node died) is placed the way torchrun
        numbers them, ``node = rank // nproc``."""
        if self.count == 1:
            return ""
        path = out_dir / "ranks" / f"rank{rank}.json"
        try:
            info = json.loads(path.read_text())
            node, local = int(info["node_rank"]), int(info["local_rank"])
        except (OSError, ValueError, KeyError):
            node, local = divmod(rank, nproc)
        return f" (node {node}, local rank {local})"


def _check_nodes(nnodes: int, node_rank: int | None, rdzv_endpoint: str | None) -> _Nodes:
    """The job's nodes, or ValueError naming the argument and what it accepts."""
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"nnodes must be an int >= 1, got {nnodes!r}")
    if node_rank is None:
        if rdzv_endpoint is not None:
            raise ValueError("rdzv_endpoint needs node_rank: it is for one node of a real "
                             "multi-node job (without node_rank every node runs here)")
        if nnodes == 1:
            return _Nodes()
        return _Nodes(nnodes, None, f"127.0.0.1:{_free_port()}")
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be an int in [0, {nnodes}) for nnodes={nnodes}, got {node_rank!r}")
    if not isinstance(rdzv_endpoint, str) or not re.fullmatch(r"[A-Za-z0-9._\-\[\]:]+:\d{1,5}", rdzv_endpoint):
        raise ValueError(f"rdzv_endpoint must be 'host:port' (the rendezvous every node reaches), "
                         f"got {rdzv_endpoint!r}")
    return _Nodes(nnodes, node_rank, rdzv_endpoint)


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a rendezvous every local agent must know in advance."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Agents:
    """The torchrun agents of one job, started together on this machine, read as one process:
    one merged output pipe, ``poll()`` is ``None`` while any runs, and ``returncode`` is the
    first failing agent's. Once one agent has failed, the others get ``grace_s`` to end on their
    own (their ranks lose a peer and fail), then they are stopped."""

    def __init__(self, procs: list[subprocess.Popen], stdout: Any, grace_s: float = 20.0) -> None:
        self.procs, self.stdout, self.grace_s = procs, stdout, grace_s
        self.pid = procs[0].pid
        self.failed_code: int | None = None
        self._failed_at: float | None = None

    def poll(self) -> int | None:
        codes = [p.poll() for p in self.procs]
        for code in codes:
            if code not in (None, 0) and self.failed_code is None:
                self.failed_code, self._failed_at = code, time.monotonic()
        if None not in codes:
            return self.returncode
        if self._failed_at is not None and time.monotonic() - self._failed_at > self.grace_s:
            for p in self.procs:
                if p.poll() is None:
                    _kill_tree(p)
        return None

    @property
    def returncode(self) -> int | None:
        if any(p.poll() is None for p in self.procs):
            return None
        return self.failed_code if self.failed_code is not None else 0


def _start_agents(commands: list[list[str]], envs: list[dict[str, str]]) -> subprocess.Popen | _Agents:
    """Start one agent (a plain ``Popen``) or several sharing one output pipe (:class:`_Agents`),
    the ``k``-th command with the ``k``-th environment."""
    if len(commands) == 1:
        return subprocess.Popen(commands[0], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=envs[0], start_new_session=True)
    read, write = os.pipe()
    procs: list[subprocess.Popen] = []
    try:
        for cmd, env in zip(commands, envs):
            procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=write,
                                          stderr=subprocess.STDOUT, env=env, start_new_session=True))
    except BaseException:
        for p in procs:
            _kill_tree(p)
        os.close(read)
        raise
    finally:
        os.close(write)
    return _Agents(procs, os.fdopen(read, "rb", buffering=0))


def _stop(proc: subprocess.Popen | _Agents, mentions: tuple[str, ...]) -> tuple[int, int]:
    """:func:`_kill_tree` for one agent or every agent of an :class:`_Agents`; summed counts."""
    procs = proc.procs if isinstance(proc, _Agents) else [proc]
    total = ranks = 0
    for p in procs:
        done, r = _kill_tree(p, mentions=mentions)
        total, ranks = total + done, ranks + r
    return total, ranks


def _sweep(mentions: tuple[str, ...]) -> None:
    """Kill any process still running this run (its module and folder on its command line)."""
    for p in _processes_mentioning(mentions, exclude={os.getpid()}):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _exit_words(code: int | None) -> str:
    """An agent's exit status in words: ``killed by SIGKILL`` or ``exit status 1``."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit status {code}"


def _check_gpus(nproc: int, said: str = "") -> None:
    """Refuse more ranks on this machine than GPUs; ``said`` is how the caller asked for them
    (default ``nproc=N``)."""
    import torch

    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise ValueError(
            f"{said or f'nproc={nproc}'} but {torch.cuda.device_count()} GPU(s) are visible; "
            "NCCL needs one rank per GPU: use nproc <= the GPU count"
        )
