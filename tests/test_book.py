"""The book builds offline with warnings as errors, and its HTML references nothing online."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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


def test_html_references_no_external_url(html):
    offenders = {}
    for page in html.rglob("*.html"):
        found = re.findall(r"https?://[^\s\"'<>)]+", page.read_text(errors="replace"))
        if found:
            offenders[str(page.relative_to(html))] = sorted(set(found))[:5]
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
