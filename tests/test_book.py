"""The book builds offline with warnings as errors, and its HTML references nothing online."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from bs4 import BeautifulSoup

ROOT = Path(__file__).resolve().parent.parent
JB = Path(sys.executable).parent / "jupyter-book"


@pytest.fixture(scope="module")
def html(tmp_path_factory) -> Path:
    if not JB.exists():
        pytest.fail(f"jupyter-book is not installed beside {sys.executable}: run scripts/setup.sh")
    out = tmp_path_factory.mktemp("book")
    done = subprocess.run([str(JB), "build", str(ROOT), "--path-output", str(out), "-n", "-W", "--keep-going"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out / "_build" / "html"


def _toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [c["file"] for c in part["chapters"]]
    return files


def test_every_toc_page_is_built(html):
    for name in _toc_files():
        assert (html / f"{name}.html").exists(), name


EXTERNAL = re.compile(r"(?:https?:)?//[^\s\"'<>)]+", re.IGNORECASE)  # http(s) or protocol-relative
TEXT_ATTRIBUTES = {"title", "alt", "aria-label", "aria-description"}  # words for the reader, never fetched


def external_urls_loaded(page: str) -> list[str]:
    """External URLs in one HTML page outside a plain link's ``<a href>``.

    Anything else may be loaded by the browser (script, stylesheet, icon, preload, image, frame,
    media source, srcset, inline style or script), so an external URL anywhere else counts.
    Text for the reader loads nothing and is allowed: the page's text (a reference's printed DOI)
    and the text attributes (a citation's ``title``, which holds the whole reference).
    """
    soup = BeautifulSoup(page, "html.parser")
    found = []
    for tag in soup.find_all(True):
        for name, value in tag.attrs.items():
            if (tag.name == "a" and name == "href") or name in TEXT_ATTRIBUTES:
                continue
            values = value if isinstance(value, list) else [value]
            found += [url for v in values for url in EXTERNAL.findall(v) if "://" in url or
                      (name in ("src", "href", "srcset", "data", "poster", "action") and
                       v.strip().startswith("//"))]
        if tag.name in ("script", "style"):
            found += [url for url in EXTERNAL.findall(tag.get_text()) if "://" in url]
    return found


def external_urls_in_css(css: str) -> list[str]:
    """External URLs a stylesheet loads: ``@import`` and ``url()`` values."""
    targets = re.findall(r"@import\s+['\"]([^'\"]+)", css)
    targets += re.findall(r"url\(\s*['\"]?([^'\")]+)", css)
    return [t for t in targets if re.match(r"(?:https?:)?//", t.strip(), re.IGNORECASE)]


def test_external_url_detectors_catch_what_a_browser_loads():
    page = """<html><head>
      <script src="https://cdn.example.org/x.js"></script>
      <link rel="preload" href="//fonts.example.org/f.woff2">
      <link rel="icon" href="https://example.org/favicon.ico">
      <style>body { background: url(https://example.org/bg.png) }</style>
      <script>fetch("https://api.example.org/")</script></head><body>
      <img srcset="a.png 1x, https://example.org/b.png 2x" src="a.png">
      <iframe src="https://example.org/frame"></iframe>
      <video><source src="https://example.org/v.mp4"></video>
      <div style="background-image: url('https://example.org/c.png')"></div>
      <a href="https://arxiv.org/abs/2304.11277">Zhao et al.</a> https://doi.org/10.1/x
      <a href="references.html#id2" title="Zhao et al. URL: https://arxiv.org/abs/2304.11277">[1]</a>
      <a href="../book/glossary.html#term-all-gather">local</a></body></html>"""
    hosts = sorted({re.sub(r"^(?:https?:)?//([^/]+).*", r"\1", url) for url in external_urls_loaded(page)})
    assert hosts == ["api.example.org", "cdn.example.org", "example.org", "fonts.example.org"]
    assert len(external_urls_loaded(page)) == 9
    css = """@import url("https://fonts.example.org/css"); @import 'local.css';
             .a { background: url(../img/a.png) } .b { src: url( "//cdn.example.org/f.woff" ) }"""
    assert external_urls_in_css(css) == ["https://fonts.example.org/css", "//cdn.example.org/f.woff"]


def test_html_references_no_external_url(html):
    offenders = {}
    for page in html.rglob("*.html"):
        found = external_urls_loaded(page.read_text(errors="replace"))
        if found:
            offenders[str(page.relative_to(html))] = sorted(set(found))[:5]
    for sheet in (html / "_static").rglob("*.css"):
        found = external_urls_in_css(sheet.read_text(errors="replace"))
        if found:
            offenders[str(sheet.relative_to(html))] = sorted(set(found))[:5]
    assert offenders == {}


def test_mathjax_is_served_locally(html):
    page = (html / "notebooks" / "01_model_and_parameters.html").read_text()
    src = re.search(r'<script[^>]+src="([^"]*mathjax[^"]*)"', page).group(1)
    assert src == "../_static/mathjax/es5/tex-chtml.js"
    assert (html / "_static" / "mathjax" / "es5" / "tex-chtml.js").stat().st_size > 100_000
    assert "\\lceil" in page  # the chapter's maths is there for MathJax to typeset


def test_no_stray_pages_are_built(html):
    built = {str(p.relative_to(html).with_suffix("")) for p in html.rglob("*.html")
             if not p.relative_to(html).parts[0].startswith("_")}  # theme assets live in _static
    assert built - set(_toc_files()) <= {"index", "genindex", "search"}


# The glossary_hover extension (book/_ext), on a small book of its own: terms with capitals and
# spaces, two terms sharing a definition, a definition of two paragraphs with maths in it, a
# reference with its own title, a reference inside the glossary, and one in a notebook's cell.
GLOSSARY = """# Glossary

```{glossary}
Sharded Data Parallel
SDP
  Each rank keeps one shard ($1/N$) of the model state.

  A second paragraph with *emphasis*, `code` and <b>raw</b> HTML.

all-gather
  Every rank receives all shards. See {term}`Sharded Data Parallel`.
```
"""
INDEX = """# Home

```{toctree}
glossary
chapter
```

An {term}`all-gather`, {term}`sharded data parallel` and {term}`the short name <SDP>`.
"""
SHARDED = ("Each rank keeps one shard (\\(1/N\\)) of the model state. "
           "A second paragraph with emphasis, code and raw HTML.")
ALL_GATHER = "Every rank receives all shards. See Sharded Data Parallel."


@pytest.fixture(scope="module")
def small_book(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("small_book")
    (src / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / 'book' / '_ext')!r})\n"
        "extensions = ['myst_nb', 'glossary_hover']\nnb_execution_mode = 'off'\n"
        "myst_enable_extensions = ['dollarmath']\n"
        f"html_static_path = [{str(ROOT / 'book' / '_static')!r}]\n")
    (src / "glossary.md").write_text(GLOSSARY)
    (src / "index.md").write_text(INDEX)
    notebook = {"cells": [{"cell_type": "markdown", "id": "a", "metadata": {},
                           "source": "# Chapter\n\nIn a notebook: {term}`All-Gather`."}],
                "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (src / "chapter.ipynb").write_text(json.dumps(notebook))
    done = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-W", "-q", str(src), str(src / "_html")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return src / "_html"


def _terms(page: Path) -> list[tuple[str, str]]:
    """(term as written, its tooltip's text) for each glossary link; checks the markup around them."""
    soup = BeautifulSoup(page.read_text(), "html.parser")
    found = []
    for link in soup.select("a.glossary-term"):
        tip = link.select_one(".glossary-tooltip")
        assert tip is not None and tip["role"] == "tooltip" and link["aria-describedby"] == tip["id"]
        assert "title" not in link.attrs  # no second, native tooltip
        found.append((link.select_one(".std-term").get_text(), " ".join(tip.get_text().split())))
    ids = [tip["id"] for tip in soup.select(".glossary-tooltip")]
    assert len(ids) == len(set(ids))
    assert not [a for a in soup.select("a") if a.select_one(".std-term") and "glossary-term" not in a["class"]]
    return found


def test_glossary_terms_carry_their_definition(small_book):
    assert _terms(small_book / "index.html") == [
        ("all-gather", ALL_GATHER), ("sharded data parallel", SHARDED), ("the short name", SHARDED)]
    assert _terms(small_book / "chapter.html") == [("All-Gather", ALL_GATHER)]
    assert _terms(small_book / "glossary.html") == [("Sharded Data Parallel", SHARDED)]
    assert (small_book / "_static" / "glossary.css").exists() and (small_book / "_static" / "glossary.js").exists()
    index = (small_book / "index.html").read_text()
    assert 'href="_static/glossary.css' in index
    # The definition's maths is maths for MathJax, which the page loads though it has none of its own.
    maths = BeautifulSoup(index, "html.parser").select(".glossary-tooltip .math")
    assert [m.get_text() for m in maths] == ["\\(1/N\\)", "\\(1/N\\)"]
    assert re.search(r'<script[^>]+src="[^"]*mathjax', index)


def test_book_glossary_links_match_the_glossary(html):
    for page in html.rglob("*.html"):
        soup = BeautifulSoup(page.read_text(errors="replace"), "html.parser")
        for link in soup.select("a.glossary-term"):
            target, _, anchor = link["href"].partition("#")
            glossary = BeautifulSoup((page.parent / target).read_text(), "html.parser") if target else soup
            dd = glossary.find(id=anchor).find_next_sibling("dd")
            for nested in dd.select(".glossary-tooltip"):
                nested.decompose()
            tip = link.select_one(".glossary-tooltip").get_text()
            assert " ".join(tip.split()) == " ".join(dd.get_text().split()), (page.name, link["href"])


def test_every_chapter_cites_its_sources():
    """Each chapter cites at least one work of book/references.bib, and every key it cites is
    there (a missing key is also a build warning; this names the chapter)."""
    keys = set(re.findall(r"^@\w+\{([^,]+),", (ROOT / "book" / "references.bib").read_text(), re.M))
    for notebook in sorted((ROOT / "notebooks").glob("0*.ipynb")):
        text = "".join("".join(c["source"]) for c in json.loads(notebook.read_text())["cells"]
                       if c["cell_type"] == "markdown")
        cited = {k.strip() for group in re.findall(r"\{cite(?::\w+)?\}`([^`]+)`", text)
                 for k in group.split(",")}
        assert cited, f"{notebook.name} cites nothing of book/references.bib"
        assert cited <= keys, f"{notebook.name} cites keys not in references.bib: {cited - keys}"
