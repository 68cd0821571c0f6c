"""A clinic case's broken and fixed lines, read from its source (handbook_lib.face.case_diff)."""

import ast

import pytest

from handbook_lib.face.case_diff import CaseDiff, case_diff, show_case, specialise
from handbook_lib.models.clinic_cases import CLINIC_CASES

BOOK_WIDTH = 86


@pytest.mark.parametrize(("text", "broken", "expected"), [
    ("x = a if broken else b\n", True, "x = a\n"),
    ("x = a if broken else b\n", False, "x = b\n"),
    ("x = a if not broken else b\n", True, "x = b\n"),
    ("f(cpu_offload=not broken)\n", True, "f(cpu_offload=False)\n"),
    ("f(flag=broken)\n", False, "f(flag=False)\n"),
    ("x = (a if broken else b) + 1\n", True, "x = (a) + 1\n"),
    ("x = (a if broken else c if broken else d)\n", False, "x = (d)\n"),
    ('s = "é"; x = a if broken else b\n', False, 's = "é"; x = b\n'),
    ("if broken:  # why\n    a()\n    b()\nelse:\n    c()\n", True, "a()\nb()\n"),
    ("if broken:\n    a()\nelse:\n    c()\n", False, "c()\n"),
    ("if not broken:\n    init()\n", True, ""),
    ("if not broken:\n    init()\n", False, "init()\n"),
    ("if broken:\n    for p in ps:\n        p.mul_(s if broken else 1)\n", True,
     "for p in ps:\n    p.mul_(s)\n"),
    ("x = f(\n    a if broken else b,\n    c)\n", False, "x = f(\n    b,\n    c)\n"),
    ("x = a + b\n", True, "x = a + b\n"),
])
def test_specialise_resolves_every_use_of_broken(text, broken, expected):
    assert specialise(text, broken) == expected


def _example(u):
    """A case shaped like the clinic's: a loop over the halves, marked lines among unmarked
    (``u``: the user's functions; the test reads the source, it does not run it)."""
    halves = []
    u.prepare()  # clinic: broken
    for broken in (True, False):
        model = u.build()
        units = [model.embedding, *model.layers] if broken else list(model.layers)  # clinic: both
        u.shard(model, units)  # clinic: both
        if not broken:  # clinic: both
            model.init_buffers()
        halves.append(u.check(model, broken))
    u.finish(u,  # clinic: fixed
             every_rank=True)
    return halves


def test_case_diff_reads_marked_statements_in_order():
    diff = case_diff(_example)
    assert diff.name == "_example"
    assert diff.lines == (
        ("-", "u.prepare()"),
        ("-", "units = [model.embedding, *model.layers]"),
        ("+", "units = list(model.layers)"),
        (" ", "u.shard(model, units)"),
        ("+", "model.init_buffers()"),
        ("+", "u.finish(u,"),
        ("+", "         every_rank=True)"),
    )
    assert diff.broken == ["u.prepare()", "units = [model.embedding, *model.layers]", "u.shard(model, units)"]
    assert diff.fixed[:2] == ["units = list(model.layers)", "u.shard(model, units)"]
    assert repr(diff).splitlines()[:2] == ["- u.prepare()", "- units = [model.embedding, *model.layers]"]


def test_the_html_highlights_the_diff():
    shown = CaseDiff("x", (("-", "a = 1 < 2"), ("+", "a = 2"))).__repr__()
    assert shown == "- a = 1 < 2\n+ a = 2"
    page = CaseDiff("x", (("-", "a = 1 < 2"), ("+", "a = 2")))._repr_html_()
    assert "&lt;" in page and "a = 2" in page and "<pre" in page


def _unmarked(u):
    for broken in (True, False):
        u.run(broken)


def _same(u):
    for broken in (True, False):
        u.run()  # clinic: both
        u.check(broken)


def _comment_only(u):
    # what the user wrote  # clinic: broken
    u.run()


@pytest.mark.parametrize(("fn", "words"), [(_unmarked, "none differ"), (_same, "none differ"),
                                           (_comment_only, "not on a comment alone")])
def test_a_case_without_differing_marked_lines_is_refused(fn, words):
    with pytest.raises(ValueError, match=words):
        case_diff(fn)


def test_show_case_names_the_accepted_cases():
    with pytest.raises(ValueError, match="case must be one of wrap_class_missing"):
        show_case("no_such_case")


@pytest.mark.parametrize("name", list(CLINIC_CASES))
def test_every_clinic_case_shows_its_halves_within_the_column(name):
    diff = show_case(name)
    signs = {sign for sign, _ in diff.lines}
    assert signs & {"-", "+"}, f"{name}: no line differs"
    for half in (diff.broken, diff.fixed):  # each half's lines are Python as the user would write them
        ast.parse("\n".join(half))
    assert all(len(line) <= BOOK_WIDTH for line in repr(diff).splitlines()), repr(diff)
    assert "broken" not in "\n".join(t for s, t in diff.lines if s == "+"), "a fixed line still reads broken"
