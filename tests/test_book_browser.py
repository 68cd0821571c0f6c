"""The built book, opened page by page in headless Chromium (scripts/check_book.py).

Skips where selenium, Chromium or chromedriver is missing (CI has no Chromium); `make
check-book` installs them. Set HANDBOOK_BOOK_HTML to a built book's HTML folder to check that
instead of building one.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_book", ROOT / "scripts" / "check_book.py")
check_book = sys.modules.setdefault("check_book", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(check_book)

_missing = check_book.missing_requirements()
pytestmark = pytest.mark.skipif(_missing is not None, reason=f"no browser check: {_missing}")

# A page with one of each fault the check looks for, each planted where the check can see it,
# beside the same content done right (a scroll box whose content fits, the hover tooltip), which
# must pass.
_STYLE = """<style>
article.bd-article { width: 600px; }
a.glossary-term { position: relative; }
.tip { display: none; } a.glossary-term:hover .tip { display: block; }
</style>"""
_FAULTS = f"""<!DOCTYPE html><html><head><meta charset="utf-8">{_STYLE}
<link rel="icon" href="data:,">
<script src="http://cdn.example.org/lib.js"></script></head><body>
<article class="bd-article">
<section id="wide"><div id="too-wide" style="width: 900px">wide</div></section>
<div id="scroller" style="overflow-x: auto"><div style="width: 900px">hidden past the edge</div></div>
<div id="clips" style="overflow: hidden; white-space: nowrap; width: 200px">{"clipped " * 60}</div>
<img src="missing.png" alt="missing">
<p>Raw maths: \\(x^2\\)</p>
<p><a class="reference internal" href="#x"><span class="xref std std-term">bare</span></a></p>
<p><a class="reference internal glossary-term" href="glossary.html#term-x" aria-describedby="t1">
<span class="xref std std-term">hidden</span><span class="glossary-tooltip" id="t1" role="tooltip"
style="display: none">Never shown.</span></a></p>
<div style="overflow: auto; height: 3em; margin-top: 6em"><p>In a box:
<a class="reference internal glossary-term" href="glossary.html#term-x" aria-describedby="t2">
<span class="xref std std-term">boxed</span><span class="glossary-tooltip tip" id="t2"
role="tooltip" style="position: absolute; top: 100%; width: 20em; height: 6em">The definition of x.</span></a>
</p></div>
<script>console.error("planted error");</script>
</article></body></html>"""
_GLOSSARY = f"""<!DOCTYPE html><html><head><meta charset="utf-8">{_STYLE}
<link rel="icon" href="data:,"></head><body><article class="bd-article">
<dl class="glossary"><dt id="term-x">x</dt><dd><p>The definition of x.</p></dd></dl>
<p><a class="reference internal glossary-term" href="#term-x" aria-describedby="t1">
<span class="xref std std-term">x</span><span class="glossary-tooltip tip" id="t1"
role="tooltip">The definition of x.</span></a></p>
<div style="overflow-x: auto"><pre>{"a line that fits " * 2}</pre></div>
</article></body></html>"""


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> list:
    site = tmp_path_factory.mktemp("site")
    (site / "index.html").write_text(_GLOSSARY)  # check_book needs an index.html
    (site / "faults.html").write_text(_FAULTS)
    (site / "glossary.html").write_text(_GLOSSARY)
    return check_book.check_book(site)


def test_a_page_done_right_passes(planted):
    assert [o.line() for o in planted if o.page != "faults.html"] == []


def test_each_planted_fault_is_found(planted):
    details = " | ".join(o.line() for o in planted)
    assert any(o.check == "width" and "div#too-wide wider than the column: 900 px" in o.detail
               for o in planted), details
    # a box that scrolls sideways hides its end from a reader who does not scroll
    assert any(o.check == "width" and "div#scroller scrolls sideways: 900 px" in o.detail
               for o in planted), details
    assert any(o.check == "width" and "div#clips content clipped" in o.detail for o in planted), details
    assert any(o.check == "image" and "missing.png" in o.detail for o in planted), details
    assert any(o.check == "maths" and "x^2" in o.detail for o in planted), details
    assert any(o.check == "glossary" and "'bare'" in o.detail for o in planted), details
    assert any(o.check == "glossary" and "'hidden'" in o.detail and "no definition" in o.detail
               for o in planted), details
    assert any(o.check == "glossary" and "'boxed' is hidden by" in o.detail for o in planted), details
    assert any(o.check == "console" and "planted error" in o.detail for o in planted), details
    assert any(o.check == "network" and "cdn.example.org" in o.detail for o in planted), details
    assert {o.page for o in planted} == {"faults.html"}


@pytest.fixture(scope="module")
def html(tmp_path_factory) -> Path:
    given = os.environ.get("HANDBOOK_BOOK_HTML")
    if given:
        return Path(given)
    return check_book.build_book(tmp_path_factory.mktemp("book"))


def test_every_page_reads_right_in_chromium(html):
    offenders = check_book.check_book(html)
    assert not offenders, f"{len(offenders)} offenders:\n" + "\n".join(o.line() for o in offenders)
