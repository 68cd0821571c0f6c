

def test_axes_table_shows_each_layout_and_its_compact_form_fits_the_book():
    from handbook_lib.face.views import axes_table
    from handbook_lib.models.axes_table import compare_axes

    rows = compare_axes("llama2-70b", "h100-80gb", 64, seq_len=131072, tp_size=8, sp_size=8)
    full, compact = str(axes_table(rows)), str(axes_table(rows, compact=True))
    import re

    assert [re.split(r"\s{2,}", line.strip())[0] for line in full.splitlines()[2:]] == [r.name for r in rows]
    assert "comm s" in full and "comm s" not in compact and "exposed s" in compact
    assert max(map(len, compact.splitlines())) <= 86 < max(map(len, full.splitlines()))
    fits = [r for r in rows if r.fits]
    assert fits and all(f"{100 * r.margin_bytes / r.budget_bytes:+.1f} %" in compact for r in fits)
