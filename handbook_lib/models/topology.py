"""How a collective travels on a cluster of machines, as NCCL runs it: which links, how many
network rails, which algorithm, and so how long it takes. Pure arithmetic: no ``torch``.

Chapter 3 prices a collective on one link; chapter 4's planner and chapter 8 price a job over
several machines with :func:`route_collective`. The ranks fill whole machines in order (rank
``r`` on machine ``r // G``, ``G`` GPUs per machine), as torchrun numbers them.

**A group inside one machine** runs a ring on the intra-node link (NVLink, PCIe):
``steps·alpha + sent / bw``, ``bw`` the link's achievable bandwidth.

**A group that spans machines** has ``c`` of its ranks on each machine it touches, and every
machine runs ``G / c`` such groups at the same time (one for FULL_SHARD or DDP over every GPU;
``G`` for HSDP's all-reduce between replicas, one rank per machine each). NCCL cuts a
collective into channels and spreads them over all the machine's ``K`` network ports (rails);
each ring leaves a machine once, through one port. So a group gets ``K·c/G`` ports' worth of
the network, and its per-GPU bus bandwidth is

    bw = min(K·c/G · nic, intra)        (``intra`` only where c > 1: the ring's in-machine hops)

with ``nic`` and ``intra`` the achievable bandwidths (line rate x efficiency). On a DGX H100
(8 GPUs, 8 x NDR 400 Gb/s) FULL_SHARD over every GPU gets min(8 x 47, 369) = 369 GB/s, as fast
as one machine's NVLink ring; HSDP's replica all-reduce, one rank per machine and 8 groups
sharing the 8 ports, gets one port: 47 GB/s.

**The algorithm.** All-gather and reduce-scatter run as rings: ``steps`` latencies of the
slower hop, the network's or NVLink's per ring step (every step waits for it;
:data:`~handbook_lib.models.hardware.NVLINK_RING_STEP_S` is fitted on NCCL's own rings and is
the larger on H100 machines). NVLink SHARP (NVLS) would send less for an all-reduce but is
slower for all-gather and reduce-scatter (each GPU sends its whole buffer, or receives it,
where a ring sends (N-1)/N of it each way: NCCL's maintainer in NVIDIA/nccl#1083), so FSDP's
two collectives run rings. An all-reduce may also run as NCCL's double binary tree:
a chain of the ``c`` ranks inside each machine and a binary tree of the ``M`` machines, up
(reduce) and down (broadcast): latency ``2·(ceil(log2 M)·alpha_step + (c-1)·alpha_intra)``,
each rank sending its buffer twice (``2B``) instead of the ring's ``2(N-1)/N·B``. The model
takes the faster of the two and names it: the tree for small buffers or many ranks, the ring
for large buffers on few. NVLS for the all-reduce (the Azure row of the published page) and PAT
are not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from handbook_lib.core.checks import check_int
from handbook_lib.core.strategies import get_strategy
from handbook_lib.models.collectives import CollectiveCost
from handbook_lib.models.hardware import Node

__all__ = ["ALGORITHMS", "Route", "route_collective", "network_bandwidth"]

ALGORITHMS = ("ring", "tree")
"""The algorithms :func:`route_collective` chooses between (the tree for all-reduce only)."""


@dataclass(frozen=True)
class Route:
    """How one collective of a job travels, and what it costs."""

    name: str
    """Name of the slowest link it crosses, the intra-node link's or the network port's: the
    same attribute as :attr:`Link.name`, so code that groups bytes by link takes either."""
    algorithm: str
    """One of :data:`ALGORITHMS`."""
    bandwidth_bytes_per_s: float
    """Bus bandwidth of one GPU, each way, bytes/s."""
    latency_s: float
    """The latency term of the whole collective, seconds."""
    sent_bytes: int
    """Bytes one rank sends with this algorithm (the ring's count, or 2B for the tree)."""
    description: str
    """One line a reader can check: the links, the rails and the algorithm."""
    machines: int = 1
    """Machines the group spans: more than one, and the collective occupies the network."""

    @property
    def seconds(self) -> float:
        """Time of the collective: latency plus bytes over bandwidth, seconds."""
        return self.latency_s + self.sent_bytes / self.bandwidth_bytes_per_s


def _placement(cost: CollectiveCost, node: Node, gpus: int, replica: bool) -> tuple[int, int]:
    """(ranks of the group on each machine it touches, machines it spans)."""
    per_node = min(node.gpus_per_node, gpus)
    g = cost.group_size
    if not replica:  # consecutive ranks: a shard group, or every rank
        return min(g, per_node), -(-g // per_node)
    shard = gpus // g  # HSDP: replicas are `shard` ranks apart
    c = max(1, per_node // shard)
    return c, -(-g // c)


def network_bandwidth(node: Node, per_node_in_group: int) -> float:
    """Per-GPU bus bandwidth, bytes/s, of a group with ``per_node_in_group`` ranks on each
    machine it spans: ``min(K·c/G · nic, intra)`` (see the module docstring)."""
    check_int("per_node_in_group", per_node_in_group, 1)
    c, g = per_node_in_group, node.gpus_per_node
    net = node.nics_per_node * c / g * node.inter_link.achievable_bytes_per_s
    return min(net, node.intra_link.achievable_bytes_per_s) if c > 1 else net


def route_collective(cost: CollectiveCost, node: Node, gpus: int, strategy: str) -> Route:
    """The route one collective of a ``gpus``-GPU job on machines like ``node`` takes.

    Args:
        cost: The collective (its kind, group size, buffer and ring counts), e.g. a record of
            :func:`~handbook_lib.models.traffic.estimate_step_traffic`.
        node: The machines.
        gpus: GPUs in the job, filling whole machines in order.
        strategy: The job's strategy: under a hybrid one, an all-reduce is the one between
            replicas (its group strided across the machines).
    """
    check_int("gpus", gpus, 1)
    replica = get_strategy(strategy).hybrid and cost.kind == "all_reduce"
    c, machines = _placement(cost, node, gpus, replica)
    intra, nic = node.intra_link, node.inter_link
    if machines <= 1 or cost.group_size <= 1:
        bw = intra.achievable_bytes_per_s
        return Route(intra.name, "ring", bw, cost.steps * intra.latency_s, cost.sent_bytes,
                     f"ring on {intra.name} at {bw / 1e9:.3g} GB/s")
    bw = network_bandwidth(node, c)
    groups = node.gpus_per_node // c
    ports = f"{node.nics_per_node} x {nic.name} per machine"
    if groups > 1:
        ports += f", shared by {groups} groups at once"
    bound = f"{intra.name} bound" if bw == intra.achievable_bytes_per_s and c > 1 else "network bound"
    rails = f"{ports}; {bound}"
    step = max(nic.latency_s, intra.latency_s)  # each step waits for its slowest hop
    ring = Route(nic.name, "ring", bw, cost.steps * step, cost.sent_bytes,
                 f"ring over {machines} machines at {bw / 1e9:.3g} GB/s per GPU ({rails})", machines)
    if cost.kind != "all_reduce":
        return ring
    depth = math.ceil(math.log2(machines))
    tree = Route(nic.name, "tree", bw, 2 * (depth * step + (c - 1) * intra.latency_s),
                 2 * cost.buffer_bytes,
                 f"tree over {machines} machines at {bw / 1e9:.3g} GB/s per GPU ({rails})", machines)
    return tree if tree.seconds < ring.seconds else ring


def network_share(cost: CollectiveCost, node: Node, gpus: int, strategy: str) -> float:
    """The fraction of one rank's bytes in ``cost`` that leave its machine through a network
    port, the rest staying on the intra-node link (NVLink).

    A group inside one machine sends nothing over the network (0). A group with ``c`` of its
    ranks on each machine it spans runs rings whose ``c`` consecutive hops inside a machine are
    followed by one hop out of it; NCCL's channels give each of the ``c`` ranks that exit hop in
    turn (each channel leaves through another port), so each rank sends ``1/c`` of its bytes
    over the network. HSDP's replica all-reduce (``c = 1``) sends all of them. The tree an
    all-reduce may take is counted the same way. Arguments as :func:`route_collective`."""
    check_int("gpus", gpus, 1)
    replica = get_strategy(strategy).hybrid and cost.kind == "all_reduce"
    c, machines = _placement(cost, node, gpus, replica)
    if machines <= 1 or cost.group_size <= 1:
        return 0.0
    return 1.0 / c
