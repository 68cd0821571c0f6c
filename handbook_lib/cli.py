"""The command line: ``python -m handbook_lib <command>`` (also installed as ``handbook``).

Chapter 1 introduces it. Commands:

- ``runs`` — list the experiments that can be launched;
- ``run NAME --nproc N [--set key=value ...] [--out DIR] [--timeout S]`` — launch one with
  torchrun, stream its ranks' output, leave ``DIR/result.json`` and print its checks;
- ``params [--set key=value ...]`` — the model's parameter count, by component.

Exit status: 0 on success, 1 if a run failed or a check was off, 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from handbook_lib.config import RunConfig, parse_overrides
from handbook_lib.display import Table, checks_table, format_bytes
from handbook_lib.launch import RunFailed, torchrun
from handbook_lib.model import param_count, param_count_breakdown
from handbook_lib.runs import available_runs

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
    return parser


def _cmd_runs() -> int:
    for name in available_runs():
        doc = importlib.import_module(f"handbook_lib.runs.{name}").__doc__ or ""
        print(f"{name:12s} {doc.strip().splitlines()[0] if doc.strip() else ''}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    result = torchrun(args.name, args.nproc, parse_overrides(args.overrides), out=args.out,
                      timeout_s=args.timeout, stream=not args.quiet)
    if result.checks:
        print(checks_table(result))
    off = result.failed_checks()
    exact = [c for c in off if c.unit == "bytes"]
    if exact:
        print(f"{len(exact)} byte-exact check(s) differ from the model", file=sys.stderr)
        return 1
    print(f"result: {result.path}")
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
        return _cmd_params(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RunFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
