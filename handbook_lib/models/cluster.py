"""Layouts of one training job over several machines, side by side: the bytes each GPU sends
on NVLink and through the network ports, the step's communication and total time, and whether
its peak fits. Pure arithmetic: no ``torch``.

Chapter 8 compares FULL_SHARD over every GPU with HSDP whose shard groups are one machine or
several. Every figure comes from the models of chapters 2 and 3 at scale:
:func:`~handbook_lib.models.traffic.estimate_step_traffic` (the collectives),
:func:`~handbook_lib.models.topology.route_collective` (their routes and bandwidths, NCCL over
every rail), :func:`~handbook_lib.models.topology.network_share` (which of a rank's bytes leave
its machine), :func:`~handbook_lib.models.timing.estimate_compute_time` (6PT and attention's
FLOPs, the forward again with activation checkpointing, at the utilization given: by default
the GPU's at the model's width, :func:`~handbook_lib.models.timing.expected_utilization`) and
:func:`~handbook_lib.models.memory.estimate_memory` (the peak as the allocator reserves it,
against the card's usable memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from handbook_lib.core.checks import check_int
from handbook_lib.core.config import get_precision
from handbook_lib.core.parallel_layout import ParallelLayout
from handbook_lib.models.hardware import Node, usable_memory_bytes
from handbook_lib.models.layout import wrap_units
from handbook_lib.models.memory import estimate_memory
from handbook_lib.models.presets import DecoderShape
from handbook_lib.models.timing import (
    compute_forward_share,
    estimate_compute_time,
    estimate_step_time,
    expected_utilization,
)
from handbook_lib.models.topology import network_share, route_collective
from handbook_lib.models.traffic import estimate_step_traffic

__all__ = ["ClusterLayout", "compare_cluster_layouts", "hsdp_groups"]


@dataclass(frozen=True)
class ClusterLayout:
    """One layout of the job, as :func:`compare_cluster_layouts` prices it."""

    label: str
    """``FULL_SHARD`` or ``HSDP/<shard group size>``."""
    strategy: str
    """``FULL_SHARD`` or ``HYBRID_SHARD``."""
    shard_group_size: int | None
    """Ranks sharding one copy of the model (``None``: every rank, FULL_SHARD)."""
    nvlink_bytes: int
    """Bytes one GPU sends per step on the intra-node link."""
    network_bytes: int
    """Bytes one GPU sends per step through a network port (the hops that leave its machine)."""
    comm_s: float
    """Seconds of the step's collectives, on their routes."""
    compute_s: float
    """Seconds of forward and backward at the utilization given."""
    step_s: float
    """Seconds of the step, communication overlapped with compute as FSDP prefetches."""
    peak_reserved: int
    """The peak as the caching allocator reserves it, bytes per GPU."""
    usable_bytes: int
    """What a process can allocate on the card, bytes."""
    routes: tuple[str, ...] = ()
    """The distinct routes its collectives take, one line each (:attr:`Route.description`)."""

    @property
    def fits(self) -> bool:
        """Whether the reserved peak fits the card's usable memory."""
        return self.peak_reserved <= self.usable_bytes


def compare_cluster_layouts(
    shape: DecoderShape,
    node: Node,
    gpus: int,
    shard_group_sizes: Sequence[int | None] = (None,),
    *,
    seq_len: int = 4096,
    micro_batch: int = 1,
    precision: str = "bf16-mixed",
    activation_checkpointing: bool | str = True,
    utilization: float | None = None,
) -> list[ClusterLayout]:
    """Each layout of ``shape`` on ``gpus`` GPUs of machines like ``node``, one per entry of
    ``shard_group_sizes``: ``None`` is FULL_SHARD over every GPU, an integer HSDP
    (``HYBRID_SHARD``) with shard groups of that many consecutive ranks.

    ``micro_batch`` sequences of ``seq_len`` tokens per GPU; ``precision`` sets the gathered
    parameters' and the reduction's dtypes (``bf16-mixed``: bf16 and fp32); the compute time is
    the hardware FLOPs (6PT and attention's; the forward again with full activation
    checkpointing) over the accelerator's bf16 peak times ``utilization`` (``None``:
    :func:`~handbook_lib.models.timing.expected_utilization` at the model's width).

    Raises:
        ValueError: for a shard group size that does not divide ``gpus``, or bad counts.
    """
    check_int("gpus", gpus, 1)
    check_int("seq_len", seq_len, 1)
    check_int("micro_batch", micro_batch, 1)
    compute, reduce = get_precision(precision)
    units = wrap_units(shape)
    full = activation_checkpointing in (True, "full")
    u = expected_utilization(node.accelerator, shape.d_model) if utilization is None else utilization
    compute_s = estimate_compute_time(shape.num_params, micro_batch * seq_len,
                                      node.accelerator.peak_flops_bf16, u,
                                      activation_checkpointing=full, seq_len=seq_len,
                                      num_layers=shape.num_layers, attention_width=shape.attention_width)
    forward_share = compute_forward_share(shape.num_params, micro_batch * seq_len, activation_checkpointing=full,
                                          seq_len=seq_len, num_layers=shape.num_layers,
                                          attention_width=shape.attention_width)
    usable = usable_memory_bytes(node.accelerator)
    rows = []
    for group in shard_group_sizes:
        if group is not None:
            ParallelLayout.for_world(gpus, shard_group=group, names=_NAMES | {"world": "gpus={}"})
        strategy = "FULL_SHARD" if group is None else "HYBRID_SHARD"
        traffic = estimate_step_traffic(units, gpus, strategy, param_dtype=compute,
                                        reduce_dtype=reduce, shard_group_size=group)

        def route(record, strategy=strategy):
            return route_collective(record, node, gpus, strategy)

        network = sum(round(route(r).sent_bytes * network_share(r, node, gpus, strategy))
                      for r in traffic.records)
        total = sum(route(r).sent_bytes for r in traffic.records)
        step = estimate_step_time(traffic, route, compute_s, overlap=True, forward_share=forward_share)
        peak = estimate_memory(shape, gpus, strategy, precision, micro_batch=micro_batch,
                               seq_len=seq_len, shard_group_size=group,
                               activation_checkpointing=activation_checkpointing).peak_reserved
        routes = tuple(sorted({route(r).description for r in traffic.records}))
        rows.append(ClusterLayout("FULL_SHARD" if group is None else f"HSDP/{group}", strategy,
                                  group, total - network, network, step.comm_s, compute_s,
                                  step.total_s, peak, usable, routes))
    return rows


_NAMES = {"dp_shard": "shard_group_size {}"}
"""How this module's refusals name the shard group."""


def hsdp_groups(world_size: int, shard_group_size: int) -> tuple[tuple[tuple[int, ...], ...],
                                                                 tuple[tuple[int, ...], ...]]:
    """HSDP's two kinds of process group over ``world_size`` ranks: ``(shard groups, replica
    groups)``, each a tuple of member-rank tuples, as FSDP2's 2-D mesh lays them out
    (``init_device_mesh(..., (world_size // shard_group_size, shard_group_size))``, dimensions
    ``("replicate", "shard")``, ranks in row-major order). A shard group is a row, consecutive
    ranks (with torchrun's numbering, one node's ranks when it is the node's size); a replica
    group is a column, the ranks holding the same shard, one per shard group.

    Raises:
        ValueError: unless ``shard_group_size`` is >= 1 and divides ``world_size``.
    """
    layout = ParallelLayout.for_world(world_size, shard_group=shard_group_size, names=_NAMES)
    rows, shard_group_size = layout.dp_replicate, layout.dp_shard
    shard = tuple(tuple(range(r * shard_group_size, (r + 1) * shard_group_size)) for r in range(rows))
    replica = tuple(tuple(range(c, world_size, shard_group_size)) for c in range(shard_group_size))
    return shard, replica
