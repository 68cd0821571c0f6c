"""The global batch in tokens, and how many data-parallel replicas it allows: the arithmetic
that decides when FSDP alone stops scaling (chapter 4) and chapter 9's axes take over. Pure."""

from __future__ import annotations

from handbook_lib.core.checks import check_int

__all__ = ["global_batch_tokens", "max_data_parallel"]


def global_batch_tokens(gpus: int, micro_batch: int, seq_len: int, *,
                        grad_accum_steps: int = 1, model_parallel: int = 1) -> int:
    """Tokens of one optimizer step over the whole job: ``micro_batch · seq_len ·
    grad_accum_steps`` per data-parallel replica, times the replicas, ``gpus /
    model_parallel`` (every GPU of a pure FSDP or DDP job is a replica of the data loop: the
    global batch grows with the GPUs; tensor, pipeline or context parallelism over
    ``model_parallel`` GPUs shares one replica's sequences instead).

    Raises:
        ValueError: for a count below 1, or ``gpus`` not a multiple of ``model_parallel``.
    """
    for name, value in (("gpus", gpus), ("micro_batch", micro_batch), ("seq_len", seq_len),
                        ("grad_accum_steps", grad_accum_steps), ("model_parallel", model_parallel)):
        check_int(name, value, 1)
    if gpus % model_parallel:
        raise ValueError(f"gpus={gpus} is not a multiple of model_parallel={model_parallel}")
    return gpus // model_parallel * micro_batch * seq_len * grad_accum_steps


def max_data_parallel(batch_tokens: int, micro_batch: int, seq_len: int) -> int:
    """The most data-parallel replicas a global batch of ``batch_tokens`` allows at
    ``micro_batch`` sequences of ``seq_len`` tokens per replica and no accumulation: past
    it, pure FSDP can add GPUs only by growing the batch (or shrinking the micro-batch);
    0 when one micro-batch is already larger than the batch."""
    for name, value in (("batch_tokens", batch_tokens), ("micro_batch", micro_batch), ("seq_len", seq_len)):
        check_int(name, value, 1)
    return batch_tokens // (micro_batch * seq_len)
