"""Sphinx extension: a glossary term's definition, shown when the reader hovers over its use.

Every resolved ``{term}`` reference (in a Markdown page or a notebook's Markdown cell) becomes::

    <a class="reference internal glossary-term" href="glossary.html#term-x"
       aria-describedby="glossary-tip-3">
      <span class="xref std std-term">x</span>
      <span class="glossary-tooltip" id="glossary-tip-3" role="tooltip">
        <span class="glossary-tooltip-p">First paragraph of the definition.</span> ...
      </span>
    </a>

The definition is plain text, one ``span`` per paragraph, taken from the ``{glossary}``
directive that defines the term; its maths stays maths (``$N$``), typeset by MathJax like the
page's own. ``_static/glossary.css`` hides it until the link is hovered or focused, and
``_static/glossary.js`` keeps it inside the content column and lets Escape dismiss it. The
link has no ``title``, so the browser never shows its own tooltip beside this one. Nothing is
fetched from the network. Builders other than HTML see an ordinary reference.
"""

from __future__ import annotations

import html
import re

from docutils import nodes
from sphinx import addnodes

_STATIC = "glossary"  # glossary.css and glossary.js in the book's html_static_path


class glossary_reference(nodes.reference):
    """A resolved ``{term}`` reference carrying its definition (``definition``: paragraphs)."""


_UNSEEN = (nodes.raw, nodes.comment, nodes.system_message, addnodes.index)  # text no reader sees

# A definition is a list of paragraphs; a paragraph, a list of (kind, text) pieces, kind "text"
# (plain text, whitespace collapsed) or "math" (LaTeX, typeset by MathJax in the tooltip too).
Paragraph = list[tuple[str, str]]


def _pieces(node: nodes.Node) -> Paragraph:
    if isinstance(node, _UNSEEN):
        return []
    if isinstance(node, (nodes.math, nodes.math_block)):
        return [("math", node.astext())]
    if isinstance(node, nodes.Text):
        return [("text", re.sub(r"\s+", " ", node.astext()))]
    return [piece for child in node.children for piece in _pieces(child)]


def _paragraphs(definition: nodes.definition) -> list[Paragraph]:
    """The definition's top-level blocks as text and maths, whitespace collapsed."""
    paragraphs = []
    for child in definition.children:
        pieces = [piece for piece in _pieces(child) if piece[1].strip() or piece[0] == "text"]
        text = "".join(t for _, t in pieces)
        if not text.strip():
            continue
        joined: Paragraph = []
        for kind, piece in pieces:  # adjacent text pieces become one, with one space at most
            if joined and kind == "text" and joined[-1][0] == "text":
                piece = re.sub(r"\s+", " ", joined.pop()[1] + piece)
            joined.append((kind, piece))
        if joined[0][0] == "text":
            joined[0] = ("text", joined[0][1].lstrip())
        if joined[-1][0] == "text":
            joined[-1] = ("text", joined[-1][1].rstrip())
        paragraphs.append([piece for piece in joined if piece[1]])
    return paragraphs


def _collect(app, doctree: nodes.document) -> None:
    """Read each glossary term's definition into ``env.glossary_definitions``."""
    env = app.env
    found = env.__dict__.setdefault("glossary_definitions", {})
    for glossary in doctree.findall(addnodes.glossary):
        for item in glossary.findall(nodes.definition_list_item):
            definitions = [c for c in item.children if isinstance(c, nodes.definition)]
            if not definitions:
                continue
            paragraphs = _paragraphs(definitions[0])
            for term in item.findall(nodes.term):
                for term_id in term["ids"]:
                    found[(env.docname, term_id)] = paragraphs


def _purge(app, env, docname: str) -> None:
    found = getattr(env, "glossary_definitions", {})
    for key in [key for key in found if key[0] == docname]:
        del found[key]


def _merge(app, env, docnames, other) -> None:
    env.__dict__.setdefault("glossary_definitions", {}).update(
        {key: value for key, value in getattr(other, "glossary_definitions", {}).items()
         if key[0] in docnames})


def _is_term(reference: nodes.reference) -> bool:
    return any(isinstance(child, nodes.inline) and "std-term" in child["classes"]
               for child in reference.children)


def _definition_of(app, fromdocname: str, reference: nodes.reference) -> list[str] | None:
    """The definition a term reference points at, found from where its link goes."""
    found = getattr(app.env, "glossary_definitions", {})
    if "refid" in reference and "refuri" not in reference:
        return found.get((fromdocname, reference["refid"]))
    uri, _, anchor = reference.get("refuri", "").partition("#")
    for (docname, term_id), paragraphs in found.items():
        if term_id == anchor and uri == app.builder.get_relative_uri(fromdocname, docname):
            return paragraphs
    return None


def _attach(app, doctree: nodes.document, fromdocname: str) -> None:
    """Turn each resolved term reference into a glossary_reference with its definition."""
    if app.builder.format != "html":
        return
    count = 0
    for reference in list(doctree.findall(nodes.reference)):
        if isinstance(reference, glossary_reference) or not _is_term(reference):
            continue
        paragraphs = _definition_of(app, fromdocname, reference)
        if not paragraphs:
            continue
        count += 1
        reference.attributes.pop("reftitle", None)  # a title would be a second, native tooltip
        hover = glossary_reference(reference.rawsource, "", *reference.children, **reference.attributes)
        hover["classes"].append("glossary-term")
        hover["definition"] = paragraphs
        hover["tip_id"] = f"glossary-tip-{count}"
        reference.replace_self(hover)
        if any(kind == "math" for paragraph in paragraphs for kind, _ in paragraph):
            # the page loads MathJax (Sphinx adds it only to pages with maths of their own)
            app.env.get_domain("math").data["has_equations"][fromdocname] = True


def visit_glossary_reference(self, node: glossary_reference) -> None:
    self.visit_reference(node)
    opening = self.body[-1]
    self.body[-1] = opening.replace("<a ", f'<a aria-describedby="{node["tip_id"]}" ', 1)


def _html(self, paragraph: Paragraph) -> str:
    opening, closing = getattr(self.builder.config, "mathjax_inline", (r"\(", r"\)"))
    return "".join(html.escape(text) if kind == "text" else
                   f'<span class="math notranslate nohighlight">{opening}{html.escape(text)}{closing}</span>'
                   for kind, text in paragraph)


def depart_glossary_reference(self, node: glossary_reference) -> None:
    spans = " ".join(f'<span class="glossary-tooltip-p">{_html(self, p)}</span>'
                     for p in node["definition"])
    self.body.append(f'<span class="glossary-tooltip" id="{node["tip_id"]}" role="tooltip">'
                     f"{spans}</span>")
    self.depart_reference(node)


def setup(app):
    app.add_node(glossary_reference, html=(visit_glossary_reference, depart_glossary_reference))
    app.connect("doctree-read", _collect)
    app.connect("env-purge-doc", _purge)
    app.connect("env-merge-info", _merge)
    app.connect("doctree-resolved", _attach)
    app.add_css_file(f"{_STATIC}.css")
    app.add_js_file(f"{_STATIC}.js", loading_method="defer")
    return {"parallel_read_safe": True, "parallel_write_safe": True, "env_version": 2}
