"""Start a run of :mod:`handbook_lib.runs` on N processes with ``torchrun`` and get its result.

Chapter 1 introduces it; it is the one thing a notebook cell calls to run a real experiment::

    from handbook_lib.launch import torchrun
    result = torchrun("fsdp_train", nproc=2, config={"steps": 3})
    result.checks          # predictions beside measurements

What it guarantees:

- every rank's output is streamed live, prefixed ``[rankR]``, through Python's ``sys.stdout``
  (so Jupyter, pytest and nbval see it), and rank 0's progress bar redraws in place;
- the rendezvous is on 127.0.0.1 with a port the OS picks, so runs never collide;
- the result comes back parsed from ``result.json`` (a :class:`~handbook_lib.results.RunResult`);
- a failing rank raises :class:`RunFailed` naming the rank that caused it, with its traceback;
- a run past ``timeout_s`` (or interrupted) is stopped with every one of its processes, and
  raises :class:`RunTimeout` showing where each rank was;
- a run whose ``checks`` include one outside its own tolerance raises :class:`ChecksFailed`
  (the parsed result is attached): a model that disagrees with its measurement is a failure.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import psutil

from handbook_lib.results import RunResult, load_result
from handbook_lib.runs import available_runs

__all__ = ["RunFailed", "RunTimeout", "ChecksFailed", "torchrun", "diagnose_failure", "RankFailure",
           "describe_failed_checks"]

_RANK_PREFIX = re.compile(r"^\[default(\d+)\]:")
_PROGRESS = re.compile(r"\d+%\|")
_CONSEQUENTIAL = re.compile(
    r"closed by peer|reset by peer|Broken pipe|remote worker|timed out|timeout|"
    r"communicator was aborted|NCCL error",
    re.IGNORECASE,
)
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


class RunFailed(RuntimeError):
    """A run ended without a result. ``str(err)`` says which rank failed and why.

    Attributes:
        run: The run's name.
        rank: The rank found to have caused the failure, or ``None`` if none could be named.
        rank_traceback: That rank's Python traceback (``""`` if it died without one).
        out_dir: The run's directory (logs under ``logs/``, rank states under ``ranks/``).
        returncode: torchrun's exit status (``None`` if it was killed).
        log_tail: The last lines of output (all ranks and torchrun itself).
    """

    def __init__(self, message: str, *, run: str, rank: int | None, rank_traceback: str,
                 out_dir: Path, returncode: int | None, log_tail: list[str]) -> None:
        super().__init__(message)
        self.run = run
        self.rank = rank
        self.rank_traceback = rank_traceback
        self.out_dir = out_dir
        self.returncode = returncode
        self.log_tail = log_tail


class RunTimeout(RunFailed):
    """A run did not finish within its timeout; all its processes were killed."""


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
    dumped); ``silent`` (died without a word: ``os._exit``, a segfault, SIGKILL, out of memory)."""
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
    stacks = stacks_file.read_text() if stacks_file.exists() else ""
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
        [s for s in states if s.status == "silent"],
        errors,
        [s for s in states if s.status == "stopped"],
    ):
        if group:
            return group[0], states
    return None, states


def _kill_tree(proc: subprocess.Popen, grace_s: float = 5.0) -> int:
    """Stop torchrun and all its ranks; return how many processes were signalled.

    torchrun starts each rank in a session of its own, so signalling torchrun's process group is
    not enough: the ranks are found by walking the process tree first. SIGTERM lets torchrun
    stop its ranks (which dump their stacks); whatever survives ``grace_s`` gets SIGKILL.
    """
    try:
        tree = [psutil.Process(proc.pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
        pass
    return len(tree)


class _Streamer:
    """Turn torchrun's ``--tee`` output into ``[rankR] line`` on ``sys.stdout``, live."""

    def __init__(self, echo: bool, out: TextIO | None = None) -> None:
        self.echo = echo
        self.out = out
        self.tail: deque[str] = deque(maxlen=200)
        self._pending = b""
        self._in_progress = False

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

    def _line(self, line: str) -> None:
        match = _RANK_PREFIX.match(line)
        if match:
            body = line[match.end():]
            if not body.strip():
                return
            line = f"[rank{match.group(1)}] {body}"
        self.tail.append(line)
        if not self.echo or not match:
            return  # torchrun's own chatter is kept for the error message, not shown
        if _PROGRESS.search(body):
            self._write(("\r" if self._in_progress else "") + line)
            self._in_progress = True
            return
        if self._in_progress:
            self._write("\n")
            self._in_progress = False
        self._write(line + "\n")


def _prepare_out_dir(run: str, out: str | os.PathLike[str] | None) -> Path:
    if out is None:
        return Path(tempfile.mkdtemp(prefix=f"handbook-{run}-"))
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    # A previous run's files must never be taken for this run's.
    for stale in ("result.json", "ranks", "logs"):
        target = out_dir / stale
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    return out_dir


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
) -> RunResult:
    """Run ``handbook_lib.runs.<run>`` on ``nproc`` processes and return its parsed result.

    Args:
        run: Name of a run module (see :func:`handbook_lib.runs.available_runs`).
        nproc: Number of processes (ranks). With GPUs, at most one per visible GPU.
        config: Config keys for the run; unknown keys or bad values raise before anything starts.
        out: Directory for ``result.json``, the rank logs and states; a fresh temporary directory
            if ``None``. Files of an earlier run there are removed first.
        timeout_s: Seconds the whole run may take before all its processes are killed.
        stream: Print the ranks' output live (prefixed ``[rankR]``).
        env: Extra environment variables for the ranks.
        allow_failed_checks: Return the result even if a check is outside its tolerance (for
            code that studies a failing model); by default that raises :class:`ChecksFailed`.

    Returns:
        The run's ``result.json``, parsed.

    Raises:
        ValueError: for an unknown run, a bad ``nproc`` or a config the run rejects.
        RunFailed: if a rank failed; the message names the rank and carries its traceback.
        RunTimeout: if the run took longer than ``timeout_s``.
        ChecksFailed: if a check is outside its tolerance (unless ``allow_failed_checks``).
    """
    runs = available_runs()
    if run not in runs:
        raise ValueError(f"unknown run {run!r}; available runs: {', '.join(runs)}")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be an int >= 1, got {nproc!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    module = importlib.import_module(f"handbook_lib.runs.{run}")
    cfg = module.CONFIG.from_mapping(config)
    if hasattr(module, "validate"):
        module.validate(cfg, nproc)
    _check_gpus(nproc)

    out_dir = _prepare_out_dir(run, out)
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
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
        "--max-restarts", "0", "--tee", "3", "--log-dir", str(out_dir / "logs"),
        "-m", f"handbook_lib.runs.{run}", "--config", str(config_path), "--out", str(out_dir),
    ]
    streamer = _Streamer(echo=stream)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=child_env, start_new_session=True)
    timed_out = False
    killed = 0
    try:
        timed_out = not _pump(proc, streamer, deadline)
    except BaseException:  # KeyboardInterrupt in a notebook: leave nothing behind
        _kill_tree(proc)
        streamer.close()
        raise
    finally:
        if timed_out:
            killed = _kill_tree(proc)
        _drain(proc, streamer)
        streamer.close()
        if proc.stdout:
            proc.stdout.close()
    wall_s = time.monotonic() - started

    common = dict(run=run, out_dir=out_dir, returncode=proc.returncode, log_tail=list(streamer.tail))
    if timed_out:
        _, states = diagnose_failure(out_dir, nproc)
        lines = [f"run {run!r} did not finish within {timeout_s:g} s and was stopped "
                 f"({killed} processes killed). Where each rank was:"]
        for s in states:
            where = _first_stack(s.traceback) if s.status == "stopped" else s.summary
            lines.append(f"--- rank {s.rank}:\n{where}")
        raise RunTimeout("\n".join(lines), rank=None, rank_traceback="", **common)
    if proc.returncode != 0:
        cause, states = diagnose_failure(out_dir, nproc)
        if cause is None:
            tail = "\n".join(list(streamer.tail)[-20:])
            raise RunFailed(f"run {run!r} failed (torchrun exit code {proc.returncode}) before any "
                            f"rank reported; last output:\n{tail}", rank=None, rank_traceback="",
                            **common)
        message = f"run {run!r} failed: rank {cause.rank} {_verb(cause)}{cause.summary}"
        if cause.traceback:
            message += f"\n\n--- traceback of rank {cause.rank} ---\n{cause.traceback.rstrip()}"
        for s in states:
            if s.rank == cause.rank or s.status == "ok":
                continue
            if s.status == "stopped":
                message += f"\n\n--- rank {s.rank} was still running, at:\n{_first_stack(s.traceback)}"
            else:
                message += f"\n\n--- then rank {s.rank}: {s.summary.splitlines()[0][:300]}"
        raise RunFailed(message, rank=cause.rank, rank_traceback=cause.traceback, **common)
    if not (out_dir / "result.json").exists():
        raise RunFailed(f"run {run!r} exited cleanly but wrote no result.json in {out_dir}",
                        rank=None, rank_traceback="", **common)
    result = load_result(out_dir)
    if stream:
        print(f"run {run!r}: {result.world_size} ranks, {result.backend} on {result.device}, "
              f"{wall_s:.1f} s wall; result in {out_dir}", flush=True)
    if result.failed_checks() and not allow_failed_checks:
        raise ChecksFailed(
            f"run {run!r} finished, but {len(result.failed_checks())} of its {len(result.checks)} "
            f"checks are outside their tolerance:\n{describe_failed_checks(result)}",
            result=result, **common)
    return result


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


def _check_gpus(nproc: int) -> None:
    import torch

    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise ValueError(
            f"nproc={nproc} but {torch.cuda.device_count()} GPU(s) are visible; "
            "NCCL needs one rank per GPU: use nproc <= the GPU count"
        )
