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
