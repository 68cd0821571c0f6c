"""NCCL's own buffers on a GPU: what the communicators of a parallel layout allocate, bytes. Pure.

NCCL moves data between two ranks through FIFOs it allocates per **connection** (one peer, one
direction), per **channel** (NCCL runs a collective as several independent rings or trees, one
thread block each) and per **protocol**: LL, LL128 and Simple. The sizes are NCCL's defaults
(``src/init.cc``, ``src/include/device.h``; unchanged from 2.28 to 2.30):

- LL: 8 lines per thread x 512 threads x 8 steps x 16 B = 524,288 B;
- LL128: 120 elements per thread x 640 threads x 8 steps x 8 B = 4,915,200 B;
- Simple: ``NCCL_BUFFSIZE``, 4 MiB by default (the one of the three the documentation names).

Where each lands (``src/transport/p2p.cc``, ``net.cc``): over NVLink or PCIe (the P2P transport)
the receiving rank holds the three FIFOs behind a 4,096-byte header and the sending rank a
4,096-byte header of its own (on an A100 the Simple FIFO moves to the sender, which reads it:
the same total); each is rounded up to the 2 MiB a shareable CUDA allocation takes
(``CUDA_IPC_MIN``). So one ring channel costs a rank 2 MiB + 10 MiB = **12 MiB** inside a node.
Over the network with GPUDirect RDMA both sides keep their FIFOs in GPU memory, 10 MiB each:
**20 MiB** for a channel whose ring leaves the node. NVLink SHARP (NVLS, the switch's multicast)
adds, once per communicator that uses it, ``nvls_channels x 2 x (128 KiB x 8 steps)`` per local
rank plus a 2 MiB credit block (``src/transport/nvls.cc``): 258 MiB on an 8-GPU H100 node.

How many channels NCCL builds comes out of its topology search; :data:`NCCL_CHANNELS` takes
the counts NCCL printed on the machines the book prices (its ``INIT`` log lines, cited), and a
ring across nodes gets two channels per network port the group's GPUs own, as the 16 of two
8-NIC H100 nodes. Since NCCL 2.22 a communicator connects an algorithm on its first use
(``NCCL_RUNTIME_CONNECT=1``), so what a layout pays depends on what its groups run. The model
prices (:func:`layout_communicators`):

- a group that all-gathers and reduce-scatters (FSDP's) or only sends small all-reduces (the
  loss, a barrier): its ring;
- a group that all-reduces gradients or activations (DDP's, HSDP's replicas, tensor
  parallelism): its ring, a tree beside it (another connection pair per channel, when the
  group has more than 2 ranks) and NVLS where the node has it and the group two or more
  ranks on it;
- point-to-point sends (the pipeline's stages, ring attention) and all-to-alls (Ulysses): a
  connection pair to each peer on each of NCCL's channels per peer.

Checked against NCCL's own reports in :data:`NCCL_MEASURED`. Not priced: ``ncclCommSplit``
with shared resources (PyTorch does not ask for it), CollNet, and RCCL on AMD GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.core.checks import check_int
from handbook_lib.core.parallel_layout import ParallelLayout
from handbook_lib.core.strategies import get_strategy
from handbook_lib.models.hardware import LINKS, Node

__all__ = [
    "NCCL_LL_BYTES", "NCCL_LL128_BYTES", "NCCL_SIMPLE_BYTES", "NCCL_CHANNELS", "NCCL_MEASURED", "NcclChannels",
    "Communicator", "CommunicatorBytes", "NcclBuffers", "channel_bytes", "nvls_bytes", "layout_communicators",
    "nccl_buffer_bytes", "strategy_nccl",
]

_MIB = 2**20
_STEPS = 8
NCCL_LL_BYTES = 8 * 512 * _STEPS * 16
"""LL's FIFO per connection, bytes: ``NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x NCCL_STEPS x
sizeof(ncclLLFifoLine)``."""
NCCL_LL128_BYTES = 120 * 640 * _STEPS * 8
"""LL128's FIFO per connection, bytes: ``NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS x
NCCL_STEPS x 8``."""
NCCL_SIMPLE_BYTES = 4 * _MIB
"""Simple's FIFO per connection, bytes: ``NCCL_BUFFSIZE``'s default."""
_HEADER = 4096  # ncclSendMem / ncclRecvMem, padded to MEM_ALIGN
_GRANULE = 2 * _MIB  # CUDA_IPC_MIN: a shareable allocation is rounded up to it
_NVLS_STEP = 128 * 1024  # NCCL_NVLS_CHUNKSIZE


def _granules(size: int) -> int:
    return -(-size // _GRANULE) * _GRANULE


@dataclass(frozen=True)
class NcclChannels:
    """How many channels NCCL builds over one kind of node, as its ``INIT`` log reports them."""

    ring: int
    """Ring (and tree) channels of a communicator inside one node ("coll channels")."""
    p2p_per_peer: int
    """Channels of a send/receive pair inside one node ("p2p channels per peer")."""
    nvls: int
    """NVLS channels (0: the node's switch has no multicast)."""
    source: str


_P5 = ("aws-samples/aws-do-eks, nccl-test README, p5.48xlarge (8 H100 SXM): one node '24 coll "
       "channels, 16 nvls channels, 32 p2p channels, 32 p2p channels per peer', two nodes '16 coll "
       "channels, 16 nvls channels, 16 p2p channels, 2 p2p channels per peer'")
NCCL_CHANNELS: dict[str, NcclChannels] = {
    "nvlink4": NcclChannels(24, 32, 16, _P5),
    "nvlink3": NcclChannels(24, 32, 0, "NVIDIA/nccl-tests#100, HGX A100 8 GPUs: 'Channel 23/24' (24 ring "
                                       "channels); per peer as the H100 (no A100 log states it); no NVLS"),
    "nvlink5": NcclChannels(24, 32, 24, "no B200 log published: ring and per-peer channels as the H100's; "
                                        "NVLS channels NCCL's NVLS_NCHANNELS_SM100_NVL (24, one node)"),
    "pcie4": NcclChannels(2, 2, 0, "NVIDIA/nccl-tests#307, 8 GPUs over PCIe: 'Ring 00', 'Ring 01' "
                                   "(2 channels), priced as P2P in GPU memory (NCCL's SHM path keeps "
                                   "them in host memory)"),
    "pcie5": NcclChannels(2, 2, 0, "as pcie4"),
}
"""NCCL's channel counts by the :data:`~handbook_lib.models.hardware.LINKS` key of a node's
intra-node link. A link without an entry (Infinity Fabric: RCCL; loopback: gloo) is not priced."""

NCCL_MEASURED: tuple[tuple[str, str, int, int, str], ...] = (
    ("8 H100, all-to-all of one 8-rank group", "all-to-all", 8, 4_340_000_000 - 1_060_000_000,
     "NVIDIA/nccl#1685: nvidia-smi 1.06 GB before the first all_to_all_single, 4.34 GB after "
     "('excluded memory usage from PyTorch'); 32 channels per pair, allocations of 10,485,760 "
     "and 2,097,152 B"),
)
"""Published GPU memory NCCL's buffers took: ``(what, op, ranks, bytes, source)``, each
compared with the model in chapter 2."""


def channel_bytes(crosses_nodes: bool, buffsize: int = NCCL_SIMPLE_BYTES) -> int:
    """One rank's bytes for one channel of a ring (its send side and its receive side), or one
    peer of a send/receive pair: 12 MiB over NVLink or PCIe, 20 MiB when the ring leaves the node.

    Args:
        crosses_nodes: The channel's connections go over the network (GPUDirect RDMA).
        buffsize: ``NCCL_BUFFSIZE``, bytes (default 4 MiB).
    """
    check_int("buffsize", buffsize, 1)
    if crosses_nodes:  # both FIFOs sets in GPU memory: send LL128 + Simple, receive all three
        return _granules(NCCL_LL128_BYTES + buffsize) + _granules(NCCL_LL_BYTES + NCCL_LL128_BYTES + buffsize)
    return _granules(_HEADER) + _granules(_HEADER + NCCL_LL_BYTES + NCCL_LL128_BYTES + buffsize)


def nvls_bytes(channels: int, local_ranks: int) -> int:
    """GPU bytes NVLS takes on each rank of a communicator: ``channels x 2 x 1 MiB`` per local
    rank (NCCL's ``nvlsPerRankSize x nHeads``), plus the credits' 2 MiB block; 0 below 2 local
    ranks or without NVLS channels."""
    if channels == 0 or local_ranks < 2:
        return 0
    return _granules(channels * 2 * _NVLS_STEP * _STEPS * local_ranks) + _granules(channels * 2 * 64 * local_ranks)


@dataclass(frozen=True)
class Communicator:
    """One process group of a layout, as NCCL sees it from one of its ranks."""

    name: str
    """The mesh axis it spans (``dp_shard``, ``dp_replicate``, ``tp``, ``sp``, ``pp``) or ``world``."""
    ranks: int
    local_ranks: int
    """Its ranks on one node (a rank's node)."""
    nodes: int
    ops: str
    """What it runs: ``ring`` (all-gather, reduce-scatter, small all-reduces), ``all-reduce``,
    ``p2p`` (sends to the neighbours) or ``all-to-all``."""


def _group(name: str, degree: int, stride: int, per_node: int, ops: str) -> Communicator:
    """The group of ``degree`` ranks ``stride`` apart (the mesh's inner axes are contiguous)."""
    local = 1 if stride >= per_node else max(1, min(degree, per_node // stride))
    return Communicator(name, degree, local, -(-degree // local), ops)


def layout_communicators(layout: ParallelLayout, gpus_per_node: int) -> tuple[Communicator, ...]:
    """The NCCL communicators a rank of ``layout`` joins, with what each runs (see the module's
    docstring). The mesh's inner axes are contiguous ranks (tp, then sp, the shard group,
    the replicas, the pipeline), so a group's ranks per node follow from its stride."""
    check_int("gpus_per_node", gpus_per_node, 1)
    tp, sp, shard = layout.tp, layout.sp, layout.dp_shard
    axes = [("tp", tp, 1, "all-reduce"),
            ("sp", sp, tp, "all-to-all" if layout.sp_method == "ulysses" else "p2p"),
            ("dp_shard", shard * sp, tp, "ring"),  # FSDP shards over the sequence ranks too
            ("dp_replicate", layout.dp_replicate, tp * sp * shard, "all-reduce"),
            ("pp", layout.pp, layout.world_size // layout.pp, "p2p")]
    groups = [_group(name, degree, stride, gpus_per_node, ops)
              for name, degree, stride, ops in axes if degree > 1 and not (name == "dp_shard" and shard == 1)]
    if layout.world_size > 1 and all(g.ranks < layout.world_size for g in groups):
        groups.append(_group("world", layout.world_size, 1, gpus_per_node, "ring"))  # the loss, barriers
    return tuple(groups)


@dataclass(frozen=True)
class CommunicatorBytes:
    """One communicator's buffers on one rank, bytes, by algorithm."""

    communicator: Communicator
    ring: int
    tree: int
    nvls: int
    p2p: int

    @property
    def total(self) -> int:
        return self.ring + self.tree + self.nvls + self.p2p


@dataclass(frozen=True)
class NcclBuffers:
    """NCCL's buffers on one rank of a layout: per communicator, and in all (bytes)."""

    groups: tuple[CommunicatorBytes, ...]
    priced: bool
    """False where the node's link has no :data:`NCCL_CHANNELS` entry (not NCCL, or not known)."""

    @property
    def total(self) -> int:
        return sum(g.total for g in self.groups)

    def text(self) -> str:
        """One line: each communicator's share, MB (10^6)."""
        if not self.priced:
            return "NCCL's buffers not priced (no channel counts for this node)"
        parts = [f"{g.communicator.name} ({g.communicator.ranks} ranks, {g.communicator.ops}) "
                 f"{g.total / 1e6:,.0f} MB" for g in self.groups if g.total]
        return "NCCL's buffers by group: " + (", ".join(parts) if parts else "none (one process)")


def _priced(group: Communicator, node: Node, channels: NcclChannels, buffsize: int) -> CommunicatorBytes:
    crosses = group.nodes > 1
    pair = channel_bytes(crosses, buffsize)
    ports = max(1, node.nics_per_node * group.local_ranks // node.gpus_per_node)
    ring_channels = min(channels.ring, 2 * ports) if crosses else channels.ring
    if group.ops in ("p2p", "all-to-all"):
        peers = min(2, group.ranks - 1) if group.ops == "p2p" else group.ranks - 1
        per_peer = 2 if crosses else channels.p2p_per_peer
        return CommunicatorBytes(group, 0, 0, 0, peers * per_peer * pair)
    ring = ring_channels * pair
    if group.ops == "ring":
        return CommunicatorBytes(group, ring, 0, 0, 0)
    tree = ring if group.ranks > 2 else 0  # two ranks: the tree's peers are the ring's
    return CommunicatorBytes(group, ring, tree, nvls_bytes(channels.nvls, group.local_ranks), 0)


def nccl_buffer_bytes(layout: ParallelLayout, node: Node, *, buffsize: int = NCCL_SIMPLE_BYTES) -> NcclBuffers:
    """NCCL's buffers on one rank of ``layout`` on machines like ``node``, bytes, per
    communicator (:func:`layout_communicators`).

    Args:
        layout: The job's parallel layout (a strategy's is ``Strategy.layout(world, group)``).
        node: The machines: their intra-node link picks NCCL's channel counts
            (:data:`NCCL_CHANNELS`), their GPUs and network ports per node place the groups.
        buffsize: ``NCCL_BUFFSIZE``, bytes (default 4 MiB).
    """
    key = next((k for k, link in LINKS.items() if link == node.intra_link), None)
    channels = NCCL_CHANNELS.get(key or "")
    if channels is None or node.accelerator.backend != "nccl":
        return NcclBuffers((), False)
    groups = layout_communicators(layout, node.gpus_per_node)
    return NcclBuffers(tuple(_priced(g, node, channels, buffsize) for g in groups), True)


def strategy_nccl(node: Node, strategy: str, gpus: int, shard_group_size: int | None = None) -> NcclBuffers:
    """NCCL's buffers of a data-parallel ``strategy`` on ``gpus`` GPUs of machines like ``node``,
    as the planner lays it out: a hybrid strategy shards within groups of ``shard_group_size``
    GPUs (default: a node's), replicated across them."""
    hybrid = get_strategy(strategy).hybrid and gpus > node.gpus_per_node
    group = (shard_group_size or node.gpus_per_node) if hybrid else None
    return nccl_buffer_bytes(get_strategy(strategy).layout(gpus, group), node)
