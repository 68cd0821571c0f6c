"""The newest releases pyproject.toml's ranges allow, checked on purpose (`make check-latest`).

    python3 scripts/check_latest.py [--skip-notebooks] [--skip-book] [--venv DIR] [--also REQ ...]

1. **Set-up**, in a separate environment (``.venv-latest``; ``.venv`` is never touched): torch
   as ``scripts/setup.sh`` installs it (the lock's version; where there is no GPU, the CPU wheel
   pip finds first, decided by setup.sh's own ``has_gpu``), uv at the lock's version, then
   ``uv pip install --upgrade -e ".[book,test,frameworks]"`` *without* the lock, only torch held
   at the lock's version: every other package gets the newest release its range allows.
2. **Moved:** each installed distribution whose version differs from the one the lock pins for
   this Python (the lock's markers evaluated inside that environment; torch's ``+cpu`` aside), as
   ``name  locked -> latest``, and each installed distribution the lock lacks.
3. **Tests**, inside that environment with ``CUDA_VISIBLE_DEVICES=`` and the other CPU kernels
   ``make test`` uses: the test files of :data:`CHECKS` that reach Accelerate, Transformers,
   DeepSpeed and torchdata; one notebook per framework with nbval as the Makefile runs notebooks;
   the book built by ``jupyter-book build`` into a temporary folder (``tests/test_book.py``).
   Results are read from pytest's JUnit XML.
4. **Report:** the moved packages, each failed test id or notebook cell, and for each the moved
   packages among those its file imports (a guess). Exit 0 when everything passed, 1 when
   something failed, 2 on a set-up error (one line naming what failed).

It takes minutes (the set-up about 1 min from nothing, the tests and notebooks the most); pytest's
full output and the JUnit files stay in ``<venv>/check-latest/``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("lock", ROOT / "scripts" / "lock.py")
lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock)

EXTRAS = "book,test,frameworks"
"""What ``make test`` installs (no JupyterLab: nothing here runs it)."""
NBVAL = ("--nbval", "--nbval-sanitize-with", "tests/nbval_sanitize.cfg")
"""As the Makefile runs notebooks."""
FRAMEWORKS = ("accelerate", "transformers", "deepspeed", "torchdata", "jupyter-book")
"""The packages whose newest releases this check exists for (distribution names)."""
VENV_OWN = frozenset({"pip"})
"""What ``python -m venv`` puts in every environment, whatever the lock says."""
WIDTH = 100
HEARTBEAT_S = 60


@dataclass(frozen=True)
class Check:
    """One file pytest runs: its phase, the frameworks it exercises."""

    phase: str  # "tests", "notebooks" or "book"
    path: str
    frameworks: tuple[str, ...]


CHECKS = (
    # Accelerate's config files and launcher, DeepSpeed's config and engine, the Trainer's
    # arguments, each imported directly and driven as a user drives them.
    Check("tests", "tests/test_frameworks.py", ("accelerate", "deepspeed", "transformers")),
    # A real torchrun job through accelerate.Accelerator (FSDP plugin, launch environment).
    Check("tests", "tests/test_runs_accelerate_fsdp.py", ("accelerate",)),
    # A real torchrun job of the Transformers Trainer with DeepSpeed ZeRO.
    Check("tests", "tests/test_runs_trainer_deepspeed.py", ("transformers", "deepspeed")),
    # Real DeepSpeed ZeRO 1/2/3 engines: their buffers' bytes and counted collectives.
    Check("tests", "tests/test_runs_deepspeed_zero.py", ("deepspeed",)),
    # DeepSpeed's DistributedAttention (Ulysses) and deepspeed.comm, in a 4-rank job.
    Check("tests", "tests/test_runs_sequence_parallel.py", ("deepspeed",)),
    # Parameter counts against transformers.AutoModelForCausalLM and AutoConfig's defaults.
    Check("tests", "tests/test_hf_config.py", ("transformers",)),
    # The learning-rate schedules against transformers.optimization's.
    Check("tests", "tests/test_lr_schedule.py", ("transformers",)),
    # torchdata's StatefulDataLoader: a loader whose position is state, restored mid-epoch.
    # (tests/test_runs_checkpoint_resume.py uses it too, in 7 torchrun jobs: chapter 6 covers it.)
    Check("tests", "tests/test_data_loader.py", ("torchdata",)),
    # Chapter 7: Accelerate, the Trainer and DeepSpeed, run for real; outputs compared by nbval.
    Check("notebooks", "notebooks/07_accelerate_trainer_deepspeed.ipynb",
          ("accelerate", "transformers", "deepspeed")),
    # Chapter 6: checkpoints that hold torchdata's StatefulDataLoader state.
    Check("notebooks", "notebooks/06_checkpointing.ipynb", ("torchdata",)),
    # `jupyter-book build ROOT --path-output <tmp> -n -W --keep-going` (the book target's flags),
    # then its HTML checked (Sphinx, the theme, MyST-NB); one build, so not a second one here.
    Check("book", "tests/test_book.py", ("jupyter-book",)),
)


class SetupError(Exception):
    """A one-line reason the check could not run."""


# ---------------------------------------------------------------------------------------------
# Pure parts (tests/test_check_latest.py)


@dataclass(frozen=True, order=True)
class Move:
    """A distribution whose installed version is not the lock's (``locked`` None: not locked)."""

    name: str
    locked: str | None
    latest: str

    def line(self) -> str:
        return f"{self.name}  {self.locked or '(not in the lock)'} -> {self.latest}"


def same_version(installed: str, locked: str) -> bool:
    """Equal as ``==locked`` matches: an installed local label (``+cpu``) is ignored unless the
    lock names one too."""
    if "+" not in locked:
        installed = installed.split("+")[0]
    if installed == locked:
        return True
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return False
    try:
        return Version(installed) == Version(locked)
    except InvalidVersion:
        return False


def locked_versions(lock_text: str, markers: dict[str, bool]) -> dict[str, list[str]]:
    """``{name: [version, ...]}`` of the lock's lines that apply here; ``markers`` says whether
    each of the lock's environment markers holds (a line without one always applies)."""
    out: dict[str, list[str]] = {}
    for name, entries in lock.pins(lock_text).items():
        versions = [version for version, marker in entries if not marker or markers[marker]]
        if versions:
            out[name] = versions
    return out


def moved(lock_text: str, installed: dict[str, str], markers: dict[str, bool],
          ignore: frozenset[str] | set[str] = VENV_OWN) -> list[Move]:
    """The installed distributions (``{name: version}``) at another version than the lock pins
    for this environment, and those the lock does not pin here (unless in ``ignore``), by name."""
    locked = locked_versions(lock_text, markers)
    out = []
    for raw, version in installed.items():
        name = lock.normalize(raw)
        versions = locked.get(name)
        if versions is None:
            if name not in ignore:
                out.append(Move(name, None, version))
        elif not any(same_version(version, v) for v in versions):
            out.append(Move(name, versions[0], version))
    return sorted(out)


@dataclass(frozen=True)
class Failure:
    """A failed (or erroring) test or notebook cell, as pytest's JUnit XML reports it."""

    path: str  # the file it belongs to ("" when none of the files run matches)
    test_id: str  # pytest's node id: path::[Class::]name
    kind: str  # "failed", "error" or "import skipped"
    message: str  # the first line of pytest's message


@dataclass(frozen=True)
class Outcome:
    passed: int
    failed: int
    skipped: int
    failures: tuple[Failure, ...]


def node_id(classname: str, name: str, paths: list[str]) -> tuple[str, str]:
    """(file, node id) from a JUnit test case: pytest writes ``tests/test_x.py::C::t`` as
    classname ``tests.test_x.C``, name ``t`` (``notebooks/n.ipynb::Cell 3``: ``notebooks.n.ipynb``,
    ``Cell 3``); a file that failed to collect has no classname and its dotted path as name."""
    dotted_full = f"{classname}.{name}" if classname else name
    for path in sorted(paths, key=len, reverse=True):
        dotted = path.replace("/", ".").removesuffix(".py")
        if dotted_full == dotted:
            return path, path
        if classname == dotted or classname.startswith(dotted + "."):
            middle = classname[len(dotted) + 1:]
            return path, "::".join([path, *([middle.replace(".", "::")] if middle else []), name])
    return "", "::".join(p for p in (classname, name) if p)


def parse_junit(xml_text: str, paths: list[str]) -> Outcome:
    """Counts and failures of a pytest JUnit XML report. A test skipped because an import failed
    (``pytest.importorskip``) counts as a failure: every package it names is installed here."""
    root = ET.fromstring(xml_text)
    passed = failed = skipped = 0
    failures: list[Failure] = []
    for case in root.iter("testcase"):
        path, test_id = node_id(case.get("classname", ""), case.get("name", ""), paths)
        problem = next((c for c in case if c.tag in ("failure", "error")), None)
        skip = case.find("skipped")
        unimported = _UNIMPORTED.search(f"{skip.get('message')}\n{skip.text}") if skip is not None else None
        if problem is not None:
            kind, message = ("failed" if problem.tag == "failure" else "error"), problem.get("message") or problem.text
            if message == "collection failure":  # the reason: the traceback's last "E   " line
                message = next((line[1:] for line in reversed((problem.text or "").splitlines())
                                if line.startswith("E ")), message)
        elif unimported:  # a module's importorskip: "collection skipped", the reason in the text
            kind, message = "import skipped", unimported.group(0)
        elif skip is not None:
            skipped += 1
            continue
        else:
            passed += 1
            continue
        failed += 1
        failures.append(Failure(path, test_id, kind, first_line(message or "")))
    return Outcome(passed, failed, skipped, tuple(failures))


_UNIMPORTED = re.compile(r"could not import [^\"\n]*")
"""pytest.importorskip's reason."""
_ANSI = re.compile(r"(?:\x1b|#x1B)\[[0-9;]*m")
"""Terminal colours, as escapes or as pytest writes them into XML (``#x1B[91m``)."""


def first_line(message: str) -> str:
    """A failure message's first line, colours removed; a short heading (nbval's "Notebook cell
    execution failed") with the line that follows it."""
    lines = [line.strip() for line in _ANSI.sub("", message).splitlines() if line.strip()]
    if not lines:
        return ""
    return f"{lines[0]}: {lines[1]}" if len(lines) > 1 and len(lines[0]) < 40 else lines[0]


def guess(imported: set[str], moved_names: set[str],
          requires: dict[str, set[str]]) -> tuple[list[str], list[str]]:
    """The moved distributions among those a file imports (``imported``), then among their
    dependencies, transitively (``requires``: ``{name: {name, ...}}``); all names normalized."""
    direct = imported & moved_names
    seen, todo = set(imported), list(imported)
    while todo:
        for dep in requires.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return sorted(direct), sorted((seen - imported) & moved_names)


def _source(path: Path) -> str:
    if path.suffix != ".ipynb":
        return path.read_text()
    cells = json.loads(path.read_text()).get("cells", [])
    code = ["".join(c.get("source", "")) for c in cells if c.get("cell_type") == "code"]
    return "\n".join(line for cell in code for line in cell.splitlines()
                     if not line.lstrip().startswith(("%", "!")))


def _local_file(module: str, root: Path) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: Path, root: Path = ROOT, local: tuple[str, ...] = ("handbook_lib", "tests")
                     ) -> set[str]:
    """Top-level names of the modules ``path`` imports (a lazy import inside a function counts),
    following the project's own modules (``local``) into what they import, transitively."""
    found: set[str] = set()
    seen: set[Path] = set()
    todo = [path]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            tree = ast.parse(_source(current))
        except (SyntaxError, ValueError, OSError):
            continue
        package = ".".join(current.relative_to(root).with_suffix("").parts) if current.is_relative_to(root) else ""
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[:-node.level]
                    base = ".".join([*parent, *([base] if base else [])])
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in local:
                    found_file = _local_file(name, root)
                    if found_file is not None:
                        todo.append(found_file)
                elif top:
                    found.add(top)
    return found


def book_excludes(relative: str, patterns: list[str]) -> bool:
    """Does one of the book's ``exclude_patterns`` (``_config.yml``) keep Sphinx out of the
    folder ``relative`` (to the book's root)? As Sphinx reads them: a pattern matches a whole path
    from the root, ``*`` and ``?`` within one path segment, ``**`` across segments; excluding a
    folder excludes what lies under it."""
    def regex(pattern: str) -> re.Pattern:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            else:
                out, i = out + {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i])), i + 1
        return re.compile(out)

    parts = Path(relative).parts
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    return any(regex(pattern).fullmatch(prefix) for pattern in patterns for prefix in prefixes)


def wrap(text: str, indent: str = "") -> str:
    return textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "    ",
                         break_on_hyphens=False)


def minutes(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60:02d} s"


# ---------------------------------------------------------------------------------------------
# The environment

_PROBE = r"""
import importlib.metadata as md, json, platform, sys
from packaging.markers import Marker
from packaging.requirements import InvalidRequirement, Requirement
installed, requires = {}, {}
for dist in md.distributions():
    name = dist.metadata["Name"]
    if not name or name in installed:
        continue
    installed[name] = dist.version
    deps = []
    for line in dist.requires or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            deps.append(req.name)
    requires[name] = deps
markers = {m: Marker(m).evaluate() for m in json.loads(sys.argv[1])}
print(json.dumps({"installed": installed, "requires": requires, "markers": markers,
                  "modules": md.packages_distributions(), "python": platform.python_version()}))
"""


class Venv:
    def __init__(self, path: Path, logs: Path) -> None:
        self.path, self.logs = path, logs
        self.python = path / "bin" / "python"

    def version(self, name: str) -> str | None:
        done = subprocess.run([str(self.python), "-c", "import importlib.metadata as m, sys\n"
                               "try: print(m.version(sys.argv[1]))\nexcept m.PackageNotFoundError: pass",
                               name], capture_output=True, text=True)
        return done.stdout.strip() or None

    def has(self, requirement: str) -> bool:
        """Is NAME==VERSION installed (a local label such as +cpu aside), as setup.sh asks."""
        name, version = requirement.split("==")
        found = self.version(name)
        return found is not None and same_version(found, version)

    def probe(self, markers: list[str]) -> dict:
        done = subprocess.run([str(self.python), "-c", _PROBE, json.dumps(markers)],
                              capture_output=True, text=True)
        if done.returncode:
            raise SetupError(f"reading {self.path.name}'s distributions failed: {_last_line(done.stderr)}")
        return json.loads(done.stdout)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = next((x for x in reversed(lines) if "error" in x.lower()), lines[-1] if lines else "no output")
    return line[:160]


def progress(message: str) -> None:
    print(f"check-latest: {message}", flush=True)


def run(command: list[str], log: Path, label: str, env: dict[str, str] | None = None) -> int:
    """Run ``command`` with its output in ``log``, saying every minute that it still runs."""
    start = time.monotonic()
    with log.open("w") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        next_beat = start + HEARTBEAT_S
        while process.poll() is None:
            time.sleep(1)
            if time.monotonic() >= next_beat:
                progress(f"{label}: still running ({minutes(time.monotonic() - start)})")
                next_beat += HEARTBEAT_S
    return process.returncode


def setup_step(command: list[str], log: Path, what: str, env: dict[str, str] | None = None) -> None:
    if run(command, log, what, env):
        text = log.read_text()
        if any(fragment in text.lower() for fragment in lock.NETWORK_ERRORS):
            raise SetupError(f"{what}: no network access to the package index (log: {_rel(log)})")
        raise SetupError(f"{what} failed: {_last_line(text)} (log: {_rel(log)})")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def has_gpu() -> bool:
    """setup.sh's own ``has_gpu`` (the script sourced: its functions only)."""
    return subprocess.run(["bash", "-c", "source scripts/setup.sh && has_gpu"], cwd=ROOT,
                          capture_output=True).returncode == 0


def set_up(venv: Venv, also: list[str]) -> tuple[str, str]:
    """The environment, newest within the ranges, torch at the lock's version; (lock text, torch pin)."""
    venv.logs.mkdir(parents=True, exist_ok=True)
    if not venv.python.exists():
        progress(f"creating {_rel(venv.path)}")
        setup_step([sys.executable, "-m", "venv", str(venv.path)], venv.logs / "venv.log", "python -m venv")
    # As setup.sh: the lock must be pyproject.toml's (checked by the venv's Python: Python 3.10's
    # tomli is pip's).
    done = subprocess.run([str(venv.python), "scripts/lock.py", "check"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SetupError(_last_line(done.stderr).removeprefix("setup: "))
    lock_text = lock.LOCK.read_text()
    try:
        torch_pin, uv_pin = lock.pin(["torch", "uv"], lock_text)
    except lock.LockError as err:
        raise SetupError(str(err)) from None
    pip = [str(venv.python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    gpu = has_gpu()
    if not gpu and not venv.has(torch_pin):
        progress(f"no GPU here: pip installs {torch_pin} (its CPU wheel), as setup.sh does")
        setup_step([*pip, torch_pin], venv.logs / "torch.log", f"pip install {torch_pin}")
    if not venv.has(uv_pin):
        progress(f"pip installs {uv_pin}")
        setup_step([*pip, uv_pin], venv.logs / "uv.log", f"pip install {uv_pin}")
    with tempfile.TemporaryDirectory(prefix="check-latest-") as tmp:
        constraints = Path(tmp, "torch.txt")
        constraints.write_text(torch_pin + "\n")
        progress(f"uv installs the newest releases of .[{EXTRAS}] the ranges allow, {torch_pin} held"
                 + (f", with {' '.join(also)}" if also else ""))
        setup_step([str(venv.path / "bin" / "uv"), "pip", "install", "--upgrade", "--compile-bytecode",
                    "--python", str(venv.python), "--constraint", str(constraints), "-e", f".[{EXTRAS}]", *also],
                   venv.logs / "install.log", "uv pip install --upgrade")
    if gpu:  # setup.sh's one line when torch cannot use the GPU (a CPU build kept, a driver too old)
        subprocess.run(["bash", "-c", 'source scripts/setup.sh && check_gpu_torch "$0"', str(venv.python)], cwd=ROOT)
    return lock_text, torch_pin


def other_kernels(venv: Venv) -> dict[str, str]:
    """The variables ``make test`` runs with: CPU kernels other than the notebooks' (cpu_variant.py)."""
    done = subprocess.run([str(venv.python), "scripts/cpu_variant.py", "--other"], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode:
        raise SetupError(f"scripts/cpu_variant.py --other: {_last_line(done.stderr)}")
    return dict(line.split("=", 1) for line in done.stdout.split())


def book_note(venv: Venv) -> str | None:
    """One line when the book's build would read the environment's files (it lies in the book's
    root and ``_config.yml`` does not exclude it): the build then fails for that reason alone."""
    if not venv.path.resolve().is_relative_to(ROOT):
        return None
    done = subprocess.run([str(venv.python), "-c", "import json, sys, yaml; print(json.dumps(yaml.safe_load("
                           "open(sys.argv[1]))['exclude_patterns']))", str(ROOT / "_config.yml")],
                          capture_output=True, text=True)
    relative = venv.path.resolve().relative_to(ROOT).as_posix()
    if done.returncode == 0 and book_excludes(relative, json.loads(done.stdout)):
        return None
    return (f"_config.yml's exclude_patterns does not cover {relative}: the book build reads its files "
            f"(any failure below may be that; add '{relative}' there, or use --venv outside the project)")


def run_phase(venv: Venv, phase: str, checks: list[Check], env: dict[str, str]) -> tuple[Outcome, float]:
    paths = [c.path for c in checks]
    junit, log = venv.logs / f"{phase}.xml", venv.logs / f"{phase}.log"
    junit.unlink(missing_ok=True)
    workers = ["-n", "2", "--dist", "loadfile"] if len(paths) > 1 else []  # as make test
    command = [str(venv.python), "-m", "pytest", *workers, "-p", "no:cacheprovider",
               "--continue-on-collection-errors", "-o", "junit_family=xunit2", f"--junitxml={junit}",
               *paths, *(NBVAL if phase == "notebooks" else ())]
    progress(f"{phase}: pytest {' '.join(paths) if len(paths) < 3 else f'{len(paths)} files'} "
             f"(log: {_rel(log)})")
    start = time.monotonic()
    rc = run(command, log, phase, env)
    took = time.monotonic() - start
    if not junit.is_file():
        raise SetupError(f"{phase}: pytest exited {rc} without a report: {_last_line(log.read_text())} "
                         f"(log: {_rel(log)})")
    outcome = parse_junit(junit.read_text(), paths)
    if rc not in (0, 1) and not outcome.failures:
        raise SetupError(f"{phase}: pytest exited {rc}: {_last_line(log.read_text())} (log: {_rel(log)})")
    if rc and not outcome.failures:  # a failure the report does not name (e.g. in a session fixture)
        outcome = Outcome(outcome.passed, 1, outcome.skipped, (Failure(
            "", f"{phase}: pytest exited {rc}", "failed", f"{_last_line(log.read_text())} (log: {_rel(log)})"),))
    progress(f"{phase}: {outcome.passed} passed, {outcome.failed} failed, {outcome.skipped} skipped "
             f"in {minutes(took)}")
    return outcome, took


def report(moves: list[Move], outcomes: dict[str, Outcome], times: dict[str, float],
           guesses: dict[str, tuple[list[str], list[str]]], notes: list[str] | tuple[str, ...] = ()
           ) -> list[str]:
    """The closing report's lines (each within :data:`WIDTH` columns)."""
    lines = ["", "check-latest report", "-" * 19]
    lines += [wrap("note: " + note) for note in notes]
    if moves:
        lines.append(f"moved beyond the lock ({len(moves)}):")
        lines += [wrap(m.line(), "  ") for m in moves]
    else:
        lines.append("nothing moved: every installed package is at the version the lock pins")
    failures = [f for o in outcomes.values() for f in o.failures]
    if failures:
        lines.append(f"failed ({len(failures)}):")
        told: set[tuple[str, str]] = set()  # (file, message) already printed
        for f in failures:
            repeated = (f.path, f.message) in told  # a module fixture's failure, for each of its tests
            lines.append(wrap(f"{f.test_id} ({f.kind}{', as above' if repeated else ''})", "  "))
            if repeated:
                continue
            told.add((f.path, f.message))
            if f.message:
                lines.append(wrap(textwrap.shorten(f.message, 2 * WIDTH, placeholder=" ..."), "    "))
            direct, deps = guesses.get(f.path, ([], []))
            named = direct + [f"{d} (a dependency)" for d in deps]
            lines.append(wrap("moved among its imports (a guess): " + (", ".join(named) or "none"), "    "))
    else:
        lines.append("failed: none")
    summary = [f"{phase} {minutes(times[phase])}" + (f" ({o.passed} passed, {o.failed} failed, "
                                                     f"{o.skipped} skipped)" if (o := outcomes.get(phase)) else "")
               for phase in times]
    lines.append(wrap("times: " + "; ".join(summary)))
    return [row for line in lines for row in line.split("\n")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="The newest releases pyproject.toml's ranges allow, in a separate environment: "
                    "which packages moved beyond requirements.lock, and which framework test, notebook "
                    "or book build breaks with them. Exit 0: all passed; 1: something failed; 2: set-up error.",
        epilog="example: %(prog)s --also accelerate==1.15.0 --skip-notebooks --skip-book  "
               "(accelerate 1.15.0 with everything else newest: what would a user on it see?)")
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-latest",
                        help="the environment to create or refresh (default: .venv-latest; never .venv)")
    parser.add_argument("--skip-notebooks", action="store_true", help="run no notebook (nbval)")
    parser.add_argument("--skip-book", action="store_true", help="do not build the book (tests/test_book.py)")
    parser.add_argument("--also", action="append", default=[], metavar="REQ",
                        help="a requirement installed in the same resolution, e.g. accelerate==1.15.0 or "
                             "'transformers<5.21', to check an older (or a pre-) release; repeatable. "
                             "The next run without it moves the package back to the newest")
    args = parser.parse_args(argv)
    venv_path = args.venv if args.venv.is_absolute() else Path.cwd() / args.venv
    if venv_path.resolve() == (ROOT / ".venv").resolve():
        print("check-latest: set-up error: refusing to upgrade the project's own .venv (use --venv DIR)",
              file=sys.stderr)
        return 2
    venv = Venv(venv_path, venv_path / "check-latest")
    times: dict[str, float] = {}
    outcomes: dict[str, Outcome] = {}
    notes: list[str] = []
    try:
        start = time.monotonic()
        lock_text, torch_pin = set_up(venv, args.also)
        markers = sorted({m for entries in lock.pins(lock_text).values() for _, m in entries if m})
        state = venv.probe(markers)
        times["set-up"] = time.monotonic() - start
        project = lock.normalize(lock._toml(lock.PYPROJECT.read_text())["project"]["name"])
        moves = moved(lock_text, state["installed"], state["markers"], VENV_OWN | {project})
        progress(f"set-up done in {minutes(times['set-up'])} (Python {state['python']}, "
                 f"torch {state['installed'].get('torch')}); {len(moves) or 'nothing'} moved beyond the lock")
        for m in moves:
            print("  " + m.line(), flush=True)
        installed = {lock.normalize(name): version for name, version in state["installed"].items()}
        progress("frameworks: " + ", ".join(f"{name} {installed.get(name, '(missing)')}" for name in FRAMEWORKS))
        skip = {"notebooks"} if args.skip_notebooks else set()
        skip |= {"book"} if args.skip_book else set()
        try:
            kernels = other_kernels(venv)
            progress("CPU kernels for the runs (as make test): " + " ".join(f"{k}={v}" for k, v in kernels.items()))
        except SetupError as err:
            if "notebooks" not in skip:
                raise
            kernels = {}  # they are chosen for the notebooks' stored outputs, not run here
            progress(f"CPU kernels for the runs: this machine's own ({err})")
        env = {**os.environ, **kernels, "CUDA_VISIBLE_DEVICES": "", "VIRTUAL_ENV": str(venv.path),
               "PATH": f"{venv.path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
        for phase in ("tests", "notebooks", "book"):
            checks = [c for c in CHECKS if c.phase == phase]
            if phase in skip or not checks:
                continue
            if phase == "book" and (note := book_note(venv)):
                notes.append(note)
                progress("note: " + note)
            outcomes[phase], times[phase] = run_phase(venv, phase, checks, env)
    except SetupError as err:
        print(f"check-latest: set-up error: {err}", file=sys.stderr)
        return 2
    names = {m.name for m in moves}
    requires = {lock.normalize(k): {lock.normalize(d) for d in v} for k, v in state["requires"].items()}
    to_dist = {module: {lock.normalize(d) for d in dists} for module, dists in state["modules"].items()}
    guesses = {}
    for path in {f.path for o in outcomes.values() for f in o.failures if f.path}:
        imported = {d for module in imported_modules(ROOT / path) for d in to_dist.get(module, ())}
        guesses[path] = guess(imported, names, requires)
    print("\n".join(report(moves, outcomes, times, guesses, notes)), flush=True)
    failed = sum(o.failed for o in outcomes.values())
    print(f"check-latest: {'all passed' if not failed else f'{failed} failed'}"
          + (f" (skipped: {', '.join(sorted(skip))})" if skip else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
