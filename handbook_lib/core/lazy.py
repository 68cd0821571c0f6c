"""Lazy exports (PEP 562): a package whose public names are each imported from their module
only when first used.

Every layer's ``__init__`` is one: importing one module of a layer (a rank's harness importing
its process-group set-up) loads no other, and ``import handbook_lib`` loads no ``torch``.

A package declares each export once, as an import under ``if TYPE_CHECKING:`` (what a type
checker and an editor read); :func:`lazy_exports` reads those lines from the package's source
and derives the rest, the table of homes and ``__all__``::

    if TYPE_CHECKING:
        from handbook_lib.core.config import RunConfig, parse_overrides

    __getattr__, __dir__, __all__ = lazy_exports(__name__)
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__: list[str] = []  # plumbing of the layers' __init__s, not an API to import from core


def declared_exports(source: str) -> dict[str, str]:
    """Each name a package's source imports under ``if TYPE_CHECKING:`` (absolute
    ``from MODULE import NAME`` lines), and that module: the package's exports and their homes.

    Raises:
        ValueError: A name declared twice, or a line that is not ``from MODULE import NAME``.
    """
    homes: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")):
            continue
        for statement in node.body:
            if not isinstance(statement, ast.ImportFrom) or statement.level or not statement.module:
                raise ValueError(f"line {statement.lineno}: an export is declared as `from MODULE import NAME`")
            for alias in statement.names:
                name = alias.asname or alias.name
                if name in homes:
                    raise ValueError(f"line {statement.lineno}: {name} is exported twice")
                homes[name] = statement.module
    return homes


def lazy_exports(package: str) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """The module-level ``__getattr__``, ``__dir__`` and ``__all__`` of ``package``, whose exports
    are declared by :func:`declared_exports`: a name's module is imported on first use and the
    name kept.

    Args:
        package: The package's ``__name__`` (it must be importing itself: in ``sys.modules``).
    """
    namespace = vars(sys.modules[package])
    homes = declared_exports(Path(namespace["__file__"]).read_text(encoding="utf-8"))

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__, list(homes)
