"""handbook_lib.display: human units and tables."""

import pytest

from handbook_lib.display import Table, checks_table, format_bytes
from handbook_lib.results import Check


@pytest.mark.parametrize("n, kwargs, text", [
    (39_474_240, {}, "39.47 MB"),
    (157_896_960, {}, "157.90 MB"),
    (112 * 10**9, {}, "112.00 GB"),
    (2**30, {"binary": True}, "1.00 GiB"),
    (999, {}, "999 B"),
    (1500, {"digits": 1}, "1.5 kB"),
])
def test_format_bytes(n, kwargs, text):
    assert format_bytes(n, **kwargs) == text


def test_table_text_is_aligned_and_html_escaped():
    table = Table(["name", "bytes"], [["a<b", 1234567], ["c", 0.5]])
    lines = table.text().splitlines()
    assert lines[0] == "name      bytes"
    assert lines[2] == " a<b  1,234,567"
    assert len({len(line) for line in lines}) == 1
    assert "a&lt;b" in table._repr_html_()


def test_checks_table_has_error_column():
    table = checks_table([Check("param_shard_bytes", 1, 10, 12, "bytes")])
    assert table.columns[4] == "error" and table.rows[0][4] == 2
