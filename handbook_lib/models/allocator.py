"""What PyTorch's CUDA caching allocator reserves beyond what tensors hold. Pure arithmetic.

A training process asks the allocator for tensors; the allocator asks CUDA for larger segments
and keeps them when tensors are freed, to hand them out again. ``torch.cuda.max_memory_allocated``
is the tensors' peak (the memory model's ``peak``); ``torch.cuda.max_memory_reserved`` is the
segments' peak, which is what ``nvidia-smi`` shows (with the CUDA context) and what most
trainers log. The difference is rounding and fragmentation. PyTorch's
``c10/cuda/CUDACachingAllocator.cpp`` rounds every request up to 512 bytes, packs requests of
at most 1 MiB into 2 MiB segments, serves 1 to 10 MiB requests from 20 MiB segments and rounds
larger ones up to 2 MiB; a freed block can then be split for a smaller request, and the rest
waits unmerged. How much that leaves reserved depends on the order of a step's allocations,
so the model takes a fraction of the allocated peak from published FSDP measurements
(:data:`RESERVE_SOURCE`), and chapter 4's sensitivity shows what its spread does.
"""

from __future__ import annotations

from handbook_lib.core.checks import check_int

__all__ = ["RESERVE_FRACTION", "RESERVE_SOURCE", "RESERVE_MODEL", "reserved_bytes"]

RESERVE_FRACTION = 0.10
"""Reserved bytes above allocated ones at a training step's peak, as a fraction of the allocated
peak: see :data:`RESERVE_SOURCE`."""

RESERVE_SOURCE = (
    "published peak reserved against peak allocated (or active) bytes of FSDP training on CUDA: "
    "+5.4 % (hf_T5, FSDP, eager) and +15.7 % (the same, torch.compile), pytorch/pytorch#89457; "
    "+8.9 % (a 42-layer Megatron FSDP v2 job, 221,706 against 203,504 MiB), "
    "NVIDIA/Megatron-LM#6885; +27 % and +31 % (Llama 2 7B, FSDP1, 4 x A100 40GB), "
    "meta-llama/llama-cookbook#41 and #165. 0.10 lies within the three lower figures (5.4 to "
    "15.7 %), below the two LoRA fine-tunes'; the spread is 5 to 31 %")
"""Where :data:`RESERVE_FRACTION` comes from."""

RESERVE_MODEL = (f"the allocated peak + {100 * RESERVE_FRACTION:.0f} % (rounding and fragmentation; published FSDP "
                 "runs measure 5 to 31 %), rounded up to 2 MiB")
""":func:`reserved_bytes` in words."""


def reserved_bytes(allocated_peak: int, *, fraction: float = RESERVE_FRACTION) -> int:
    """Peak bytes the caching allocator reserves for a step whose tensors peak at
    ``allocated_peak`` bytes: ``allocated_peak x (1 + fraction)``, rounded up to the allocator's
    2 MiB.

    Raises:
        ValueError: for a negative peak or a fraction outside [0, 1).
    """
    check_int("allocated_peak", allocated_peak, 0)
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction must be in [0, 1), got {fraction!r}")
    step = 2 * 2**20
    total = allocated_peak + round(allocated_peak * fraction)  # to the byte: no float residue
    return -(-total // step) * step
