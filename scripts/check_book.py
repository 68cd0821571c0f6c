"""Open every page of the built book in headless Chromium and check what a reader would see.

    python scripts/check_book.py [HTML_DIR] [--build]    # default HTML_DIR: _build/html

``--build`` builds the book first (``jupyter-book build . --all -n -W --keep-going``). The pages are
served on 127.0.0.1 by Python's http.server and opened at a 1400 px wide window. On each page:

- no console error (browser log level SEVERE);
- no request to any host but 127.0.0.1 (Chrome's performance log, ``Network.requestWillBeSent``);
- every ``<img>`` loaded (complete, naturalWidth > 0);
- maths typeset: each ``.math`` element holds an ``mjx-container``, no MathJax error node, and no
  raw ``\\(``, ``\\[`` or ``$$`` left in visible text outside code;
- nothing wider than the content column (``article.bd-article``), and no box whose content spills
  out of it or is clipped, unless it sits inside a box that scrolls horizontally (computed
  ``overflow-x`` auto or scroll);
- no box that scrolls sideways: a table or a code line wider than its scroll box (a reader
  who does not scroll misses its end);
- each glossary term link: hovering it shows one tooltip, inside the window, whose text is the
  definition on the glossary page; no ``title`` attribute (a second, native tooltip).

Prints one line per offender (``page: check: detail``) and exits 1 if there is any. Needs
selenium (``scripts/setup.sh book,browser``) and Chromium with its driver (Debian:
``apt-get install chromium chromium-driver``).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urljoin, urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # check_planner, beside this script
from check_planner import PAGE as PLANNER_PAGE, check_planner  # noqa: E402
WINDOW = (1400, 1000)  # pixels: the width at which readers found clipped content
ALLOWED_SCHEMES = {"data", "blob", "about"}  # never leave the machine
HOST = "127.0.0.1"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVERS = ("chromedriver",)


@dataclass(frozen=True)
class Offender:
    """One thing a reader would see go wrong: the page, which check, and what was found."""

    page: str
    check: str
    detail: str

    def line(self) -> str:
        return f"{self.page}: {self.check}: {self.detail}"


def missing_requirements() -> str | None:
    """Why the check cannot run here (selenium, Chromium or its driver missing), or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed: scripts/setup.sh book,browser"
    if not any(shutil.which(b) for b in BROWSERS):
        return "Chromium is not installed: apt-get install chromium chromium-driver"
    if not any(shutil.which(d) for d in DRIVERS):
        return "chromedriver is not installed: apt-get install chromium-driver"
    return None


def build_book(out: Path | None = None) -> Path:
    """Build the book (warnings as errors) and return its HTML folder.

    ``--all``: Sphinx copies ``_static`` only when a page is out of date, and a CSS change is not.
    """
    jb = Path(sys.executable).parent / "jupyter-book"
    command = [str(jb), "build", str(ROOT), "--all", "-n", "-W", "--keep-going"]
    if out is not None:
        command += ["--path-output", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError("jupyter-book build failed:\n" + done.stdout[-3000:] + done.stderr[-3000:])
    return (out or ROOT) / "_build" / "html"


def pages(html_dir: Path) -> list[str]:
    """Every HTML page of the book, genindex and search included, as paths relative to html_dir."""
    return sorted(str(p.relative_to(html_dir)) for p in html_dir.rglob("*.html")
                  if p.relative_to(html_dir).parts[0] not in ("_static", "_sources"))


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # the browser left mid-request
            super().handle_error(request, client_address)


@contextmanager
def serve(directory: Path) -> Iterator[str]:
    """Serve directory on 127.0.0.1 (a free port) in a thread; yield its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = _Server((HOST, 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{HOST}:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def chrome() -> Iterator:
    """Headless Chromium with its browser and performance logs, every other host unresolvable."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = next(shutil.which(b) for b in BROWSERS if shutil.which(b))
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--window-size={WINDOW[0]},{WINDOW[1]}",
                 "--disable-background-networking", "--disable-component-update", "--no-first-run",
                 "--disable-extensions", "--disable-features=OptimizationHints,Translate",
                 f"--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE {HOST}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    service = Service(executable_path=next(shutil.which(d) for d in DRIVERS if shutil.which(d)))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        driver.set_window_size(*WINDOW)
        driver.set_script_timeout(30)
        yield driver
    finally:
        driver.quit()


_WAIT_FOR_MATHJAX = """
const done = arguments[arguments.length - 1], start = Date.now();
const wait = () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    MathJax.startup.promise.then(() => done("typeset"), (e) => done("error: " + e));
  } else if (!document.querySelector(".math") || Date.now() - start > 15000) {
    done("none");
  } else { setTimeout(wait, 50); }  // MathJax's script is loaded async, maybe not run yet
};
wait();
"""

_INSPECT = """
const col = document.querySelector("article.bd-article") || document.querySelector("main")
  || document.body;
const cb = col.getBoundingClientRect();
const path = (el) => {
  const parts = [];
  for (let e = el; e && e !== col && parts.length < 4; e = e.parentElement) {
    let part = e.tagName.toLowerCase();
    if (e.id) part += "#" + e.id;
    else if (e.classList.length) part += "." + [...e.classList].slice(0, 2).join(".");
    parts.unshift(part);
  }
  const sec = el.closest("section[id]"), shown = parts.join(" > ");
  return (sec && !shown.includes("section#" + sec.id) ? "section#" + sec.id + " " : "") + shown;
};
const scrolls = (el) => {
  for (let a = el.parentElement; a && a !== col; a = a.parentElement) {
    const o = getComputedStyle(a).overflowX;
    if (o === "auto" || o === "scroll") return true;
  }
  return false;
};
// The right edge of what el draws: its text and elements, less MathJax's assistive MathML (an
// off-screen copy of the maths for screen readers, which overflows by design).
const contentRight = (el) => {
  let right = -Infinity;
  for (const n of el.childNodes) {
    if (n.nodeType === 1 && n.matches("mjx-assistive-mml")) continue;
    if (n.nodeType === 1 && n.querySelector("mjx-assistive-mml")) {
      right = Math.max(right, n.getBoundingClientRect().right, contentRight(n));
      continue;
    }
    const range = document.createRange();
    range.selectNode(n);
    const r = range.getBoundingClientRect();
    if (r.width > 0) right = Math.max(right, r.right);
  }
  return right;
};
const wide = [], spilled = [], reported = new Set();
for (const el of col.querySelectorAll("*")) {
  if (el.closest("mjx-assistive-mml, .glossary-tooltip, script, style")) continue;
  let parent = el.parentElement, under = false;
  for (; parent && parent !== col; parent = parent.parentElement)
    if (reported.has(parent)) { under = true; break; }
  if (under) continue;
  const r = el.getBoundingClientRect();
  if (r.width === 0 || r.height === 0 || scrolls(el)) continue;
  const o = getComputedStyle(el).overflowX, spill = el.scrollWidth - el.clientWidth;
  const size = " px, column " + Math.round(cb.width) + " px";
  if (r.right > cb.right + 1 || r.left < cb.left - 1) {
    reported.add(el);  // the outermost box that is too wide; what it holds is not listed again
    wide.push(path(el) + " wider than the column: " + Math.round(r.width) + size);
  } else if (el.clientWidth > 0 && spill > 1 && o !== "auto" && o !== "scroll" &&
             contentRight(el) > r.left + el.clientLeft + el.clientWidth + 1) {
    spilled.push([el, path(el) + (o === "visible" ? " content spills out: " : " content clipped: ")
                      + el.scrollWidth + size]);
  }
}
// A box that scrolls sideways (a wide table, a long code line) hides part of itself from a
// reader who does not scroll: the content must fit the column, not a scroll box.
for (const el of col.querySelectorAll("*")) {
  if (el.closest("mjx-assistive-mml, .glossary-tooltip, script, style, mjx-container")) continue;
  const o = getComputedStyle(el).overflowX;
  if ((o === "auto" || o === "scroll") && el.clientWidth > 0 &&
      el.scrollWidth > el.clientWidth + 1 && contentRight(el) > el.getBoundingClientRect().left
        + el.clientLeft + el.clientWidth + 1)
    wide.push(path(el) + " scrolls sideways: " + el.scrollWidth + " px in " + el.clientWidth
              + " px");
}
// Of the boxes whose content overflows, the innermost (the one that holds the long line), and
// none that a box already listed as too wide explains.
for (const [el, line] of spilled)
  if (!spilled.some(([other]) => other !== el && el.contains(other)) &&
      ![...reported].some((w) => w.contains(el) || el.contains(w))) wide.push(line);
const images = [...document.images].filter((i) => !(i.complete && i.naturalWidth > 0))
  .map((i) => i.getAttribute("src"));
const maths = [...document.querySelectorAll(".math")];
const untypeset = maths.filter((m) => !m.querySelector("mjx-container")).length;
const errors = document.querySelectorAll("mjx-merror, [data-mjx-error]").length;
const raw = [];
const walker = document.createTreeWalker(col, NodeFilter.SHOW_TEXT);
for (let t = walker.nextNode(); t; t = walker.nextNode()) {
  const p = t.parentElement;
  if (!p || p.closest("pre, code, script, style, textarea, mjx-container, .glossary-tooltip"))
    continue;
  if (!p.checkVisibility()) continue;
  const m = t.data.match(/\\\\\\(|\\\\\\[|\\$\\$/);
  if (m) raw.push(JSON.stringify(t.data.trim().slice(0, 60)));
}
const terms = [...col.querySelectorAll("a .std-term")].map((s) => s.closest("a"));
return {wide, images, maths: maths.length, untypeset, errors, raw,
        terms: terms.filter((a) => a.classList.contains("glossary-term")).length,
        bare_terms: terms.filter((a) => !a.classList.contains("glossary-term"))
          .map((a) => a.textContent.trim())};
"""

_TOOLTIP = """
const a = document.querySelectorAll("article a.glossary-term")[arguments[0]];
const tip = document.getElementById(a.getAttribute("aria-describedby"));
const visible = [...document.querySelectorAll(".glossary-tooltip")].filter((t) => {
  const s = getComputedStyle(t), r = t.getBoundingClientRect();
  return s.display !== "none" && s.visibility !== "hidden" && +s.opacity > 0 && r.width > 0;
});
const r = tip ? tip.getBoundingClientRect() : null;
let titled = null;
for (let e = a; e; e = e.parentElement) if (e.title) { titled = e.tagName; break; }
// What the reader sees at the tooltip's corners and centre: the tooltip, not a box above it or
// the edge of a scroll box that clips it.
let covered = null;
if (r && r.width > 0) {
  for (const [x, y] of [[r.left + 4, r.top + 4], [r.right - 4, r.bottom - 4],
                        [(r.left + r.right) / 2, (r.top + r.bottom) / 2]]) {
    const hit = document.elementFromPoint(x, y);
    if (!hit || !tip.contains(hit)) { covered = hit ? hit.tagName.toLowerCase() +
      (hit.classList.length ? "." + [...hit.classList].slice(0, 2).join(".") : "") : "nothing"; break; }
  }
}
const maths = tip ? [...tip.querySelectorAll(".math")] : [];
const text = tip ? tip.cloneNode(true) : null;
if (text) text.querySelectorAll(".math").forEach((m) => m.replaceWith("[maths]"));
return {term: a.querySelector(".std-term").textContent.trim(), href: a.href,
        shown: !!tip && visible.includes(tip), count: visible.length, titled, covered,
        text: text ? text.textContent : "", maths: maths.length,
        untypeset: maths.filter((m) => !m.querySelector("mjx-container")).length,
        inside: !!r && r.left >= 0 && r.right <= document.documentElement.clientWidth &&
                r.top >= 0 && r.bottom <= window.innerHeight};
"""

_DEFINITIONS = """
// Each glossary page the links point at, fetched once: {page URL: {term id: definition text}}.
const done = arguments[arguments.length - 1], pages = arguments[0];
Promise.all(pages.map((page) => fetch(page).then((r) => r.text()).then((text) => {
  const doc = new DOMParser().parseFromString(text, "text/html"), found = {};
  for (const dt of doc.querySelectorAll("dt[id]")) {
    let e = dt.nextElementSibling;
    while (e && e.tagName !== "DD") e = e.nextElementSibling;
    if (!e) continue;
    e.querySelectorAll(".glossary-tooltip").forEach((t) => t.remove());  // nested terms
    e.querySelectorAll(".math").forEach((m) => m.replaceWith("[maths]"));  // typeset apart
    found[dt.id] = e.textContent;
  }
  return [page, found];
}, () => [page, {}]))).then((entries) => done(Object.fromEntries(entries)));
"""

_LINKS = """
// The first link to each term that a reader can see: [index, term, href without its #].
const seen = new Set(), out = [];
document.querySelectorAll("article a.glossary-term").forEach((a, index) => {
  const term = a.querySelector(".std-term").textContent.trim().toLowerCase();
  if (seen.has(term) || !a.checkVisibility()) return;  // hidden: in a closed dropdown
  seen.add(term);
  out.push([index, a.href.split("#")[0], decodeURIComponent(new URL(a.href).hash.slice(1))]);
});
return out;
"""


def _squash(text: str | None) -> str:
    return " ".join((text or "").split())


def _requests_off_host(driver) -> list[str]:
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message.get("method") != "Network.requestWillBeSent":
            continue
        url = message["params"]["request"]["url"]
        parts = urlsplit(url)
        if parts.scheme not in ALLOWED_SCHEMES and parts.hostname != HOST:
            urls.append(url[:100])
    return urls


def _hover_terms(driver, definitions: dict[str, dict[str, str]]) -> list[tuple[str, str]]:
    """Hover the first visible link to each term; return (check, detail) for each failure.

    definitions caches each glossary page's definitions by its URL, across pages.
    """
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    failures = []
    links = driver.execute_script(_LINKS)
    new = sorted({page for _, page, _ in links} - definitions.keys())
    if new:
        definitions.update(driver.execute_async_script(_DEFINITIONS, new))
    elements = driver.find_elements(By.CSS_SELECTOR, "article a.glossary-term")
    for index, page, anchor in links:
        link = elements[index]
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", link)
        ActionChains(driver, duration=0).move_to_element(link).perform()  # default: a 250 ms glide
        got = driver.execute_script(_TOOLTIP, index)
        expected = definitions.get(page, {}).get(anchor)
        name = repr(got["term"])
        if not got["shown"]:
            failures.append(("glossary", f"hovering {name} shows no definition"))
        elif got["count"] != 1:
            failures.append(("glossary", f"hovering {name} shows {got['count']} tooltips"))
        elif not got["inside"]:
            failures.append(("glossary", f"the definition of {name} is cut off by the window"))
        elif got["covered"]:
            failures.append(("glossary", f"the definition of {name} is hidden by {got['covered']}"))
        if got["untypeset"]:
            failures.append(("maths", f"{got['untypeset']} of {got['maths']} maths in the definition "
                                      f"of {name} not typeset"))
        if got["titled"]:
            failures.append(("glossary", f"{name} has a title attribute on its {got['titled']} "
                                         "(a second tooltip)"))
        if expected is None:
            failures.append(("glossary", f"{name} links to no glossary entry: {got['href']}"))
        elif _squash(got["text"]) != _squash(expected):
            failures.append(("glossary", f"the tooltip of {name} differs from the glossary: "
                                         f"{_squash(got['text'])[:50]!r}"))
    return failures


def wait_until_loaded(driver, url: str, timeout: float = 30.0) -> None:
    """Wait for the page's load event: chromedriver's get() sometimes returns before it, and a
    DOM read then sees the blank tab or half the page (check_hub.py waits with it too).

    Raises:
        TimeoutError: the browser is not on ``url`` with the page loaded within ``timeout`` s.
    """
    deadline = time.monotonic() + timeout
    while driver.execute_script("return [location.href, document.readyState]") != [url, "complete"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not finish loading in {timeout:.0f} s")
        time.sleep(0.05)


def _redirected(url: str, file: Path) -> str:
    """Where the page at url ends up: the target of its meta refresh (index.html has one)."""
    found = re.search(r'<meta http-equiv="refresh" content="\d+;\s*url=([^"]+)"',
                      file.read_text(errors="replace"), re.IGNORECASE)
    return urljoin(url, found.group(1)) if found else url


def check_page(driver, base: str, page: str, html_dir: Path,
               definitions: dict[str, dict[str, str]] | None = None) -> list[Offender]:
    """Open one page and return what is wrong with it (definitions: see _hover_terms)."""
    driver.get_log("browser")  # drop the previous page's entries
    driver.get_log("performance")
    url = base + quote(page)
    driver.get(url)
    wait_until_loaded(driver, _redirected(url, html_dir / page))
    found: list[tuple[str, str]] = []
    mathjax = driver.execute_async_script(_WAIT_FOR_MATHJAX)
    if mathjax.startswith("error"):
        found.append(("maths", f"MathJax failed: {mathjax}"))
    info = driver.execute_script(_INSPECT)
    found += [("width", w) for w in info["wide"]]
    found += [("image", f"not loaded: {src}") for src in info["images"]]
    if info["maths"] and mathjax != "typeset":
        found.append(("maths", f"{info['maths']} maths elements but MathJax did not run"))
    if info["untypeset"]:
        found.append(("maths", f"{info['untypeset']} of {info['maths']} maths elements not typeset"))
    if info["errors"]:
        found.append(("maths", f"{info['errors']} MathJax error nodes"))
    found += [("maths", f"raw TeX delimiter in text: {text}") for text in info["raw"]]
    found += [("glossary", f"term link without a definition: {t!r}") for t in info["bare_terms"]]
    if info["terms"]:
        found += _hover_terms(driver, {} if definitions is None else definitions)
    found += [("console", e["message"][:160]) for e in driver.get_log("browser")
              if e["level"] == "SEVERE"]
    found += [("network", f"request off {HOST}: {url}") for url in _requests_off_host(driver)]
    return [Offender(page, check, detail) for check, detail in found]


def check_book(html_dir: Path) -> list[Offender]:
    """Every page of the book at html_dir, opened in headless Chromium: all offenders found."""
    html_dir = Path(html_dir)
    if not (html_dir / "index.html").exists():
        raise FileNotFoundError(f"no index.html in {html_dir}: build the book first (--build)")
    offenders: list[Offender] = []
    definitions: dict[str, dict[str, str]] = {}
    with serve(html_dir) as base, chrome() as driver:
        for page in pages(html_dir):
            offenders += check_page(driver, base, page, html_dir, definitions)
        if (html_dir / PLANNER_PAGE).exists():  # the planner's own checks (scripts/check_planner.py)
            offenders += [Offender(PLANNER_PAGE, check, detail)
                          for check, detail in check_planner(driver, base.rstrip("/"), html_dir)]
    return offenders


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("html_dir", nargs="?", type=Path, default=ROOT / "_build" / "html",
                        help="the built book (default: _build/html)")
    parser.add_argument("--build", action="store_true", help="build the book first")
    args = parser.parse_args(argv)
    reason = missing_requirements()
    if reason:
        print(f"check_book: cannot run: {reason}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        html_dir = build_book() if args.build else args.html_dir
        offenders = check_book(html_dir)
    except (FileNotFoundError, RuntimeError) as error:
        print(f"check_book: {error}", file=sys.stderr)
        return 2
    for offender in offenders:
        print(offender.line())
    count = len(pages(html_dir))
    print(f"check_book: {count} pages, {len(offenders)} offenders, "
          f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 1 if offenders else 0


if __name__ == "__main__":
    sys.exit(main())
