"""Published tensor-parallel runs, plain and asynchronous, beside the planner's pricing of their
layouts. Pure: no ``torch``.

Chapter 9 shows them. Each row is one of torchtitan's June 2025 benchmarks of asynchronous TP
(``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md``): a Llama 3 model trained with TP 8
inside each node of H100s and FSDP across, bf16, 8,192-token sequences, once with plain TP and
once with asynchronous TP. The prediction is :func:`~handbook_lib.models.axes_table.tp_rows`'
row for the same layout and batch, plain and asynchronous
(:data:`~handbook_lib.models.axes_table.ASYNC_TP_SOURCE`), at the H100 preset's peak and the
planner's utilization: one model for every row, nothing fitted on them.

What the model leaves out, and the rows carry: the runs used ``torch.compile`` on 96 GB H100s
held to 500 W; the 8B ran torchtitan's per-operator selective checkpointing, which recomputes
less than the full checkpointing it is priced with (so it should run faster than priced).
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.models.axes_table import AxisOption, tp_rows
from handbook_lib.models.hardware import get_accelerator
from handbook_lib.models.published import published_model
from handbook_lib.models.presets import DecoderShape
from handbook_lib.models.timing import expected_utilization

__all__ = ["ASYNC_TP_BENCHMARK", "PublishedAsyncTP", "PUBLISHED_ASYNC_TP", "AsyncTPRow", "async_tp_rows"]

ASYNC_TP_BENCHMARK = ("pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (2025): Grand Teton "
                      "hosts of 8 H100 (96 GB HBM2e, 500 W), 400 Gb/s RDMA per GPU, torch.compile, bf16 rows")
"""Where the rows come from."""


@dataclass(frozen=True)
class PublishedAsyncTP:
    """One published pair of runs, plain TP and asynchronous TP, tokens per second per GPU."""

    label: str
    model: str
    gpus: int
    tp: int
    local_batch: int
    """Sequences per data-parallel rank (a TP group) a step."""
    activation_checkpointing: str
    """As the source says it: ``full`` or ``per-op SAC``."""
    plain_tokens_per_s: float
    async_tokens_per_s: float
    seq_len: int = 8192


PUBLISHED_ASYNC_TP: tuple[PublishedAsyncTP, ...] = (
    PublishedAsyncTP("Llama 3 70B, 256 H100, TP 8 x FSDP 32", "llama3-70b", 256, 8, 16, "full", 597.3, 652.4),
    PublishedAsyncTP("Llama 3 8B, 64 H100, TP 8 x FSDP 8", "llama3.1-8b", 64, 8, 12, "per-op SAC", 4378.0, 4809.4),
)


@dataclass(frozen=True)
class AsyncTPRow:
    """A published pair beside the planner's rows for its layout."""

    published: PublishedAsyncTP
    plain: AxisOption
    asynchronous: AxisOption

    @property
    def errors(self) -> tuple[float, float]:
        """Predicted tokens per second per GPU over the published, minus one: plain, asynchronous."""
        p = self.published
        return (self.plain.tokens_per_s_per_gpu / p.plain_tokens_per_s - 1,
                self.asynchronous.tokens_per_s_per_gpu / p.async_tokens_per_s - 1)

    @property
    def speedups(self) -> tuple[float, float]:
        """Asynchronous TP's tokens per second over plain TP's: published, predicted."""
        p = self.published
        return (p.async_tokens_per_s / p.plain_tokens_per_s,
                self.asynchronous.tokens_per_s_per_gpu / self.plain.tokens_per_s_per_gpu)


def async_tp_rows(rows: tuple[PublishedAsyncTP, ...] = PUBLISHED_ASYNC_TP) -> list[AsyncTPRow]:
    """Each published pair with :func:`~handbook_lib.models.axes_table.price_layout`'s plain and
    asynchronous rows for its layout (full checkpointing wherever the run checkpointed)."""
    out = []
    for row in rows:
        shape = published_model(row.model)
        assert isinstance(shape, DecoderShape)
        acc = get_accelerator("h100-80gb")
        priced = tp_rows(shape, acc, row.gpus, [row.tp], seq_len=row.seq_len, micro_batch=row.local_batch,
                         gpus_per_node=8, inter_link="ib-ndr400", precision="bf16-mixed",
                         utilization=expected_utilization(acc, shape.d_model), headroom=0.0)
        ac = row.activation_checkpointing != "none"
        plain, asynchronous = (next(r for r in priced if r.activation_checkpointing == ac
                                    and ("(async)" in r.name) == a) for a in (False, True))
        out.append(AsyncTPRow(row, plain, asynchronous))
    return out
