"""The command line's rules between flags, each refused in one line that names the flags."""

from __future__ import annotations

import argparse

from handbook_lib.core.strategies import get_strategy
from handbook_lib.models.recompute import check_policy_flags

__all__ = ["check_memory_flags"]


def check_memory_flags(args: argparse.Namespace) -> None:
    """Refuse a combination of ``memory``'s flags that prices nothing meaningful.

    Raises:
        ValueError: one line naming the flags and what they need.
    """
    if bool(args.micro_batch) != bool(args.seq_len):
        missing = "--seq-len" if args.micro_batch else "--micro-batch"
        raise ValueError(f"--micro-batch and --seq-len go together: give {missing} too (> 0), or neither")
    if args.micro_batch and args.params is not None:
        raise ValueError("--micro-batch/--seq-len need a model shape, and --params is only a count: "
                         "use --model (e.g. 7b), --hf-config or the handbook's model instead")
    if args.activation_checkpointing != "none" and not args.micro_batch:
        raise ValueError("--activation-checkpointing changes activations only: give --micro-batch "
                         "and --seq-len too")
    check_policy_flags(args.activation_checkpointing, args.ac_every, args.ac_matmul_every, args.ac_save)
    if (args.ac_every > 1 or args.ac_matmul_every > 1 or args.ac_save != "matmul+attention") and (
            args.tp_size > 1 or args.sp_size > 1):
        raise ValueError("--ac-every or --ac-matmul-every with --tp-size or --sp-size: the layouts beyond FSDP "
                         "checkpoint every layer, every product")
    if args.precision == "bf16" and args.cpu_offload and get_strategy(args.strategy).wrapper == "deepspeed":
        raise ValueError("--precision bf16 with --cpu-offload: DeepSpeed offloads a bf16 master and bf16 optimizer "
                         "states only to its compiled CPU Adam; give --precision bf16-mixed")
    if args.loss_chunks > 1 and (not args.seq_len or args.seq_len % args.loss_chunks):
        raise ValueError(f"--loss-chunks {args.loss_chunks} cuts each sequence into equal chunks: give --micro-batch "
                         "and a --seq-len it divides")
    for flag, on in (("--set-to-none", getattr(args, "set_to_none", False)),
                     ("--float8-all-gather", getattr(args, "float8_all_gather", False))):
        if on and (args.tp_size > 1 or args.sp_size > 1):
            raise ValueError(f"{flag} with --tp-size or --sp-size: the layouts beyond FSDP price neither")
    row = get_strategy(args.strategy)
    if getattr(args, "float8_all_gather", False) and row.wrapper != "deepspeed" and (
            args.precision == "fp32" or not row.shards_params or args.cpu_offload):
        raise ValueError("--float8-all-gather gathers float8 weights for bf16 compute: it needs a sharding "
                         f"--strategy, a 16-bit --precision and no --cpu-offload (got {args.strategy}, "
                         f"{args.precision})")
    if args.loss_chunks > 1 and (args.tp_size > 1 or args.sp_size > 1):
        raise ValueError("--loss-chunks with --tp-size or --sp-size: the layouts beyond FSDP price the whole loss")
    if args.sync_every_micro_step and args.grad_accum < 2:
        raise ValueError(f"--sync-every-micro-step needs --grad-accum >= 2, got {args.grad_accum}")

