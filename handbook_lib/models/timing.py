"""How long one training step's collectives take on a cluster, and its compute: the step time
model. Pure arithmetic: no ``torch.distributed``.

Chapter 3 teaches it; chapter 4's planner and chapter 8's many nodes use it. Each collective of
:func:`handbook_lib.models.traffic.estimate_step_traffic` is priced with the alpha-beta model
(:func:`handbook_lib.models.collectives.estimate_collective_time`) on the link it crosses, or on
the route it takes over several machines (:func:`handbook_lib.models.topology.route_collective`);
compute follows the 6PT rule; overlap hides what compute can.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from handbook_lib.core.checks import check_int
from handbook_lib.models.collectives import estimate_collective_time
from handbook_lib.models.hardware import Link
from handbook_lib.models.topology import Route
from handbook_lib.models.traffic import CollectiveRecord, StepTraffic

__all__ = ["StepTime", "bytes_by_link", "estimate_step_time", "estimate_compute_time",
           "DEFAULT_UTILIZATION", "UTILIZATION_SOURCE"]

DEFAULT_UTILIZATION = 0.41
"""Model FLOPs utilization assumed where none is given: see :data:`UTILIZATION_SOURCE`."""

UTILIZATION_SOURCE = (
    "Llama 3 405B pre-training on 16,384 H100 80GB (TP 8, PP 16, FSDP 128, sequences of 8,192): "
    "400 TFLOP/s per GPU, 'BF16 MFU' 41 %, Grattafiori et al. 2024, The Llama 3 Herd of Models, "
    "Table 4 (43 % on 8,192 GPUs, 38 % with 131,072-token sequences). FSDP alone on fewer GPUs "
    "measures 32 to 37 % on H100 and 47 to 57 % on A100 (PyTorch/IBM, 'Maximizing training "
    "throughput using PyTorch FSDP', 2024, Llama 2 7B to 70B)")
"""Where :data:`DEFAULT_UTILIZATION` comes from."""

LinkOrRoute = Link | Route
"""What prices a collective: one link (chapter 3), or its route on a cluster (chapter 4)."""


@dataclass(frozen=True)
class StepTime:
    """Predicted time of one optimizer step, seconds."""

    comm_s: float
    """All collectives, back to back."""
    compute_s: float
    """Forward and backward compute, as given."""
    exposed_comm_s: float
    """Communication that no compute hides."""
    total_s: float
    """The step."""
    bound: str
    """``"communication"`` if ``comm_s > compute_s``, else ``"compute"``."""

def bytes_by_link(traffic: StepTraffic, link_of: Callable[[CollectiveRecord], LinkOrRoute]) -> dict[str, int]:
    """Bytes one rank sends per step on each link (by the link's name; a route's slowest link),
    counted as the ring counts them, in execution order of first use: e.g.
    ``{"NVLink 4 (H100 SXM)": ..., "InfiniBand NDR 400 Gb/s": ...}``."""
    sent: dict[str, int] = {}
    for record in traffic.records:
        name = link_of(record).name
        sent[name] = sent.get(name, 0) + record.sent_bytes
    return sent

def estimate_step_time(
    traffic: StepTraffic,
    link: Link | Callable[[CollectiveRecord], LinkOrRoute],
    compute_s: float,
    overlap: bool,
    *,
    extra_comm_s: float = 0.0,
) -> StepTime:
    """Time of one step: its collectives on ``link`` plus ``compute_s`` seconds of compute.

    ``link`` is one link for every collective, or a function choosing the link of each (e.g.
    NVLink inside a node, InfiniBand for HSDP's all-reduce across nodes) or its
    :class:`~handbook_lib.models.topology.Route` on a cluster.

    Without overlap, ``total = comm + compute``. With overlap, FSDP prefetches each unit's
    all-gather while the previous unit computes and reduce-scatters while the next one does;
    only the first forward all-gather of each micro-step has nothing to hide behind. So
    ``total = exposed + max(compute, comm - exposed)``, exposed being those first all-gathers.

    ``extra_comm_s`` is other transfer time on the collectives' streams, hidden as they are
    (CPU offload's copies to and from the host, :mod:`handbook_lib.models.offload`).
    """
    if not compute_s >= 0:
        raise ValueError(f"compute_s must be >= 0, got {compute_s!r}")
    if not extra_comm_s >= 0:
        raise ValueError(f"extra_comm_s must be >= 0, got {extra_comm_s!r}")
    choose = link if callable(link) else (lambda record: link)
    comm = exposed = 0.0
    started: set[int] = set()
    for r in traffic.records:
        chosen = choose(r)
        t = chosen.seconds if isinstance(chosen, Route) else estimate_collective_time(r, chosen)
        comm += t
        if r.kind == "all_gather" and r.phase == "forward" and r.micro_step not in started:
            started.add(r.micro_step)
            exposed += t
    comm += extra_comm_s
    if overlap:
        total = exposed + max(compute_s, comm - exposed)
    else:
        exposed, total = comm, comm + compute_s
    bound = "communication" if comm > compute_s else "compute"
    return StepTime(comm, compute_s, exposed, total, bound)

def estimate_compute_time(num_params: int, tokens: int, peak_flops: float,
                          utilization: float = DEFAULT_UTILIZATION, *,
                          activation_checkpointing: bool = False) -> float:
    """Seconds of one rank's forward + backward: the 6PT rule, ``6·P·T / (peak · utilization)``;
    with ``activation_checkpointing`` (full recomputation) the forward runs twice, 8PT: a third
    more.

    Forward costs 2 FLOPs (a multiply and an add) per parameter per token, backward twice that
    (gradients of activations and of weights); every rank runs the whole model (gathered, under
    FSDP) on its own tokens. The rule ignores attention's sequence-length
    term and counts embedding lookups as matrix products.

    Args:
        num_params: P, parameters.
        tokens: T, tokens one rank processes in the step (its share of the global batch).
        peak_flops: Peak FLOP/s of one accelerator, e.g. ``Accelerator.peak_flops_bf16``.
        utilization: Fraction of the peak achieved (model FLOPs utilization), in (0, 1].
    """
    check_int("num_params", num_params, 0)
    check_int("tokens", tokens, 0)
    if not peak_flops > 0:
        raise ValueError(f"peak_flops must be > 0 FLOP/s, got {peak_flops!r}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    seconds = 6 * num_params * tokens / (peak_flops * utilization)
    return seconds * (4 / 3) if activation_checkpointing else seconds
