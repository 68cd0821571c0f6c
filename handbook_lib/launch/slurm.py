"""Write a Slurm batch script that runs one experiment on several nodes with ``torchrun``.

Chapter 1 launches runs on one machine (:func:`handbook_lib.launch.torchrun`); this module is
the same launch on a cluster. From the terminal::

    python -m handbook_lib slurm fsdp_train --nodes 2 --gpus-per-node 4 --set steps=20 \\
        --time 00:20:00 --partition gpu --output fsdp_train.sbatch
    sbatch fsdp_train.sbatch

The script asks Slurm for N nodes with one task each; ``srun`` starts that task, one torchrun
agent per node, and the agents meet at a c10d rendezvous on the allocation's first node, then
start G ranks each (one per GPU): N x G ranks in all. Every line carries a comment saying why.
The script asks for whole nodes (``--exclusive``, ``--mem=0``), takes a rendezvous port derived
from the job id unless one is given, writes one log per rank (torchrun's ``--tee 3 --log-dir``),
sets NCCL's and PyTorch's error reporting (``NCCL_DEBUG=WARN``, the flight recorder) and says,
in comments, what to set on hosts with several network interfaces, how to look at a hung rank,
and how a preempted job resumes from its latest checkpoint.

- :class:`SlurmJob` is the job spec (a frozen dataclass); :func:`build_job` makes one with the
  run's config checked by the run module's own ``CONFIG`` and ``validate`` (imports torch);
- :func:`render_sbatch` turns a spec into the script's text (pure: no files, no imports);
- :func:`write_script` saves it, refusing to replace a file this module did not write.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from handbook_lib.core.checks import check_int, is_int
from handbook_lib.core.protocol import COLLECTIVE_TIMEOUT_ENV, PREEMPTED_EXIT
from handbook_lib.runs import check_run_name, run_spec

__all__ = [
    "BASE_PORT",
    "MARKER",
    "SHEBANG",
    "SlurmJob",
    "build_job",
    "is_own_script",
    "parse_time",
    "render_sbatch",
    "write_script",
]

SHEBANG = "#!/bin/bash"
"""First line of every script: sbatch runs the script with the interpreter it names."""
MARKER = "# Written by `python -m handbook_lib slurm` (the FSDP Handbook)."
"""Second line of every script: how :func:`write_script` knows a file is one of its own."""

BASE_PORT = 29500
"""torchrun's default rendezvous port; a script without ``--port`` adds ``SLURM_JOB_ID % 1000``."""

_TIME = re.compile(r"(?:(\d+)-)?(\d+):(\d\d):(\d\d)")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_LOG = re.compile(r"[A-Za-z0-9_.%/+,:=@-]+")


def parse_time(text: str) -> int:
    """Seconds in a Slurm time limit written ``HH:MM:SS`` or ``D-HH:MM:SS`` (e.g. ``00:30:00``).

    Raises:
        ValueError: naming ``--time`` and the accepted forms, for anything else or a zero limit.
    """
    match = _TIME.fullmatch(text)
    accepted = "HH:MM:SS or D-HH:MM:SS, e.g. 00:30:00 or 1-12:00:00"
    if match is None:
        raise ValueError(f"--time expects {accepted}; got {text!r}")
    days, hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    if minutes > 59 or seconds > 59 or (match.group(1) is not None and hours > 23):
        raise ValueError(f"--time {text}: minutes and seconds go up to 59 (hours to 23 after D-); "
                         f"accepted: {accepted}")
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total == 0:
        raise ValueError(f"--time must be longer than 0 seconds; accepted: {accepted}")
    return total


@dataclass(frozen=True)
class SlurmJob:
    """One multi-node run of an experiment, as Slurm will be asked for it.

    Every check but the run's config happens here, without importing torch; :func:`build_job`
    also checks the config against the run. Errors name the CLI flag of the field.
    """

    run: str
    """Run module under :mod:`handbook_lib.runs`, e.g. ``"fsdp_train"``."""
    nodes: int
    """Nodes to allocate (``--nodes``); one torchrun agent runs on each."""
    gpus_per_node: int
    """GPUs per node (``--gpus-per-node``); each agent starts one rank per GPU."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """The run's config keys (JSON-ready), written into the job's ``config.json``; keys left out
    take the run's defaults when it starts."""
    time: str = "00:30:00"
    """Wall-clock limit, ``HH:MM:SS`` or ``D-HH:MM:SS`` (``--time``); Slurm stops the job then."""
    partition: str | None = None
    """Slurm partition (queue), or several separated by commas; ``None``: the cluster's default."""
    account: str | None = None
    """Account charged for the job; ``None``: the user's default account."""
    job_name: str | None = None
    """Name shown by ``squeue`` and in the log's name; ``None``: ``handbook-<run>``."""
    out_dir: str | None = None
    """Folder for ``config.json`` and ``result.json``, on a filesystem every node sees (relative
    paths start at the folder sbatch is run from); ``None``: ``runs/<run>-<job id>``."""
    log: str = "%x-%j.out"
    """sbatch ``--output`` file for the job's output: ``%x`` is the job name, ``%j`` the job id.
    Relative to the folder sbatch is run from; Slurm does not create its folder."""
    cpus_per_task: int | None = None
    """CPU cores per node for its agent and ranks; ``None``: 4 per GPU."""
    port: int | None = None
    """TCP port of the rendezvous on the first node (``--port``); ``None``: derived from the job
    id, ``29500 + SLURM_JOB_ID % 1000``, so two jobs sharing a first node do not collide."""
    preemptible: bool = False
    """The run saves and stops on a preemption signal (its module's ``PREEMPTIBLE``): the script
    asks for SIGUSR1 ahead of the time limit and requeues itself when the ranks stopped saved."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", dict(self.config))
        check_run_name(self.run)
        for flag, value in (("--nodes", self.nodes), ("--gpus-per-node", self.gpus_per_node),
                            ("--cpus-per-task", 1 if self.cpus_per_task is None else self.cpus_per_task)):
            check_int(flag, value, 1, noun="a whole number")
        if self.port is not None and (not is_int(self.port) or not 1024 <= self.port <= 65535):
            raise ValueError(f"--port must be a whole number from 1024 to 65535, got {self.port!r}")
        parse_time(self.time)
        for flag, text, pattern, accepted in (
            ("--partition", self.partition, re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*"),
             "letters, digits, '_', '.', '-' (several partitions: comma-separated)"),
            ("--account", self.account, _NAME, "letters, digits, '_', '.', '-'"),
            ("--job-name", self.job_name, _NAME, "letters, digits, '_', '.', '-'"),
            ("--log", self.log, _LOG, "letters, digits and _ . % / + , : = @ - (sbatch expands no "
             "$VARIABLES or ~ there: use %x for the job name, %j for the job id)"),
        ):
            if text is not None and not pattern.fullmatch(text):
                raise ValueError(f"{flag} {text!r}: accepted characters are {accepted}")
        if self.out_dir is not None and (not self.out_dir.strip() or any(c in self.out_dir for c in "\n\r\0")):
            raise ValueError(f"--out must be a folder path on one line, got {self.out_dir!r}")

    @property
    def world_size(self) -> int:
        """Ranks in the job: ``nodes * gpus_per_node``."""
        return self.nodes * self.gpus_per_node

    @property
    def name(self) -> str:
        """The job's name (``job_name``, else ``handbook-<run>``)."""
        return self.job_name or f"handbook-{self.run}"

    @property
    def port_expression(self) -> str:
        """The script's ``MASTER_PORT`` value: the fixed ``port``, else one derived from the job id."""
        return str(self.port) if self.port is not None else f"$(({BASE_PORT} + SLURM_JOB_ID % 1000))"

    @property
    def cpus(self) -> int:
        """CPU cores per task (``cpus_per_task``, else 4 per GPU)."""
        return self.cpus_per_task or 4 * self.gpus_per_node


def build_job(run: str, nodes: int, gpus_per_node: int, overrides: Mapping[str, Any] | None = None,
              **options: Any) -> SlurmJob:
    """A :class:`SlurmJob` whose config the run accepts for ``nodes * gpus_per_node`` ranks.

    The options (``time``, ``partition``, ...) are checked first; then ``overrides`` go through the
    run's config class and its ``validate(config, world_size)``, as :func:`handbook_lib.launch.torchrun`
    checks them (the run's spec, :func:`handbook_lib.runs.run_spec`: no torch).
    The job keeps the whole resolved config, so later changes to a run's defaults do not change
    what a written script runs.

    Raises:
        ValueError: naming the flag (or config key) and what is accepted.
    """
    job = SlurmJob(run, nodes, gpus_per_node, **options)
    spec = run_spec(run)
    preemptible = spec.preemptible
    overrides = dict(overrides or {})
    if preemptible:  # the first start begins at step 0; a requeued one resumes from the latest save
        overrides = {**overrides, "resume": True, "resume_if_present": True}
    try:
        config = spec.config.from_mapping(overrides)
    except ValueError as err:  # one message (the CLI wraps it): the key, then the accepted keys
        text = "; ".join(str(err).splitlines())
        raise ValueError(text if text.startswith("--set ") else "--set: " + text) from None
    if spec.validate is not None:
        try:
            spec.validate(config, job.world_size)
        except ValueError as err:
            raise ValueError(f"--nodes {nodes} x --gpus-per-node {gpus_per_node} = {job.world_size} "
                             f"ranks: {err}") from None
    return dataclasses.replace(job, config=config.to_dict(), preemptible=preemptible)


def render_sbatch(job: SlurmJob) -> str:
    """The batch script for ``job``: ``#SBATCH`` lines, then the rendezvous and one ``srun``.

    Every value is either checked by :class:`SlurmJob` (names, numbers) or shell-quoted (the
    out folder); the config goes in a quoted here-document, which the shell copies untouched.
    """
    g, run = job.gpus_per_node, job.run
    nodes_word = "node" if job.nodes == 1 else "nodes"
    out = shlex.quote(job.out_dir) if job.out_dir is not None else f'"runs/{run}-$SLURM_JOB_ID"'
    lines = [
        SHEBANG,
        MARKER,
        f"# It runs {run} on {job.nodes} {nodes_word} x {g} GPUs = {job.world_size} ranks. Submit it with",
        "# `sbatch <this file>` from the handbook's folder, its Python environment active: sbatch",
        "# hands your shell's environment to the job, so `python` below is the one you use there.",
        "# (Where the site sets SBATCH_EXPORT=NONE or builds environments from modules, load them",
        "# below, before srun: e.g. `module load cuda` and `source .venv/bin/activate`.)",
        "#",
        "# sbatch reads the #SBATCH lines (up to the first command) as if they were its own options.",
        "#",
        "# The job's name, shown by squeue.",
        f"#SBATCH --job-name={job.name}",
        "# Nodes to allocate: one torchrun agent runs on each.",
        f"#SBATCH --nodes={job.nodes}",
        "# One Slurm task per node: that task is torchrun, which starts the node's ranks itself.",
        "#SBATCH --ntasks-per-node=1",
        "# GPUs on each node: torchrun starts one rank per GPU.",
        f"#SBATCH --gpus-per-node={g}",
        f"# CPU cores for each node's task, shared by its {g} rank{'s' * (g != 1)}.",
        f"#SBATCH --cpus-per-task={job.cpus}",
        "# Whole nodes: no other job shares their GPUs, NICs or memory.",
        "#SBATCH --exclusive",
        "# All of each node's memory (0 means all): a default of a few GB per CPU is too little",
        "# for a full-state export or CPU offload, and the kernel's OOM kill looks like a crash.",
        "#SBATCH --mem=0",
        "# Wall-clock limit ([D-]HH:MM:SS): Slurm stops the job when it is reached.",
        f"#SBATCH --time={job.time}",
    ]
    if job.partition:
        lines += ["# The partition (queue) to run in.", f"#SBATCH --partition={job.partition}"]
    if job.account:
        lines += ["# The account charged for the job.", f"#SBATCH --account={job.account}"]
    if job.preemptible:
        lines += [
            "# A preemption notice 120 s before the time limit: SIGUSR1 to every process of the",
            "# job step (torchrun passes it to its ranks); each rank saves at its next step and stops.",
            "#SBATCH --signal=USR1@120",
            "# Slurm may queue the job again (same id, same $OUT_DIR) after a preemption or a",
            "# node failure; the script asks for it itself when the ranks stopped, saved.",
            "#SBATCH --requeue",
            "# A requeued job appends to the same log instead of replacing it.",
            "#SBATCH --open-mode=append",
        ]
    lines += [
        "# The job's log (%x: job name, %j: job id): every node's lines, each prefixed by its",
        "# node (srun --label); each rank also writes its own files under $OUT_DIR/logs. Slurm",
        "# does not create the log's folder; a relative path starts where you run sbatch.",
        f"#SBATCH --output={job.log}",
        "",
        "# Stop at the first failing command (-e), an unset variable (-u) or a failing pipe stage.",
        "set -euo pipefail",
        "# Outside Slurm (plain `bash`), stop here with a clear message: the job id comes from sbatch.",
        ': "${SLURM_JOB_ID:?run this script with sbatch, not bash}"',
        "",
        "# The rendezvous host: the first node of the allocation. Each torchrun agent meets the",
        "# others there. scontrol expands a node list such as gpu[01-04] into one name a line;",
        "# sed -n 1p keeps the first but reads them all (head -n 1 would stop reading, and on a",
        "# long list scontrol's next write would fail, which pipefail turns into a failed job).",
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"',
        "# Its TCP port: two jobs whose first node is the same need different ones, so it is"
        if job.port is None else "# Its TCP port (--port): two jobs whose first node is the same need different ones.",
        *(["# derived from the job id (--port fixes one)."] if job.port is None else []),
        f"MASTER_PORT={job.port_expression}",
        "# The run's folder, for config.json and result.json; every node must see it (shared disk).",
        f"OUT_DIR={out}",
        "# One thread per rank for CPU math (torchrun would set it too, with a warning), and",
        "# Python output unbuffered so the log follows the run live; exported, srun passes them on.",
        "export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1",
        "",
        "# NCCL reports problems only (INFO also prints, at start-up, the rings, channels and NICs",
        "# it chose: rerun with it when a job is slower than nccl-tests says the fabric is).",
        "export NCCL_DEBUG=WARN",
        "# A collective that waits past the timeout (seconds) raises instead of hanging to --time;",
        "# error handling 1 then ends the process, and --kill-on-bad-exit ends the job. The flight",
        "# recorder keeps each rank's last 2000 collectives and dumps them on a timeout",
        "# (read the dumps with python -m torch.distributed.flight_recorder.fr_trace).",
        f"export {COLLECTIVE_TIMEOUT_ENV}=600 TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        "export TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1",
        *(["# The signals torchrun passes on to its ranks: its default list lacks SIGUSR1,",
           "# which would end torchrun at once and its ranks with it, unsaved.",
           "export TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]
          if job.preemptible else []),
        "#",
        "# On hosts with several interfaces (docker0, a management Ethernet), name NCCL's:",
        "#   export NCCL_SOCKET_IFNAME=ib0     # its sockets (^docker0,lo: all but those)",
        "#   export NCCL_IB_HCA=mlx5_0,mlx5_1  # its InfiniBand adapters (ibstat lists them)",
        "#",
        "# To debug a hang: TORCH_DISTRIBUTED_DEBUG=DETAIL checks that every rank calls the same",
        "# collectives (slow: for a rerun), and on a stuck rank's node (srun --overlap",
        "# --jobid <id> --pty bash), py-spy dump --pid <pid> prints where its Python waits.",
        "#",
        "# Preemption: Slurm sends SIGTERM, then SIGKILL; --requeue (a #SBATCH line) reruns this",
        "# script with the same job id, so the same $OUT_DIR. A run that saves checkpoints",
        "# (checkpoint_resume, with resume=true resume_if_present=true) then continues from the",
        "# latest; --signal=USR1@120 warns 120 s ahead, for a run that traps SIGUSR1 to save.",
        "",
        "# Never mix two runs' files: a folder that already holds a result is refused.",
        'if [ -e "$OUT_DIR/result.json" ]; then',
        '  echo "error: $OUT_DIR already holds a result.json; choose another --out" >&2',
        "  exit 1",
        "fi",
        'mkdir -p "$OUT_DIR"',
        *(["# A requeued job: the rank states of its earlier start, which would say preempted.",
           'rm -f "$OUT_DIR"/ranks/rank*.json'] if job.preemptible else []),
        "# The run's whole config, checked when this script was written; every rank reads it.",
        "# ('JSON' in quotes: the shell copies the lines as they are, expanding nothing.)",
        "cat > \"$OUT_DIR/config.json\" <<'JSON'",
        json.dumps(dict(job.config), indent=2),
        "JSON",
        "",
        f'echo "job $SLURM_JOB_ID: {run} on $SLURM_NNODES {nodes_word} x {g} GPUs"',
        'echo "nodes: $SLURM_JOB_NODELIST"',
        'echo "rendezvous at $MASTER_ADDR:$MASTER_PORT; results in $OUT_DIR"',
        "",
        "# srun starts the job's tasks: one per node, each one torchrun agent. It gives each task",
        "# the GPUs and cores of its node, --label prefixes each output line with its node, and",
        "# --kill-on-bad-exit=1 stops every node as soon as one fails, rather than leaving the",
        "# others waiting at a collective until --time.",
        "# (--cpus-per-task is repeated: since Slurm 22.05, srun may not take it from sbatch.)",
        "#",
        "# torchrun's arguments:",
        "#   --nnodes           agents that must join before any rank starts: all the nodes",
        f"#   --nproc-per-node   ranks each agent starts: one per GPU, so {job.world_size} ranks in all",
        "#   --rdzv-backend     c10d: the agents meet through a TCP store that torchrun runs on",
        "#                      MASTER_ADDR; once all have joined, it numbers them in the sorted",
        "#                      order of their (host name, pid) descriptors, not in the order",
        "#                      they joined, so node 0 is the smallest host name, which need not",
        "#                      be MASTER_ADDR's or $SLURM_NODEID's (no --node-rank: torchrun",
        "#                      ignores it here, with a warning)",
        "#   --rdzv-endpoint    host:port of that store",
        "#   --rdzv-id          unique to this job, so agents of two jobs never join each other",
        "#   --max-restarts 0   a failed rank ends the run (no silent restart)",
        "#   --tee 3 --log-dir  each rank's stdout and stderr in its own files under",
        "#                      $OUT_DIR/logs/<rdzv id>_*/attempt_0/<local rank>/, and in the log",
        "#   -m ...             the run, as every rank starts it: config in, $OUT_DIR/result.json out",
        *(["# (set +e: the script goes on after a failed srun, to requeue a job whose ranks",
           "# stopped saved.)", "set +e"] if job.preemptible else []),
        f"srun --ntasks-per-node=1 --cpus-per-task={job.cpus} --label --kill-on-bad-exit=1 \\",
        "  python -m torch.distributed.run \\",
        '    --nnodes "$SLURM_NNODES" \\',
        f"    --nproc-per-node {g} \\",
        "    --rdzv-backend c10d \\",
        '    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \\',
        '    --rdzv-id "$SLURM_JOB_ID" \\',
        "    --max-restarts 0 \\",
        '    --tee 3 --log-dir "$OUT_DIR/logs" \\',
        f"    -m handbook_lib.runs.{run} \\",
        '    --config "$OUT_DIR/config.json" \\',
        '    --out "$OUT_DIR"',
        *(_requeue_lines() if job.preemptible else ['echo "result: $OUT_DIR/result.json"']),
    ]
    return "\n".join(_fit(lines)) + "\n"


def _requeue_lines() -> list[str]:
    """The end of a preemptible job's script: requeue it when its ranks stopped saved."""
    return [
        "status=$?",
        "set -e",
        "# Each rank that saved and stopped on the signal wrote the state preempted (and exited",
        f"# {PREEMPTED_EXIT}): then the job queues itself again and resumes from that checkpoint.",
        "if grep -qs '\"status\": \"preempted\"' \"$OUT_DIR\"/ranks/rank*.json; then",
        '  echo "preempted: every rank saved; requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "fi",
        'if [ "$status" -ne 0 ]; then exit "$status"; fi',
        'echo "result: $OUT_DIR/result.json"',
    ]


WIDTH = 86
"""Longest line of a script (the book's column): :func:`_fit` reflows the comments to it."""


def _fit(lines: list[str], width: int = WIDTH) -> list[str]:
    """The script's lines with every comment reflowed within ``width`` columns: a paragraph of
    prose comments (``# text`` lines, ended by a line ending in ``:``, a ``#`` line or code),
    and an entry of a table of flags (``#   --flag   what it does``, with the lines under its
    text) keeping its columns. Code lines, ``#SBATCH`` lines and the header are left as they
    are."""
    out: list[str] = []
    prose: list[str] = []
    entry: list[str] = []  # [head, text...] of a table entry: head is "#   --flag    "

    def flush(keep_prose: bool = False) -> None:
        if prose and not keep_prose:
            out.extend(textwrap.wrap(" ".join(prose), width, initial_indent="# ", subsequent_indent="# ",
                                     break_on_hyphens=False, break_long_words=False))
            prose.clear()
        if entry:
            head, *text = entry
            out.extend(textwrap.wrap(" ".join(text), width, initial_indent=head,
                                     subsequent_indent="#" + " " * (len(head) - 1),
                                     break_on_hyphens=False, break_long_words=False))
            entry.clear()

    for line in lines:
        flag = re.match(r"#   -\S*(?: \S+)*?\s{2,}", line)
        if flag:
            flush()
            entry.extend([flag.group(0), line[flag.end():]])
        elif entry and line.startswith("#" + " " * (len(entry[0]) - 1)) and line.strip("# "):
            entry.append(line.strip("# "))
        elif line.startswith("# ") and not line.startswith("#  ") and line != MARKER:
            flush(keep_prose=True)
            prose.append(line[2:])
            if line.endswith(":"):
                flush()
        else:
            flush()
            out.append(line)
    flush()
    return out


def is_own_script(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with this module's two header lines."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as handle:
        head = handle.read(len(SHEBANG) + len(MARKER) + 2).decode("utf-8", errors="replace")
    return head.splitlines()[:2] == [SHEBANG, MARKER]


def write_script(path: str | Path, text: str, overwrite: bool = False) -> Path:
    """Save ``text`` (a rendered script) at ``path``; return the path.

    A new file is always written; an existing one only if this module wrote it and
    ``overwrite`` is true. Anything else (a foreign file, a folder, a link) is left untouched.

    Raises:
        ValueError: naming ``--output`` and why the file was not written.
    """
    path = Path(path)
    try:
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise ValueError(f"--output {path}: exists and is not a plain file; choose another path")
        if not path.parent.is_dir():
            raise ValueError(f"--output {path}: folder {path.parent} does not exist")
        if path.exists():
            if not is_own_script(path):
                raise ValueError(f"--output {path}: exists and was not written by this tool; not replaced "
                                 "(choose another path)")
            if not overwrite:
                raise ValueError(f"--output {path}: exists (an earlier script of this tool); add --overwrite "
                                 "to replace it")
            path.write_text(text)
            return path
        with open(path, "x") as handle:  # "x": never clobber a file that appeared meanwhile
            handle.write(text)
    except OSError as err:  # a read-only folder or disk, a full disk, no permission
        raise ValueError(f"--output {path}: cannot be written ({err.strerror or err}); choose a path in a "
                         "folder you can write to") from None
    return path
