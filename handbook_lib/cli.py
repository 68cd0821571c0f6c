"""The command line: ``python -m handbook_lib <command>`` (also installed as ``handbook``).

Chapter 1 introduces it. Commands:

- ``runs`` — list the experiments that can be launched;
- ``run NAME --nproc N [--nnodes M [--node-rank K --rdzv-endpoint HOST:PORT]] [--set key=value ...]
  [--out DIR [--overwrite]] [--timeout S]`` — launch
  one with torchrun, stream its ranks' output, leave ``DIR/result.json`` (without ``--out``, a
  temporary folder, removed at the end) and print its checks
  (with each one's tolerance and whether it passed), then a one-line verdict;
- ``params [--model 7b | --set key=value ...]`` — a model's parameter count, by component;
- ``memory (--params N | --model 7b | --set key=value ...) --world-size N ...`` — the memory
  model's per-rank bytes by component (``--json`` for bytes);
- ``comm (--params N | --model 70b) --world-size N --strategy S --link nvlink4 ...`` — bytes
  each rank sends per step, and the time they take (``--json`` for bytes and seconds);
- ``plan --model llama2-7b --gpu h100-80gb --gpus 8 --seq-len 4096 --micro-batch 1`` — every
  option priced, and a recommendation with its reasons (``--json`` for tools);
- ``slurm NAME --nodes N --gpus-per-node G [--set key=value ...] [--output FILE]`` — write a
  Slurm batch script that runs the experiment on N nodes x G GPUs (one torchrun agent per node),
  its config checked first; to stdout, or to FILE (never replacing a file it did not write).

Every planning command prints the model it prices and its assumptions (strategy, ranks,
precision, optimizer) first; everything it prints fits in 100 columns. A bad argument gets one
short line naming the flag and what it accepts.

Exit status: 0 on success, 1 if a run failed or a check was off, 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import textwrap
from collections.abc import Callable

from handbook_lib.activations import DECODER_SHAPES
from handbook_lib.architecture import ModelConfig, param_count, param_count_breakdown
from handbook_lib.comm import (
    estimate_compute_time,
    estimate_step_time,
    estimate_step_traffic,
    units_for_decoder,
)
from handbook_lib.config import (
    OPTIMIZERS,
    PRECISIONS,
    STRATEGIES,
    RunConfig,
    parse_overrides,
)
from handbook_lib.display import (
    Table,
    checks_legend,
    checks_table,
    checks_verdict,
    fit_table,
    format_bytes,
    step_time_summary,
    step_time_table,
)
from handbook_lib.hardware import ACCELERATORS, LINKS, get_accelerator, get_link, node_preset
from handbook_lib.launch import RunFailed, describe_failed_checks, torchrun
from handbook_lib.memory import PHASE_WORDS, estimate_memory
from handbook_lib.planner import check_whole_nodes, plan
from handbook_lib.presets import DecoderShape
from handbook_lib.runs import describe_runs, run_config_fields
from handbook_lib.sharding import Unit
from handbook_lib.strategies import get_strategy, strategies_where

__all__ = ["main", "build_parser", "WIDTH", "MAX_PARAMS", "MODEL_KEYS"]

WIDTH = 100
"""Columns every line the CLI prints fits in (tables, notes, reasons, legends)."""
MAX_PARAMS = 10**15
"""Largest ``--params`` accepted: a quadrillion parameters, beyond any model trained so far."""
MODEL_KEYS = ("vocab_size", "d_model", "nhead", "dim_feedforward", "num_layers")
"""The ``--set`` keys of ``params`` and ``memory``: the handbook's model's shape."""
_HYBRID = strategies_where(hybrid=True)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line naming the flag, then where to read more."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message}\n(see: {self.prog} --help)\n")


def _whole(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, got {value}")
        return value
    return parse


def _param_count(text: str) -> int:
    """An argparse type for ``--params``: a whole number of parameters in [1, MAX_PARAMS]."""
    accepted = f"a whole number of parameters from 1 to 1e{round(math.log10(MAX_PARAMS))} (e.g. 7e9)"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}") from None
    if not (math.isfinite(value) and 1 <= value <= MAX_PARAMS and value == int(value)):
        raise argparse.ArgumentTypeError(f"must be {accepted}, got {text!r}")
    return int(value)


def _fraction(text: str) -> float:
    """An argparse type: a number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1), e.g. 0.1, got {text!r}")
    return value


def _add_model_choice(cmd: argparse.ArgumentParser, params_help: str | None, set_help: str) -> None:
    what = cmd.add_mutually_exclusive_group()
    if params_help:
        what.add_argument("--params", type=_param_count, metavar="N", help=params_help)
    what.add_argument("--model", choices=sorted(DECODER_SHAPES), metavar="NAME",
                      help=f"a decoder preset (chapter 2): {', '.join(sorted(DECODER_SHAPES))}")
    cmd.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help=set_help)


def _add_sharding(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--world-size", type=_whole(1), default=8, metavar="N", help="ranks (GPUs), default 8")
    cmd.add_argument("--strategy", default="FULL_SHARD", choices=STRATEGIES, metavar="S",
                     help=f"one of {', '.join(STRATEGIES)} (default FULL_SHARD)")
    cmd.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS, metavar="P",
                     help=f"one of {', '.join(PRECISIONS)} (default bf16-mixed; runs default to fp32)")
    cmd.add_argument("--shard-group-size", type=_whole(1), default=None, metavar="N",
                     help=f"{' and '.join(_HYBRID)} only: ranks per shard group (default: all)")


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
    run.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                     help="c10d rendezvous every node reaches (with --node-rank)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="set a config key (repeatable), e.g. --set steps=3; keys listed below")
    run.add_argument("--out", default=None, help="directory for result.json, kept (default: a temp dir, removed); "
                     "new, empty, or an earlier run's (with --overwrite)")
    run.add_argument("--overwrite", action="store_true",
                     help="reuse an earlier run's --out folder: replace only the files a run writes")
    run.add_argument("--timeout", type=float, default=600.0, help="seconds before the run is killed")
    run.add_argument("--quiet", action="store_true", help="do not stream the ranks' output")

    params = sub.add_parser("params", help="parameter count of a model, by component")
    _add_model_choice(params, None, f"the handbook's model with a shape key changed: {', '.join(MODEL_KEYS)}")

    mem = sub.add_parser("memory", help="predicted per-rank memory, by component")
    _add_model_choice(mem, "a model known by its parameter count (e.g. 7e9): model state only",
                      f"the handbook's model (the default) with a shape key changed: {', '.join(MODEL_KEYS)}")
    _add_sharding(mem)
    mem.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, metavar="O",
                     help=f"one of {', '.join(OPTIMIZERS)} (default adamw)")
    mem.add_argument("--micro-batch", type=_whole(0), default=0, metavar="B",
                     help="sequences per rank (0: no activations); needs --seq-len and a model shape")
    mem.add_argument("--seq-len", type=_whole(0), default=0, metavar="T", help="tokens per sequence")
    mem.add_argument("--activation-checkpointing", action="store_true",
                     help="recompute each layer's activations in backward (needs --micro-batch)")
    mem.add_argument("--cpu-offload", action="store_true", help="keep the model state in host RAM (FSDP only)")
    mem.add_argument("--json", action="store_true", help="print bytes as JSON")

    comm = sub.add_parser("comm", help="bytes sent per step and their time on a link")
    what = comm.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=_param_count, metavar="N",
                      help="a model known by its parameter count (one flat unit)")
    what.add_argument("--model", choices=sorted(DECODER_SHAPES), metavar="NAME",
                      help=f"a decoder preset, one unit per layer: {', '.join(sorted(DECODER_SHAPES))}")
    _add_sharding(comm)
    comm.add_argument("--link", default="nvlink4", choices=list(LINKS), metavar="L", help=f"one of {', '.join(LINKS)}")
    comm.add_argument("--gpu", default=None, choices=list(ACCELERATORS), metavar="G",
                      help=f"for compute time (with --tokens): one of {', '.join(ACCELERATORS)}")
    comm.add_argument("--tokens", type=_whole(0), default=0, help="tokens per GPU per step, for compute time")
    comm.add_argument("--json", action="store_true", help="print bytes and seconds as JSON")

    pl = sub.add_parser("plan", help="price every strategy and recommend one")
    pl.add_argument("--model", required=True, choices=sorted(DECODER_SHAPES), metavar="NAME",
                    help=f"a model preset: {', '.join(sorted(DECODER_SHAPES))}")
    pl.add_argument("--gpu", required=True, choices=sorted(ACCELERATORS), metavar="G",
                    help=f"a GPU preset: {', '.join(sorted(ACCELERATORS))}")
    pl.add_argument("--gpus", type=_whole(1), required=True, help="GPUs in the job")
    pl.add_argument("--seq-len", type=_whole(1), default=2048, help="tokens per sequence (default 2048)")
    pl.add_argument("--micro-batch", type=_whole(1), default=1, help="sequences per GPU per step (default 1)")
    pl.add_argument("--gpus-per-node", type=_whole(1), default=None,
                    help="GPUs per node (default: the GPU's usual node, 8 for the SXM presets)")
    pl.add_argument("--inter-link", default="ib-ndr400", choices=list(LINKS), metavar="L",
                    help=f"link between nodes: one of {', '.join(LINKS)}")
    pl.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS, metavar="P",
                    help=f"one of {', '.join(PRECISIONS)} (default bf16-mixed)")
    pl.add_argument("--headroom", type=_fraction, default=0.10, help="fraction of GPU memory kept free")
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
    sl.add_argument("--port", type=_whole(1), default=29500, help="rendezvous TCP port (default 29500)")
    sl.add_argument("--output", default=None, metavar="FILE", help="write the script here (default: stdout)")
    sl.add_argument("--overwrite", action="store_true",
                    help="replace --output FILE if it is an earlier script of this tool")


def _wrap(text: str, indent: str = "") -> str:
    """``text`` wrapped to :data:`WIDTH` columns, continuation lines indented by ``indent``."""
    return textwrap.fill(text, WIDTH, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False)


@functools.lru_cache(maxsize=1)
def _run_epilog() -> str:
    """The runs and their config keys, read from the sources (no torch import)."""
    lines = ["runs:"]
    lines += [_wrap(f"  {name:19s}{doc}", " " * 21) for name, doc in describe_runs().items()]
    shared = [f"{f.name}={f.default}" for f in dataclasses.fields(RunConfig)]
    users, own = [], []
    for name in describe_runs():
        info = run_config_fields(name)
        keys = " ".join(f"{k}={_plain(v)}" for k, v in info.fields)
        if info.base == "RunConfig":
            users.append(name)
            if keys:
                own.append(_wrap(f"  {name} adds: {keys}", "    "))
        else:
            own.append(_wrap(f"  {name} (its own keys): {keys}", "    "))
        own += [_wrap(f"    {k}: {' | '.join(v)}", "      ") for k, v in info.choices.items()]
    lines.append("config keys (--set KEY=VALUE, repeatable; default values shown):")
    lines.append(_wrap(f"  {', '.join(users)} share the run config: " + " ".join(shared), "    "))
    lines += [_wrap(f"    {k}: {' | '.join(v)}", "      ") for k, v in RunConfig.choices().items()]
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


def _model_overrides(items: list[str]) -> ModelConfig:
    """The handbook's model with ``--set`` shape keys; any other key is refused."""
    overrides = parse_overrides(items)
    for key in overrides:
        if key not in MODEL_KEYS:
            raise ValueError(f"--set {key}: not a model key; accepted here: {', '.join(MODEL_KEYS)}")
    return RunConfig.from_mapping(overrides).model_config()


def _chosen_model(args: argparse.Namespace) -> tuple[int | DecoderShape | ModelConfig, str]:
    """The model named on the command line (``--params N``, ``--model NAME``, or the handbook's
    model with ``--set`` keys) and a line naming it."""
    params, overrides = getattr(args, "params", None), getattr(args, "overrides", [])
    if (params is not None or args.model is not None) and overrides:
        flag = "--params" if params is not None else "--model"
        raise ValueError(f"--set changes the handbook's model; do not combine it with {flag}")
    if params is not None:
        return params, f"model: {params:,} parameters (--params: a count only, so model state only)"
    if args.model is not None:
        shape = DECODER_SHAPES[args.model]
        return shape, f"model: {shape.name}, {shape.num_params:,} parameters (--model {args.model})"
    config = _model_overrides(overrides)
    changed = f"; changed: {' '.join(overrides)}" if overrides else ""
    return config, (f"model: the handbook's model, {param_count(config):,} parameters{changed} "
                    "(other models: --model, --params)")


def _check_sharding(args: argparse.Namespace) -> None:
    """Refuse flags that the chosen strategy would ignore or cannot honour."""
    row = get_strategy(args.strategy)
    if args.shard_group_size is not None:
        if not row.hybrid:
            raise ValueError(f"--shard-group-size applies to the HYBRID strategies ({', '.join(_HYBRID)}), "
                             f"not --strategy {args.strategy}")
        if args.world_size % args.shard_group_size:
            raise ValueError(f"--shard-group-size {args.shard_group_size} must divide "
                             f"--world-size {args.world_size}")
    if not row.distributed and args.world_size != 1:
        raise ValueError(f"--strategy NONE is one plain process: use --world-size 1, not {args.world_size}")


def _assumptions(args: argparse.Namespace, optimizer: str) -> str:
    group = f" (shard groups of {args.shard_group_size})" if args.shard_group_size else ""
    return (f"assumes: {args.strategy} on {args.world_size} ranks{group}, {args.precision}, "
            f"optimizer {optimizer}")


def _cmd_memory(args: argparse.Namespace) -> int:
    _check_sharding(args)
    get_strategy(args.strategy).check_cpu_offload(args.cpu_offload, flag="--cpu-offload")
    if bool(args.micro_batch) != bool(args.seq_len):
        missing = "--seq-len" if args.micro_batch else "--micro-batch"
        raise ValueError(f"--micro-batch and --seq-len go together: give {missing} too (> 0), or neither")
    if args.micro_batch and args.params is not None:
        raise ValueError("--micro-batch/--seq-len need a model shape, and --params is only a count: "
                         "use --model (e.g. 7b) or the handbook's model instead")
    if args.activation_checkpointing and not args.micro_batch:
        raise ValueError("--activation-checkpointing changes activations only: give --micro-batch "
                         "and --seq-len too")
    model, named = _chosen_model(args)
    est = estimate_memory(model, args.world_size, args.strategy, args.precision, args.optimizer,
                          micro_batch=args.micro_batch, seq_len=args.seq_len,
                          shard_group_size=args.shard_group_size,
                          activation_checkpointing=args.activation_checkpointing,
                          cpu_offload=args.cpu_offload)
    tokens = (f"micro-batch {args.micro_batch} x {args.seq_len} tokens" if args.micro_batch
              else "no activations")
    assumes = (f"{_assumptions(args, args.optimizer)}; {tokens}; activation checkpointing "
               f"{'on' if args.activation_checkpointing else 'off'}; CPU offload "
               f"{'on' if args.cpu_offload else 'off'}")
    if args.json:
        print(json.dumps({"model": named.removeprefix("model: "), "assumptions": assumes.removeprefix("assumes: "),
                          "components": est.components, "peak": est.peak, "peak_phase": est.peak_phase,
                          "phases": est.phases, "host": est.host, "notes": list(est.notes)}, indent=2))
        return 0
    print(_wrap(named, "  "))
    print(_wrap(assumes, "  "))
    if args.precision != "fp32" and isinstance(model, ModelConfig):
        print("(runs default to fp32: add --precision fp32 to compare with a run's measurements)")
    rows = [[name, b, format_bytes(b)] for name, b in est.components.items()]
    rows.append([f"peak ({est.peak_phase})", est.peak, format_bytes(est.peak)])
    if est.host:
        rows.append(["host (offloaded)", est.host, format_bytes(est.host)])
    print(Table(["component", "bytes", "human"], rows))
    what = PHASE_WORDS.get(est.peak_phase, ("", ""))[1]
    print(_wrap(f"peak = the step's largest phase; {est.peak_phase} = {what}",
                "  "))
    for note in est.notes:
        if note.startswith("activations not included"):
            note = ("activations not included: give --micro-batch and --seq-len (with --model or the "
                    "handbook's model)" if args.params is None else
                    "activations not included: --params has no shape to compute them from (use --model)")
        print(_wrap(f"note: {note}", "  "))
    return 0


def _cmd_comm(args: argparse.Namespace) -> int:
    _check_sharding(args)
    if bool(args.gpu) != bool(args.tokens):
        raise ValueError("compute time needs both --gpu and --tokens (> 0): give both, or neither")
    model, named = _chosen_model(args)
    if isinstance(model, int):
        units, num_params = [Unit("model", ((model,),))], model
    else:
        units, num_params = units_for_decoder(model), model.num_params
    param_dtype, reduce_dtype = PRECISIONS[args.precision]
    traffic = estimate_step_traffic(units, args.world_size, args.strategy, param_dtype=param_dtype,
                                    reduce_dtype=reduce_dtype, shard_group_size=args.shard_group_size)
    link = get_link(args.link)
    compute_s = 0.0
    if args.gpu:
        compute_s = estimate_compute_time(num_params, args.tokens, get_accelerator(args.gpu).peak_flops_bf16)
    plain = estimate_step_time(traffic, link, compute_s, overlap=False)
    hidden = estimate_step_time(traffic, link, compute_s, overlap=True)
    assumes = (f"{_assumptions(args, 'any (it adds no traffic)')}; parameters gathered in "
               f"{param_dtype}, gradients reduced in {reduce_dtype}; link {link.name}")
    if args.json:
        print(json.dumps({"model": named.removeprefix("model: "), "assumptions": assumes.removeprefix("assumes: "),
                          "counts": traffic.counts, "sent_bytes": traffic.sent_bytes,
                          "received_bytes": traffic.received_bytes, "comm_s": plain.comm_s,
                          "compute_s": compute_s, "step_s_no_overlap": plain.total_s,
                          "step_s_overlap": hidden.total_s, "bound": hidden.bound}, indent=2))
        return 0
    rows = []
    for kind, count in traffic.counts.items():
        if count:
            sent = sum(r.sent_bytes for r in traffic.records if r.kind == kind)
            rows.append([kind, count, sent, format_bytes(sent)])
    rows.append(["total", sum(traffic.counts.values()), traffic.sent_bytes, format_bytes(traffic.sent_bytes)])
    print(_wrap(named, "  "))
    print(_wrap(assumes, "  "))
    print("per rank and step:")
    print(Table(["collective", "calls", "bytes sent", "human"], rows))
    print(f"communication: {plain.comm_s * 1e3:.2f} ms on {link.name}")
    if compute_s:
        print(f"compute (6PT at 40 % of {args.gpu}'s bf16 peak): {compute_s * 1e3:.2f} ms")
        print(f"step: {plain.total_s * 1e3:.2f} ms without overlap, {hidden.total_s * 1e3:.2f} ms with; "
              f"{hidden.bound}-bound")
        print(_wrap("bound = what sets the step time with overlap: compute (the links' time hides "
                    "behind it) or communication (the links are the bottleneck)", "  "))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    per_node = args.gpus_per_node or node_preset(args.gpu).gpus_per_node
    check_whole_nodes(args.gpus, per_node, names=("--gpus {}", "--gpus-per-node {}"))
    result = plan(args.model, args.gpu, args.gpus, micro_batch=args.micro_batch, seq_len=args.seq_len,
                  gpus_per_node=per_node, inter_link=args.inter_link,
                  precision=args.precision, headroom=args.headroom)
    if args.json:
        print(json.dumps(dataclasses.asdict(result), indent=2))
        return 0
    print(f"model: {result.model}, {result.num_params:,} parameters (--model {args.model})")
    print(_wrap(f"assumes: {result.gpus} x {result.gpu} ({per_node} per node, "
                f"{args.inter_link} between nodes), {args.precision}, optimizer adamw, micro-batch "
                f"{args.micro_batch} x {args.seq_len} tokens, {args.headroom:.0%} of GPU memory kept "
                "free; every strategy priced", "  "))
    rows = [[o.name, o.gpus, format_bytes(o.peak_bytes), format_bytes(o.host_bytes) if o.host_bytes else "-",
             "yes" if o.fits else "no", round(o.comm_s, 3), round(o.compute_s, 3), round(o.step_s, 3),
             "comm" if o.bound == "communication" else o.bound] for o in result.options]
    print(Table(["option", "GPUs", "peak/GPU", "host/GPU", "fits", "comm s", "compute s", "step s", "bound"],
                rows))
    print(_wrap("AC = activation checkpointing; offload = model state in host RAM (host/GPU); bound = "
                "what sets the step time: compute, or comm (communication not hidden by compute)", "  "))
    for reason in result.reasons:
        print(_wrap(f"- {reason}", "  "))
    print(f"(the seed's rule, fp32 model state only, would answer: {result.seed_answer})")
    return 0


def _cmd_runs() -> int:
    for name, doc in describe_runs().items():
        print(_wrap(f"{name:19s}{doc}", " " * 19))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    """Launch, print every check with its verdict; exit 1 if any is outside its own tolerance."""
    result = torchrun(args.name, args.nproc, parse_overrides(args.overrides), out=args.out,
                      timeout_s=args.timeout, stream=not args.quiet, allow_failed_checks=True,
                      overwrite=args.overwrite, nnodes=args.nnodes, node_rank=args.node_rank,
                      rdzv_endpoint=args.rdzv_endpoint)
    if result is None:  # one node of a real multi-node job, not rank 0's
        print(f"node {args.node_rank}: its ranks finished; rank 0's node holds result.json")
        return 0
    if result.checks:
        print(checks_table(result))
        print(checks_verdict(result))
        legend = checks_legend(result)
        if legend:
            print(_wrap(legend, "  "))
    if result.run == "comm_bench":
        print("alpha-beta fit: time = steps x alpha + bytes sent / beta, per collective")
        print(fit_table(result))
        for note in result.extra.get("notes", []):
            print(_wrap(f"note: {note}", "  "))
    if result.run == "step_time":
        print(step_time_table(result))
        print(step_time_summary(result))
    print(f"result: {result.path}" if result.path else "result: not kept (its folder was temporary); pass --out DIR "
          "to keep result.json and the logs")
    failed = result.failed_checks()
    if failed:
        print(f"error: {len(failed)} of {len(result.checks)} checks are outside their tolerance:\n"
              f"{describe_failed_checks(result)}", file=sys.stderr)
        return 1
    return 0


def _cmd_slurm(args: argparse.Namespace) -> int:
    """Check everything, then print the script or write it to ``--output``."""
    from handbook_lib.slurm import build_job, render_sbatch, write_script

    if args.overwrite and args.output is None:
        raise ValueError("--overwrite applies to --output FILE: give --output, or leave --overwrite out")
    job = build_job(args.name, args.nodes, args.gpus_per_node, parse_overrides(args.overrides),
                    time=args.time, partition=args.partition, account=args.account, job_name=args.job_name,
                    out_dir=args.out, log=args.log, cpus_per_task=args.cpus_per_task, port=args.port)
    text = render_sbatch(job)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    path = write_script(args.output, text, overwrite=args.overwrite)
    print(f"wrote {path}: {job.run} on {job.nodes} x {job.gpus_per_node} GPUs = {job.world_size} ranks; "
          f"submit it with: sbatch {path}")
    return 0


def _cmd_params(args: argparse.Namespace) -> int:
    model, named = _chosen_model(args)
    if isinstance(model, DecoderShape):
        parts, total = model.param_breakdown(), model.num_params
    else:
        parts, total = param_count_breakdown(model), param_count(model)
    print(_wrap(named, "  "))
    rows = [[name, count, format_bytes(4 * count)] for name, count in parts.items()]
    rows.append(["total", total, format_bytes(4 * total)])
    print(Table(["component", "parameters", "fp32 bytes"], rows))
    return 0


_COMMANDS = {"runs": lambda args: _cmd_runs(), "run": _cmd_run, "params": _cmd_params,
             "memory": _cmd_memory, "comm": _cmd_comm, "plan": _cmd_plan, "slurm": _cmd_slurm}


def main(argv: list[str] | None = None) -> int:
    """Run one command; return its exit status (0 ok, 1 a run failed, 2 a bad argument)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help (0) or a bad argument (2), already printed
        return stop.code if isinstance(stop.code, int) else 2
    try:
        return _COMMANDS[args.command](args)
    except ValueError as err:  # one line naming the flag or key; long lists wrapped to WIDTH
        text = f"error: {err}"
        print(_wrap(text, "  ") if "\n" not in text else text, file=sys.stderr)
        return 2
    except RunFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the launcher has already stopped torchrun and its ranks
        what = f"run {args.name!r}" if args.command == "run" else args.command
        print(f"error: {what} interrupted" + ("; torchrun and its ranks were stopped"
                                              if args.command == "run" else ""), file=sys.stderr)
        return 130
