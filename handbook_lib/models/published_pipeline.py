"""Published pipelined training runs beside the planner's pipeline pricing. Pure: no ``torch``.

Chapter 9 shows them. Each row is a job that ran tensor parallelism inside a node, a pipeline
across nodes and FSDP over the rest, with the throughput (and, where the source gives it, the peak
memory per GPU) it reported. The prediction is :func:`~handbook_lib.models.axes_table.compare_axes`'
own pipeline row for the same layout, micro-batches and checkpointing (1F1B, bf16, the H100
preset's peak and the planner's utilization): one model for every row, nothing fitted on them.

What the model leaves out, and the rows carry: Llama 3 ran its own interleaved schedule (a
smaller bubble than 1F1B's); torchtitan's runs used Float8 matrix products, ``torch.compile``
and asynchronous TP on 96 GB, 500 W H100s.
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.models.axes_table import AxisOption, compare_axes

__all__ = ["PublishedPipeline", "PUBLISHED_PIPELINES", "PipelineRow", "pipeline_rows", "tokens_per_s"]


def tokens_per_s(flops_per_s: float, params: int, layers: int, width: int, seq_len: int) -> float:
    """Tokens per second a GPU trains at ``flops_per_s`` of model FLOPs: over ``6P`` per token and
    attention's ``12·L·w·s`` (the count the sources' MFU uses)."""
    return flops_per_s / (6 * params + 12 * layers * width * seq_len)


_LLAMA3 = ("Grattafiori et al. 2024, The Llama 3 Herd of Models (arXiv:2407.21783), Table 4: {gpus} H100, "
           "TP 8, PP 16, DP {dp}, 8,192-token sequences, {m} per DP rank, 16M tokens a batch, {tf} TFLOP/s "
           "per GPU; tokens/s per GPU are {tf} TFLOP/s over 6P + 12·L·w·s. Its schedule is interleaved")
_TITAN = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (2024), Table 5: Llama 3.1 405B on 512 "
          "H100 (96 GB HBM2e, 500 W), FSDP 8, TP 8, PP 8, local batch 32, full activation checkpointing, "
          "torch.compile, Float8 and asynchronous TP; 1F1B: 100 tokens/s per GPU, 82.5 GiB (the largest of "
          "the ranks)")
_405B = (405_853_388_800, 126, 16_384)
"""Llama 3.1 405B's parameters, layers and query width (the ``llama3-405b`` preset's)."""


@dataclass(frozen=True)
class PublishedPipeline:
    """One published pipelined run."""

    label: str
    gpus: int
    tp: int
    pp: int
    microbatches: int
    """Micro-batches of one sequence each a pipeline runs a step (the sequences per DP rank)."""
    activation_checkpointing: bool
    tokens_per_s_per_gpu: float
    memory_bytes: int
    """Peak memory per GPU the source reports, bytes (0: none reported)."""
    source: str
    model: str = "llama3-405b"
    gpu: str = "h100-80gb"
    seq_len: int = 8192


PUBLISHED_PIPELINES: tuple[PublishedPipeline, ...] = (
    PublishedPipeline("Llama 3 405B, 8,192 H100", 8192, 8, 16, 32, False, tokens_per_s(430e12, *_405B, 8192), 0,
                      _LLAMA3.format(gpus="8,192", dp=64, m=32, tf=430)),
    PublishedPipeline("Llama 3 405B, 16,384 H100", 16384, 8, 16, 16, False, tokens_per_s(400e12, *_405B, 8192), 0,
                      _LLAMA3.format(gpus="16,384", dp=128, m=16, tf=400)),
    PublishedPipeline("torchtitan 405B, 512 H100, 1F1B", 512, 8, 8, 32, True, 100.0, int(82.5 * 2**30), _TITAN),
)
"""The pipelined runs the planner's pipeline pricing is checked against."""


@dataclass(frozen=True)
class PipelineRow:
    """A published pipelined run beside the planner's row for its layout."""

    published: PublishedPipeline
    predicted: AxisOption

    @property
    def tokens_error(self) -> float:
        """Predicted tokens per second per GPU over the published, minus one."""
        return self.predicted.tokens_per_s_per_gpu / self.published.tokens_per_s_per_gpu - 1

    @property
    def memory_error(self) -> float | None:
        """Predicted reserved peak over the published peak, minus one (``None``: none published)."""
        if not self.published.memory_bytes:
            return None
        return self.predicted.peak_reserved_bytes / self.published.memory_bytes - 1


def pipeline_rows(rows: tuple[PublishedPipeline, ...] = PUBLISHED_PIPELINES) -> list[PipelineRow]:
    """Each published run with the planner's pipeline row for its layout: ``compare_axes`` with
    the run's TP and PP degrees and its batch (``gpus / (tp · pp)`` replicas of ``microbatches``
    sequences), the row with its checkpointing setting.

    Raises:
        AssertionError: if the planner chose other micro-batches than the run's (it takes as
            many as the batch allows, up to 4·pp).
    """
    out = []
    for row in rows:
        replicas = row.gpus // (row.tp * row.pp)
        options = compare_axes(row.model, row.gpu, row.gpus, seq_len=row.seq_len, tp_size=row.tp, pp_size=row.pp,
                               batch_tokens=replicas * row.microbatches * row.seq_len)
        match = next(o for o in options if o.pp_size == row.pp and o.stages_per_rank == 1
                     and o.activation_checkpointing == row.activation_checkpointing)
        assert match.microbatches == row.microbatches, (row.label, match.microbatches)
        out.append(PipelineRow(row, match))
    return out
