"""A run that fails on purpose, to show (and test) what the launcher reports.

Chapter 1 uses it to show a learner what a crashed, a silently killed and a hung rank look like.
All ranks first meet in a barrier; then rank ``fail_rank`` misbehaves while the others wait for
it in an all-reduce:

- ``raise``: raises a Python exception (the launcher names the rank and shows its traceback);
- ``exit``: ends its process abruptly with ``os._exit(3)``, leaving no traceback, as a rank
  killed by the out-of-memory killer would;
- ``hang``: sleeps instead of joining the all-reduce; the others' collective times out, and the
  launcher blames this rank (the one that never joined), not the ones that waited;
- ``sleep``: every rank sleeps, so only the launcher's timeout ends the run;
- ``bad_check``: nothing crashes, but every rank reports a count check whose measurement is
  off by one (a model that disagrees with reality): the launcher raises ``ChecksFailed`` and
  the CLI exits 1;
- ``kill_agent``: kills its own torchrun agent with SIGKILL, as a node that loses power would
  end: the agent and every rank it started (each rank dies with its agent) are gone at once;
  in a run over several nodes, the others must end with an error naming that node;
- ``none``: nothing goes wrong; the run writes a result.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from handbook_lib.core.results import Check
from handbook_lib.runs.entry import RankReport, main
from handbook_lib.runs.specs.fault import CONFIG as CONFIG, FaultConfig, validate
from handbook_lib.runtime.distributed import RankContext


def run(config: FaultConfig, ctx: RankContext) -> RankReport:
    validate(config, ctx.world_size)
    dist.barrier()
    print(f"rank {ctx.rank} passed the barrier", flush=True)
    if config.mode == "sleep":
        time.sleep(config.sleep_s)
    if ctx.rank == config.fail_rank:
        if config.mode == "raise":
            raise RuntimeError(f"deliberate failure on rank {ctx.rank} (fault run, mode=raise)")
        if config.mode == "exit":
            sys.stdout.flush()
            os._exit(3)
        if config.mode == "hang":
            time.sleep(config.sleep_s)
        if config.mode == "kill_agent":  # the agent, then this rank (it dies with its agent)
            sys.stdout.flush()
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(config.sleep_s)
    value = torch.ones(1, device=ctx.device)
    dist.all_reduce(value)
    checks = []
    if config.mode == "bad_check":  # the all-reduce of ones counts the ranks: claim one more
        checks.append(Check("ranks_counted", ctx.rank, ctx.world_size + 1, value.item(), "ranks"))
    return RankReport(metrics={"all_reduce_sum": value.item()}, checks=checks)


if __name__ == "__main__":
    main(sys.modules[__name__])
