"""Build the book for a JupyterHub: every chapter carries Jupyter Book's JupyterHub launch button.

    make book-hub HUB_URL=https://hub.example.org REPO_URL=https://github.com/ORG/REPO [BRANCH=main]
    python hub/build_book.py --hub-url URL --repo-url URL [--branch main] [--out _build/hub]

The button (sphinx-book-theme's, in the page header, under the rocket) is an nbgitpuller link::

    {hub}/hub/user-redirect/git-pull?repo={repo}&urlpath=lab/tree/{folder}/notebooks/NN_x.ipynb&branch={branch}

The learner logs in, nbgitpuller clones the repository into their home (or merges its news into
their copy, keeping their edits), and JupyterLab opens the chapter. ``folder`` is the last part
of the repository's URL, the folder nbgitpuller clones into. The hub's image needs nbgitpuller
(the ``hub`` extra; ``hub/Dockerfile``).

``make book`` is unchanged: ``_config.yml`` names no hub, so the default build has no button and
stays offline. This script writes a second config, ``_config.yml`` plus the hub's keys
(:func:`hub_config`), into the output folder and builds the book with ``--config``; the HTML is
in ``OUT/_build/html``.

The theme makes launch links from a repository it recognises by its host (GitHub, GitLab,
Bitbucket); for any other git URL (a university's GitLab under its own name, or the
``git://127.0.0.1`` daemon of ``make check-hub``) the config names the provider itself
(``repository_provider``, the theme's documented option), which only names the keys the theme
files the URL under: the link carries the URL as given.
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import yaml

ROOT = Path(__file__).resolve().parent.parent
HUB_SCHEMES = ("http", "https")
REPO_SCHEMES = ("https", "http", "git", "ssh", "file")
KNOWN_PROVIDERS = ("github", "gitlab", "bitbucket")  # the hosts sphinx-book-theme recognises


def check_hub_url(url: str) -> str:
    """``url`` without its trailing ``/``, if it is an http(s) URL with a host.

    Raises:
        ValueError: one line, e.g. for ``hub.example.org`` (no scheme).
    """
    parts = urlsplit(url or "")
    if parts.scheme not in HUB_SCHEMES or not parts.hostname:
        raise ValueError(f"the hub URL must start with http:// or https:// and name a host, e.g. "
                         f"https://hub.example.org; got {url!r}")
    return url.rstrip("/")


def check_repo_url(url: str) -> str:
    """``url`` without its trailing ``/``, if git can clone from a URL of its kind (scheme, host
    or path, and a last part to name the learner's folder).

    Raises:
        ValueError: one line naming what is missing.
    """
    parts = urlsplit(url or "")
    if parts.scheme not in REPO_SCHEMES or not (parts.netloc or parts.scheme == "file") \
            or not parts.path.strip("/"):
        raise ValueError(f"the repository URL must be a git URL ({', '.join(s + '://' for s in REPO_SCHEMES)}) "
                         f"ending in the repository's name, e.g. https://github.com/ORG/REPO; got {url!r}")
    return url.rstrip("/")


def launch_url(hub_url: str, repo_url: str, chapter: str, branch: str = "main") -> str:
    """The nbgitpuller link of one chapter (``notebooks/NN_x.ipynb``), as the button makes it."""
    folder = repo_url.rstrip("/").rsplit("/", 1)[-1]
    query = urlencode({"repo": repo_url, "urlpath": f"lab/tree/{folder}/{chapter}", "branch": branch}, safe="/")
    return f"{hub_url.rstrip('/')}/hub/user-redirect/git-pull?{query}"


def hub_config(base: dict[str, Any], hub_url: str, repo_url: str, branch: str = "main",
               root: Path = ROOT) -> dict[str, Any]:
    """The book's config for a hub: ``base`` (``_config.yml``, parsed) with the hub's keys.

    Adds ``launch_buttons.jupyterhub_url``, ``repository`` (``url``, ``branch``), and for a host
    the theme does not know, ``repository_provider``; makes ``local_extensions`` absolute (they
    are read relative to the config file, which is no longer at ``root``). Nothing else changes.

    Raises:
        ValueError: for a bad ``hub_url``, ``repo_url`` or ``branch`` (one line).
    """
    hub_url, repo_url = check_hub_url(hub_url), check_repo_url(repo_url)
    if not isinstance(branch, str) or not branch.strip() or branch.startswith("-") or " " in branch:
        raise ValueError(f"the branch must be a git branch name, got {branch!r}")
    config = copy.deepcopy(base)
    config.setdefault("launch_buttons", {})["jupyterhub_url"] = hub_url
    config["repository"] = {"url": repo_url, "branch": branch}
    sphinx = config.setdefault("sphinx", {})
    extensions = sphinx.get("local_extensions") or {}
    sphinx["local_extensions"] = {name: str((root / path).resolve()) for name, path in extensions.items()}
    provider_url = repo_url.rsplit("/", 2)[0].lower()
    if not any(p in provider_url for p in KNOWN_PROVIDERS):
        sphinx["recursive_update"] = True  # merge the one theme option below, replace nothing
        sphinx.setdefault("config", {}).setdefault("html_theme_options", {})["repository_provider"] = "github"
    return config


def write_config(out: Path, hub_url: str, repo_url: str, branch: str = "main") -> Path:
    """Write the hub's config (from ``_config.yml``) to ``out/_config.hub.yml``; return its path."""
    config = hub_config(yaml.safe_load((ROOT / "_config.yml").read_text()), hub_url, repo_url, branch)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "_config.hub.yml"
    path.write_text("# Written by hub/build_book.py from _config.yml: the book for a JupyterHub.\n"
                    + yaml.safe_dump(config, sort_keys=False))
    return path


def build(out: Path, hub_url: str, repo_url: str, branch: str = "main") -> Path:
    """Build the book for a hub into ``out`` (warnings as errors); return its HTML folder.

    Raises:
        ValueError: for a bad URL or branch, before anything is built.
        RuntimeError: if the build fails (with the end of its output).
    """
    config = write_config(out, hub_url, repo_url, branch)
    jb = Path(sys.executable).parent / "jupyter-book"
    done = subprocess.run([str(jb), "build", str(ROOT), "--config", str(config), "--path-output", str(out),
                           "--all", "-n", "-W", "--keep-going"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError("jupyter-book build failed:\n" + done.stdout[-3000:] + done.stderr[-3000:])
    return out / "_build" / "html"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hub-url", required=True, help="the hub's address, e.g. https://hub.example.org")
    parser.add_argument("--repo-url", required=True, help="the repository nbgitpuller clones, e.g. "
                        "https://github.com/ORG/REPO")
    parser.add_argument("--branch", default="main", help="its branch (default: main)")
    parser.add_argument("--out", type=Path, default=ROOT / "_build" / "hub", help="output folder")
    args = parser.parse_args(argv)
    try:
        html = build(args.out, args.hub_url, args.repo_url, args.branch)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2 if isinstance(err, ValueError) else 1
    print(f"open {html / 'index.html'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
