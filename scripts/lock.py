"""The lock: every package the project's set-up installs, pinned, in ``requirements.lock``.

``pyproject.toml`` keeps ranges, for people who ``pip install`` the package into their own
environment. The course's own set-up (``scripts/setup.sh``, hence ``make test``, ``make book``,
``make lab``, ``make check-hub``, CI and the hub image through ``environment.yml``) installs
within the lock, so every machine gets the versions the notebooks' outputs were stored with.

    python scripts/lock.py write [--torch VERSION]   # make lock: resolve again, replace the lock
    python scripts/lock.py check                     # one line and exit 2 when the lock is stale
    python scripts/lock.py pin NAME [NAME ...]       # NAME==VERSION lines, for setup.sh

The lock is one universal resolution (``uv pip compile --universal``): Python 3.10 and later,
Linux, macOS and Windows markers, every extra of ``pyproject.toml`` and the set-up's own tool
(uv). It is used as a *constraints* file (``uv pip install -c requirements.lock -e .[EXTRAS]``):
an extra installs only its own packages, each at its locked version. torch is pinned to one
version and its build is left to the machine: on a machine without a GPU, set-up installs the
CPU wheel of that version first (its local label, ``+cpu``, satisfies ``torch==VERSION``); on a
GPU machine the CUDA build of the same version comes from PyPI, with the ``nvidia-*`` and
``triton`` packages it pins, which the lock lists at those same versions.

Its first lines record a digest of the requirements it was resolved from (``requires-python``,
the dependencies, every extra, the set-up's tools and torch's version). ``check`` recomputes it
from ``pyproject.toml``: a range changed without ``make lock`` is refused in one line, before
anything is installed. Standard library only (Python 3.10's lack of ``tomllib`` is covered by
the ``tomli`` that every virtual environment's pip carries).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
PYPROJECT = ROOT / "pyproject.toml"

TOOLS = ("uv>=0.5,<1",)
"""What set-up installs besides the project: uv, which installs the project (locked too)."""

DIGEST_LINE = "# requirements-sha256: "
TORCH_LINE = "# torch: "
PINNED_ONCE = ("torch", "uv")
"""Packages set-up installs with pip before the lock can be applied: each must resolve to one
version for every Python the lock covers (no environment marker), so setup can name it."""

NETWORK_ERRORS = ("dns error", "failed to fetch", "connection refused", "error sending request",
                  "network connectivity is disabled", "could not connect", "timed out",
                  "failed to download", "tcp connect error", "name or service not known",
                  "temporary failure in name resolution", "no route to host")
"""Fragments of uv's messages (lower case) that mean the package index could not be reached."""


class LockError(Exception):
    """A one-line refusal: the message says what is wrong and what to run."""


def _toml(text: str) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10: the tomli that pip vendors (every venv has pip)
        from pip._vendor import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(text)


def requirements_of(pyproject_text: str, torch: str) -> dict:
    """What the lock is resolved from: ``requires-python``, the dependencies, each extra's list,
    the set-up's tools and torch's version (each list sorted: order does not change a resolution)."""
    project = _toml(pyproject_text)["project"]
    return {
        "requires-python": project.get("requires-python", ""),
        "dependencies": sorted(project.get("dependencies", [])),
        "optional-dependencies": {extra: sorted(reqs) for extra, reqs
                                  in sorted(project.get("optional-dependencies", {}).items())},
        "tools": sorted(TOOLS),
        "torch": torch,
    }


def digest(requirements: dict) -> str:
    """SHA-256 of the requirements' canonical JSON."""
    return hashlib.sha256(json.dumps(requirements, sort_keys=True).encode()).hexdigest()


def header_value(lock_text: str, prefix: str) -> str | None:
    """The value of the lock's header line that starts with ``prefix``, or ``None``."""
    for line in lock_text.splitlines():
        if line.startswith(prefix):
            return line[len(prefix):].strip()
        if line and not line.startswith("#"):
            break
    return None


def check(pyproject: Path = PYPROJECT, lock: Path = LOCK) -> None:
    """Raise :class:`LockError` unless ``lock`` was resolved from ``pyproject``'s requirements."""
    if not lock.is_file():
        raise LockError(f"{lock.name} is missing: run `make lock` (it resolves {pyproject.name}'s ranges)")
    text = lock.read_text()
    torch, recorded = header_value(text, TORCH_LINE), header_value(text, DIGEST_LINE)
    if torch is None or recorded is None:
        raise LockError(f"{lock.name} has no '{DIGEST_LINE.strip()}' header: run `make lock`")
    if digest(requirements_of(pyproject.read_text(), torch)) != recorded:
        raise LockError(f"{lock.name} does not match {pyproject.name} (a requirement changed since "
                        "the lock was made): run `make lock`, then `make check-latest`")


def pins(lock_text: str) -> dict[str, list[tuple[str, str]]]:
    """``{name: [(version, marker), ...]}`` of a lock's requirement lines (names normalized:
    lower case, runs of ``-_.`` as ``-``; marker ``""`` where a line has none)."""
    found: dict[str, list[tuple[str, str]]] = {}
    for line in lock_text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-")):
            continue
        requirement, _, marker = line.partition(";")
        name, sep, version = requirement.strip().partition("==")
        if not sep:
            raise LockError(f"not a pinned requirement in the lock: {line!r}")
        found.setdefault(normalize(name), []).append((version.strip(), marker.strip()))
    return found


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pin(names: list[str], lock_text: str, lock_name: str = LOCK.name) -> list[str]:
    """``NAME==VERSION`` for each of ``names``, which the lock pins once for every environment."""
    table = pins(lock_text)
    out = []
    for name in names:
        entries = table.get(normalize(name), [])
        if len(entries) != 1 or entries[0][1]:
            raise LockError(f"{lock_name} must pin {name} once, for every environment "
                            f"(it has {len(entries)} line(s)): run `make lock`")
        out.append(f"{name}=={entries[0][0]}")
    return out


def _find_uv() -> str:
    """A uv to resolve with: the project environment's, one on PATH, or one pip installs into
    ``.venv-lock`` (which needs the index too)."""
    venv = Path(os.environ.get("VENV", ROOT / ".venv"))
    for candidate in (venv / "bin" / "uv", shutil.which("uv"), ROOT / ".venv-lock" / "bin" / "uv"):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    tools = ROOT / ".venv-lock"
    subprocess.run([sys.executable, "-m", "venv", str(tools)], check=True)
    done = subprocess.run([str(tools / "bin" / "python"), "-m", "pip", "install", "--quiet",
                           "--disable-pip-version-check", *TOOLS], capture_output=True, text=True)
    if done.returncode:
        raise LockError(_explain(done.stderr, "pip could not install uv to resolve with"))
    return str(tools / "bin" / "uv")


def _explain(stderr: str, what: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if any(fragment in stderr.lower() for fragment in NETWORK_ERRORS):
        return "no network access to the package index; the lock is unchanged"
    last = next((line for line in reversed(lines) if "error" in line.lower()), lines[-1] if lines else "")
    return f"{what} ({last[:160]}); the lock is unchanged"


def write(torch: str | None = None, pyproject: Path = PYPROJECT, lock: Path = LOCK,
          uv: str | None = None) -> str:
    """Resolve ``pyproject``'s requirements again, as new as the ranges allow (torch at
    ``torch``, default the version the lock has now), and replace ``lock`` in one rename.
    Nothing is written unless the resolution succeeds. Returns a one-line summary."""
    if torch is None:
        torch = header_value(lock.read_text(), TORCH_LINE) if lock.is_file() else None
        if torch is None:
            raise LockError("no torch version: make lock TORCH=VERSION")
    requirements = requirements_of(pyproject.read_text(), torch)
    uv = uv or _find_uv()
    with tempfile.TemporaryDirectory(prefix="lock-") as tmp:
        tools, constraints, out = Path(tmp, "setup-tools.in"), Path(tmp, "torch.txt"), Path(tmp, "out.lock")
        tools.write_text("\n".join(TOOLS) + "\n")
        constraints.write_text(f"torch=={torch}\n")
        command = [uv, "pip", "compile", pyproject.name, str(tools), "--all-extras", "--universal",
                   "--python-version", "3.10", "--constraint", str(constraints), "--refresh",
                   "--no-header", "--quiet", "--output-file", str(out)]
        done = subprocess.run(command, capture_output=True, text=True, cwd=pyproject.parent,
                              env={**os.environ, "UV_HTTP_RETRIES": os.environ.get("UV_HTTP_RETRIES", "1")})
        if done.returncode or not out.is_file():
            raise LockError(_explain(done.stderr, "uv could not resolve the requirements"))
        body = out.read_text().replace(tmp + "/", "")
        pin(list(PINNED_ONCE), body)
        text = ("# The project's lock: every package its set-up installs, pinned (scripts/lock.py).\n"
                "# Made by `make lock` (uv pip compile --universal --all-extras, Python >= 3.10);\n"
                "# refreshed by `make lock` then `make check-latest` (README, 'Versions').\n"
                f"{TORCH_LINE}{torch}\n{DIGEST_LINE}{digest(requirements)}\n" + body)
        staged = lock.with_name(lock.name + ".new")
        staged.write_text(text)
        os.replace(staged, lock)
    table = pins(text)
    return f"{lock.name}: {len(table)} packages pinned (torch {torch})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="resolve again and replace the lock (make lock)")
    w.add_argument("--torch", help="torch's version (default: the lock's)")
    sub.add_parser("check", help="exit 2 with one line when the lock does not match pyproject.toml")
    p = sub.add_parser("pin", help="NAME==VERSION for packages the lock pins once")
    p.add_argument("names", nargs="+")
    for each in (w, sub.choices["check"], p):
        each.add_argument("--pyproject", type=Path, default=PYPROJECT)
        each.add_argument("--lock", type=Path, default=LOCK)
    args = parser.parse_args(argv)
    try:
        if args.command == "write":
            print(write(args.torch, args.pyproject, args.lock))
        elif args.command == "check":
            check(args.pyproject, args.lock)
        else:
            print("\n".join(pin(args.names, args.lock.read_text(), args.lock.name)))
    except LockError as err:
        print(f"{'make lock' if args.command == 'write' else 'setup'}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
