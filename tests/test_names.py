"""handbook_lib.names: one lookup, one error message, everywhere."""

import pytest

from handbook_lib.names import lookup


def test_lookup_returns_the_entry_and_lists_choices_on_error():
    table = {"a": 1, "b": 2}
    assert lookup(table, "b", "letter") == 2
    with pytest.raises(ValueError, match=r"^letter must be one of a, b, got 'c'$"):
        lookup(table, "c", "letter")
    with pytest.raises(ValueError, match="letter must be one of"):
        lookup(table, ["unhashable"], "letter")
