"""Tensor parallelism inside a node x FSDP across nodes, priced beside FULL_SHARD and HYBRID_SHARD.
Pure arithmetic: no ``torch``.

Chapter 9 teaches it, after :mod:`handbook_lib.models.axes` has said *whether* FSDP is enough.
:func:`compare_axes` prices, for one job, the planner's FULL_SHARD and HYBRID_SHARD options (with
and without activation checkpointing, :func:`~handbook_lib.models.planner.plan`) and the same job
laid out as TP over ``tp`` GPUs of a node x FSDP2 over the TP groups (and, if asked, the sequence
split over ``sp`` GPUs x FSDP2 over all, and both together): per-GPU memory, communication, compute, step and tokens
per second per GPU, the one figure that compares layouts whose global batches differ (a TP group
shares its sequences, so TP x FSDP takes ``1/tp`` of FULL_SHARD's tokens per step).
:func:`recommend_axes` picks the fastest that fits, a tie within 1 % going to fewer axes.

What each layout pays (one function, :func:`price_layout`, for every layout):

- FULL_SHARD / HYBRID_SHARD: the planner's own pricing (chapter 4);
- tensor parallelism over ``tp`` GPUs of a node: compute ``1/tp`` of its group's tokens' FLOPs;
  TP's collectives per layer (:func:`~handbook_lib.models.tensor_parallel.estimate_tp_layer_traffic`,
  sequence parallel: 4 all-gathers and 4 reduce-scatters of T·d·c, and the forward's again when a
  checkpointed layer is recomputed) on the node's link, **not hidden** (each sits between two
  matrix products);
- the sequence split over ``sp`` ranks: compute of ``1/sp`` of the tokens; Ulysses' all-to-alls
  (not hidden) or the ring's sends (hidden when
  :func:`~handbook_lib.models.sequence_parallel.ring_overlap` says so), of a tensor rank's heads
  when both axes are on, on NVLink while ``tp · sp`` GPUs fit a node;
- FSDP2 over the ``gpus / tp`` ranks that hold the same TP slice (data-parallel and sequence
  ranks together), one rank per node when ``tp`` fills it, on that rank's own network port,
  hidden as chapter 3 hides them. Memory: :func:`~handbook_lib.models.axes.estimate_job_memory`.

Compute counts attention's FLOPs (12·L·w·s per token) beside 6PT, at the utilization the
planner uses (:func:`~handbook_lib.models.timing.estimate_compute_time`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from handbook_lib.core.checks import check_int
from handbook_lib.core.config import get_precision
from handbook_lib.core.parallel_layout import ParallelLayout
from handbook_lib.models.axes import estimate_job_memory
from handbook_lib.models.bands import StepTimeBand
from handbook_lib.models.budget import memory_budget
from handbook_lib.models.collectives import estimate_collective_time
from handbook_lib.models.hardware import (
    Accelerator,
    Link,
    Node,
    get_accelerator,
    node_preset,
)
from handbook_lib.models.layout import model_layout
from handbook_lib.models.nccl_buffers import nccl_buffer_bytes
from handbook_lib.models.pipeline import bubble_fraction, stage_layers
from handbook_lib.models.planner import STEP_TIE, Option, plan
from handbook_lib.models.presets import DecoderShape, get_shape
from handbook_lib.models.sequence_parallel import (
    ring_layer_bytes,
    ring_overlap,
    ulysses_layer_bytes,
)
from handbook_lib.models.tensor_parallel import (
    decoder_tp_units,
    estimate_tp_layer_traffic,
)
from handbook_lib.models.timing import (
    StepTime,
    compute_forward_share,
    estimate_compute_time,
    estimate_step_time,
)
from handbook_lib.models.topology import route_collective
from handbook_lib.models.traffic import StepTraffic, estimate_step_traffic

__all__ = ["ASYNC_TP_SOURCE", "AxisOption", "axes_reason", "compare_axes", "pipeline_microbatches", "price_layout",
           "recommend_axes",
           "tp_rows"]

_FROM_PLAN = ("FULL_SHARD", "FULL_SHARD + AC", "HYBRID_SHARD", "HYBRID_SHARD + AC")


@dataclass(frozen=True)
class AxisOption:
    """One layout of the job, priced (seconds per step, bytes per GPU)."""

    name: str
    tp_size: int
    sp_size: int
    dp_size: int
    """Data-parallel replicas (FSDP's groups: shard groups of HYBRID_SHARD count as one)."""
    activation_checkpointing: bool
    peak_reserved_bytes: int
    budget_bytes: int
    comm_s: float
    """All collectives of a step back to back."""
    exposed_s: float
    """Communication no compute hides (TP's and Ulysses' all of it)."""
    compute_s: float
    step_s: float
    tokens_per_step: int
    """Tokens of one optimizer step over the whole job."""
    within_batch: bool = True
    """Its step takes no more tokens than the recipe's batch (``compare_axes(batch_tokens=...)``)."""
    pp_size: int = 1
    """Pipeline stages, one per GPU of a pipeline (1: no pipeline)."""
    microbatches: int = 1
    """Micro-batches each pipeline runs a step (1 without a pipeline)."""
    bubble_s: float = 0.0
    """Seconds a step's stages idle while the pipeline fills and drains: ``(p − 1)`` micro-batches'
    stage time (:func:`~handbook_lib.models.pipeline.bubble_fraction` of the step's stage time)."""
    stages_per_rank: int = 1
    """Pipeline stages a GPU holds (interleaved 1F1B above 1)."""

    @property
    def fits(self) -> bool:
        return self.peak_reserved_bytes <= self.budget_bytes

    @property
    def margin_bytes(self) -> int:
        return self.budget_bytes - self.peak_reserved_bytes

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Tokens per second per GPU: the step's tokens over its time and the job's GPUs."""
        return self.tokens_per_step / self.step_s / (self.tp_size * self.sp_size * self.pp_size * self.dp_size)


@dataclass(frozen=True)
class _Job:
    shape: DecoderShape
    node: Node
    gpus: int
    micro_batch: int
    seq_len: int
    precision: str
    utilization: float
    headroom: float

    def budget(self, layout: ParallelLayout) -> int:
        """What ``layout`` may reserve per GPU: the usable memory less its NCCL buffers, less the headroom."""
        return memory_budget(self.node.accelerator, self.headroom, nccl_buffer_bytes(layout, self.node)).budget_bytes

    def compute(self, tokens: int, ac: bool) -> float:
        acc = self.node.accelerator
        peak = acc.peak_flops(self.precision)
        return estimate_compute_time(self.shape.num_params, tokens, peak, self.utilization, activation_checkpointing=ac,
                                     seq_len=self.seq_len, num_layers=self.shape.num_layers,
                                     attention_width=self.shape.attention_width)

    def forward_share(self, ac: bool) -> float:
        """The forward's share of :meth:`compute` (a quarter with full recomputation, else a third)."""
        return compute_forward_share(self.shape.num_params, self.micro_batch * self.seq_len,
                                     activation_checkpointing=ac, seq_len=self.seq_len,
                                     num_layers=self.shape.num_layers, attention_width=self.shape.attention_width)

    def mode(self, ac: bool) -> str:
        return "full" if ac else "none"


def _from_plan(o: Option, job: _Job) -> AxisOption:
    """A planner's option as a row: every GPU a data-parallel rank."""
    return AxisOption(o.name, 1, 1, job.gpus, o.activation_checkpointing, o.peak_reserved_bytes, o.budget_bytes,
                      o.comm_s, max(0.0, o.step_s - o.compute_s), o.compute_s, o.step_s,
                      job.gpus * job.micro_batch * job.seq_len)


def _attention_slice(shape: DecoderShape, tp: int) -> DecoderShape:
    """What one tensor-parallel rank attends with: ``nhead / tp`` query heads and ``kv_heads / tp``
    key/value heads of the same width (the sequence split's transfers carry those)."""
    if tp == 1:
        return shape
    head = shape.head_dim or shape.d_model // shape.nhead
    return dataclasses.replace(shape, nhead=shape.nhead // tp, num_kv_heads=shape.kv_heads // tp, head_dim=head)


ASYNC_TP_SOURCE = ("torch's micro-pipelined TP (torch.distributed._symmetric_memory, torchtitan's "
                   "enable_async_tensor_parallel): each all-gather is cut into the TP group's chunks and fed to "
                   "the matrix product chunk by chunk, and each reduce-scatter likewise, so a layer's transfers "
                   "run under its products; torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md "
                   "measures 1.09x and 1.10x over plain TP on Llama 3 70B and 8B (bf16)")
"""How asynchronous TP hides its collectives, and the published speed-up it is checked against."""


def _tp_seconds(job: _Job, tokens: int, tp: int, layers: int, ac: bool, async_tp: bool = False) -> float:
    """TP's exposed collectives for ``tokens`` tokens through ``layers`` layers on the node's link
    (0 without TP); with checkpointing the forward's are issued again when a layer is recomputed.
    Plain TP hides none of them (each sits between two matrix products). Asynchronous TP
    (:data:`ASYNC_TP_SOURCE`) runs a layer's transfers under its products: what outlasts the
    layer's compute is exposed, and the first of a collective's ``tp`` chunks, which has no
    product before it."""
    if tp == 1:
        return 0.0
    layer = estimate_tp_layer_traffic(job.shape.d_model, tokens, tp, 4 if job.precision == "fp32" else 2,
                                      sequence_parallel=True)
    per_layer = [estimate_collective_time(x, job.node.intra_link) for x in layer.collectives]
    half = len(per_layer) // 2  # forward first: recomputed with checkpointing
    comm = sum(per_layer) + (sum(per_layer[:half]) if ac else 0.0)
    if not async_tp:
        return layers * comm
    compute = job.compute(tokens, ac) / tp / job.shape.num_layers  # one layer's, on one TP rank
    return layers * (max(0.0, comm - compute) + comm / tp)


def _fsdp_time(job: _Job, traffic: StepTraffic, tp: int, fsdp_ranks: int, compute_s: float, ac: bool, *,
               extra_comm_s: float = 0.0) -> StepTime:
    """FSDP2's step over ``fsdp_ranks`` ranks, one per TP slice: each node holds ``gpus_per_node / tp``
    of the group's ranks and as many of its network ports, hidden behind ``compute_s`` as chapter 3
    hides them."""
    node = job.node
    slots = max(1, node.gpus_per_node // tp)
    lane = dataclasses.replace(node, gpus_per_node=slots, nics_per_node=max(1, node.nics_per_node * slots
                                                                           // node.gpus_per_node))
    return estimate_step_time(traffic, lambda r: route_collective(r, lane, fsdp_ranks, "FULL_SHARD"), compute_s,
                              overlap=True, extra_comm_s=extra_comm_s, forward_share=job.forward_share(ac))


def price_layout(job: _Job, layout: ParallelLayout, ac: bool, microbatches: int = 1,
                 async_tp: bool = False, stages_per_rank: int = 1) -> AxisOption:
    """One layout's row, the one time entry point for every layout of the job's GPUs: a pipeline
    (``layout.pp`` > 1, ``microbatches`` a step) by :func:`_price_pipeline`; otherwise TP over
    ``tp`` GPUs of a node, the sequence split over ``sp`` ranks, FSDP2 over the ``gpus / tp`` ranks
    of each TP slice (module docstring); ``tp`` = ``sp`` = 1 is FULL_SHARD priced the same way.
    Memory: :func:`~handbook_lib.models.axes.estimate_job_memory`."""
    if layout.pp > 1:
        return _price_pipeline(job, layout, microbatches, ac, stages_per_rank)
    tp, sp, method = layout.tp, layout.sp, layout.sp_method
    fsdp_ranks, dp = job.gpus // tp, job.gpus // (tp * sp)
    tokens = job.micro_batch * job.seq_len // sp  # one GPU's (one TP group's)
    mem = estimate_job_memory(job.shape, layout, micro_batch=job.micro_batch, seq_len=job.seq_len,
                              precision=job.precision, activation_checkpointing=job.mode(ac))
    compute = job.compute(tokens, ac) / tp
    node, sp_s, hidden = job.node, 0.0, False
    tp_s = _tp_seconds(job, tokens, tp, job.shape.num_layers, ac, async_tp)
    if sp > 1:
        link: Link = node.intra_link if sp * tp <= node.gpus_per_node else node.inter_link
        local = _attention_slice(job.shape, tp)
        fn = ulysses_layer_bytes if method == "ulysses" else ring_layer_bytes
        split = fn(local, job.seq_len, sp, micro_batch=job.micro_batch)
        steps = split.forward_transfers * (2 if ac else 1) + split.backward_transfers
        sp_s = job.shape.num_layers * (steps * link.latency_s
                                       + (split.sent + (split.forward_sent if ac else 0)) / link.achievable_bytes_per_s)
        hidden = method == "ring" and ring_overlap(local, job.seq_len, sp, link, node.accelerator,
                                                   micro_batch=job.micro_batch).hides
    param_dtype, reduce_dtype = get_precision(job.precision)
    units = decoder_tp_units(job.shape, tp) if tp > 1 else model_layout(job.shape).units()
    traffic = estimate_step_traffic(units, fsdp_ranks, "FULL_SHARD", param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fsdp = _fsdp_time(job, traffic, tp, fsdp_ranks, compute, ac, extra_comm_s=sp_s if hidden else 0.0)
    exposed = tp_s + (0.0 if hidden else sp_s)
    parts = ([f"TP {tp}" + (" (async)" if async_tp else "")] if tp > 1 else []) + (
        [f"SP {sp} ({method})"] if sp > 1 else [])
    return AxisOption(" x ".join([*parts, f"FSDP {dp}"]) + (" + AC" if ac else ""), tp, sp, dp, ac, mem.peak_reserved,
                      job.budget(layout), fsdp.comm_s + exposed, fsdp.exposed_comm_s + exposed, compute,
                      fsdp.total_s + exposed, dp * job.micro_batch * job.seq_len)


def _price_pipeline(job: _Job, layout: ParallelLayout, microbatches: int, ac: bool, v: int = 1) -> AxisOption:
    """A pipeline's row: ``pp`` stages (the outermost axis, one stage per GPU of a pipeline,
    1F1B; with ``v`` > 1, interleaved 1F1B, ``v`` stages a GPU: the bubble ``v`` times shorter,
    ``v`` times the sends, more chunks in flight,
    :func:`~handbook_lib.models.pipeline.interleaved_in_flight`), TP over ``tp`` GPUs of a node
    inside each, FSDP2 over the ``gpus / (tp · pp)``
    data-parallel ranks of each stage; each pipeline runs ``microbatches`` micro-batches of
    ``micro_batch`` sequences a step. What it pays, beside :func:`price_layout`'s terms:

    - compute: a stage's share of each micro-batch (its layers over the model's: the first stage,
      with one more layer when they do not divide, sets the pace), ``m`` of them busy and ``p − 1``
      idle in the bubble (:func:`~handbook_lib.models.pipeline.bubble_fraction`); TP's collectives
      inside each micro-batch's stage time, not hidden, stretched by the bubble alike;
    - point to point: each micro-batch's activation (``b·s·d`` in the compute dtype, ``1/tp`` of
      it with sequence parallelism) to the next stage and its gradient back, across nodes when a
      stage's ranks fill a node; the ``2(p − 1)`` transfers of the fill and the drain are exposed,
      the steady state's hide behind the other micro-batches' compute;
    - FSDP2 over a stage's data-parallel ranks: its units all-gathered ``m + 1`` times a step and
      reduce-scattered once (as the ``pipeline`` run measures it), hidden as chapter 3 hides them.

    Memory: :func:`~handbook_lib.models.axes.estimate_job_memory` with ``pp`` (the worst stage)."""
    shape, node, m, tp, pp = job.shape, job.node, microbatches, layout.tp, layout.pp
    fsdp_ranks = job.gpus // (tp * pp)
    mem = estimate_job_memory(shape, layout, micro_batch=job.micro_batch, seq_len=job.seq_len, precision=job.precision,
                              activation_checkpointing=job.mode(ac), pp_microbatches=m,
                              pp_schedule="Interleaved1F1B" if v > 1 else "1F1B", pp_stages_per_rank=v)
    layers = stage_layers(shape.num_layers, pp)[0].layers
    tokens = job.micro_batch * job.seq_len
    compute_micro = job.compute(tokens, ac) / tp * layers / shape.num_layers
    tp_micro = _tp_seconds(job, tokens, tp, layers, ac)
    compute_dtype, reduce_dtype = get_precision(job.precision)
    activation = tokens * shape.d_model * (4 if compute_dtype == "fp32" else 2) // tp
    link: Link = node.inter_link if tp * fsdp_ranks >= node.gpus_per_node else node.intra_link
    transfer = link.latency_s + activation / link.achievable_bytes_per_s
    p2p_s = 2 * (pp - 1) * transfer  # the fill's and the drain's; 2m in all
    stage = dataclasses.replace(shape, num_layers=layers, tied_embeddings=True)
    units = decoder_tp_units(stage, tp) if tp > 1 else model_layout(stage).units()
    traffic = estimate_step_traffic(units, fsdp_ranks, "FULL_SHARD", param_dtype=compute_dtype,
                                    reduce_dtype=reduce_dtype, grad_accum_steps=m, sync_every_micro_step=False,
                                    reshard_after_backward=False)
    fsdp = _fsdp_time(job, traffic, tp, fsdp_ranks, m * compute_micro, ac)
    bubble = (pp - 1) * (compute_micro + tp_micro) / v  # each of the fill's steps a chunk, 1/v of a stage
    exposed = m * tp_micro + p2p_s
    stages = f"{pp}x{v}" if v > 1 else f"{pp}"  # 8x2: 8 ranks of 2 interleaved stages each
    name = f"{f'TP {tp} x ' if tp > 1 else ''}PP {stages} (m {m}) x FSDP {fsdp_ranks}" + (" + AC" if ac else "")
    return AxisOption(name, tp, 1, fsdp_ranks, ac, mem.peak_reserved, job.budget(layout),
                      fsdp.comm_s + m * tp_micro + 2 * v * m * transfer, fsdp.exposed_comm_s + exposed,
                      m * compute_micro, fsdp.total_s + exposed + bubble, fsdp_ranks * m * tokens,
                      pp_size=pp, microbatches=m, bubble_s=bubble, stages_per_rank=v)


_NAMES = {"world": "the GPUs ({})", "gpus_per_node": "the GPUs per node ({})", "nhead": "the heads ({})",
          "pp": "the pipeline stages ({})", "layers": "the layers ({})"}
"""How :func:`compare_axes` names the layout's quantities in a refusal."""


def compare_axes(model: DecoderShape | str, gpu: Accelerator | str, gpus: int, *, seq_len: int,
                 tp_size: int | None = None, sp_size: int = 1, sp_method: str = "ulysses", micro_batch: int = 1,
                 gpus_per_node: int | None = None, inter_link: str = "ib-ndr400", precision: str = "bf16-mixed",
                 utilization: float | None = None, headroom: float = 0.0,
                 batch_tokens: int | None = None, pp_size: int = 1) -> list[AxisOption]:
    """FULL_SHARD and HYBRID_SHARD (the planner's pricing) beside TP over ``tp_size`` GPUs of a
    node x FSDP2 (and, with ``sp_size`` > 1, the sequence split x FSDP2, and TP x the split x FSDP2
    where the layout allows both), each with and without full activation checkpointing
    (:func:`price_layout`); ``micro_batch`` sequences per data-parallel replica (a TP group, an sp
    group or one GPU).

    Args:
        model: A decoder shape or preset name.
        gpu: An accelerator or preset name.
        gpus: GPUs in the job, whole nodes.
        seq_len: Tokens per sequence.
        tp_size: TP ranks inside a node (default: the whole node); 1 leaves TP out.
        sp_size: Ranks of the sequence split (1: left out).
        sp_method: ``ulysses`` or ``ring``.
        micro_batch, gpus_per_node, inter_link, precision, utilization, headroom: as for
            :func:`~handbook_lib.models.planner.plan`.
        batch_tokens: The recipe's global batch, tokens per step: a layout whose step takes more
            is marked not :attr:`AxisOption.within_batch` (``None``: no limit).
        pp_size: Pipeline stages across nodes, TP ``tp_size`` inside each (:func:`price_layout`;
            micro-batches: :func:`pipeline_microbatches`); 0 prices every stage count from 2 that
            divides the TP groups and the layers and keeps the best of them, with and without
            checkpointing; 1 (the default) leaves the pipeline out.

    Raises:
        ValueError: for a ``tp_size`` that does not divide the GPUs per node or the heads, an
            ``sp_size`` that does not divide the GPUs or the sequence, or what ``plan`` refuses.
    """
    shape = get_shape(model) if isinstance(model, str) else model
    acc = get_accelerator(gpu) if isinstance(gpu, str) else gpu
    result = plan(shape, acc, gpus, micro_batch=micro_batch, seq_len=seq_len, gpus_per_node=gpus_per_node,
                  inter_link=inter_link, precision=precision, utilization=utilization, headroom=headroom)
    node = node_preset(acc, inter_link=inter_link, gpus_per_node=min(result.gpus_per_node, gpus))
    job = _Job(shape, node, gpus, micro_batch, seq_len, precision, result.utilization, headroom)
    tp = node.gpus_per_node if tp_size is None else tp_size
    ParallelLayout.for_world(gpus, tp=tp, gpus_per_node=node.gpus_per_node, nhead=shape.nhead, names=_NAMES)
    rows = [_from_plan(o, job) for o in result.options if o.name in _FROM_PLAN and o.gpus == gpus]
    for ac in (False, True):
        if tp > 1:
            rows.append(price_layout(job, ParallelLayout.for_world(gpus, tp=tp), ac))
        if sp_size > 1:
            rows.append(price_layout(job, ParallelLayout.for_world(gpus, sp=sp_size, sp_method=sp_method), ac))
        if tp > 1 and sp_size > 1 and ParallelLayout.allows(gpus, tp=tp, sp=sp_size, sp_method=sp_method,
                                                            nhead=shape.nhead, kv_heads=shape.kv_heads,
                                                            seq_len=seq_len):
            rows.append(price_layout(job, ParallelLayout.for_world(gpus, tp=tp, sp=sp_size, sp_method=sp_method), ac))
    if pp_size != 1:
        rows += _pipeline_rows(job, tp, pp_size, batch_tokens)
    if batch_tokens is not None:
        rows = [dataclasses.replace(r, within_batch=r.tokens_per_step <= batch_tokens) for r in rows]
    return rows


def tp_rows(shape: DecoderShape, gpu: Accelerator, gpus: int, sizes: list[int], *, seq_len: int, micro_batch: int,
            gpus_per_node: int, inter_link: str, precision: str, utilization: float,
            headroom: float) -> list[AxisOption]:
    """TP over each of ``sizes`` GPUs of a node x FSDP2 across, plain and asynchronous, without and
    with full checkpointing (:func:`price_layout`), at ``utilization``: the planner's search
    (:func:`~handbook_lib.models.plan_search.search_plan`). Arguments as :func:`compare_axes`."""
    node = node_preset(gpu, inter_link=inter_link, gpus_per_node=min(gpus_per_node, gpus))
    job = _Job(shape, node, gpus, micro_batch, seq_len, precision, utilization, headroom)
    return [price_layout(job, ParallelLayout.for_world(gpus, tp=t), ac, async_tp=a)
            for t in sizes for a in (False, True) for ac in (False, True)]


def pipeline_microbatches(gpus: int, tp: int, pp: int, tokens_per_micro_batch: int,
                          batch_tokens: int | None) -> int:
    """Micro-batches a pipeline of ``pp`` stages runs a step: ``4·pp``, which keeps 1F1B's bubble
    ``(p − 1)/(m + p − 1)`` under 20 %, or fewer if the batch allows fewer, never fewer than
    ``pp`` (1F1B's least; then the step takes more than the batch). ``tokens_per_micro_batch``:
    one micro-batch's tokens (its sequences times their length)."""
    check_int("pp", pp, 1)
    if batch_tokens is None:
        return 4 * pp
    replicas = gpus // (tp * pp)
    return max(pp, min(4 * pp, batch_tokens // (replicas * tokens_per_micro_batch)))


def _pipeline_rows(job: _Job, tp: int, pp_size: int, batch_tokens: int | None) -> list[AxisOption]:
    """The pipeline rows of :func:`compare_axes`, 1F1B and interleaved 1F1B (two stages a GPU,
    where the layers allow): ``pp_size``'s, or with 0 the best stage count and schedule (the most
    tokens per second per GPU among those that fit, within the batch; else the smallest peak),
    with and without checkpointing."""
    groups = job.gpus // tp
    sizes = [pp_size] if pp_size > 1 else [p for p in (2, 4, 8, 16, 32, 64)
                                           if p <= min(groups, job.shape.num_layers) and groups % p == 0]
    if pp_size > 1:
        ParallelLayout.for_world(job.gpus, tp=tp, pp=pp_size, layers=job.shape.num_layers, names=_NAMES)
    tokens = job.micro_batch * job.seq_len
    rows = []
    for ac in (False, True):
        priced = []
        for p in sizes:
            m = pipeline_microbatches(job.gpus, tp, p, tokens, batch_tokens)
            layout = ParallelLayout.for_world(job.gpus, tp=tp, pp=p)
            priced.append(price_layout(job, layout, ac, m))
            # interleaved 1F1B, two stages a GPU, where the layers fill 2p stages and the rounds divide m
            if job.shape.num_layers >= 2 * p and m % max(1, m // p) == 0:
                priced.append(price_layout(job, layout, ac, m, stages_per_rank=2))
        if pp_size > 1:
            rows += priced
            continue
        good = [r for r in priced if r.fits and (batch_tokens is None or r.tokens_per_step <= batch_tokens)]
        if priced:
            rows.append(max(good, key=lambda r: r.tokens_per_s_per_gpu) if good
                        else min(priced, key=lambda r: r.peak_reserved_bytes))
    return rows


def recommend_axes(rows: list[AxisOption]) -> AxisOption | None:
    """The layout that fits (and keeps within the batch) with the most tokens per second per GPU; within
    :data:`~handbook_lib.models.planner.STEP_TIE` (1 %) of the best, fewer axes, then no
    recomputation. ``None`` when none fits."""
    fits = [r for r in rows if r.fits and r.within_batch]
    if not fits:
        return None
    best = max(r.tokens_per_s_per_gpu for r in fits)
    tied = [r for r in fits if r.tokens_per_s_per_gpu >= best * (1 - STEP_TIE)]
    return min(tied, key=lambda r: (r.tp_size * r.sp_size * r.pp_size, r.activation_checkpointing,
                                    -r.tokens_per_s_per_gpu))


def axes_reason(rows: list[AxisOption], band: StepTimeBand | None = None) -> str:
    """One or two sentences: which layout wins and why, against the best of the others; with the
    GPU's ``band`` (:func:`~handbook_lib.models.bands.step_time_band`), a lead smaller than the
    model's median error there is called a tie to time."""
    chosen = recommend_axes(rows)
    if chosen is None:
        least = min(rows, key=lambda r: r.peak_reserved_bytes)
        return (f"Nothing fits: the smallest peak is {least.name}'s, {least.peak_reserved_bytes / 1e9:.1f} GB "
                f"reserved per GPU against {least.budget_bytes / 1e9:.1f} GB usable.")
    others = [r for r in rows if r.fits and r.within_batch and r is not chosen]
    text = (f"Picks {chosen.name}: {chosen.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
            f"{chosen.peak_reserved_bytes / 1e9:.1f} GB reserved of {chosen.budget_bytes / 1e9:.1f} GB.")
    past = [r for r in rows if r.fits and not r.within_batch]
    if past:
        text += (f" {past[0].name} would take {past[0].tokens_per_step:,} tokens a step, past the batch.")
    unfit = [r for r in rows if not r.fits and r.activation_checkpointing and r.tp_size * r.sp_size * r.pp_size == 1]
    if others:
        runner = max(others, key=lambda r: r.tokens_per_s_per_gpu)
        if runner.tokens_per_s_per_gpu >= chosen.tokens_per_s_per_gpu * (1 - STEP_TIE):
            why = "a tie, won by fewer axes or no recomputation"
        else:
            why = f"{chosen.tokens_per_s_per_gpu / runner.tokens_per_s_per_gpu:.2f}x its tokens/s per GPU"
            if band is not None and band.tie(chosen.tokens_per_s_per_gpu, runner.tokens_per_s_per_gpu):
                why += f", less than the model's median error on this GPU ({100 * band.median:.1f} %): time both"
        text += f" Best other: {runner.name} ({runner.tokens_per_s_per_gpu:,.0f}); {why}."
    elif unfit and not past:
        text += (f" Nothing without another axis fits ({unfit[0].name}: "
                 f"{unfit[0].peak_reserved_bytes / 1e9:.1f} GB).")
    pipes = [r for r in rows if r.pp_size > 1]
    return text + (" " + _pipeline_reason(pipes, chosen) if pipes else "")


def _pipeline_reason(pipes: list[AxisOption], chosen: AxisOption) -> str:
    """What the best pipeline row buys and pays, against the pick."""
    good = [r for r in pipes if r.fits and r.within_batch]
    if not good:
        least = min(pipes, key=lambda r: r.peak_reserved_bytes)
        return (f"No pipeline fits: {least.name} reserves {least.peak_reserved_bytes / 1e9:.1f} GB per GPU (its "
                f"first stage keeps {least.pp_size} micro-batches in flight, and its units gathered with their "
                "gradients unsharded through the micro-batches).")
    best = max(good, key=lambda r: r.tokens_per_s_per_gpu)
    p, m, v = best.pp_size, best.microbatches, best.stages_per_rank
    formula = "(p - 1)/(v m + p - 1)" if v > 1 else "(p - 1)/(m + p - 1)"
    text = (f"A pipeline of {p} stages ({best.name}) shards each stage over {best.dp_size:,} GPUs, not "
            f"{best.dp_size * p:,}, and gathers each unit {m + 1} times for {m} micro-batches; it idles "
            f"{best.bubble_s:.2f} s of its {best.step_s:.2f} s step in the bubble ({formula} = "
            f"{bubble_fraction(p, m, v):.0%})")
    if best is chosen:
        return text + ": the fastest that fits."
    return text + (f": {best.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
                   f"{best.tokens_per_s_per_gpu / chosen.tokens_per_s_per_gpu:.2f}x the pick's.")
