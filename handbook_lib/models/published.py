"""Other people's GPU measurements, and the models' predictions beside them. Pure: no ``torch``.

What this book cannot measure (many GPUs, many machines) is checked against figures that others
published, each with its configuration and its source. One model for every row, nothing tuned
per row; a row the model's own parameters were taken from is marked ``calibration`` and is not
evidence for the model.

Bus bandwidth is nccl-tests' ``busbw`` (NVIDIA/nccl-tests, ``doc/PERFORMANCE.md``): the bytes
one rank sends in the ring algorithm over the time, ``2(N-1)/N · B / t`` for an all-reduce and
``(N-1)/N · B / t`` for an all-gather, comparable to a link's bandwidth whatever N is.
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.models.collectives import estimate_collective
from handbook_lib.models.hardware import node_preset
from handbook_lib.models.topology import route_collective

__all__ = ["PublishedBandwidth", "PUBLISHED_BUS_BANDWIDTH", "BandwidthRow", "bus_bandwidth_rows"]

_VOLTAGE_PARK = ("AI @ Georgia Tech and Voltage Park, github.com/aigatech/vpbenchmarking (2025): "
                 "4 nodes x 8 H100 SXM, 3.2 Tb/s InfiniBand (8 x 400 Gb/s) per node, NCCL 2.24.3, "
                 "nccl-tests peak bus bandwidth across nodes")


@dataclass(frozen=True)
class PublishedBandwidth:
    """One published collective benchmark."""

    label: str
    kind: str
    """``all_reduce`` or ``all_gather``."""
    strategy: str
    """The strategy whose group the benchmark's collective is (one group of every GPU: DDP's
    all-reduce, FULL_SHARD's all-gather), for :func:`~handbook_lib.models.topology.route_collective`."""
    gpu: str
    """Accelerator preset of the machines."""
    gpus: int
    """GPUs in the benchmark, filling whole machines."""
    inter_link: str
    """Network port preset (one per GPU on these machines)."""
    buffer_bytes: int
    """Message size the model is priced at, bytes (large: where the figure peaks)."""
    busbw_bytes_per_s: float
    """The published bus bandwidth, bytes/s."""
    source: str
    calibration: bool = False
    """The model's own parameters were taken from this figure."""


PUBLISHED_BUS_BANDWIDTH: tuple[PublishedBandwidth, ...] = (
    PublishedBandwidth("1 x 8 H100, ring", "all_gather", "FULL_SHARD", "h100-80gb", 8, "ib-ndr400", 8 * 2**30, 370e9,
                       "NCCL's maintainer, NVIDIA/nccl-tests#212 (2024): 'an effective NVLink bandwidth "
                       "of 370GB/s' for non-all-reduce collectives or NCCL_ALGO=RING on 8 H100",
                       calibration=True),
    PublishedBandwidth("4 x 8 H100, 8 x NDR", "all_reduce", "DDP", "h100-80gb", 32, "ib-ndr400", 8 * 2**30,
                       330.93e9, _VOLTAGE_PARK),
    PublishedBandwidth("4 x 8 H100, 8 x NDR", "all_gather", "FULL_SHARD", "h100-80gb", 32, "ib-ndr400", 8 * 2**30,
                       323.53e9, _VOLTAGE_PARK),
)
"""Published bus bandwidths, with their configurations and sources."""


@dataclass(frozen=True)
class BandwidthRow:
    """A published bus bandwidth beside the model's."""

    published: PublishedBandwidth
    model_bytes_per_s: float
    """The model's bus bandwidth at the row's buffer, bytes/s."""
    algorithm: str
    """The algorithm the model chose."""

    @property
    def error(self) -> float:
        """Model over published, minus one (+0.10: the model is 10 % faster)."""
        return self.model_bytes_per_s / self.published.busbw_bytes_per_s - 1


def bus_bandwidth_rows(rows: tuple[PublishedBandwidth, ...] = PUBLISHED_BUS_BANDWIDTH) -> list[BandwidthRow]:
    """Each published bus bandwidth with the model's: the collective priced on its route
    (:func:`~handbook_lib.models.topology.route_collective`) over machines of the row's
    preset, its ring bytes over the predicted time."""
    out = []
    for row in rows:
        node = node_preset(row.gpu, inter_link=row.inter_link)
        cost = estimate_collective(row.kind, row.buffer_bytes, row.gpus)
        route = route_collective(cost, node, row.gpus, row.strategy)
        out.append(BandwidthRow(row, cost.sent_bytes / route.seconds, route.algorithm))
    return out
