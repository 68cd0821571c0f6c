"""handbook_lib.core.results: the result.json shape."""

import json

import pytest

from handbook_lib.core import SCHEMA, Check, RunResult, load_result, write_json_atomic


def _result_dict(**changes):
    data = {
        "schema": SCHEMA, "run": "demo", "config": {"steps": 1}, "world_size": 2,
        "backend": "gloo", "device": "cpu", "torch_version": "2.x",
        "ranks": [{"rank": 1, "x": 20}, {"rank": 0, "x": 10}],
        "checks": [{"quantity": "q", "rank": 0, "predicted": 4, "measured": 4, "unit": "bytes"},
                   {"quantity": "q", "rank": 1, "predicted": 4, "measured": 5, "unit": "bytes",
                    "tolerance": 0.0},
                   {"quantity": "p", "rank": 1, "predicted": 100, "measured": 109, "unit": "bytes",
                    "tolerance": 0.1}],
        "num_params": 3,
    }
    data.update(changes)
    return data


def test_round_trip_through_a_file(tmp_path):
    write_json_atomic(tmp_path / "result.json", _result_dict())
    result = load_result(tmp_path)  # a directory means DIR/result.json
    assert result.path == tmp_path / "result.json"
    assert result.metric("x") == [10, 20]  # rank order, whatever the file's order
    assert result.extra == {"num_params": 3}
    data = _result_dict()
    data["checks"][0]["tolerance"] = 0.0  # the default is written out
    assert result.to_dict() == data
    assert [c.exact for c in result.checks] == [True, False, False]
    assert [c.ok for c in result.checks] == [True, False, True]  # 9 % off, within its 10 %
    assert result.failed_checks() == [result.checks[1]]
    assert list(tmp_path.iterdir()) == [tmp_path / "result.json"]  # no temp file left


@pytest.mark.parametrize("changes, match", [
    ({"schema": "other/9"}, "schema"),
    ({"ranks": None}, None),
])
def test_bad_results_raise(changes, match):
    data = _result_dict(**changes)
    if match is None:
        del data["ranks"]
        match = "missing key"
    with pytest.raises(ValueError, match=match):
        RunResult.from_dict(data)


def test_check_errors():
    assert Check("q", 0, 100, 110, "bytes").relative_error == pytest.approx(0.1)
    assert Check("q", 0, 0, 0, "bytes").relative_error == 0.0
    assert Check("q", None, 0, 1, "bytes").relative_error == float("inf")
    assert Check("q", 0, 3, 1, "s").error == -2


def test_write_json_atomic_replaces(tmp_path):
    target = tmp_path / "a.json"
    write_json_atomic(target, {"v": 1})
    write_json_atomic(target, {"v": 2})
    assert json.loads(target.read_text()) == {"v": 2}


def test_max_relative_difference():
    from handbook_lib.core import max_relative_difference

    assert max_relative_difference([1.0, 2.2], [1.0, 2.0]) == pytest.approx(0.1)
    assert max_relative_difference([], []) == 0.0
    with pytest.raises(ValueError, match="cannot compare 1 values with 2"):
        max_relative_difference([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="is 0"):
        max_relative_difference([1.0], [0.0])
