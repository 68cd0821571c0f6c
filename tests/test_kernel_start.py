"""The suite's notebook kernels: a kernel that dies before it answers is started again, up to
three times (conftest.py), and what it printed is shown."""

import pytest

from conftest import KERNEL_STARTS, _retrying_kernel_start


def _flaky(deaths: int):
    calls = []

    def start(*args, **kwargs):
        calls.append(kwargs)
        kwargs["stderr"].write(f"zmq.error.ZMQError: Address already in use (try {len(calls)})")
        if len(calls) <= deaths:
            raise RuntimeError("Kernel died before replying to kernel_info")
        return "manager", "client"

    return start, calls


def test_a_kernel_that_dies_at_start_is_started_again(capsys):
    start, calls = _flaky(KERNEL_STARTS - 1)
    assert _retrying_kernel_start(start)(kernel_name="python3", cwd="x") == ("manager", "client")
    assert len(calls) == KERNEL_STARTS and all(c["kernel_name"] == "python3" for c in calls)
    err = capsys.readouterr().err
    assert "kernel start 1 of 3 failed" in err and "Address already in use (try 1)" in err
    assert "(try 3)" not in err  # the one that started says nothing


def test_a_kernel_that_always_dies_fails_the_notebook():
    start, calls = _flaky(KERNEL_STARTS)
    with pytest.raises(RuntimeError, match="Kernel died"):
        _retrying_kernel_start(start)()
    assert len(calls) == KERNEL_STARTS


def test_nbval_starts_its_kernels_through_the_retry():
    import nbval.kernel

    assert getattr(nbval.kernel.start_new_kernel, "_retries", False)
