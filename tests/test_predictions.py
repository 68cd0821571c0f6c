"""Every prediction of the pure models, pinned: 3,725 configurations, 4,005 predictions.

The file ``tests/data/predictions.json.gz`` was written by the flat package (commit 53daa75)
before its models were rebuilt over one layout and one function per memory phase; the layered
package must give every number, phase name, note and planner reason of it, byte for byte
(``tests/prediction_grid.py`` says what the grid covers and how to regenerate the file after a
deliberate change).
"""

from __future__ import annotations

import gzip
import hashlib
import json

from tests.prediction_grid import GOLDEN, canonical, predictions

FLAT_PACKAGE_SHA256 = "b3a882bc89682bb40e5881c813d19f1f897da2aa7f6264db24ecbf75424dad11"
"""SHA-256 of the canonical text the flat package gave (the golden file's content)."""


def test_the_golden_file_is_the_flat_packages():
    text = gzip.decompress(GOLDEN.read_bytes()).decode()
    assert hashlib.sha256(text.encode()).hexdigest() == FLAT_PACKAGE_SHA256


def test_every_prediction_is_unchanged():
    golden = json.loads(gzip.decompress(GOLDEN.read_bytes()))
    count, out = predictions()
    now = json.loads(canonical(out))
    assert count >= 400 and len(now) == len(golden) == 4005
    differ = [key for key in golden if now.get(key) != golden[key]]
    assert not differ, f"{len(differ)} predictions changed, e.g. {differ[:5]}"
    assert set(now) == set(golden)
