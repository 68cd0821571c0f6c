"""The planner's layouts beyond FSDP on the terminal (``plan``, chapter 9): which layouts a plan
prices beside FSDP's options, and how they print. Called by :mod:`handbook_lib.face.commands`."""

from __future__ import annotations

import argparse

from handbook_lib.core.parallel_layout import ParallelLayout
from handbook_lib.core.text import TERMINAL_WIDTH, wrap
from handbook_lib.face.views import axes_table
from handbook_lib.models.axes import AxesVerdict, estimate_axes
from handbook_lib.models.axes_table import AxisOption, axes_reason, compare_axes, recommend_axes
from handbook_lib.models.bands import StepTimeBand
from handbook_lib.models.hf_config import read_hf_config
from handbook_lib.models.planner import Plan
from handbook_lib.models.presets import DecoderShape, get_shape

__all__ = ["FLAGS", "SCALES", "chosen_shape", "plan_axes", "print_axes", "short_of_fsdp", "wrap_line"]


def wrap_line(text: str, indent: str = "") -> str:
    """``text`` wrapped to :data:`~handbook_lib.core.text.TERMINAL_WIDTH` columns, continuation
    lines indented by ``indent`` (a flag or a name is never cut)."""
    return wrap(text, TERMINAL_WIDTH, indent, break_long_words=False)


FLAGS = {"world": "--world-size {}", "dp_shard": "--shard-group-size {}", "tp": "--tp-size {}",
         "sp": "--sp-size {}", "sp_method": "--sp-method {}", "gpus_per_node": "the GPUs per node ({})",
         "nhead": "the heads ({})", "kv_heads": "the KV heads ({})", "seq_len": "--seq-len ({})",
         "pp": "--pp-size {}", "layers": "the layers ({})"}
"""How the commands' refusals name the layout's quantities: by their flags, or in words."""


def chosen_shape(args: argparse.Namespace) -> DecoderShape:
    """The decoder named by ``--model`` or ``--hf-config`` (the axes price a decoder's shape)."""
    if getattr(args, "model", None) is not None:
        return get_shape(args.model)
    if getattr(args, "hf_config", None) is not None:
        return read_hf_config(args.hf_config)
    flag = "--tp-size" if getattr(args, "tp_size", 1) > 1 else "--sp-size"
    raise ValueError(f"{flag} prices a decoder at scale: give --model (e.g. llama2-70b) or --hf-config, "
                     "not the handbook's model or --params")


def plan_axes(args: argparse.Namespace, per_node: int, result: Plan) -> tuple[list[AxisOption], AxesVerdict] | None:
    """``plan --tp-size/--sp-size/--pp-size/--batch-tokens``, or a decoder's shape none of FSDP's
    options fits: the layouts beyond FSDP and the verdict. On more than one node, where FSDP and
    TP alone fall short (:func:`short_of_fsdp`), pipelines are priced too (every stage count, the
    best shown), unless ``--pp-size`` says which."""
    asked = (args.tp_size > 1 or args.sp_size > 1 or args.pp_size is not None
             or args.batch_tokens is not None)
    decoder = getattr(args, "model", None) is not None or getattr(args, "hf_config", None) is not None
    if not asked and (not decoder or any(o.fits for o in result.options)):
        return None
    offer = args.pp_size is None and args.gpus > per_node  # a pipeline where FSDP and TP alone fall short
    pp = args.pp_size if args.pp_size is not None else 1
    shape = chosen_shape(args)  # plan takes --model or --hf-config: a decoder's shape
    tp, sp = args.tp_size, args.sp_size
    for one in ({"tp": tp}, {"sp": sp}):  # each axis priced beside FSDP, alone
        ParallelLayout.for_world(args.gpus, **one, sp_method=args.sp_method, gpus_per_node=per_node,
                                 nhead=shape.nhead, kv_heads=shape.kv_heads, seq_len=args.seq_len,
                                 names=FLAGS | {"world": "--gpus ({})"})
    common = {"micro_batch": args.micro_batch, "gpus_per_node": per_node, "inter_link": args.inter_link,
              "precision": args.precision, "headroom": args.headroom}
    verdict = estimate_axes(shape, args.gpu, args.gpus, seq_len=args.seq_len, batch_tokens=args.batch_tokens,
                            **common)
    # the table also prices the axis the verdict calls for, so that its pick and the verdict agree
    method = args.sp_method if sp > 1 or verdict.sp_size == 1 else verdict.sp_method
    tp, sp = (tp if tp > 1 else verdict.tp_size), (sp if sp > 1 else verdict.sp_size)
    kwargs = {"seq_len": args.seq_len, "sp_size": sp, "sp_method": method, "batch_tokens": args.batch_tokens,
              **common}
    rows = compare_axes(shape, args.gpu, args.gpus, tp_size=tp, pp_size=pp, **kwargs)
    if offer and short_of_fsdp(result, rows):
        if tp == 1 and ParallelLayout.allows(args.gpus, tp=per_node, gpus_per_node=per_node, nhead=shape.nhead,
                                             kv_heads=shape.kv_heads, ffn=shape.ffn):
            tp = per_node  # a pipeline across nodes, TP inside each (where the heads allow a node's)
        rows = compare_axes(shape, args.gpu, args.gpus, tp_size=tp, pp_size=0, **kwargs)
    return rows, verdict


SCALES = 0.10
"""Exposed communication, as a fraction of compute, past which a layout is said not to scale: the
planner then prices pipelines beside it."""


def short_of_fsdp(result: Plan, rows: list[AxisOption]) -> bool:
    """Whether FSDP and TP alone fall short, so that the plan prices pipelines too: none of FSDP's
    options fits; or the fastest layout that fits (and keeps within the batch) spends more than
    :data:`SCALES` of its compute on communication it does not hide."""
    if not any(o.fits for o in result.options):
        return True
    best = recommend_axes(rows)
    return best is None or best.step_s > (1 + SCALES) * best.compute_s


def print_axes(rows: list[AxisOption], verdict: AxesVerdict, band: StepTimeBand | None) -> None:
    """The layouts' table, its legend, the pick and why, and the verdict with its reasons."""
    pipes = any(r.pp_size > 1 for r in rows)
    print(wrap_line("beyond FSDP (chapter 9): the same job as TP inside a node x FSDP across, or the sequence "
                    "split" + (", or a pipeline across nodes (PP p (m micro-batches), 1F1B)" if pipes else ""),
                    "  "))
    print(axes_table(rows))
    print(wrap_line("exposed = communication no compute hides (TP's collectives and Ulysses' all-to-alls sit "
                    "between two matrix products"
                    + ("; a pipeline's sends of the fill and the drain), bubble = the pipeline's idle time, "
                       "both in seconds" if pipes else ")")
                    + "; tok/s/GPU compares layouts whose batches differ (a TP "
                    "group shares its sequences); margin batch: fits, but its step takes more tokens than "
                    "--batch-tokens; compute counts attention's FLOPs, 12 L w s per token", "  "))
    print(wrap_line(f"- {axes_reason(rows, band)}", "  "))
    print(wrap_line(f"is FSDP enough? {verdict.axes}", "  "))
    for reason in verdict.reasons:
        print(wrap_line(f"- {reason}", "  "))
