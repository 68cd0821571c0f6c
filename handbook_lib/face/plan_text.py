"""``plan`` on the terminal: the options' table, the budget, the routes, the reasons, the
sensitivity and the layouts beyond FSDP, all from one
:class:`~handbook_lib.models.plan_output.PlanReport`. Called by :mod:`handbook_lib.face.commands`."""

from __future__ import annotations

import argparse

from handbook_lib.core.strategies import get_strategy
from handbook_lib.face.display import Table, format_bytes
from handbook_lib.face.plan_axes import print_axes, wrap_line
from handbook_lib.models.plan_output import SEARCH_ROWS, PlanReport
from handbook_lib.models.plan_search import PlanSearch
from handbook_lib.models.planner import Plan
from handbook_lib.models.sensitivity import FlipPoints, Sensitivity

__all__ = ["accum_text", "impl_text", "print_plan"]


def accum_text(args: argparse.Namespace, lead: str = ", ") -> str:
    """``, 4 micro-steps a step, gradients reduced in the last`` (after ``lead``), or nothing
    without accumulation."""
    if args.grad_accum == 1:
        return ""
    return (f"{lead}{args.grad_accum} micro-steps a step, gradients reduced in "
            f"{'each' if args.sync_every_micro_step else 'the last'}")


def impl_text(args: argparse.Namespace) -> str:
    """`` (fused)``: the optimizer's implementation where one is asked for; torch's default
    (foreach on a GPU) says nothing."""
    impl = getattr(args, "optimizer_impl", "default")
    return "" if impl == "default" else f" ({impl})"


def _priced(args: argparse.Namespace) -> str:
    """Which strategies the plan priced, in words (``--strategy`` and DeepSpeed's bucket)."""
    strategy = getattr(args, "strategy", None)
    if strategy is None:
        return "every strategy priced"
    if get_strategy(strategy).wrapper != "deepspeed":
        return f"{strategy} alone priced"
    bucket = getattr(args, "reduce_bucket_size", None)
    return (f"{strategy} alone priced, DeepSpeed's defaults but a gradient bucket of {bucket:,} elements" if bucket
            else f"{strategy} alone priced, DeepSpeed's defaults (gradient buckets of 5e8 elements)")


def print_plan(report: PlanReport, args: argparse.Namespace, per_node: int) -> None:
    """Print ``report`` as ``plan`` does, ``args`` its flags, ``per_node`` the GPUs per node."""
    result, changes, flips, budget, band = (report.plan, list(report.sensitivity or ()), report.flips, report.budget,
                                            report.band)
    axes = (list(report.axes), report.verdict) if report.verdict is not None else None
    print(wrap_line(f"assumes: {result.gpus} x {result.gpu} ({per_node} per node, "
                f"{result.nics_per_node} x {args.inter_link} between nodes), {args.precision}, optimizer "
                f"{args.optimizer}{impl_text(args)}, micro-batch {args.micro_batch} x {args.seq_len} tokens"
                f"{accum_text(args)}, utilization {100 * result.utilization:.0f} %, "
                f"{100 * args.headroom:.0f} % headroom; {_priced(args)}", "  "))
    rows = [[o.name, o.gpus, format_bytes(o.peak_reserved_bytes),
             _margin(o.margin) if o.fits or o.margin < 0 else "host RAM",
             format_bytes(o.host_bytes) if o.host_bytes else "-", round(o.comm_s, 3), round(o.compute_s, 3),
             round(o.step_s, 3), "comm" if o.bound == "communication" else "comp"] for o in result.options]
    print(Table(["option", "GPUs", "reserved", "margin", "host/GPU", "comm s", "comp s", "step s", "bound"],
                rows))
    pick = result.recommended or result.options[0]
    sizes = sorted({o.shard_group_size for o in result.options if "/" in o.name and o.shard_group_size})
    groups = (f"HYBRID_SHARD/{sizes[0]} = shard groups of {sizes[0]} GPUs, replicated across them; "
              if sizes else "")
    print(wrap_line(f"budget per GPU ({pick.name}): {budget.text()}", "  "))
    print(wrap_line("reserved = peak per GPU as the allocator holds it; margin = what is left of the "
                    f"option's budget ({format_bytes(budget.budget_bytes)} for {pick.name}: each option's "
                    "NCCL buffers differ), "
                    "negative: does not fit (host RAM: the node's host memory is too small); AC = "
                    f"activation checkpointing ({result.checkpointing}); {groups}offload = model state in host "
                    "RAM (host/GPU), its optimizer "
                    "step on the CPU; comp = compute; bound = what sets the step: compute, or comm "
                    "(communication not hidden by compute)", "  "))
    print("how the collectives travel (NCCL's ring or tree, over every rail of a machine):")
    for o in result.options:
        if not o.activation_checkpointing or o.cpu_offload:
            for route in o.routes:
                print(wrap_line(f"  {o.name} {route}", "    "))
    for reason in result.reasons:
        print(wrap_line(f"- {reason}", "  "))
    print(wrap_line(f"- Step times: {band.text()}; a lead smaller than that is a tie to time." if band else
                    f"- Step times: no published run on {args.gpu} tests the model there.", "  "))
    for left in report.not_modelled:
        print(wrap_line(f"- Not modelled: {left}.", "  "))
    print(f"(the 16-bytes-per-parameter rule, fp32 model state only, would answer: {result.seed_answer})")
    if report.search is not None:
        _print_search(report.search)
    if args.sensitivity:
        _print_sensitivity(result, changes, flips)
    if axes:
        print_axes(*axes, band)


def _print_search(search: PlanSearch) -> None:
    """The search's fastest layouts that fit, and its verdict."""
    print(wrap_line(f"searched {search.searched}", "  "))
    best = search.winner
    if best is not None:
        rows = [[c.name, format_bytes(c.peak_reserved_bytes), round(c.step_s, 3), f"{c.tokens_per_s_per_gpu:,.0f}",
                 "best" if c is best else "tie" if c in search.tied else
                 _margin(c.tokens_per_s_per_gpu / best.tokens_per_s_per_gpu - 1)]
                for c in search.fitting[:SEARCH_ROWS]]
        print(Table(["fastest that fit", "reserved", "step s", "tok/s/GPU", "vs best"], rows))
    print(wrap_line(f"- {search.verdict()}", "  "))


def _margin(fraction: float) -> str:
    """A margin as a signed percentage, to 0.1 % near the edge, whole far from it (fits 100 columns)."""
    return f"{100 * fraction:+.1f} %" if abs(fraction) < 1 else f"{100 * fraction:+.0f} %"

def _print_sensitivity(result: Plan, changes: list[Sensitivity], flips: FlipPoints | None) -> None:
    print("sensitivity: the plan again with one assumption changed")
    rows = [[c.assumption, c.planned, c.changed, c.recommended, round(c.step_s, 3),
             _margin(c.margin) if c.step_s else "-", "FLIPS" if c.flips else "same"] for c in changes]
    print(Table(["assumption", "planned", "changed to", "recommended", "step s", "margin", "verdict"], rows))
    if flips is None:
        return
    o = result.recommended
    assert o is not None  # flips are those of the recommended option
    words = [f"fits up to {100 * flips.headroom:.1f} % headroom",
             f"on cards of at least {format_bytes(flips.memory_bytes)}"]
    if flips.utilization is not None:
        words.append(f"compute-bound up to {100 * flips.utilization:.0f} % utilization")
    elif o.bound == "compute":
        words.append("compute-bound at any utilization")
    else:
        words.append("communication-bound already")
    if flips.network_factor is not None:
        words.append(f"and down to {100 * flips.network_factor:.0f} % of the links' bandwidth")
    print(wrap_line(f"where {o.name} flips: it {', '.join(words)}", "  "))

