"""Every prediction of the pure models, pinned: 4,313 configurations, 4,593 predictions.

The file ``tests/data/predictions.json.gz`` was first written by the flat package (commit
53daa75, SHA-256 b3a882bc...dad11) before its models were rebuilt over one layout and one
function per memory phase; the layered package gave every number, phase name, note and planner
reason of it, byte for byte. It was written again once, on purpose, when the planner began to
price a collective over a machine's every network rail with the links' published efficiencies
(:mod:`handbook_lib.models.topology`): that changed 5 plans' ``comm_s`` (34 options),
``step_s`` (26), ``routes`` (new, 40) and 6 reasons, and no memory figure. And once more when
``estimate_init_bytes`` with ``init="full"`` under a sharding strategy learned that the peak may
come when the root unit is sharded, last, not with the first unit: 28 ``init|...|full``
entries changed, each checked against a real gloo run (e.g. 2 ranks, vocab 1001, d 64: 892,416 B
measured and now predicted, where 809,964 B was), no other figure.
``tests/prediction_grid.py`` says what the grid covers and how to regenerate the file after a
deliberate change.
"""

from __future__ import annotations

import gzip
import hashlib
import json

from tests.prediction_grid import GOLDEN, canonical, predictions

GOLDEN_SHA256 = "a7015c9ff0849ea34220e98fa803aa3d8bef5b6a9d70b19f630ae3e2b8ea76f3"
"""SHA-256 of the golden file's canonical text (a change to it must be deliberate)."""


def test_the_golden_file_is_the_pinned_one():
    text = gzip.decompress(GOLDEN.read_bytes()).decode()
    assert hashlib.sha256(text.encode()).hexdigest() == GOLDEN_SHA256


def test_every_prediction_is_unchanged():
    golden = json.loads(gzip.decompress(GOLDEN.read_bytes()))
    count, out = predictions()
    now = json.loads(canonical(out))
    assert count >= 400 and len(now) == len(golden) == 4593
    differ = [key for key in golden if now.get(key) != golden[key]]
    assert not differ, f"{len(differ)} predictions changed, e.g. {differ[:5]}"
    assert set(now) == set(golden)
