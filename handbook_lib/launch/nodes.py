"""The nodes of a job: how many, which one this machine is, and how their torchrun agents meet.

Chapter 8 teaches it: every node's agent on this machine (a c10d rendezvous on 127.0.0.1, each
agent with its own GPUs), or one node of a real multi-node job (a rendezvous every node reaches).
The node numbers are the rendezvous's, not the launch order: see :meth:`Nodes.commands`.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from handbook_lib.core.checks import check_int
from handbook_lib.core.protocol import LOGS_DIR, RankStatus, rank_status_path

__all__ = []  # the launcher's own part: Nodes, check_nodes, free_port



AGENT = ("import os, sys, traceback\n"
         "from torch.distributed.run import main\n"
         "code = 0\n"
         "try:\n"
         "    main(sys.argv[1:])\n"
         "except SystemExit as done:\n"
         "    code = done.code if isinstance(done.code, int) else int(done.code is not None)\n"
         "except BaseException:\n"
         "    traceback.print_exc()\n"
         "    code = 1\n"
         "sys.stdout.flush()\n"
         "sys.stderr.flush()\n"
         "os._exit(code)  # torch.distributed.run, then no interpreter teardown\n")
"""The torchrun agent's program (``python -c AGENT ARGS``): ``torch.distributed.run``'s ``main``
with the same arguments and exit status as ``python -m torch.distributed.run ARGS`` (an error's
traceback printed, status 1), ending with ``os._exit`` once its workers are done and its
output flushed: the interpreter's teardown of torch's modules cost 0.3-0.6 s per job, paid by
every run a chapter or a test starts."""

@dataclass(frozen=True)
class Nodes:
    """The nodes of a job and how their torchrun agents meet (see :func:`~handbook_lib.launch.torchrun`)."""

    count: int = 1
    node_rank: int | None = None
    """This machine's node in a real multi-node job; ``None``: every node runs here."""
    endpoint: str = "127.0.0.1:0"

    def commands(self, nproc: int, out_dir: Path, tail: list[str]) -> list[list[str]]:
        """One torchrun command per agent this machine starts.

        Each agent's ``--node-rank`` names its log folder (``logs/nodeK``) only: with
        the c10d rendezvous torchrun ignores it (with a warning). When every agent has
        joined, the rendezvous numbers them by sorting their descriptors (host name,
        process id, local id; ``_mark_rendezvous_complete`` in ``torch.distributed.
        elastic.rendezvous.dynamic_rendezvous``), not in the order they joined: on a
        cluster node 0 is the smallest host name, here the agent with the smallest
        process id. Each rank records the node torchrun gave it (``GROUP_RANK``), which
        is what :meth:`where` reports."""
        def agent(node: int | None, conf: list[str], logs: Path) -> list[str]:
            rank = [] if node is None else ["--node-rank", str(node)]
            return [sys.executable, "-c", AGENT, "--nnodes", str(self.count), *rank,
                    "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", self.endpoint,
                    "--rdzv-id", self.rdzv_id(out_dir), *conf,
                    "--max-restarts", "0", "--tee", "3", "--log-dir", str(logs), *tail]

        logs = out_dir / LOGS_DIR
        if self.count == 1:
            return [agent(None, [], logs)]
        if self.node_rank is not None:
            return [agent(self.node_rank, [], logs / f"node{self.node_rank}")]
        # every node here: node 0's agent hosts the rendezvous store, the others join it
        return [agent(k, ["--rdzv-conf", f"is_host={'true' if k == 0 else 'false'}"],
                      logs / f"node{k}") for k in range(self.count)]

    @property
    def local_agents(self) -> int:
        """Agents this machine starts: every node's, or only its own."""
        return self.count if self.node_rank is None else 1

    def agent_env(self, agent: int, nproc: int) -> dict[str, str]:
        """Extra environment of this machine's ``agent``-th agent. With every node here and
        GPUs visible, each agent gets its own ``nproc`` of them (``CUDA_VISIBLE_DEVICES``), as
        separate machines would: rank ``cuda:LOCAL_RANK`` of two agents must not share a GPU."""
        if self.node_rank is not None or self.count == 1:
            return {}
        import torch

        if not torch.cuda.is_available():
            return {}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        return {"CUDA_VISIBLE_DEVICES": ",".join(ids[agent * nproc:(agent + 1) * nproc])}

    def rdzv_id(self, out_dir: Path) -> str:
        """The job's name at the rendezvous: the same on every node of one job."""
        if self.node_rank is not None:
            return "handbook-" + re.sub(r"[^A-Za-z0-9]+", "-", self.endpoint)
        return f"handbook-{os.getpid()}-{out_dir.name}"

    def where(self, rank: int, nproc: int, out_dir: Path) -> str:
        """`` (node N, local rank L)`` for a job over several nodes, else ``""``. Read from the
        rank's own state file; a rank that left none (its node died) is placed the way torchrun
        numbers them, ``node = rank // nproc``."""
        if self.count == 1:
            return ""
        try:
            info = RankStatus.from_dict(json.loads(rank_status_path(out_dir, rank).read_text()))
            node, local = int(info.node_rank), int(info.local_rank)
        except (OSError, ValueError, KeyError, TypeError):
            node, local = divmod(rank, nproc)
        return f" (node {node}, local rank {local})"

def check_nodes(nnodes: int, node_rank: int | None, rdzv_endpoint: str | None) -> Nodes:
    """The job's nodes, or ValueError naming the argument and what it accepts."""
    check_int("nnodes", nnodes, 1)
    if node_rank is None:
        if rdzv_endpoint is not None:
            raise ValueError("rdzv_endpoint needs node_rank: it is for one node of a real "
                             "multi-node job (without node_rank every node runs here)")
        if nnodes == 1:
            return Nodes()
        return Nodes(nnodes, None, f"127.0.0.1:{free_port()}")
    check_int("node_rank", node_rank, 0, below=nnodes, context=f"for nnodes={nnodes}")
    if not isinstance(rdzv_endpoint, str) or not re.fullmatch(r"[A-Za-z0-9._\-\[\]:]+:\d{1,5}", rdzv_endpoint) \
            or not 1 <= int(rdzv_endpoint.rpartition(":")[2]) <= 65535:
        raise ValueError(f"rdzv_endpoint must be 'host:port' (port 1-65535) every node reaches, "
                         f"got {rdzv_endpoint!r}")
    return Nodes(nnodes, node_rank, rdzv_endpoint)

def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a rendezvous every local agent must know in advance."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
