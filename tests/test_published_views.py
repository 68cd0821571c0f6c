"""handbook_lib.face.published_views: the published throughputs summarised, by hand."""

from __future__ import annotations

import statistics

from handbook_lib.face import (
    plot_throughput_errors,
    source_name,
    throughput_by_length_table,
    throughput_summary_table,
)
from handbook_lib.models import throughput_rows

ROWS = throughput_rows()


def test_the_summary_counts_and_medians_each_source_and_gpu():
    table = throughput_summary_table(ROWS)
    by = {(r[0], r[1]): r for r in table.rows}
    counted = [r for r in ROWS if not r.published.calibration]
    overall = by[("every source", "every GPU")]
    assert (overall[2], overall[3]) == (len(counted), len(ROWS) - len(counted))
    assert overall[4] == f"{100 * statistics.median(abs(r.error) for r in counted):.1f}%"
    titan = [r for r in counted if "torchtitan" in r.published.source]
    row = by[("torchtitan", "A100 80GB")]
    assert row[2] == len(titan) == 3 and row[3] == 0
    assert row[6] == f"{100 * max((r.error for r in titan), key=abs):+.1f}%"
    # every GPU's line counts what its sources' lines count
    for gpu in ("A100 40GB", "A100 80GB", "H100"):
        assert by[("every source", gpu)][2] == sum(r[2] for k, r in by.items() if k[1] == gpu and k[0] != "every source")


def test_the_length_table_splits_the_counted_rows_by_checkpointing():
    table = throughput_by_length_table(ROWS)
    counted = [r for r in ROWS if not r.published.calibration]
    assert sum(r[1] + r[3] for r in table.rows) == len(counted)
    row = next(r for r in table.rows if r[0] == "65,536")
    plain = [r.error for r in counted if r.published.seq_len == 65536 and not r.published.activation_checkpointing]
    assert row[1] == len(plain) and row[2] == f"{100 * statistics.median(plain):+.1f}%"


def test_source_names_and_the_figure():
    assert source_name("MosaicML, mosaicml/llm-foundry ...") == "MosaicML"
    assert source_name("Grattafiori et al. 2024, The Llama 3 Herd of Models") == "Meta (Llama 3)"
    fig = plot_throughput_errors(ROWS)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "sequence length (tokens)"
    assert sum(len(c.get_offsets()) for c in ax.collections) == len(ROWS)  # every row drawn once
