"""What CPU offload costs per step, as FSDP2's ``CPUOffloadPolicy`` runs it. Pure arithmetic.

Chapter 4's planner prices it; chapter 5 runs it on this machine. With the policy, each rank's
sharded fp32 parameters, their gradients and the optimizer state live in (pinned) host memory:

- **host → device, at every all-gather**: before a unit is gathered, its shard is copied to the
  GPU (4 bytes per parameter, fp32), then cast to the compute dtype and all-gathered. FULL_SHARD
  gathers a unit in forward and again in backward, so a shard crosses PCIe twice per step
  (once for a unit kept gathered, as SHARD_GRAD_OP keeps every unit and FSDP2 keeps the root).
- **device → host, at every reduce-scatter**: the reduced gradient shard (in the reduce dtype)
  is copied back.
- **the optimizer step runs on the CPU**, over the rank's shard: a few passes over parameters,
  gradients and two Adam moments, at the host's speed. Nothing hides it: it sits between the
  last reduce-scatter and the next forward.

The copies run on the same streams as the collectives that need them, so they join the step's
communication (which compute may hide); every rank copies in the same phase, so GPUs behind one
PCIe switch share its uplink (a DGX A100's pairs: half the link each); the CPU step is added. On the device, a
unit's shards copied in before its all-gather hold memory for a moment
(:func:`estimate_offload_gather_bytes`, the memory model's ``offload_gather`` phase). The CPU speed is
:data:`CPU_ADAM_PARAMS_PER_S_PER_CORE`, measured on this book's machine, times the cores a rank
gets: the host's cores shared by its GPUs; at most the rank's share of the host's memory
bandwidth over the :data:`ADAM_BYTES_PER_PARAM` an Adam step moves per parameter (a DGX A100's
two EPYC 7742 stream 409.6 GB/s: 1.83 G parameters/s per GPU, below its 16 cores' 2.4 G).
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.core.checks import check_int
from handbook_lib.core.config import dtype_bytes
from handbook_lib.models.hardware import LINKS, Host
from handbook_lib.models.traffic import StepTraffic

__all__ = ["OffloadCost", "ADAM_BYTES_PER_PARAM", "CPU_ADAM_PARAMS_PER_S_PER_CORE", "CPU_ADAM_SOURCE",
           "estimate_offload", "estimate_offload_gather_bytes"]

ADAM_BYTES_PER_PARAM = 28
"""Bytes of host memory an fp32 Adam(W) step moves per parameter at the least: it reads the
parameter, its gradient and the two moments (16 B) and writes the parameter and the moments
(12 B). A machine's CPUs step at most its memory bandwidth over this many parameters a second,
whatever their cores (the for-loop implementation's temporaries move more: a bound)."""

CPU_ADAM_PARAMS_PER_S_PER_CORE = 1.5e8
"""fp32 parameters per second one CPU core steps through ``torch.optim.AdamW`` (its default
for-loop implementation, which CPU tensors get), 0.6 GB/s of parameters: see
:data:`CPU_ADAM_SOURCE`."""

CPU_ADAM_SOURCE = (
    "measured on this book's build machine (AMD EPYC, 1 thread, torch 2.13.0+cpu) with "
    "handbook_lib.runtime.measure.measure_cpu_adam over 16 Mi fp32 parameters in 16 tensors: "
    "134 to 177 M parameters/s for AdamW's default (for-loop) implementation, 510 to 617 M with "
    "fused=True; 1.5e8 taken per core, and per rank the host's cores divided by its GPUs, capped by "
    "the rank's share of the host's memory bandwidth (ADAM_BYTES_PER_PARAM a parameter)")
"""Where :data:`CPU_ADAM_PARAMS_PER_S_PER_CORE` comes from."""


@dataclass(frozen=True)
class OffloadCost:
    """One rank's offload traffic and CPU work in one optimizer step."""

    host_to_device_bytes: int
    """Shards copied to the GPU before their all-gathers, bytes."""
    device_to_host_bytes: int
    """Reduced gradient shards copied back, bytes."""
    copy_s: float
    """Both copies over the host link, back to back, seconds: at the link's achievable rate over
    the GPUs sharing its uplink (:attr:`~handbook_lib.models.hardware.Host.gpus_per_uplink`), all
    of them copying in the same phase of the step."""
    optimizer_params: int
    """Parameters the rank's CPU optimizer step updates (its shard)."""
    optimizer_s: float
    """That step on the rank's share of the host's cores, or of its memory bandwidth where that
    is less (:data:`ADAM_BYTES_PER_PARAM`), seconds."""
    link: str
    """The host link's name."""
    optimizer_limit: str = "cores"
    """What sets the CPU step's speed: ``"cores"`` or ``"memory bandwidth"``."""


def estimate_offload(traffic: StepTraffic, num_params: int, host: Host, gpus_per_node: int, *,
                     shard_group_size: int | None = None,
                     params_per_s_per_core: float = CPU_ADAM_PARAMS_PER_S_PER_CORE) -> OffloadCost:
    """Price CPU offload for one rank of the step ``traffic`` lists (an FSDP strategy's).

    Args:
        traffic: The step's collectives (:func:`~handbook_lib.models.traffic.estimate_step_traffic`).
        num_params: Parameters of the whole model, P; the rank's optimizer steps ceil(P / S).
        shard_group_size: Ranks one copy of the model state is sharded over, S (HSDP's group;
            default the whole world).
        host: The machine's CPU side (cores and the GPU's link to host memory).
        gpus_per_node: GPUs sharing the host's cores (ranks per machine).
        params_per_s_per_core: CPU optimizer speed, parameters/s per core.

    Raises:
        ValueError: for a count < 1 or a speed not > 0.
    """
    check_int("num_params", num_params, 1)
    check_int("gpus_per_node", gpus_per_node, 1)
    if not params_per_s_per_core > 0:
        raise ValueError(f"params_per_s_per_core must be > 0, got {params_per_s_per_core!r}")
    up = down = 0
    for r in traffic.records:
        shard = r.buffer_bytes // r.group_size
        if r.kind == "all_gather":
            up += shard * 4 // dtype_bytes(r.dtype)  # the fp32 shard, cast after the copy
        elif r.kind == "reduce_scatter":
            down += shard
    link = LINKS[host.link]
    mine = -(-num_params // (shard_group_size or traffic.world_size))
    rate = host.cores / gpus_per_node * params_per_s_per_core
    limit = "cores"
    if host.memory_bandwidth_bytes_per_s is not None:
        streamed = host.memory_bandwidth_bytes_per_s / gpus_per_node / ADAM_BYTES_PER_PARAM
        if streamed < rate:
            rate, limit = streamed, "memory bandwidth"
    copy_s = (up + down) * host.gpus_per_uplink / link.achievable_bytes_per_s  # every GPU copies at once
    return OffloadCost(up, down, copy_s, mine, mine / rate, link.name, limit)


def estimate_offload_gather_bytes(shards: tuple[int, ...], compute_bytes: int, group: int) -> int:
    """Device bytes one unit's all-gather holds at its worst moment when its shards live in host
    memory (FSDP2's CPU offload on a GPU), its output included.

    FSDP2 (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py:
    FSDPParam.all_gather_inputs``) copies each parameter's padded fp32 shard to the device
    (``sharded_param_data.to(self.device, non_blocking=True)``) and casts it to the compute
    dtype when that differs (the fp32 copy is dropped as the cast returns). Then, with c the
    compute dtype's bytes and U = N·Σ shard:

    - N > 1 (``_fsdp_collectives.py: foreach_all_gather``): every input is kept while the
      all-gather output is allocated and filled, ``c·U + c·U/N``; in mixed precision, while the
      inputs are made, one fp32 copy beside the casts so far, ``c·Σ_{q≤p} shard_q + 4·shard_p``;
    - N = 1 (``_fsdp_param_group.py: FSDPParamGroup.wait_for_unshard``): tensor by tensor into
      its own output, the previous input still bound to the loop variable,
      ``c·Σ_{q<p} s_q + c·s_{p-1} + [4·s_p] + c·s_p``, then ``c·Σ_{q≤p} s_q + c·s_p``.

    A CPU run has none of the copies (``.to(cpu)`` returns the host shard itself). Read from
    torch's source, not yet measured on a GPU (unverified); the caching allocator's 512-B
    rounding is left out.

    Args:
        shards: Each parameter's padded shard, elements, in the unit's order (the whole tensor
            when ``group`` is 1).
        compute_bytes: c, bytes per element of the compute dtype (4 for fp32: no cast).
        group: N, the ranks sharding the unit.

    Raises:
        ValueError: for a size, dtype width or group that is not a positive integer (a shard
            may be 0).
    """
    check_int("compute_bytes", compute_bytes, 1)
    check_int("group", group, 1)
    for shard in shards:
        check_int("shards", shard, 0)
    cast = 4 if compute_bytes != 4 else 0  # mixed precision: the fp32 copy beside its cast
    c, worst, done, prev = compute_bytes, 0, 0, 0
    for shard in shards:
        if group > 1:
            worst = max(worst, c * (done + shard) + cast * shard)
        else:
            worst = max(worst, c * (done + prev + shard) + cast * shard, c * (done + 2 * shard))
        done, prev = done + shard, shard
    return max(worst, c * done * (group + 1)) if group > 1 else worst
