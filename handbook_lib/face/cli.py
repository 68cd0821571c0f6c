"""The command line: ``python -m handbook_lib <command>`` (also installed as ``handbook``).

Chapter 1 introduces it. Commands:

- ``runs`` — list the experiments that can be launched;
- ``run NAME --nproc N [--nnodes M [--node-rank K --rdzv-endpoint HOST:PORT]] [--set key=value ...]
  [--out DIR [--overwrite]] [--timeout S] [--force-resources]`` — launch
  one with torchrun, stream its ranks' output, leave ``DIR/result.json`` (without ``--out``, a
  temporary folder, removed at the end) and print its checks
  (with each one's tolerance and whether it passed), then a one-line verdict; a run this machine
  cannot hold (more than 8 ranks per CPU core, or more host memory than is available by the
  run's own prediction: :func:`~handbook_lib.launch.preflight.check_job_resources`) is refused
  first, unless ``--force-resources``;
- ``params [--model 7b | --hf-config config.json | --set key=value ...] [--json]`` — a model's
  parameter count, by component (``--json``: ``{"total": N, ...}``);
- ``memory (--params N | --model 7b | --hf-config PATH | --set key=value ...) --world-size N
  ...`` — the memory model's per-rank bytes by component (``--json`` for bytes);
- ``comm (--params N | --model 70b | --hf-config PATH) --world-size N --strategy S --link nvlink4
  ...`` — bytes each rank sends per step, and the time they take (``--json``: bytes, seconds);
- ``plan (--model llama2-7b | --hf-config PATH) --gpu h100-80gb --gpus 8 --seq-len 4096
  --micro-batch 1`` — every option priced, and a recommendation with its reasons (``--json`` for
  tools); ``--tp-size N`` / ``--sp-size N`` (also on ``memory``, chapter 9) price tensor
  parallelism inside a node x FSDP, or the sequence split, beside FULL_SHARD and HYBRID_SHARD;
- ``slurm NAME --nodes N --gpus-per-node G [--set key=value ...] [--output FILE]`` — write a
  Slurm batch script that runs the experiment on N nodes x G GPUs (one torchrun agent per node),
  its config checked first; to stdout, or to FILE (never replacing a file it did not write).

A Transformers ``config.json`` (``--hf-config``) is read as the model's shape
(:func:`~handbook_lib.models.hf_config.read_hf_config`). Every planning command prints the model it
prices and its assumptions (strategy, ranks, precision, optimizer) first; everything it prints fits
in 100 columns. A bad argument gets one short line naming the flag and what it accepts: every
number, of a flag or of a ``--set``, is read by the one parser of its type
(:func:`~handbook_lib.core.checks.parse_int` and its siblings), whose message gives the range; a
``--set`` key given twice is refused; control characters in what it echoes are escaped.

Exit status: 0 on success, 1 if a run failed or a check was off, 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shlex
import signal
import sys
import threading
import unicodedata
from collections.abc import Iterator
from typing import NoReturn

from handbook_lib.core.architecture import MODEL_KEYS
from handbook_lib.core.config import (AC_SAVE_POLICIES, CHECKPOINTING_MODES, OPTIMIZER_IMPLS, OPTIMIZERS,
                                      PRECISIONS, RunConfig)
from handbook_lib.core.protocol import PREEMPTED_EXIT
from handbook_lib.core.strategies import PLAN_STRATEGIES, STRATEGIES, strategies_where
from handbook_lib.core.text import TERMINAL_WIDTH
from handbook_lib.face.arg_types import MAX_PARAMS, MAX_PORT
from handbook_lib.face.arg_types import endpoint as _endpoint
from handbook_lib.face.arg_types import fraction as _fraction
from handbook_lib.face.arg_types import param_count as _param_count
from handbook_lib.face.arg_types import seconds as _seconds
from handbook_lib.face.arg_types import whole as _whole
from handbook_lib.face.commands import COMMANDS
from handbook_lib.face.plan_axes import wrap_line
from handbook_lib.launch.errors import RunFailed, RunPreempted
from handbook_lib.launch.preflight import RANKS_PER_CORE
from handbook_lib.models.hardware import ACCELERATORS, LINKS
from handbook_lib.models.hf_config import HF_FAMILIES
from handbook_lib.models.presets import DECODER_SHAPES
from handbook_lib.runs import describe_runs, run_config_fields

__all__ = ["MAX_PARAMS", "build_parser", "main"]

_HYBRID = strategies_where(hybrid=True)
_SP_METHODS = ("ulysses", "ring")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line naming the flag, then where to read more."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}\n(see: {self.prog} --help)\n")


def _add_model_choice(cmd: argparse.ArgumentParser, params_help: str | None, set_help: str) -> None:
    what = cmd.add_mutually_exclusive_group()
    if params_help:
        what.add_argument("--params", type=_param_count, metavar="N", help=params_help)
    what.add_argument("--model", choices=sorted(DECODER_SHAPES), metavar="NAME",
                      help=f"a decoder preset (chapter 2): {', '.join(sorted(DECODER_SHAPES))}")
    _add_hf_config(what)
    cmd.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help=set_help)


def _add_hf_config(group: argparse._MutuallyExclusiveGroup) -> None:
    group.add_argument("--hf-config", default=None, metavar="PATH",
                       help=f"a Transformers config.json of your own model (model_type: {', '.join(HF_FAMILIES)})")


def _add_sharding(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--world-size", type=_whole(1), default=8, metavar="N", help="ranks (GPUs), default 8")
    cmd.add_argument("--strategy", default="FULL_SHARD", choices=STRATEGIES, metavar="S",
                     help=f"one of {', '.join(STRATEGIES)} (default FULL_SHARD)")
    cmd.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS, metavar="P",
                     help=f"one of {', '.join(PRECISIONS)} (default bf16-mixed; runs default to fp32)")
    cmd.add_argument("--shard-group-size", type=_whole(1), default=None, metavar="N",
                     help=f"{' and '.join(_HYBRID)} only: ranks per shard group (default: all)")


def _add_accumulation(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--grad-accum", type=_whole(1), default=1, metavar="K",
                     help="micro-steps per optimizer step (default 1); gradients reduced in the last one, "
                     "so a sharding strategy holds them unsharded in between")
    cmd.add_argument("--sync-every-micro-step", action="store_true", help="with --grad-accum >= 2: reduce the "
                     "gradients in every micro-step (kept sharded)")


def _add_optimizer_impl(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--optimizer-impl", default="default", choices=OPTIMIZER_IMPLS, metavar="I",
                     help="how the optimizer step runs: for-loop, foreach (one fp32 temporary of every "
                     "local parameter), fused (none) or default (torch's choice: foreach on a GPU)")


def _add_checkpointing(cmd: argparse.ArgumentParser, default: str, modes: tuple[str, ...], text: str) -> None:
    """The checkpointing policy's flags: the mode (``text``) and the policy's three keys."""
    cmd.add_argument("--activation-checkpointing", nargs="?", const="full", default=default, choices=modes,
                     metavar="MODE", help=text)
    cmd.add_argument("--ac-every", type=_whole(1), default=1, metavar="K", help="with --activation-checkpointing: "
                     "checkpoint layers 0, K, 2K, ... only, the others keep every activation (default 1: all layers)")
    cmd.add_argument("--ac-matmul-every", type=_whole(1), default=1, metavar="N", help="with --activation-"
                     "checkpointing selective: keep every N-th matrix product's output only (torchtitan's: 2)")
    cmd.add_argument("--ac-save", default="matmul+attention", choices=AC_SAVE_POLICIES, metavar="S", help="with "
                     f"--activation-checkpointing selective: what it keeps, {', '.join(AC_SAVE_POLICIES)}")


def _add_loss_chunks(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--loss-chunks", type=_whole(1), default=1, metavar="K", help="the cross-entropy in K chunks "
                     "of each sequence, one chunk's fp32 gradients at a time (default 1: whole; K divides --seq-len)")


def _add_reduce_bucket(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--reduce-bucket-size", type=_whole(1), default=None, metavar="N", help="with a ZeRO "
                     "strategy: elements of DeepSpeed's gradient bucket (default DeepSpeed's 5e8; Accelerate's and "
                     "the Trainer's auto: hidden size squared)")


def _add_axes(cmd: argparse.ArgumentParser) -> None:
    """Chapter 9's axes beyond FSDP: tensor parallelism inside a node, the sequence split."""
    cmd.add_argument("--tp-size", type=_whole(1), default=1, metavar="N", help="tensor-parallel ranks inside a "
                     "node (must divide the GPUs per node and the heads), FSDP across the rest (default 1: none)")
    cmd.add_argument("--sp-size", type=_whole(1), default=1, metavar="N", help="ranks one sequence is split over "
                     "(must divide the GPUs and the sequence), FSDP over every GPU (default 1: none)")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; subcommands are added one function call each."""
    parser = _Parser(prog="python -m handbook_lib", description="The FSDP Handbook's companion tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command",
                                help="runs, run, params, memory, comm, plan or slurm")

    sub.add_parser("runs", help="list the experiments that can be launched")

    run = sub.add_parser("run", help="launch an experiment with torchrun", epilog=_run_epilog(),
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("name", help="run name (listed below)")
    run.add_argument("--nproc", type=_whole(1), default=2, help="processes (ranks) per node (default 2)")
    run.add_argument("--nnodes", type=_whole(1), default=1,
                     help="nodes in the job (default 1); without --node-rank, all of them on this machine")
    run.add_argument("--node-rank", type=_whole(0), default=None, metavar="K",
                     help="this machine's node in a real multi-node job (0 .. nnodes-1); needs --rdzv-endpoint")
    run.add_argument("--rdzv-endpoint", type=_endpoint, default=None, metavar="HOST:PORT",
                     help="c10d rendezvous every node reaches (with --node-rank)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="set a config key (repeatable), e.g. --set steps=3; keys listed below")
    run.add_argument("--out", default=None, help="directory for result.json, kept (default: a temp dir, removed); "
                     "new, empty, or an earlier run's (with --overwrite)")
    run.add_argument("--overwrite", action="store_true",
                     help="reuse an earlier run's --out folder: remove only the files its manifest lists")
    run.add_argument("--timeout", type=_seconds, default=600.0, help="seconds before the run is killed")
    run.add_argument("--force-resources", action="store_true",
                     help="start the run even if it needs more than this machine has (more than "
                     f"{RANKS_PER_CORE} ranks per CPU core, or more host memory than is available by "
                     "the run's own prediction)")
    run.add_argument("--quiet", action="store_true", help="do not stream the ranks' output")

    params = sub.add_parser("params", help="parameter count of a model, by component")
    _add_model_choice(params, None, f"the handbook's model with a shape key changed: {', '.join(MODEL_KEYS)}")
    params.add_argument("--json", action="store_true", help="print the counts as JSON")

    mem = sub.add_parser("memory", help="predicted per-rank memory, by component")
    _add_model_choice(mem, "a model known by its parameter count (e.g. 7e9): model state only",
                      f"the handbook's model (the default) with a shape key changed: {', '.join(MODEL_KEYS)}")
    _add_sharding(mem)
    mem.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, metavar="O",
                     help=f"one of {', '.join(OPTIMIZERS)} (default adamw)")
    _add_optimizer_impl(mem)
    mem.add_argument("--micro-batch", type=_whole(0), default=0, metavar="B", help="sequences per rank (0: no "
                     "activations); needs --seq-len and a model shape")
    mem.add_argument("--seq-len", type=_whole(0), default=0, metavar="T", help="tokens per sequence")
    _add_checkpointing(mem, "none", CHECKPOINTING_MODES, "recompute activations in backward: none, selective (keep "
                       "the matrix products' and attention's outputs) or full (keep each layer's input; the flag "
                       "alone); needs --micro-batch")
    mem.add_argument("--cpu-offload", action="store_true", help="keep the model state in host RAM (FSDP only)")
    _add_accumulation(mem)
    mem.add_argument("--set-to-none", action="store_true", help="the gradients freed after each step "
                     "(zero_grad's default): none until backward makes them (the reserved peak keeps their blocks)")
    mem.add_argument("--float8-all-gather", action="store_true", help="torchao's Float8 training: each layer's "
                     "weights gathered in 1 byte an element (unverified on CPU ranks)")
    _add_loss_chunks(mem)
    _add_reduce_bucket(mem)
    _add_axes(mem)
    mem.add_argument("--gpu", default=None, choices=sorted(ACCELERATORS), metavar="G", help="also the budget per "
                     f"GPU (less NCCL's buffers for the layout) and whether the peak fits: {', '.join(ACCELERATORS)}")
    mem.add_argument("--json", action="store_true", help="print bytes as JSON")

    comm = sub.add_parser("comm", help="bytes sent per step and their time on a link")
    what = comm.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=_param_count, metavar="N",
                      help="a model known by its parameter count (one flat unit)")
    what.add_argument("--model", choices=sorted(DECODER_SHAPES), metavar="NAME",
                      help=f"a decoder preset, one unit per layer: {', '.join(sorted(DECODER_SHAPES))}")
    _add_hf_config(what)
    _add_sharding(comm)
    comm.add_argument("--link", default="nvlink4", choices=list(LINKS), metavar="L", help=f"one of {', '.join(LINKS)}")
    comm.add_argument("--gpu", default=None, choices=list(ACCELERATORS), metavar="G",
                      help=f"for compute time (with --tokens): one of {', '.join(ACCELERATORS)}")
    comm.add_argument("--tokens", type=_whole(0), default=0, help="tokens per GPU per step, for compute time")
    comm.add_argument("--seq-len", type=_whole(0), default=0, metavar="T",
                      help="tokens per sequence: compute counts attention's FLOPs too (needs --tokens and a shape)")
    comm.add_argument("--json", action="store_true", help="print bytes and seconds as JSON")

    pl = sub.add_parser("plan", help="price every strategy and recommend one")
    which = pl.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", choices=sorted(DECODER_SHAPES), metavar="NAME",
                       help=f"a model preset: {', '.join(sorted(DECODER_SHAPES))}")
    _add_hf_config(which)
    pl.add_argument("--gpu", required=True, choices=sorted(ACCELERATORS), metavar="G",
                    help=f"a GPU preset: {', '.join(sorted(ACCELERATORS))}")
    pl.add_argument("--gpus", type=_whole(1), required=True, help="GPUs in the job")
    pl.add_argument("--seq-len", type=_whole(1), default=2048, help="tokens per sequence (default 2048)")
    pl.add_argument("--micro-batch", type=_whole(1), default=1, help="sequences per GPU per step (default 1)")
    _add_accumulation(pl)
    _add_loss_chunks(pl)
    pl.add_argument("--strategy", default=None, choices=PLAN_STRATEGIES, metavar="S", help="price this strategy "
                    f"alone: {', '.join(PLAN_STRATEGIES)} (default: every FSDP option, and CPU offload)")
    _add_reduce_bucket(pl)
    pl.add_argument("--gpus-per-node", type=_whole(1), default=None,
                    help="GPUs per node (default: the GPU's usual node, 8 for the SXM presets)")
    pl.add_argument("--inter-link", default="ib-ndr400", choices=list(LINKS), metavar="L",
                    help=f"one network port between nodes: one of {', '.join(LINKS)}")
    pl.add_argument("--nics-per-node", type=_whole(1), default=None,
                    help="network ports per node (default: one per GPU for InfiniBand, one for Ethernet)")
    pl.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS, metavar="P",
                    help=f"one of {', '.join(PRECISIONS)} (default bf16-mixed)")
    pl.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, metavar="O",
                    help=f"one of {', '.join(OPTIMIZERS)} (default adamw; the layouts beyond FSDP price adamw)")
    _add_optimizer_impl(pl)
    _add_checkpointing(pl, "full", ("full", "selective"), "the policy of the options marked + AC: full (keep "
                       "each layer's input; the default) or selective (keep the matrix products' and attention's "
                       "outputs); options named after it (AC, SAC, SAC every 2nd product)")
    pl.add_argument("--shard-group-size", type=_whole(0), default=None, metavar="N", help="HYBRID_SHARD's shard "
                    "group, GPUs: a whole number of nodes (or a divisor of one) that divides --gpus; 0: every "
                    "whole number of nodes, each an option (default: one node)")
    pl.add_argument("--headroom", type=_fraction, default=0.0,
                    help="fraction of usable GPU memory kept free beyond what the model prices (default 0)")
    pl.add_argument("--sensitivity", action="store_true",
                    help="plan again with each assumption changed (headroom, capacity, allocator reserve, "
                    "utilization, network, CPU optimizer) and show where the verdict flips")
    _add_axes(pl)
    pl.add_argument("--sp-method", default=None, choices=_SP_METHODS, metavar="M",
                    help="how the split attends across ranks: ulysses (all-to-alls; heads must divide) or "
                    "ring (point-to-point sends), default ulysses")
    pl.add_argument("--batch-tokens", type=_whole(1), default=None, metavar="N", help="the global batch the recipe "
                    "wants, tokens per step: past it, GPUs must share sequences (chapter 9)")
    pl.add_argument("--pp-size", type=_whole(0), default=None, metavar="N",
                    help="pipeline stages across nodes, TP inside each (1F1B, 4N micro-batches or as many "
                    "as the batch allows); 0: every stage count, the best shown; 1: none (default: 0 "
                    "on more than one node)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")

    _add_slurm(sub)
    return parser


def _add_slurm(sub: argparse._SubParsersAction) -> None:
    sl = sub.add_parser("slurm", help="write a Slurm batch script for a multi-node run",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="Write an sbatch script that runs an experiment on N nodes x G GPUs:\n"
                        "one torchrun agent per node (srun), meeting at a c10d rendezvous on the first node.",
                        epilog="example:\n  python -m handbook_lib slurm fsdp_train --nodes 2 --gpus-per-node 4 "
                        "--set steps=20 \\\n      --partition gpu --output fsdp_train.sbatch\n"
                        "  sbatch fsdp_train.sbatch")
    sl.add_argument("name", help="run name (see: python -m handbook_lib runs)")
    sl.add_argument("--nodes", type=_whole(1), required=True, metavar="N", help="nodes to allocate")
    sl.add_argument("--gpus-per-node", type=_whole(1), required=True, metavar="G",
                    help="GPUs per node: one rank each, N x G ranks in all")
    sl.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="set a config key (repeatable); keys: python -m handbook_lib run --help")
    sl.add_argument("--time", default="00:30:00", metavar="HH:MM:SS",
                    help="wall-clock limit, HH:MM:SS or D-HH:MM:SS (default 00:30:00)")
    sl.add_argument("--partition", default=None, metavar="P", help="Slurm partition (default: the cluster's)")
    sl.add_argument("--account", default=None, metavar="A", help="Slurm account (default: yours)")
    sl.add_argument("--job-name", default=None, metavar="NAME", help="job name (default: handbook-<run>)")
    sl.add_argument("--out", default=None, metavar="DIR",
                    help="the run's folder, on a disk every node sees (default: runs/<run>-<job id>)")
    sl.add_argument("--log", default="%x-%j.out", metavar="FILE",
                    help="the job's log, sbatch --output (default %%x-%%j.out: job name, job id)")
    sl.add_argument("--cpus-per-task", type=_whole(1), default=None, metavar="C",
                    help="CPU cores per node (default: 4 per GPU)")
    sl.add_argument("--port", type=_whole(1, MAX_PORT + 1), default=None,
                    help="rendezvous TCP port (default: 29500 + the job id mod 1000)")
    sl.add_argument("--output", default=None, metavar="FILE", help="write the script here (default: stdout)")
    sl.add_argument("--overwrite", action="store_true",
                    help="replace --output FILE if it is an earlier script of this tool")


@functools.lru_cache(maxsize=1)
def _run_epilog() -> str:
    """The runs and their config keys, read from the sources (no torch import)."""
    lines = ["runs:"]
    lines += [wrap_line(f"  {name:19s}{doc}", " " * 21) for name, doc in describe_runs().items()]
    defaults = RunConfig().to_dict()
    shared = [wrap_line(f"    {section}: " + " ".join(f"{k}={defaults[k]}" for k in keys), "      ")
              for section, keys in RunConfig.sections().items()]
    users, own = [], []
    for name in describe_runs():
        info = run_config_fields(name)
        keys = " ".join(f"{k}={_plain(v)}" for k, v in info.fields)
        if info.base == "RunConfig":
            users.append(name)
            if keys:
                own.append(wrap_line(f"  {name} adds: {keys}", "    "))
        else:
            own.append(wrap_line(f"  {name} (its own keys): {keys}", "    "))
        own += [wrap_line(f"    {k}: {' | '.join(v)}", "      ") for k, v in info.choices.items()]
    lines.append("config keys (--set KEY=VALUE, repeatable; default values shown):")
    lines.append(wrap_line(f"  {', '.join(users)} share the run config, in five sections (--set KEY, or "
                           "--set SECTION.KEY):", "    "))
    lines += shared
    lines += [wrap_line(f"    {k}: {' | '.join(v)}", "      ") for k, v in RunConfig.choices().items()]
    lines += own
    lines.append("example: python -m handbook_lib run fsdp_train --nproc 2 --set steps=3 --out runs/first")
    lines.append("two nodes on this machine: python -m handbook_lib run fsdp_train --nnodes 2 --nproc 2 \\")
    lines.append("  --set strategy=HYBRID_SHARD --set shard_group_size=2")
    return "\n".join(lines)


def _plain(source: str) -> str:
    """A default as written in a run's source, for the help: strings unquoted, no spaces."""
    import ast

    try:
        value = ast.literal_eval(source)
    except ValueError:  # arithmetic such as ``8 * 2 ** 20``: shown as written
        return source.replace(" ", "")
    return repr(value) if value == "" else str(value)


class _Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP) to the CLI while it runs a job, turned into the launcher's Ctrl-C path,
    which stops torchrun and every rank before the CLI exits."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _stop_on_terminate(active: bool) -> Iterator[None]:
    """While ``active`` (the ``run`` command, in the main thread), SIGTERM and SIGHUP raise
    :class:`_Terminated` here; the previous handlers come back afterwards."""
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise _Terminated(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _resume_command(argv: list[str] | None) -> str:
    """The command that resumes a preempted run: this one, with ``--set resume=true`` and, when
    it names an ``--out`` folder (now the stopped run's), ``--overwrite``; a shell command cut
    with backslashes to fit the terminal."""
    args = list(sys.argv[1:] if argv is None else argv)
    pairs = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--set"]
    if "resume=true" not in pairs:
        args += ["--set", "resume=true"]
    if "--out" in args and "--overwrite" not in args:
        args.append("--overwrite")
    words = ["python", "-m", "handbook_lib", *args]
    # one flag with its value per piece, so no line is cut inside a pair
    pieces = [shlex.join(words[:4])]
    rest = words[4:]
    while rest:
        take = 2 if rest[0].startswith("--") and len(rest) > 1 and not rest[1].startswith("--") else 1
        pieces.append(shlex.join(rest[:take]))
        rest = rest[take:]
    lines, line = [], ""
    for piece in pieces:
        if line and len(line) + 1 + len(piece) > TERMINAL_WIDTH - 2:
            lines.append(line + " \\")
            line = "  " + piece
        else:
            line = f"{line} {piece}" if line else piece
    return "\n".join([*lines, line])


def printable(text: str) -> str:
    """``text`` with every control character but the newline escaped (``\\x1b``, ``\\r``): a
    name typed with a terminal escape or a carriage return is shown, never obeyed."""
    return "".join(c if c == "\n" or unicodedata.category(c) not in ("Cc", "Cf") else
                   repr(c)[1:-1] for c in text)


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of ``command`` (a subcommand of ``parser``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise AssertionError("the parser has no commands")  # pragma: no cover


def _check_flags(args: argparse.Namespace) -> None:
    """Flags that parse but cannot be honoured, refused in one line before anything runs: a
    flag that another flag must come with. (``run``'s config, and whether this machine can hold
    the job, are checked once, by :func:`~handbook_lib.launch.torchrun` before it starts anything.)"""
    if args.command == "plan":
        if args.sp_method is not None and args.sp_size == 1:
            raise ValueError(f"--sp-method {args.sp_method} applies to the sequence split: give --sp-size N "
                             "(N >= 2) too, or leave --sp-method out")
        args.sp_method = args.sp_method or _SP_METHODS[0]


def main(argv: list[str] | None = None) -> int:
    """Run one command; return its exit status (0 ok, 1 a run failed, 2 a bad argument, 75
    (:data:`~handbook_lib.core.protocol.PREEMPTED_EXIT`) a run preempted after saving, 130 or
    128 + the signal's number when stopped by Ctrl-C, SIGTERM or SIGHUP)."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # the command's own parser says so, pointing at the command's own help
            _command_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as stop:  # --help (0) or a bad argument (2), already printed
        return stop.code if isinstance(stop.code, int) else 2
    try:
        _check_flags(args)
        with _stop_on_terminate(args.command == "run"):
            return COMMANDS[args.command](args)
    except ValueError as err:  # one line naming the flag or key; long lists wrapped to TERMINAL_WIDTH
        text = printable(f"error: {err}")
        print(wrap_line(text, "  ") if "\n" not in text else text, file=sys.stderr)
        return 2
    except RunPreempted as err:  # every rank saved: the same command with resume=true continues
        print(wrap_line(f"error: {err}", "  "), file=sys.stderr)
        print("resume with:\n" + _resume_command(argv), file=sys.stderr)
        return PREEMPTED_EXIT
    except RunFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (`... | head`); a run was stopped by the launcher
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no 2nd error at exit's flush
        return 141  # 128 + SIGPIPE, as a shell reports a command whose pipe closed
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM: the launcher has stopped torchrun and its ranks
        what = f"run {args.name!r}" if args.command == "run" else args.command
        signum = getattr(err, "signum", None) or getattr(err.__context__, "signum", None)
        if signum is not None:
            print(f"error: {what} stopped by {signal.Signals(signum).name}; torchrun and its ranks "
                  "were stopped", file=sys.stderr)
            return 128 + signum
        print(f"error: {what} interrupted" + ("; torchrun and its ranks were stopped"
                                              if args.command == "run" else ""), file=sys.stderr)
        return 130
