"""Lazy exports (PEP 562): a package that names the module of each public name, and imports
that module only when the name is first used.

Every layer's ``__init__`` is one: importing one module of a layer (a rank's harness importing
its process-group set-up) loads no other, and ``import handbook_lib`` loads no ``torch``.

    __getattr__, __dir__ = lazy_exports(__name__, {"RunConfig": "config", ...})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__: list[str] = []  # plumbing of the layers' __init__s, not an API to import from core


def lazy_exports(package: str, homes: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package``, whose name ``n`` lives in
    its submodule ``homes[n]``: the submodule is imported on first use and the name kept.

    Args:
        package: The package's ``__name__`` (it must be importing itself: in ``sys.modules``).
        homes: Each exported name and the submodule it is defined in, relative to ``package``.
    """
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{homes[name]}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace.get("__all__", ())})

    return __getattr__, __dir__
