"""The package's architecture, enforced: layers, purity, no import cycles, and sizes.

``handbook_lib`` is a folder per layer (``DESIGN.md``). Every module is parsed (nothing is
imported) and three rules are checked:

1. **Layers:** a module imports only its own layer's package or a lower layer (an import inside a
   function counts: a lazy import is still a dependency);
2. **Pure layers:** ``core``, ``models``, ``launch``, ``face`` (matplotlib allowed), the
   framework-config writer and the runs' index never load ``torch`` (or DeepSpeed, Transformers,
   Accelerate) when imported, counting what they import transitively and the parent packages
   Python runs first; ``core`` and ``models`` do not import them even lazily;
3. **No cycles** among the package's modules.

The tests at the end build small packages with each of the four breaks this layout fixed and
show that the checker reports each.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "handbook_lib"

RANKS = {"core": 0, "models": 1, "runtime": 2, "integrations": 3, "lessons": 3, "runs": 4, "launch": 5,
         "face": 6}
"""Each layer's rank: a module may import its own layer or one of lower rank."""
HEAVY = ("torch", "deepspeed", "transformers", "accelerate")
"""Packages the pure layers must not load."""
PURE_LAYERS = ("core", "models", "launch", "face")
PURE_MODULES = ("handbook_lib", "handbook_lib.integrations", "handbook_lib.integrations.frameworks",
                "handbook_lib.runs")
STRICT_LAYERS = ("core", "models")
"""Layers that import no heavy package even inside a function."""

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


def imports(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    """What module ``name`` imports: absolute names, each with where and when it runs."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[Import] = []
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]

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
                    candidate = f"{base}.{alias.name}"
                    target = candidate if candidate in known else base
                    found.append(Import(name, target, child.lineno, lazy, type_only))
            visit(child, inner_lazy, inner_type)

    visit(tree, False, False)
    return found


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
    edges = {m: imports(m, p, known) for m, p in known.items()}
    out: list[str] = []
    for module, found in edges.items():
        here = _layer(module)
        for imp in found:
            if not imp.target.startswith(top + "."):
                if (imp.target.split(".")[0] in HEAVY and here in STRICT_LAYERS):
                    out.append(f"{module}:{imp.line} imports {imp.target} (layer {here} is pure)")
                continue
            there = _layer(imp.target)
            if here is None or there is None or there == here:
                continue
            if RANKS[there] >= RANKS[here]:
                out.append(f"{module}:{imp.line} imports {imp.target}: layer {here} may not import "
                           f"layer {there}")

    chains: dict[str, tuple[str, ...] | None] = {}

    def loads_heavy(module: str) -> tuple[str, ...] | None:
        """The chain of module-level imports from ``module`` to a heavy package, if any."""
        if module in chains:
            return chains[module]
        chains[module] = None  # in progress: a cycle adds nothing
        for imp in edges.get(module, []):
            if imp.lazy or imp.type_only:
                continue
            if imp.target.split(".")[0] in HEAVY:
                chains[module] = (module, imp.target)
                return chains[module]
            if imp.target.startswith(top + "."):
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
    assert "handbook_lib.models.memory:2 imports torch (layer models is pure)" in found
    assert ("handbook_lib.face.cli loads torch when imported: handbook_lib.face.cli -> handbook_lib.launch -> "
            "torch") in found


def test_the_size_check_counts_code_not_docstrings(tmp_path):
    doc = '    """' + "\n" * 200 + '    """\n'
    root = _package(tmp_path, {"core/long.py": "def documented():\n" + doc + "    x = 1\n" * 88,
                               "core/big.py": "def f():\n" + "    x = 1\n" * 90,
                               "core/many.py": "x = 1\n" * 501})
    assert oversized(root) == ["handbook_lib.core.big.f: 91 lines of code", "handbook_lib.core.many: 501 lines"]


def _exports(layer: str) -> list[str]:
    from handbook_lib.core.lazy import declared_exports

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
