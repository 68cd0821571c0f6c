"""How a run shows itself while it runs and when it ends: streamed lines in a terminal, one line
with its log folded under it in a notebook.

Chapter 1 introduces it. In a terminal every rank's output is streamed live, prefixed
``[rankR]``, and rank 0's progress bar, labelled with the run's name, redraws in place; in a
notebook a run is one line (:func:`describe_run`) that repeats on any machine, with the ranks'
whole output folded under it in HTML (:class:`RunReport`).
"""

from __future__ import annotations

import html
import re
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from handbook_lib.core.architecture import MODEL_KEYS
from handbook_lib.core.results import RunResult
from handbook_lib.core.text import BOOK_WIDTH, wrap

__all__ = ["in_notebook", "RunReport", "describe_run", "show_result", "config_defaults"]

_RANK_PREFIX = re.compile(r"^\[default(\d+)\]:")

_PROGRESS = re.compile(r"\d+%\|")


@dataclass(frozen=True)
class RunReport:
    """What a notebook shows for one run: one line that repeats on any machine (text/plain),
    and, in HTML only, the full run log (every rank's output) folded under it.

    Attributes:
        line: What ran and how it ended (:func:`describe_run`): no timings, paths or PIDs.
        log: The ranks' output lines, ``[rankR]``-prefixed.
        detail: Shown only beside the folded log (wall time, where the result is).
    """

    line: str
    log: tuple[str, ...] = ()
    detail: str = ""

    def __repr__(self) -> str:
        return self.line

    def _repr_html_(self) -> str:
        n = len(self.log)
        summary = f"run log: {n} line{'s' * (n != 1)}" + (f"; {self.detail}" if self.detail else "")
        return (f'<pre style="margin-bottom:0">{html.escape(self.line)}</pre>'
                f"<details><summary>{html.escape(summary)}</summary>"
                f'<pre style="font-size:85%">{html.escape(chr(10).join(self.log))}</pre></details>')

_QUIET_KEYS = frozenset({*MODEL_KEYS, "batch_size", "seq_len", "steps", "seed", "strategy", "api",
                         "shard_group_size"})
"""Config keys :func:`describe_run` does not list as changes (the model's shape, the data, and
the keys it already shows)."""

def describe_run(run: str, nproc: int, config: Mapping[str, Any], defaults: Mapping[str, Any] | None = None,
                 result: RunResult | Sequence[RunResult] | None = None, outcome: str = "", nnodes: int = 1,
                 batch: int = 0) -> str:
    """One line on a run, the same on any machine: its name, ranks (with backend and device once
    known), steps, strategy, the config keys changed from ``defaults`` (not the model's shape,
    and no paths), and how it ended: its checks, or ``outcome`` (e.g. ``"running"``,
    ``"failed: rank 1"``). Wrapped at :data:`~handbook_lib.core.text.BOOK_WIDTH`.

    ``describe_run("fsdp_train", 2, cfg, defaults, result)`` ->
    ``"fsdp_train on 2 ranks (gloo, cpu), 5 steps, FULL_SHARD: 26/26 checks passed"``; over
    several nodes (``nnodes``, ``nproc`` per node), ``"fsdp_train on 2 nodes x 2 ranks ..."``;
    a batch of ``batch`` configs (``result`` then holds their results), ``"fsdp_train on 2 ranks
    (gloo, cpu), 8 configs: 212/212 checks passed"``.
    """
    results = [result] if isinstance(result, RunResult) else list(result or [])
    where = f"{run} on {nproc} rank{'s' * (nproc != 1)}"
    if nnodes > 1:  # nproc per node
        where = f"{run} on {nnodes} nodes x {nproc} rank{'s' * (nproc != 1)}"
    if results:
        where += f" ({results[0].backend}, {results[0].device})"
    head = [where]
    if batch:
        head.append(f"{batch} config{'s' * (batch != 1)}")
        config = {}
    if "steps" in config:
        head.append(f"{config['steps']} step{'s' * (config['steps'] != 1)}")
    what = []
    if config.get("strategy"):
        strategy = str(config["strategy"])
        if config.get("api") == "fsdp1":
            strategy = f"FSDP1 {strategy}"
        if config.get("shard_group_size"):
            strategy += f" (groups of {config['shard_group_size']})"
        what.append(strategy)
    for key, value in config.items():
        if key in _QUIET_KEYS or defaults is None or key not in defaults or value == defaults[key]:
            continue
        if isinstance(value, str) and "/" in value:
            continue  # a path: it changes from machine to machine
        what.append(f"{key}={value}")
    if what:
        head.append(" ".join(what))
    if results and not outcome:
        failed = sum(len(r.failed_checks()) for r in results)
        n = sum(len(r.checks) for r in results)
        outcome = ("no checks" if n == 0 else f"{n}/{n} checks passed" if not failed
                   else f"{failed} of {n} checks FAILED")
    return wrap(", ".join(head) + (f": {outcome}" if outcome else ""))


def config_defaults(run: str) -> dict[str, Any]:
    """The default config of ``handbook_lib.runs.<run>`` (its spec's config class with no keys
    set, no torch): what :func:`describe_run` compares a run's config with."""
    from handbook_lib.runs import run_spec

    return run_spec(run).config.from_mapping({}).to_dict()


def show_result(result: RunResult, display: Any = None) -> RunResult:
    """Show one config's result from a batch (:func:`~handbook_lib.launch.runner.torchrun_batch`)
    as :func:`~handbook_lib.launch.runner.torchrun` shows a run that ends, and return it:
    ``runs["DDP"] = show_result(results["DDP"])`` shows ``"fsdp_train on 2 ranks (gloo, cpu), 4
    steps, DDP: 20/20 checks passed"``. In a notebook it is a :class:`RunReport` (the ranks'
    output is in the log of the cell that ran the batch); elsewhere the line is printed.
    ``display``: the notebook's display function (by default IPython's).
    """
    line = describe_run(result.run, result.world_size, result.config, config_defaults(result.run), result)
    if not in_notebook():
        print(line, flush=True)
        return result
    if display is None:
        from IPython.display import display
    display(RunReport(line, (), "this config's output is in the log of the batch that ran it"))
    return result


def in_notebook() -> bool:
    """True inside a Jupyter kernel (JupyterLab, nbclient, nbval): a run is then shown as one
    line with its log folded under it, not as streamed lines."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None

class NotebookView:
    """One output in a notebook cell, updated in place: the run's line and its latest log line
    while it runs, then its :class:`~handbook_lib.launch.show.RunReport`."""

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
            self.handle.update(RunReport(f"{self._line}: running\n  {latest[:BOOK_WIDTH - 2]}"))

    def finish(self, report: RunReport) -> None:
        self.handle.update(report)

class Streamer:
    """Turn torchrun's ``--tee`` output into ``[rankR] line``: echoed live on ``sys.stdout`` (a
    terminal: rank 0's progress bar redrawn in place, labelled ``label``), or shown as the latest
    line of a :class:`NotebookView`; kept whole in :attr:`log` either way."""

    def __init__(self, echo: bool, out: TextIO | None = None, *, label: str = "",
                 view: NotebookView | None = None) -> None:
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

class Show:
    """How a run shows itself: nothing (``stream=False``); in a notebook, one line updated in
    place then a :class:`~handbook_lib.launch.show.RunReport` (its log folded in HTML); in a
    terminal, its description, the ranks' output live with a labelled progress bar, and a
    closing line."""

    def __init__(self, run: str, nproc: int, config: dict[str, Any], defaults: dict[str, Any], stream: bool,
                 kept: bool, nnodes: int = 1, batch: int = 0) -> None:
        self.run, self.nproc, self.config, self.defaults = run, nproc, config, defaults
        self.nnodes, self.batch = nnodes, batch
        self.stream, self.kept = stream, kept
        self.notebook = stream and in_notebook()
        self.streamer: Streamer | None = None
        self.started = time.monotonic()

    def start(self) -> Streamer:
        line = describe_run(self.run, self.nproc, self.config, self.defaults, nnodes=self.nnodes,
                            batch=self.batch)
        view = NotebookView(line) if self.notebook else None
        terminal = self.stream and not self.notebook
        if terminal:
            print(f"{line}: starting", flush=True)
        self.streamer = Streamer(echo=terminal, label=self.run, view=view)
        return self.streamer

    def end(self, results: Sequence[RunResult] | None, wall_s: float, out_dir: Path, outcome: str = "") -> None:
        """Show how the run ended: its ``results``, or ``outcome`` (a failure) when there are none."""
        if not self.stream or self.streamer is None:
            return
        line = describe_run(self.run, self.nproc, self.config, self.defaults, results, outcome,
                            nnodes=self.nnodes, batch=self.batch)
        detail = f"{wall_s:.1f} s wall" + (f"; result in {out_dir}" if self.kept else "")
        if self.streamer.view is not None:
            self.streamer.view.finish(RunReport(line, tuple(self.streamer.log), detail))
        else:
            print(f"{line}; {detail}", flush=True)
