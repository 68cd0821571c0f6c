"""Sphinx extension: make the built book work, and reference nothing, off the network.

Two things in a stock Jupyter Book 1.x build point outside it:

- MathJax, loaded from a CDN. MathJax 3 comes here from the ``django-static-mathjax`` wheel (a
  plain copy of MathJax's files); after an HTML build its ``es5`` folder is copied to
  ``_static/mathjax/es5``, where ``mathjax_path`` in ``_config.yml`` points. It is copied after
  the build, not listed in ``html_static_path``, so that none of its scripts is added to pages.
- sphinx-thebe's loader, which names thebe's bundle on unpkg.com. The book has no live-code
  (thebe) buttons, so the loader and its inline configuration are dropped from every page.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def _copy_mathjax(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    import mathjax  # the django-static-mathjax package

    source = Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"
    if not (source / "tex-chtml.js").exists():
        raise RuntimeError(f"MathJax not found at {source}: pip install django-static-mathjax")
    shutil.copytree(source, Path(app.outdir) / "_static" / "mathjax" / "es5", dirs_exist_ok=True)


def _is_thebe(script) -> bool:
    text = f"{script} {getattr(script, 'filename', '')} {getattr(script, 'attributes', {}).get('body', '')}"
    return "thebe" in text.lower()


def _drop_thebe(app, pagename, templatename, context, doctree) -> None:
    if "script_files" in context:
        context["script_files"] = [s for s in context["script_files"] if not _is_thebe(s)]


def setup(app):
    app.connect("build-finished", _copy_mathjax)
    app.connect("html-page-context", _drop_thebe, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
