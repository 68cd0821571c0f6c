"""handbook_lib.launch.processes.Agents: several torchrun agents read as one process."""

from __future__ import annotations

from handbook_lib.launch.processes import Agents


class _Ended:
    """A finished agent, as ``subprocess.Popen`` reports it."""

    def __init__(self, code: int | None) -> None:
        self.code, self.pid = code, 1000

    def poll(self) -> int | None:
        return self.code


def test_the_agent_a_signal_killed_is_the_one_that_failed_first():
    """Both agents ended between two polls: node 1's was SIGKILLed (a lost node), node 0's then
    failed with status 1 after its ranks lost their peer. The lost node is the cause, in either
    order of the agents."""
    for procs in ([_Ended(1), _Ended(-9)], [_Ended(-9), _Ended(1)]):
        agents = Agents(procs, stdout=None)
        assert agents.poll() == -9 and agents.failed_code == -9
    one = Agents([_Ended(1), _Ended(0)], stdout=None)
    assert one.poll() == 1  # no signal: the first failure as polled
    running = Agents([_Ended(None), _Ended(2)], stdout=None)
    assert running.poll() is None and running.failed_code == 2
    assert Agents([_Ended(0), _Ended(0)], stdout=None).poll() == 0


_LAUNCHER = """
import os, signal, subprocess, sys
from handbook_lib.launch.processes import parent_death_signal
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                         stdout=subprocess.DEVNULL, preexec_fn=parent_death_signal())
print(child.pid, flush=True)
sys.stdin.read(1)  # until the test has the child's start time
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_child_started_with_the_parent_death_signal_ends_with_its_killed_launcher():
    """SIGKILL to the launcher runs none of its clean-up: the kernel sends the child SIGTERM. Its
    own session (as torchrun's) keeps a terminal's signals from it, not this one."""
    import subprocess
    import sys

    import psutil

    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
    child = psutil.Process(int(launcher.stdout.readline()))
    assert child.ppid() == launcher.pid
    launcher.stdin.write("x")
    launcher.stdin.close()
    assert launcher.wait(30) == -9
    try:
        child.wait(5)
    except psutil.TimeoutExpired:
        child.kill()
        raise AssertionError("the child outlived its launcher by 5 s") from None
