"""The command line: ``python -m handbook_lib <command>`` (also installed as ``handbook``).

Chapter 1 introduces it. Commands:

- ``runs`` — list the experiments that can be launched;
- ``run NAME --nproc N [--set key=value ...] [--out DIR] [--timeout S]`` — launch one with
  torchrun, stream its ranks' output, leave ``DIR/result.json`` and print its checks;
- ``params [--set key=value ...]`` — the model's parameter count, by component;
- ``memory (--params N | --model 7b | --set key=value ...) --world-size N ...`` — the memory
  model's per-rank bytes by component (``--json`` for bytes);
- ``comm (--params N | --model 70b) --world-size N --strategy S --link nvlink4 ...`` — bytes
  each rank sends per step, and the time they take (``--json`` for bytes and seconds);
- ``plan --model llama2-7b --gpu h100-80gb --gpus 8 --seq-len 4096 --micro-batch 1`` — every
  option priced, and a recommendation with its reasons (``--json`` for tools).

Exit status: 0 on success, 1 if a run failed or a check was off, 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys

from handbook_lib.activations import DECODER_SHAPES
from handbook_lib.architecture import ModelConfig, param_count, param_count_breakdown
from handbook_lib.comm import (
    estimate_compute_time,
    estimate_step_time,
    estimate_step_traffic,
    units_for_decoder,
)
from handbook_lib.config import OPTIMIZERS, PRECISIONS, STRATEGIES, RunConfig, parse_overrides
from handbook_lib.display import Table, checks_table, format_bytes
from handbook_lib.hardware import ACCELERATORS, LINKS, get_accelerator, get_link
from handbook_lib.launch import RunFailed, describe_failed_checks, torchrun
from handbook_lib.memory import PRECISION_DTYPES, estimate_memory
from handbook_lib.presets import DecoderShape
from handbook_lib.runs import available_runs
from handbook_lib.sharding import Unit
from handbook_lib.strategy import plan

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m handbook_lib",
                                     description="The FSDP Handbook's companion tools.")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("runs", help="list the experiments that can be launched")

    run = sub.add_parser("run", help="launch an experiment with torchrun")
    run.add_argument("name", help="run name (see: runs)")
    run.add_argument("--nproc", type=int, default=2, help="number of processes (default 2)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="set a config key (repeatable), e.g. --set steps=3")
    run.add_argument("--out", default=None, help="directory for result.json (default: a temp dir)")
    run.add_argument("--timeout", type=float, default=600.0, help="seconds before the run is killed")
    run.add_argument("--quiet", action="store_true", help="do not stream the ranks' output")

    params = sub.add_parser("params", help="parameter count of the model, by component")
    params.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a model key: vocab_size, d_model, nhead, dim_feedforward, num_layers")
    mem = sub.add_parser("memory", help="predicted per-rank memory, by component")
    what = mem.add_mutually_exclusive_group()
    what.add_argument("--params", type=float, help="a model known by its parameter count (e.g. 7e9)")
    what.add_argument("--model", choices=sorted(DECODER_SHAPES), help="a decoder shape (chapter 2)")
    mem.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="the handbook's model, with model keys changed (the default model)")
    mem.add_argument("--world-size", type=int, default=8, help="ranks (GPUs), default 8")
    mem.add_argument("--strategy", default="FULL_SHARD", help=f"one of {', '.join(STRATEGIES)}")
    mem.add_argument("--precision", default="bf16-mixed", help=f"one of {', '.join(PRECISIONS)}")
    mem.add_argument("--optimizer", default="adamw", help=f"one of {', '.join(OPTIMIZERS)}")
    mem.add_argument("--micro-batch", type=int, default=0, help="sequences per rank (0: no activations)")
    mem.add_argument("--seq-len", type=int, default=0, help="tokens per sequence")
    mem.add_argument("--shard-group-size", type=int, default=None, help="HYBRID: ranks per shard group")
    mem.add_argument("--activation-checkpointing", action="store_true")
    mem.add_argument("--cpu-offload", action="store_true")
    mem.add_argument("--json", action="store_true", help="print bytes as JSON")
    comm = sub.add_parser("comm", help="bytes sent per step and their time on a link")
    what = comm.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="a model known by its parameter count (one flat unit)")
    what.add_argument("--model", choices=sorted(DECODER_SHAPES), help="a decoder shape: one unit per layer")
    comm.add_argument("--world-size", type=int, default=8, help="ranks (GPUs), default 8")
    comm.add_argument("--strategy", default="FULL_SHARD", help=f"one of {', '.join(STRATEGIES)}")
    comm.add_argument("--precision", default="bf16-mixed", help=f"one of {', '.join(PRECISIONS)}")
    comm.add_argument("--shard-group-size", type=int, default=None, help="HYBRID: ranks per shard group")
    comm.add_argument("--link", default="nvlink4", help=f"one of {', '.join(LINKS)}")
    comm.add_argument("--gpu", default=None, help=f"for compute time: one of {', '.join(ACCELERATORS)}")
    comm.add_argument("--tokens", type=int, default=0, help="tokens per GPU per step, for compute time")
    comm.add_argument("--json", action="store_true", help="print bytes and seconds as JSON")
    pl = sub.add_parser("plan", help="price every strategy and recommend one")
    pl.add_argument("--model", required=True, choices=sorted(DECODER_SHAPES), help="a model preset")
    pl.add_argument("--gpu", required=True, choices=sorted(ACCELERATORS), help="a GPU preset")
    pl.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    pl.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    pl.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per step")
    pl.add_argument("--gpus-per-node", type=int, default=8)
    pl.add_argument("--inter-link", default="ib-ndr400", help=f"one of {', '.join(LINKS)}")
    pl.add_argument("--precision", default="bf16-mixed", help=f"one of {', '.join(PRECISIONS)}")
    pl.add_argument("--headroom", type=float, default=0.10, help="fraction of GPU memory kept free")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def _cmd_plan(args: argparse.Namespace) -> int:
    result = plan(args.model, args.gpu, args.gpus, micro_batch=args.micro_batch, seq_len=args.seq_len,
                  gpus_per_node=args.gpus_per_node, inter_link=args.inter_link,
                  precision=args.precision, headroom=args.headroom)
    if args.json:
        print(json.dumps(dataclasses.asdict(result), indent=2))
        return 0
    print(f"{result.model} ({result.num_params:,} parameters) on {result.gpus} x {result.gpu}, "
          f"seq {args.seq_len}, micro-batch {args.micro_batch}, {args.precision}")
    rows = [[o.name, o.gpus, format_bytes(o.peak_bytes), "yes" if o.fits else "no",
             round(o.comm_s, 3), round(o.compute_s, 3), round(o.step_s, 3), o.bound] for o in result.options]
    print(Table(["option", "GPUs", "peak per GPU", "fits", "comm (s)", "compute (s)", "step (s)", "bound"], rows))
    for reason in result.reasons:
        print(f"- {reason}")
    print(f"(the seed's rule, fp32 model state only, would answer: {result.seed_answer})")
    return 0


def _chosen_model(args: argparse.Namespace, minimum_params: int) -> int | DecoderShape | ModelConfig:
    """The model named on the command line: ``--params N``, ``--model NAME``, or the handbook's
    model with ``--set`` keys (where the command has them)."""
    overrides = getattr(args, "overrides", [])
    if args.params is not None:
        if overrides:
            raise ValueError("--set applies to the handbook's model; do not combine it with --params")
        if args.params < minimum_params or args.params != int(args.params):
            raise ValueError(f"--params must be a whole number >= {minimum_params}, got {args.params}")
        return int(args.params)
    if args.model is not None:
        return DECODER_SHAPES[args.model]
    return RunConfig.from_mapping(parse_overrides(overrides)).model_config()


def _cmd_comm(args: argparse.Namespace) -> int:
    model = _chosen_model(args, minimum_params=1)
    if isinstance(model, int):
        units, num_params = [Unit("model", ((model,),))], model
    else:
        units, num_params = units_for_decoder(model), model.num_params
    param_dtype, reduce_dtype = PRECISION_DTYPES[args.precision]
    traffic = estimate_step_traffic(units, args.world_size, args.strategy, param_dtype=param_dtype,
                                    reduce_dtype=reduce_dtype, shard_group_size=args.shard_group_size)
    link = get_link(args.link)
    compute_s = 0.0
    if args.gpu or args.tokens:
        if not (args.gpu and args.tokens > 0):
            raise ValueError("compute time needs both --gpu and --tokens > 0")
        compute_s = estimate_compute_time(num_params, args.tokens, get_accelerator(args.gpu).peak_flops_bf16)
    plain = estimate_step_time(traffic, link, compute_s, overlap=False)
    hidden = estimate_step_time(traffic, link, compute_s, overlap=True)
    if args.json:
        print(json.dumps({"counts": traffic.counts, "sent_bytes": traffic.sent_bytes,
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
    print(f"per rank and step: {args.strategy}, {args.world_size} ranks, {args.precision}, link {link.name}")
    print(Table(["collective", "calls", "bytes sent", "human"], rows))
    print(f"communication: {plain.comm_s * 1e3:.2f} ms on {link.name}")
    if compute_s:
        print(f"compute (6PT at 40 % of {args.gpu}'s bf16 peak): {compute_s * 1e3:.2f} ms")
        print(f"step: {plain.total_s * 1e3:.2f} ms without overlap, {hidden.total_s * 1e3:.2f} ms with; "
              f"{hidden.bound}-bound")
    return 0


def _cmd_memory(args: argparse.Namespace) -> int:
    model = _chosen_model(args, minimum_params=0)
    est = estimate_memory(model, args.world_size, args.strategy, args.precision, args.optimizer,
                          micro_batch=args.micro_batch, seq_len=args.seq_len,
                          shard_group_size=args.shard_group_size,
                          activation_checkpointing=args.activation_checkpointing,
                          cpu_offload=args.cpu_offload)
    if args.json:
        print(json.dumps({"components": est.components, "peak": est.peak, "peak_phase": est.peak_phase,
                          "phases": est.phases, "host": est.host, "notes": list(est.notes)}, indent=2))
        return 0
    rows = [[name, b, format_bytes(b)] for name, b in est.components.items()]
    rows.append([f"peak ({est.peak_phase})", est.peak, format_bytes(est.peak)])
    if est.host:
        rows.append(["host (offloaded)", est.host, format_bytes(est.host)])
    print(f"per-rank memory: {args.strategy}, {args.world_size} ranks, {args.precision}, {args.optimizer}")
    print(Table(["component", "bytes", "human"], rows))
    for note in est.notes:
        print(f"note: {note}")
    return 0


def _cmd_runs() -> int:
    for name in available_runs():
        doc = importlib.import_module(f"handbook_lib.runs.{name}").__doc__ or ""
        print(f"{name:12s} {doc.strip().splitlines()[0] if doc.strip() else ''}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    """Launch, print every check; exit 1 if any check is outside its own tolerance."""
    result = torchrun(args.name, args.nproc, parse_overrides(args.overrides), out=args.out,
                      timeout_s=args.timeout, stream=not args.quiet, allow_failed_checks=True)
    if result.checks:
        print(checks_table(result))
    print(f"result: {result.path}")
    failed = result.failed_checks()
    if failed:
        print(f"error: {len(failed)} of {len(result.checks)} checks are outside their tolerance:\n"
              f"{describe_failed_checks(result)}", file=sys.stderr)
        return 1
    return 0


def _cmd_params(args: argparse.Namespace) -> int:
    config = RunConfig.from_mapping(parse_overrides(args.overrides)).model_config()
    parts = param_count_breakdown(config)
    total = param_count(config)
    rows = [[name, count, format_bytes(4 * count)] for name, count in parts.items()]
    rows.append(["total", total, format_bytes(4 * total)])
    print(Table(["component", "parameters", "fp32 bytes"], rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "runs":
            return _cmd_runs()
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "memory":
            return _cmd_memory(args)
        if args.command == "comm":
            return _cmd_comm(args)
        if args.command == "plan":
            return _cmd_plan(args)
        return _cmd_params(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RunFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
