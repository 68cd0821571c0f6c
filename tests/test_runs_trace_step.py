"""handbook_lib.runs.trace_step: what it cannot trace is refused before any process starts.

The run itself runs once in the suite, in the reference page "Measured on GPUs" (nbval replays
it): its checks count the traced all-gathers and reduce-scatters against the traffic model, and
the page's hidden cell asserts the order of FSDP2's ranges; the range reader is unit-tested in
test_trace.py.
"""

import pytest

from handbook_lib.runs.specs.trace_step import validate
from handbook_lib.core import RunConfig


@pytest.mark.parametrize(("change", "world", "words"), [
    ({"strategy": "HYBRID_SHARD"}, 4, "trace_step runs api='fsdp2' with strategy"),
    ({"api": "fsdp1"}, 2, "got api='fsdp1'"),
    ({}, 1, "needs >= 2 ranks"),
    ({"steps": 1}, 2, "needs steps >= 2"),
    ({"lr_schedule": "cosine"}, 2, "keeps the learning rate constant"),
])
def test_what_it_cannot_trace_is_refused_before_anything_starts(change, world, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        validate(RunConfig.from_mapping({"steps": 3, **change}), world)
