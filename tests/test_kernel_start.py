"""The suite's warm-up kernel (conftest.py): a process that runs notebooks starts one kernel
first, tried up to three times, what a dead one printed shown, before any notebook's."""

import pytest

from conftest import KERNEL_STARTS, _start_kernel, warm_kernel


def _flaky(deaths: int):
    calls = []

    def start(err):
        calls.append(err)
        err.write(f"zmq.error.ZMQError: Address already in use (try {len(calls)})")
        if len(calls) <= deaths:
            raise RuntimeError("Kernel died before replying to kernel_info")

    return start, calls


def test_a_kernel_that_dies_at_start_is_started_again(capsys):
    start, calls = _flaky(KERNEL_STARTS - 1)
    assert warm_kernel(start) == KERNEL_STARTS == len(calls) == 3
    err = capsys.readouterr().err
    assert "warm-up kernel start 1 of 3 failed" in err and "Address already in use (try 1)" in err
    assert "(try 3)" not in err  # the one that started says nothing


def test_a_kernel_that_always_dies_fails_the_run():
    start, calls = _flaky(KERNEL_STARTS)
    with pytest.raises(RuntimeError, match="Kernel died"):
        warm_kernel(start)
    assert len(calls) == KERNEL_STARTS


def test_the_warm_up_starts_a_real_kernel_and_leaves_none(tmp_path):
    import psutil

    pids = []
    with open(tmp_path / "err.txt", "w+") as err:
        assert warm_kernel(lambda e: pids.append(_start_kernel(err))) == 1
    assert pids[0] > 0
    assert not psutil.pid_exists(pids[0]) or psutil.Process(pids[0]).status() == psutil.STATUS_ZOMBIE
