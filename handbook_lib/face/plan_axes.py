"""The planner's layouts beyond FSDP on the terminal (``plan``, chapter 9): the decoder the flags
name, and how the layouts :func:`~handbook_lib.models.plan_output.plan_report` priced print.
Called by :mod:`handbook_lib.face.commands`."""

from __future__ import annotations

import argparse

from handbook_lib.core.text import TERMINAL_WIDTH, wrap
from handbook_lib.face.views import axes_table
from handbook_lib.models.axes import AxesVerdict
from handbook_lib.models.axes_table import AxisOption, axes_reason
from handbook_lib.models.bands import StepTimeBand
from handbook_lib.models.hf_config import read_hf_config
from handbook_lib.models.presets import DecoderShape, get_shape

__all__ = ["FLAGS", "chosen_shape", "print_axes", "wrap_line"]


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


def print_axes(rows: list[AxisOption], verdict: AxesVerdict, band: StepTimeBand | None) -> None:
    """The layouts' table, its legend, the pick and why, and the verdict with its reasons."""
    pipes = any(r.pp_size > 1 for r in rows)
    print(wrap_line("beyond FSDP (chapter 9): the same job as TP inside a node x FSDP across, or the sequence "
                    "split" + (", or a pipeline across nodes (PP p (m micro-batches), 1F1B; PP pxv: interleaved "
                               "1F1B, v stages a GPU)" if pipes else ""),
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
