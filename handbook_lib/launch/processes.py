"""Process-tree control: start torchrun's agents, and stop a run so that nothing is left behind.

Chapter 1 relies on it (a stopped cell leaves no orphan rank). torchrun starts each rank in a
session of its own, so a run is stopped by walking the agent's process tree (the agent frozen
first, so it starts nothing more), signalling every rank, and sweeping any process that still
names the run's module and folder.

A launcher that is killed outright (SIGKILL, the out-of-memory killer, a closed terminal's
kernel) runs none of that: on Linux each agent is started with the parent-death signal set to
SIGTERM, so it stops its ranks (they are SIGTERMed, and SIGKILLed with it should it die) and
exits within seconds of its launcher.
"""

from __future__ import annotations

import ctypes
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from handbook_lib.launch.show import Streamer

__all__ = []  # the launcher's own part: kill_tree, Agents, start_agents, stop, sweep, exit_words


def kill_tree(proc: subprocess.Popen, grace_s: float = 5.0, *, mentions: tuple[str, ...] = ()
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
        frozen = psutil.Process(proc.pid)
        frozen.suspend()
        agent: psutil.Process | None = frozen
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

class Agents:
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
        failed = [code for code in codes if code not in (None, 0)]
        if failed and self.failed_code is None:
            # several ended since the last poll: one a signal killed (a lost node) went first, the
            # others failed after losing it
            self.failed_code, self._failed_at = min(failed, key=lambda c: c >= 0), time.monotonic()
        if None not in codes:
            return self.returncode
        if self._failed_at is not None and time.monotonic() - self._failed_at > self.grace_s:
            for p in self.procs:
                if p.poll() is None:
                    kill_tree(p)
        return None

    @property
    def returncode(self) -> int | None:
        if any(p.poll() is None for p in self.procs):
            return None
        return self.failed_code if self.failed_code is not None else 0

_PR_SET_PDEATHSIG = 1
"""``prctl`` option of Linux: the signal a process gets when the thread that started it ends."""


def parent_death_signal(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``signum`` when the thread that
    starts it ends, however it ends (SIGKILL included); ``None`` off Linux.

    The thread is the launcher's, which waits for torchrun to end: it ends before torchrun only
    when its process dies. Should the launcher die before the child arms the signal, the child
    sends it to itself.
    """
    if not sys.platform.startswith("linux"):  # pragma: no cover - the launcher runs on Linux
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        return None
    parent, number = os.getpid(), int(signum)

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, number)
        if os.getppid() != parent:  # the launcher died in between
            os.kill(os.getpid(), number)

    return arm


def start_agents(commands: list[list[str]], envs: list[dict[str, str]]) -> subprocess.Popen | Agents:
    """Start one agent (a plain ``Popen``) or several sharing one output pipe (:class:`Agents`),
    the ``k``-th command with the ``k``-th environment; each stops with its ranks when this
    process dies (:func:`parent_death_signal`)."""
    arm = parent_death_signal()
    if len(commands) == 1:
        return subprocess.Popen(commands[0], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=envs[0], start_new_session=True,
                                preexec_fn=arm)
    read, write = os.pipe()
    procs: list[subprocess.Popen] = []
    try:
        for cmd, env in zip(commands, envs):
            procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=write,
                                          stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                          preexec_fn=arm))
    except BaseException:
        for p in procs:
            kill_tree(p)
        os.close(read)
        raise
    finally:
        os.close(write)
    return Agents(procs, os.fdopen(read, "rb", buffering=0))

def stop(proc: subprocess.Popen | Agents, mentions: tuple[str, ...]) -> tuple[int, int]:
    """:func:`kill_tree` for one agent or every agent of an :class:`Agents`; summed counts."""
    procs = proc.procs if isinstance(proc, Agents) else [proc]
    total = ranks = 0
    for p in procs:
        done, r = kill_tree(p, mentions=mentions)
        total, ranks = total + done, ranks + r
    return total, ranks

def sweep(mentions: tuple[str, ...]) -> None:
    """Kill any process still running this run (its module and folder on its command line)."""
    for p in _processes_mentioning(mentions, exclude={os.getpid()}):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass

def exit_words(code: int | None) -> str:
    """An agent's exit status in words: ``killed by SIGKILL`` or ``exit status 1``."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit status {code}"


def pump(proc: subprocess.Popen | Agents, streamer: Streamer, deadline: float) -> bool:
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


def drain(proc: subprocess.Popen | Agents, streamer: Streamer) -> None:
    """Read what is left in the pipe after the process ended (non-blocking)."""
    if proc.stdout is None or proc.poll() is None:
        return
    os.set_blocking(proc.stdout.fileno(), False)
    try:
        while data := os.read(proc.stdout.fileno(), 65536):
            streamer.feed(data)
    except (BlockingIOError, OSError):
        pass
