"""The README's multi-node recipe, node by node: the command each machine types, run as separate
machines would run it (one CLI process per node, all on 127.0.0.1). Chapter 8 shows it and the
tests prove it: every node exits 0, and the node that ran rank 0 holds ``result.json``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from handbook_lib.core.checks import check_int
from handbook_lib.core.protocol import RESULT_FILE
from handbook_lib.core.text import BOOK_WIDTH, wrap
from handbook_lib.launch.errors import RunTimeout
from handbook_lib.launch.nodes import Nodes, free_port
from handbook_lib.launch.processes import kill_tree, parent_death_signal
from handbook_lib.runs import check_run_name

__all__ = ["NodeRun", "recipe_commands", "run_recipe"]

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_EXIT_MARGIN_S = 30.0
"""Seconds past the CLI's own ``--timeout`` before a node still running is killed."""


@dataclass(frozen=True)
class NodeRun:
    """One node of the recipe, as its machine saw it.

    Attributes:
        node: The ``--node-rank`` typed there (it names the node's files; torchrun's c10d
            rendezvous numbers the nodes itself).
        command: The command as typed, ``python -m handbook_lib run ...`` (run with this
            interpreter in place of ``python``).
        exit_code: The CLI's exit status (0: the job succeeded; negative: killed by that signal).
        said: Its last line, unwrapped: ``result: DIR/result.json``, or that rank 0 ran elsewhere.
        output: Everything it printed (stdout and stderr).
        out: Its ``--out`` folder.
        has_result: Whether ``out`` held ``result.json`` once every node had ended.
        wall_s: Seconds from the start of the nodes to this node's exit.
    """

    node: int
    command: tuple[str, ...]
    exit_code: int
    said: str
    output: str
    out: Path
    has_result: bool
    wall_s: float

    def describe(self, root: str | Path | None = None, width: int = BOOK_WIDTH) -> str:
        """The command wrapped to ``width`` columns (`` \\`` continuations, a flag beside its
        value), then the exit status and ``said``: the port shown as ``PORT`` and paths under
        ``root`` relative to it, the same text on every machine (no timing: see ``wall_s``)."""
        endpoint = self.command[self.command.index("--rdzv-endpoint") + 1]

        def shown(text: str) -> str:
            text = text.replace(endpoint, endpoint.rsplit(":", 1)[0] + ":PORT")
            return text if root is None else text.replace(f"{Path(root)}{os.sep}", "")

        pairs: list[str] = []
        for word in (shown(shlex.quote(w)) for w in self.command):
            flag = pairs and pairs[-1].startswith("--") and " " not in pairs[-1]
            pairs[-1:] = [f"{pairs[-1]} {word}"] if flag and not word.startswith("-") else [*pairs[-1:], word]
        lines: list[str] = []
        for pair in pairs:
            fits = lines and len(lines[-1]) + len(pair) + 3 <= width  # room for " \"
            lines[-1:] = [f"{lines[-1]} {pair}"] if fits else [*lines[-1:], ("    " if lines else "") + pair]
        said = f"  exit {self.exit_code}: {shown(self.said)}"
        return " \\\n".join(lines) + "\n" + wrap(said, width, "    ", break_long_words=False)


def recipe_commands(run: str, nnodes: int, nproc: int, overrides: Mapping[str, object] | None = None,
                    *, out: str | Path | Sequence[str | Path], endpoint: str = "127.0.0.1:29500",
                    timeout_s: float = 120.0) -> list[list[str]]:
    """The command each of ``nnodes`` machines types (node ``K``'s at index ``K``); nothing starts.

    Args:
        run: A run's name (``python -m handbook_lib runs`` lists them).
        nnodes: Nodes in the job, at least 2.
        nproc: Ranks per node, at least 1.
        overrides: ``--set key=value`` items, in order (a bool as ``true``/``false``).
        out: One folder every node shares (on a shared disk), or one folder per node.
        endpoint: ``host:port`` of the c10d rendezvous, the same on every node.
        timeout_s: The CLI's ``--timeout``, seconds, > 0.

    Raises:
        ValueError: for an unknown run, ``nnodes < 2``, ``nproc < 1``, a bad ``timeout_s``, or
            ``out`` neither one folder nor ``nnodes`` folders.
    """
    check_run_name(run)
    check_int("nnodes", nnodes, 2, context="(the recipe is for several nodes)")
    check_int("nproc", nproc, 1)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    outs = [out] * nnodes if isinstance(out, (str, Path)) else list(out)
    if len(outs) != nnodes or not all(isinstance(o, (str, Path)) for o in outs):
        raise ValueError(f"out must be one folder or {nnodes} folders (one per node), got {out!r}")
    sets = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in (overrides or {}).items()]
    return [["python", "-m", "handbook_lib", "run", run, "--nnodes", str(nnodes), "--nproc", str(nproc),
             "--node-rank", str(k), "--rdzv-endpoint", endpoint, "--out", str(outs[k]), "--quiet",
             "--timeout", f"{timeout_s:g}", *[w for s in sets for w in ("--set", s)]]
            for k in range(nnodes)]


def run_recipe(run: str, nnodes: int, nproc: int, overrides: Mapping[str, object] | None = None,
               *, out: str | Path | Sequence[str | Path], timeout_s: float = 120.0) -> list[NodeRun]:
    """Run :func:`recipe_commands` as ``nnodes`` machines would: every node's CLI at once, each a
    process of its own with its own ``nproc`` GPUs (or, where this machine has fewer than
    ``nnodes x nproc``, none: gloo on the CPU), the rendezvous on a free port of 127.0.0.1.

    Arguments as :func:`recipe_commands`. Each node's CLI stops its job after ``timeout_s``
    seconds; a node still running 30 s later is killed.

    Returns:
        One :class:`NodeRun` per node, node ``K``'s at index ``K``.

    Raises:
        ValueError: as :func:`recipe_commands`, before anything starts.
        RunTimeout: a node outlived its timeout. Then, and on any other error or Ctrl-C, every
            process the nodes started is killed first.
    """
    commands = recipe_commands(run, nnodes, nproc, overrides, out=out,
                               endpoint=f"127.0.0.1:{free_port()}", timeout_s=timeout_s)
    outs = [Path(cmd[cmd.index("--out") + 1]) for cmd in commands]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
    procs: list[subprocess.Popen] = []
    logs = [tempfile.TemporaryFile("w+", errors="replace") for _ in commands]
    ended: dict[int, float] = {}
    start = time.monotonic()
    try:
        for cmd, log, gpus in zip(commands, logs, _node_gpus(nnodes, nproc)):
            procs.append(subprocess.Popen([sys.executable, *cmd[1:]], stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, env={**env, **gpus}, start_new_session=True,
                                          preexec_fn=parent_death_signal()))
        while len(ended) < nnodes:
            ended.update({k: time.monotonic() - start for k, p in enumerate(procs)
                          if k not in ended and p.poll() is not None})
            if len(ended) < nnodes and time.monotonic() - start > timeout_s + _EXIT_MARGIN_S:
                raise RunTimeout(f"run {run!r}: {nnodes - len(ended)} of {nnodes} nodes still ran after "
                                 f"{timeout_s + _EXIT_MARGIN_S:g} s; every node's processes were killed",
                                 run=run, rank=None, rank_traceback="", out_dir=outs[0], returncode=None,
                                 log_tail=[])
            time.sleep(0.05)
    except BaseException:
        for p, folder in zip(procs, outs):
            kill_tree(p, mentions=("handbook_lib", str(folder)))
        raise
    finally:
        texts = [_read(log) for log in logs]
    return [NodeRun(k, tuple(commands[k]), procs[k].returncode, _last_said(texts[k]), texts[k], outs[k],
                    (outs[k] / RESULT_FILE).is_file(), ended[k]) for k in range(nnodes)]


def _read(log: IO[str]) -> str:
    """All of a node's output file, which is then closed (and so removed)."""
    with log:
        log.seek(0)
        return log.read()


def _last_said(text: str) -> str:
    """The last line of ``text`` with its indented continuation lines, joined into one."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    k = len(lines) - 1
    while k > 0 and lines[k][:1].isspace():
        k -= 1
    return " ".join(line.strip() for line in lines[max(k, 0):])


def _node_gpus(nnodes: int, nproc: int) -> list[dict[str, str]]:
    """Each node's ``CUDA_VISIBLE_DEVICES``: its own ``nproc`` GPUs, as on separate machines;
    ``""`` for every node where this machine has fewer than ``nnodes x nproc``; none without CUDA."""
    envs = [Nodes(nnodes).agent_env(k, nproc) for k in range(nnodes)]
    if all(len([g for g in e.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]) == nproc for e in envs):
        return envs
    return [{"CUDA_VISIBLE_DEVICES": ""} if any(envs) else {} for _ in envs]
