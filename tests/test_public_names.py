"""The public API keeps its names: every name ``from handbook_lib[.LAYER] import NAME`` gave
when the exports moved to one declaration each (``tests/public_names.json``, 625 names of 9
packages) is still exported, listed in ``__all__`` and importable.

A name may be added (the list is a floor, not a ceiling); removing or renaming one is a change of
the public API: update the list in the same commit and say so.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

NAMES = json.loads((Path(__file__).with_name("public_names.json")).read_text(encoding="utf-8"))


@pytest.mark.parametrize("package", sorted(NAMES))
def test_every_public_name_of_today_is_still_exported(package):
    module = importlib.import_module(package)
    missing = sorted(set(NAMES[package]) - set(module.__all__))
    assert not missing, f"{package} no longer exports {missing}"
    assert len(module.__all__) == len(set(module.__all__))
    for name in NAMES[package]:
        assert hasattr(module, name), (package, name)
        assert name in dir(module), (package, name)


def test_a_star_import_gives_every_name():
    namespace: dict[str, object] = {}
    exec("from handbook_lib.models import *", namespace)
    assert set(NAMES["handbook_lib.models"]) <= set(namespace)
