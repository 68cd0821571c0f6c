"""The package's architecture, enforced: layers, purity, no import cycles, and sizes.

``handbook_lib`` is a folder per layer; the layers, their ranks and what each may import are
written in README.md, section "For contributors: the layers and what each may import". Every
module is parsed (nothing is imported) and three rules are checked:

1. **Layers:** a module imports only its own layer's package or a lower layer. What counts as an
   import: ``import``/``from`` statements, also inside a function (a lazy import is still a
   dependency) or under ``TYPE_CHECKING``; a name taken from a layer's package is followed to the
   module the package's lazy table imports it from; ``importlib.import_module`` and
   ``__import__`` calls, whose argument must be a string, or an f-string whose constant start
   names the package reached. The top-level ``handbook_lib`` ranks above every layer (its lazy
   exports reach into four of them), so no module of a layer imports it.
2. **Pure layers:** ``core`` and ``models`` import only the standard library and ``core`` and
   ``models`` (an allow-list, even inside a function); ``launch``, ``face``, the framework-config
   writer, the runs' index and the top-level package load, when imported, no third-party package
   but those in :data:`LIGHT` (matplotlib, psutil), counting what they import transitively and
   the parent packages Python runs first;
3. **No cycles** among the package's modules.

The tests at the end build small packages with each break this layout once fixed, and each way
the checker was once fooled, and show that the checker reports each.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from handbook_lib.core.lazy import declared_exports

PACKAGE = Path(__file__).resolve().parent.parent / "handbook_lib"

RANKS = {"core": 0, "models": 1, "runtime": 2, "integrations": 3, "lessons": 3, "runs": 4, "launch": 5,
         "face": 6}
"""Each layer's rank: a module may import its own layer or one of lower rank."""
TOP = 7
"""The rank of ``handbook_lib`` itself and of ``handbook_lib.__main__``: above every layer."""
STRICT_LAYERS = ("core", "models")
"""The pure layers: they import the standard library and these layers only, even inside a function."""
LIGHT = {"matplotlib": "face draws its figures with it", "psutil": "launch watches its process trees"}
"""The third-party packages the layers that load no torch may load when imported, and why."""
PURE_LAYERS = ("core", "models", "launch", "face")
PURE_MODULES = ("handbook_lib", "handbook_lib.integrations", "handbook_lib.integrations.frameworks",
                "handbook_lib.runs")
"""What loads no third-party package but :data:`LIGHT` when imported."""
UNREAD_DYNAMIC_IMPORTS = {
    "handbook_lib.core.lazy": "the lazy-export plumbing: it imports the module a package's own TYPE_CHECKING "
                              "block names, and the checker reads that block as the package's imports",
}
"""Modules allowed an ``import_module`` whose target the checker cannot read, and why."""
STDLIB = frozenset(sys.stdlib_module_names)

MAX_MODULE_LINES = 500
MAX_FUNCTION_CODE_LINES = 90
DECLARATIVE = {"handbook_lib.face.cli.build_parser", "handbook_lib.launch.slurm.render_sbatch"}
"""Functions exempt from the size rule: an argument parser's table and the Slurm template."""


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    lazy: bool
    """Inside a function: runs when called, not when the module is imported."""
    type_only: bool
    """Under ``if TYPE_CHECKING:``: never runs."""


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root``, by dotted name."""
    return {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def exports(known: dict[str, Path]) -> dict[str, dict[str, str]]:
    """Each package's lazy exports (name -> the module it is imported from), as
    :func:`handbook_lib.core.lazy.lazy_exports` reads them."""
    return {name: declared_exports(path.read_text(encoding="utf-8"))
            for name, path in known.items() if path.name == "__init__.py"}


DYNAMIC = ("import_module", "__import__")
"""Calls that import the module their first argument names."""


def _dynamic_target(call: ast.Call) -> str | None:
    """The module an ``import_module``/``__import__`` call reaches: its string argument, or the
    package an f-string's constant start names (``f"handbook_lib.runs.{run}"``: the runs);
    ``None`` when the argument says nothing."""
    arg = call.args[0] if call.args else None
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and not arg.value.startswith("."):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        start = str(arg.values[0].value)
        return start.rsplit(".", 1)[0] if "." in start else None
    return None


def imports(name: str, path: Path, known: dict[str, Path], exported: dict[str, dict[str, str]] | None = None,
            unread: list[str] | None = None) -> list[Import]:
    """What module ``name`` imports: absolute names, each with where and when it runs. A
    dynamic import whose target cannot be read is added to ``unread`` as ``"name:line"``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    exported = exported or {}
    found: list[Import] = []
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]

    def home(module: str, attribute: str) -> str:
        """Where ``from module import attribute`` takes it from: a submodule, the module the
        package's lazy table names (followed through packages that re-export it), or ``module``."""
        for _ in range(len(known)):
            if f"{module}.{attribute}" in known:
                return f"{module}.{attribute}"
            nxt = exported.get(module, {}).get(attribute)
            if nxt is None or nxt == module:
                return module
            module = nxt
        return module

    def visit(node: ast.AST, lazy: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner_lazy = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            inner_type = type_only or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            if isinstance(child, ast.Import):
                found.extend(Import(name, a.name, child.lineno, lazy, type_only) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*up, base] if base else up)
                for alias in child.names:  # ``from pkg import module`` imports the module
                    found.append(Import(name, home(base, alias.name), child.lineno, lazy, type_only))
            elif isinstance(child, ast.Call) and (getattr(child.func, "id", None) in DYNAMIC
                                                  or getattr(child.func, "attr", None) in DYNAMIC):
                target = _dynamic_target(child)
                if target is None:
                    if unread is not None:
                        unread.append(f"{name}:{child.lineno}")
                else:
                    found.append(Import(name, target, child.lineno, lazy, type_only))
            visit(child, inner_lazy, inner_type)

    visit(tree, False, False)
    return found


def _rank(module: str, top: str) -> int | None:
    """The rank of ``module``'s layer: :data:`TOP` for the package itself and its ``__main__``."""
    if module in (top, f"{top}.__main__"):
        return TOP
    parts = module.split(".")
    return RANKS.get(parts[1]) if len(parts) > 1 and parts[0] == top else None


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANKS else None


def _parents(module: str) -> list[str]:
    """The packages Python imports before ``module``: ``a``, ``a.b`` for ``a.b.c``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def violations(root: Path) -> list[str]:
    """Every break of the three rules in the package under ``root``, one line each."""
    top = root.name
    known = modules(root)
    exported = exports(known)
    unread: list[str] = []
    edges = {m: imports(m, p, known, exported, unread) for m, p in known.items()}
    out = [f"{where}: a dynamic import whose target is not a string naming it"
           for where in unread if where.split(":")[0] not in UNREAD_DYNAMIC_IMPORTS]
    for module, found in edges.items():
        here = _layer(module)
        for imp in found:
            first = imp.target.split(".")[0]
            if first != top:
                if here in STRICT_LAYERS and first not in STDLIB:
                    out.append(f"{module}:{imp.line} imports {imp.target} (layer {here} is pure: the "
                               "standard library only)")
                continue
            mine, theirs = _rank(module, top), _rank(imp.target, top)
            if here is None or theirs is None or _layer(imp.target) == here:
                continue
            if theirs >= mine:
                there = _layer(imp.target) or f"the top-level {top}"
                out.append(f"{module}:{imp.line} imports {imp.target}: layer {here} may not import "
                           + (f"layer {there}" if _layer(imp.target) else there))

    chains: dict[str, tuple[str, ...] | None] = {}

    def loads_heavy(module: str) -> tuple[str, ...] | None:
        """The chain of module-level imports from ``module`` to a third-party package outside
        :data:`LIGHT`, if any."""
        if module in chains:
            return chains[module]
        chains[module] = None  # in progress: a cycle adds nothing
        for imp in edges.get(module, []):
            if imp.lazy or imp.type_only:
                continue
            first = imp.target.split(".")[0]
            if first not in STDLIB and first not in LIGHT and first != top:
                chains[module] = (module, imp.target)
                return chains[module]
            if first == top:
                for nxt in (*_parents(imp.target), imp.target):
                    chain = loads_heavy(nxt) if nxt in known and nxt != module else None
                    if chain:
                        chains[module] = (module, *chain)
                        return chains[module]
        return None

    pure = [m for m in known if _layer(m) in PURE_LAYERS or m in PURE_MODULES]
    for module in pure:
        chain = loads_heavy(module)
        if chain:
            out.append(f"{module} loads {chain[-1]} when imported: {' -> '.join(chain)}")

    graph = {m: sorted({i.target for i in found if i.target in known and i.target != m})
             for m, found in edges.items()}
    for cycle in _cycles(graph):
        out.append("import cycle: " + " -> ".join([*cycle, cycle[0]]))
    return out


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, []):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def oversized(root: Path) -> list[str]:
    """Modules over :data:`MAX_MODULE_LINES` lines and functions over
    :data:`MAX_FUNCTION_CODE_LINES` lines of code (their docstring excluded)."""
    out = []
    for module, path in modules(root).items():
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > MAX_MODULE_LINES:
            out.append(f"{module}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = node.end_lineno - node.lineno + 1
            doc = node.body[0] if node.body and isinstance(node.body[0], ast.Expr) and isinstance(
                getattr(node.body[0], "value", None), ast.Constant) else None
            if doc is not None:
                lines -= doc.end_lineno - doc.lineno + 1
            if lines > MAX_FUNCTION_CODE_LINES and f"{module}.{node.name}" not in DECLARATIVE:
                out.append(f"{module}.{node.name}: {lines} lines of code")
    return out


def test_every_layer_is_a_folder_of_the_package():
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(RANKS)
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "__main__.py"]


def test_the_package_keeps_its_layers_purity_and_has_no_cycle():
    assert violations(PACKAGE) == []


def test_no_module_or_function_is_too_large():
    assert oversized(PACKAGE) == []


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    """A small ``handbook_lib`` under ``tmp_path`` with a folder per layer and ``files``."""
    root = tmp_path / "handbook_lib"
    for layer in RANKS:
        (root / layer).mkdir(parents=True)
        (root / layer / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    for name, text in files.items():
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize("files, expected", [
    pytest.param({"models/checkpoint.py": "", "runtime/checkpoint.py": "import torch\nCommitStep = 1\n",
                  "face/plots.py": "from handbook_lib.runtime.checkpoint import CommitStep\n"},
                 "handbook_lib.face.plots loads torch when imported: handbook_lib.face.plots -> "
                 "handbook_lib.runtime.checkpoint -> torch", id="plots-loads-torch-for-a-type-hint"),
    pytest.param({"face/display.py": "WIDTH = 86\n", "launch/torchrun.py": "from handbook_lib.face.display import WIDTH\n"},
                 "handbook_lib.launch.torchrun:1 imports handbook_lib.face.display: layer launch may not import "
                 "layer face", id="launch-imports-display"),
    pytest.param({"models/memory.py": "def estimate_rank_state():\n    from handbook_lib.models.zero import x\n",
                  "models/zero.py": "from handbook_lib.models.memory import estimate_rank_state\nx = 1\n"},
                 "import cycle: handbook_lib.models.memory -> handbook_lib.models.zero -> handbook_lib.models.memory",
                 id="memory-and-zero-import-each-other-lazily"),
    pytest.param({"models/architecture.py": "class ModelConfig: ...\n",
                  "core/config.py": "from handbook_lib.models.architecture import ModelConfig\n"},
                 "handbook_lib.core.config:1 imports handbook_lib.models.architecture: layer core may not import "
                 "layer models", id="config-imports-architecture"),
])
def test_the_checker_reports_each_break_this_layout_fixed(tmp_path, files, expected):
    assert violations(_package(tmp_path, files)) == [expected]


def test_the_checker_reports_a_pure_layer_importing_torch_lazily_and_a_parent_package_loading_it(tmp_path):
    root = _package(tmp_path, {"models/memory.py": "def f():\n    import torch\n",
                               "launch/__init__.py": "import torch\n", "launch/gpus.py": "x = 1\n",
                               "face/cli.py": "from handbook_lib.launch.gpus import x\n"})
    found = violations(root)
    assert "handbook_lib.models.memory:2 imports torch (layer models is pure: the standard library only)" in found
    assert ("handbook_lib.face.cli loads torch when imported: handbook_lib.face.cli -> handbook_lib.launch -> "
            "torch") in found


LAUNCH = {"launch/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                "    from handbook_lib.launch.runner import torchrun\n",
          "launch/runner.py": "def torchrun(): ...\n"}
"""A launch layer that exports ``torchrun`` lazily, as the real one does."""
TOP_LEVEL = {"__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                            "    from handbook_lib.launch import torchrun\n"}
"""A top-level package that re-exports it, as the real one does."""


@pytest.mark.parametrize("files, expected", [
    pytest.param({**LAUNCH, **TOP_LEVEL, "models/roofline.py": "from handbook_lib import torchrun\n"},
                 ["handbook_lib.models.roofline:1 imports handbook_lib.launch.runner: layer models may not import "
                  "layer launch"], id="from-the-top-level-lazy-exports"),
    pytest.param({**LAUNCH, **TOP_LEVEL, "models/roofline.py": "def f():\n    import handbook_lib as h\n"
                                                               "    return h.torchrun\n"},
                 ["handbook_lib.models.roofline:2 imports handbook_lib: layer models may not import the top-level "
                  "handbook_lib"], id="the-top-level-module-then-an-attribute"),
    pytest.param({**LAUNCH, "models/roofline.py": "from handbook_lib.launch import torchrun\n"},
                 ["handbook_lib.models.roofline:1 imports handbook_lib.launch.runner: layer models may not import "
                  "layer launch"], id="from-a-layers-lazy-exports"),
    pytest.param({"face/plots.py": "x = 1\n",
                  "models/roofline.py": "import importlib\ndef f():\n"
                                        "    return importlib.import_module('handbook_lib.face.plots')\n"},
                 ["handbook_lib.models.roofline:3 imports handbook_lib.face.plots: layer models may not import "
                  "layer face"], id="import-module-with-a-literal"),
    pytest.param({"runtime/build.py": "x = 1\n",
                  "models/roofline.py": "from importlib import import_module\ndef f(name):\n"
                                        "    return import_module(f'handbook_lib.runtime.{name}')\n"},
                 ["handbook_lib.models.roofline:3 imports handbook_lib.runtime: layer models may not import "
                  "layer runtime"], id="import-module-with-an-f-string"),
    pytest.param({"models/roofline.py": "import importlib\ndef f(name):\n    return importlib.import_module(name)\n"},
                 ["handbook_lib.models.roofline:3: a dynamic import whose target is not a string naming it"],
                 id="import-module-of-a-variable"),
    pytest.param({"models/roofline.py": "def f():\n    return __import__('torch')\n"},
                 ["handbook_lib.models.roofline:2 imports torch (layer models is pure: the standard library only)"],
                 id="dunder-import-of-torch"),
    pytest.param({"launch/gpus.py": "x = __import__('torch')\n"},
                 ["handbook_lib.launch.gpus loads torch when imported: handbook_lib.launch.gpus -> torch"],
                 id="dunder-import-at-import-time"),
    pytest.param({"models/roofline.py": "def f():\n    import safetensors\n    import torchvision.models\n",
                  "core/config.py": "import numpy as np\n"},
                 ["handbook_lib.models.roofline:2 imports safetensors (layer models is pure: the standard library "
                  "only)", "handbook_lib.models.roofline:3 imports torchvision.models (layer models is pure: the "
                  "standard library only)", "handbook_lib.core.config:1 imports numpy (layer core is pure: the "
                  "standard library only)", "handbook_lib.core.config loads numpy when imported: "
                  "handbook_lib.core.config -> numpy"], id="packages-outside-the-old-four-name-list"),
    pytest.param({"face/views.py": "import torchdata\nimport triton\n"},
                 ["handbook_lib.face.views loads torchdata when imported: handbook_lib.face.views -> torchdata"],
                 id="a-light-layer-loading-torchdata"),
    pytest.param({"runtime/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from handbook_lib.runtime.checkpoint import CommitStep\n",
                  "runtime/checkpoint.py": "import torch\nCommitStep = 1\n",
                  "face/plots.py": "from handbook_lib.runtime import CommitStep\n"},
                 ["handbook_lib.face.plots loads torch when imported: handbook_lib.face.plots -> "
                  "handbook_lib.runtime.checkpoint -> torch"], id="a-heavy-name-through-a-lazy-table"),
])
def test_the_checker_is_not_fooled(tmp_path, files, expected):
    """The ways the review fooled the old checker (a pure layer reaching a higher one through the
    lazy exports of ``handbook_lib`` or of a layer, ``importlib.import_module``, ``__import__``, a
    heavy package outside a four-name deny-list), each planted in a small package."""
    assert sorted(violations(_package(tmp_path, files))) == sorted(expected)


def test_the_reviews_snippets_planted_in_the_real_package_are_each_reported(tmp_path):
    """The review's demonstration, replayed: its snippets appended to a copy of
    ``models/roofline.py``, each reported (the old checker printed ``violations: []``)."""
    import shutil

    root = Path(shutil.copytree(PACKAGE, tmp_path / "handbook_lib", ignore=shutil.ignore_patterns("__pycache__")))
    planted = root / "models" / "roofline.py"
    lines = len(planted.read_text(encoding="utf-8").splitlines())
    planted.write_text(planted.read_text(encoding="utf-8") + (
        "import handbook_lib as _h\n"
        "def _fool_1():\n    from handbook_lib import torchrun\n    return torchrun, _h.torchrun\n"
        "def _fool_2():\n    import importlib\n    return importlib.import_module('handbook_lib.face.plots')\n"
        "def _fool_3():\n    return __import__('torch')\n"
        "def _fool_4():\n    import triton\n"), encoding="utf-8")
    where = "handbook_lib.models.roofline"
    assert violations(root) == [
        f"{where}:{lines + 1} imports handbook_lib: layer models may not import the top-level handbook_lib",
        f"{where}:{lines + 3} imports handbook_lib.launch.runner: layer models may not import layer launch",
        f"{where}:{lines + 7} imports handbook_lib.face.plots: layer models may not import layer face",
        f"{where}:{lines + 9} imports torch (layer models is pure: the standard library only)",
        f"{where}:{lines + 11} imports triton (layer models is pure: the standard library only)",
    ]


def test_the_real_package_has_only_readable_dynamic_imports():
    """The launcher reaches the runs by ``import_module(f"handbook_lib.runs.{run}")``: read as
    an import of the runs (launch may import them); the one unread target is the lazy plumbing."""
    known, unread = modules(PACKAGE), []
    targets = [i.target for m, p in known.items() for i in imports(m, p, known, exports(known), unread)
               if m.startswith("handbook_lib.launch.")]
    assert targets.count("handbook_lib.runs") >= 4
    assert [where.split(":")[0] for where in unread] == list(UNREAD_DYNAMIC_IMPORTS)


def test_the_size_check_counts_code_not_docstrings(tmp_path):
    doc = '    """' + "\n" * 200 + '    """\n'
    root = _package(tmp_path, {"core/long.py": "def documented():\n" + doc + "    x = 1\n" * 88,
                               "core/big.py": "def f():\n" + "    x = 1\n" * 90,
                               "core/many.py": "x = 1\n" * 501})
    assert oversized(root) == ["handbook_lib.core.big.f: 91 lines of code", "handbook_lib.core.many: 501 lines"]


def _exports(layer: str) -> list[str]:
    return list(declared_exports((PACKAGE / layer / "__init__.py").read_text(encoding="utf-8")))


@pytest.mark.parametrize("layer", [name for name in RANKS if name != "runs"])
def test_a_layer_exports_each_name_from_its_one_home(layer):
    """Every name a layer package exports is defined in one of its modules (no second home),
    resolves on first use, and no module of the layer bears an exported name (a submodule
    imported by anyone would shadow the name on the package)."""
    import importlib

    package = importlib.import_module(f"handbook_lib.{layer}")
    names = _exports(layer)
    assert names == package.__all__
    modules = {p.stem for p in (PACKAGE / layer).glob("*.py")}
    assert not set(names) & modules
    import inspect

    for name in names:
        value = getattr(package, name)
        if inspect.isfunction(value) or inspect.isclass(value):
            assert value.__module__.startswith(f"handbook_lib.{layer}."), (name, value.__module__)


def test_a_rank_imports_only_what_its_run_needs():
    """Layer packages import their names on first use: a rank's harness (``runs.fault``) loads
    no checkpointing, no FSDP wrapping, no planner and no face."""
    import subprocess
    import sys

    code = ("import sys, handbook_lib.runs.fault; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('handbook_lib'))))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                cwd=PACKAGE.parent).stdout.split())
    assert "handbook_lib.runtime.distributed" in loaded and "handbook_lib.runs.entry" in loaded
    assert not loaded & {"handbook_lib.runtime.checkpoint", "handbook_lib.runtime.build", "handbook_lib.models.planner",
                         "handbook_lib.face.display", "handbook_lib.launch.runner"}


def test_the_first_names_come_from_the_package_without_torch():
    """``from handbook_lib import ModelConfig, estimate_memory, plan, torchrun ...``: the names a
    learner meets first, each its layer's own object, and none of them loads torch."""
    import subprocess
    import sys

    code = ("import sys, handbook_lib as h; objs = [getattr(h, n) for n in h.__all__]; "
            "print(len(objs), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout.split()
    assert out == ["15", "False"]
    import handbook_lib
    from handbook_lib.launch import torchrun
    from handbook_lib.models import estimate_memory, plan

    assert (handbook_lib.torchrun, handbook_lib.estimate_memory, handbook_lib.plan) == (torchrun, estimate_memory, plan)
