"""What every rank does before and after its experiment: device, backend, process group.

Chapter 1 introduces it. The device and the backend are picked at run time, so one code path
serves a laptop and a GPU node: CUDA + NCCL (one rank per visible GPU, ``cuda:LOCAL_RANK``) when
GPUs are present, else CPU + gloo. A rank started with ``CUDA_VISIBLE_DEVICES=""`` sees no GPU
and takes CPU + gloo on any machine: that is how the launcher runs a lesson's ranks on the CPU of
a GPU hub (``HANDBOOK_DEVICE=cpu``, or too few GPUs: :mod:`handbook_lib.launch.gpus`).
"""

from __future__ import annotations

import datetime
import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

from handbook_lib.core.protocol import COLLECTIVE_TIMEOUT_ENV

__all__ = ["RankContext", "pick_device", "resolve_device", "init_distributed", "shutdown_distributed",
           "shared_temp_dir"]


@dataclass(frozen=True)
class RankContext:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that writes the result and draws progress bars."""
        return self.rank == 0


def pick_device(local_rank: int = 0) -> tuple[torch.device, str]:
    """Choose ``(device, backend)``: ``cuda:local_rank`` + NCCL with GPUs, else CPU + gloo.

    Raises:
        RuntimeError: if GPUs are present but fewer than ``local_rank + 1`` (start one rank per
            visible GPU).
    """
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise RuntimeError(
                f"local rank {local_rank} has no GPU: {count} visible; start at most {count} "
                "processes per node, or run the ranks on the CPU (CUDA_VISIBLE_DEVICES='')"
            )
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``) as a
    ``torch.device``, with an index on CUDA (this process's current GPU where none is given).

    Raises:
        ValueError: in one line naming ``device``, for anything else, or a CUDA device that is
            not visible here.
    """
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r}: not a device; use 'cpu' or 'cuda[:N]'") from None
    if where.type == "cpu":
        return where
    if where.type != "cuda":
        raise ValueError(f"device={str(where)!r}: use 'cpu' or 'cuda[:N]'")
    if not torch.cuda.is_available():
        raise ValueError(f"device={str(where)!r}: no CUDA device is visible here; use 'cpu'")
    index = torch.cuda.current_device() if where.index is None else where.index
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"device={str(where)!r}: {torch.cuda.device_count()} CUDA device(s) "
                         "are visible here")
    return torch.device("cuda", index)


def init_distributed(timeout_s: float | None = None) -> RankContext:
    """Join the process group that ``torchrun`` set up through the environment.

    Args:
        timeout_s: Seconds a collective may block before it raises; defaults to the launcher's
            ``HANDBOOK_COLLECTIVE_TIMEOUT_S``, else 300 s (torch's own default is 30 min, far too
            long for a learner watching a hung cell).
    """
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device, backend = pick_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # a rank that times out in a collective raises (and dumps NCCL's flight record) instead
        # of being aborted by the watchdog without a Python traceback
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if timeout_s is None:
        timeout_s = float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, "300"))
    dist.init_process_group(
        # with NCCL, gloo too, for CPU tensors: offloaded gradients' norm, fp16's found-inf, DCP,
        # objects (gpu-path.md S1-7); ctx.backend stays "nccl"
        backend="cpu:gloo,cuda:nccl" if backend == "nccl" else backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    return RankContext(rank, world_size, local_rank, device, backend)


def shutdown_distributed() -> None:
    """Destroy the process group if one exists (safe to call twice, or after a failure)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def shared_temp_dir(prefix: str, ctx: RankContext, group: dist.ProcessGroup | None = None) -> str:
    """A new temporary folder made by rank 0 and named to every rank of ``group`` (the job's by
    default; one machine's ranks, or a shared ``TMPDIR``); the caller removes it."""
    name = [tempfile.mkdtemp(prefix=prefix) if ctx.is_main else None]
    if ctx.world_size > 1:
        dist.broadcast_object_list(name, src=0, group=group)
    assert name[0] is not None  # rank 0's, broadcast
    return name[0]
