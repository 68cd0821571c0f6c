"""Layer 6, what a person reads: formatted bytes and tables, views of runs, figures and
diagrams, and the command line (``python -m handbook_lib``). Names are imported on first use,
so ``handbook_lib.face`` does not load matplotlib until a figure is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from handbook_lib.core.lazy import lazy_exports

if TYPE_CHECKING:  # what a type checker sees; at run time each name is imported on first use
    from handbook_lib.face.cli import build_parser, main
    from handbook_lib.face.case_diff import CaseDiff, show_case
    from handbook_lib.face.diagrams import (
        fsdp_step_slots,
        plot_collective_timeline,
        plot_commit_protocol,
        plot_fsdp_step,
        plot_pipeline_schedules,
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
        checks_halves,
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
    from handbook_lib.face.gpu_results import (
        gpu_budget_table,
        gpu_fit_curve,
        gpu_fit_table,
        gpu_memory_rows,
        gpu_memory_table,
        gpu_mfu_table,
        gpu_sets_table,
        gpu_smoke_table,
        gpu_utilization_fit,
        gpu_utilization_rows,
        gpu_utilization_table,
        plot_utilization,
        read_gpu_results,
        root_resharded,
    )
    from handbook_lib.face.published_views import (
        plot_throughput_errors,
        source_name,
        throughput_by_length_table,
        throughput_summary_table,
    )
    from handbook_lib.face.plots import (
        BOOK_WIDTH_IN,
        MIN_FONT_PT,
        plot_collective_bench,
        plot_fit_map,
        plot_loss_curves,
        plot_memory_breakdown,
        plot_memory_vs_seq_len,
        plot_micro_batch_fit,
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


__getattr__, __dir__, __all__ = lazy_exports(__name__)
