"""Layer 5, what a person reads: formatted bytes and tables, views of runs, figures and
diagrams, and the command line (``python -m handbook_lib``). Names are imported on first use,
so ``handbook_lib.face`` does not load matplotlib until a figure is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from handbook_lib.core.lazy import lazy_exports

if TYPE_CHECKING:  # what a type checker sees; at run time each name is imported on first use
    from handbook_lib.face.cli import build_parser, main
    from handbook_lib.face.diagrams import (
        fsdp_step_slots,
        plot_collective_timeline,
        plot_commit_protocol,
        plot_fsdp_step,
        plot_ring_schedule,
        plot_step_phases,
    )
    from handbook_lib.face.display import (
        COLLECTIVE_QUANTITIES,
        LOSS_DECIMALS,
        Definitions,
        ErrorText,
        SourceCode,
        Table,
        checks_legend,
        checks_summary,
        checks_table,
        checks_verdict,
        collective_checks,
        definitions,
        format_bound,
        format_bytes,
        format_loss,
        format_losses,
        format_tolerance,
        ranks_table,
        show_exception,
        show_source,
    )
    from handbook_lib.face.plots import (
        BOOK_WIDTH_IN,
        MIN_FONT_PT,
        plot_collective_bench,
        plot_fit_map,
        plot_loss_curves,
        plot_memory_breakdown,
        plot_memory_vs_seq_len,
        plot_min_tokens_by_link,
        plot_peak_by_run,
        plot_predicted_vs_measured,
        plot_prediction_scatter,
        plot_rank_bytes,
        plot_step_time_by_link,
        plot_volume_vs_memory,
    )
    from handbook_lib.face.views import (
        compare_runs,
        fit_table,
        run_summary,
        step_time_summary,
        step_time_table,
        summarize_runs,
        zero_vs_fsdp_table,
        gathered_table,
        knob_traffic_table,
        checks_by_run,
    )
    from handbook_lib.face.views import (
        axes_table,
    )
    from handbook_lib.face.display import (
        checks_bound,
    )

_HOMES = {
    "main": "cli",
    "build_parser": "cli",
    "plot_ring_schedule": "diagrams",
    "plot_collective_timeline": "diagrams",
    "plot_commit_protocol": "diagrams",
    "fsdp_step_slots": "diagrams",
    "plot_fsdp_step": "diagrams",
    "plot_step_phases": "diagrams",
    "format_bytes": "display",
    "format_loss": "display",
    "format_losses": "display",
    "format_bound": "display",
    "LOSS_DECIMALS": "display",
    "Table": "display",
    "checks_table": "display",
    "checks_summary": "display",
    "collective_checks": "display",
    "COLLECTIVE_QUANTITIES": "display",
    "checks_verdict": "display",
    "checks_legend": "display",
    "format_tolerance": "display",
    "ranks_table": "display",
    "Definitions": "display",
    "definitions": "display",
    "ErrorText": "display",
    "show_exception": "display",
    "SourceCode": "display",
    "show_source": "display",
    "plot_rank_bytes": "plots",
    "plot_memory_breakdown": "plots",
    "plot_predicted_vs_measured": "plots",
    "plot_prediction_scatter": "plots",
    "plot_collective_bench": "plots",
    "plot_volume_vs_memory": "plots",
    "plot_step_time_by_link": "plots",
    "plot_fit_map": "plots",
    "plot_min_tokens_by_link": "plots",
    "plot_loss_curves": "plots",
    "plot_peak_by_run": "plots",
    "plot_memory_vs_seq_len": "plots",
    "BOOK_WIDTH_IN": "plots",
    "MIN_FONT_PT": "plots",
    "summarize_runs": "views",
    "run_summary": "views",
    "compare_runs": "views",
    "step_time_table": "views",
    "step_time_summary": "views",
    "fit_table": "views",
    "zero_vs_fsdp_table": "views",
    "gathered_table": "views",
    "knob_traffic_table": "views",
    "checks_by_run": "views",
    "axes_table": "views",
    "checks_bound": "display",
}
"""Each exported name and the module of this package it is defined in."""

__all__ = [
    "main", "build_parser", "plot_ring_schedule", "plot_collective_timeline",
    "plot_commit_protocol", "format_bytes", "format_loss", "format_losses", "format_bound",
    "LOSS_DECIMALS", "Table", "checks_table", "checks_summary", "checks_verdict", "checks_legend", "format_tolerance",
    "ranks_table", "Definitions", "definitions", "ErrorText", "show_exception", "SourceCode",
    "show_source", "plot_rank_bytes", "plot_memory_breakdown", "plot_predicted_vs_measured",
    "plot_collective_bench", "plot_volume_vs_memory", "plot_step_time_by_link", "plot_fit_map",
    "plot_loss_curves", "plot_peak_by_run", "plot_memory_vs_seq_len", "BOOK_WIDTH_IN",
    "MIN_FONT_PT", "summarize_runs", "run_summary", "compare_runs", "step_time_table",
    "step_time_summary", "fit_table", "zero_vs_fsdp_table", "gathered_table", "knob_traffic_table", "checks_by_run",
    "COLLECTIVE_QUANTITIES", "collective_checks", "fsdp_step_slots", "plot_fsdp_step",
    "plot_min_tokens_by_link", "plot_prediction_scatter", "plot_step_phases",
    "axes_table",
    "checks_bound",
]

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
