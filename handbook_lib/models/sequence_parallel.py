"""Sequence parallelism: one sequence split over ``sp`` ranks, its activations and its traffic.
Pure arithmetic: no ``torch``.

Chapter 9 teaches it. FSDP shards the model state, not one sequence's activations: past some
length a single sequence no longer fits one GPU, whatever the data-parallel degree. Splitting
the sequence over ``sp`` ranks divides every per-token activation by ``sp``; attention, the one
operation that mixes tokens, then needs the other ranks' keys and values. Two ways:

- **DeepSpeed Ulysses** (Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv 2309.14509;
  ``deepspeed.sequence.layer.DistributedAttention``): an all-to-all turns each of Q, K and V from
  (s/P tokens, all heads) into (all s tokens, h/P heads), the attention runs locally, and one
  more all-to-all turns the output back: 4 all-to-alls per layer in forward, and 4 in backward
  (each one's gradient is the all-to-all with scatter and gather swapped). Each moves (P-1)/P of
  its tensor. With M = the whole sequence's b·s·d activation, one rank's buffer is M/P, so a
  layer's forward sends ``4·(P-1)/P · M/P`` ≈ 4M/P per rank: constant when s and P grow
  together. Megatron-LM's sequence parallelism (beside tensor parallelism) all-gathers and
  reduce-scatters the full M, two of each per layer: ``4·(P-1)/P · M`` per rank, P times more
  (the paper's comparison, §3.2). Ulysses needs the heads (the KV heads with grouped-query
  attention) divisible by P.
- **Ring attention** (Liu et al. 2023, "Ring Attention with Blockwise Transformers",
  arXiv 2310.01889): rank r keeps its queries and passes its K and V blocks around a ring of
  point-to-point sends, P-1 steps; each step it attends to the block it holds and merges the
  result with its log-sum-exp (the online softmax). The transfer of the next block hides behind
  the current block's attention when the block is long enough (:func:`ring_overlap`). On GPUs
  PyTorch's ``context_parallel`` (``torch.distributed.tensor.experimental``) is this ring; it
  runs only CUDA attention kernels, so the CPU runs use the book's own
  (:mod:`handbook_lib.runtime.ring_attention`).

Two kinds of function here:

- for the book's model and its CPU runs, exact integer bytes: :func:`parallel_layout` (the
  model with Q, K and V split, as :mod:`handbook_lib.runtime.parallel_model` builds it),
  :func:`estimate_sp_activation_bytes` (what autograd keeps per rank) and
  :func:`estimate_sp_collectives` / :func:`estimate_sp_step_traffic` (every all-to-all, send and
  receive of a step, and FSDP2's collectives over the whole world beside them);
- for decoders at scale (:class:`~handbook_lib.models.presets.DecoderShape`), for the planner:
  :func:`sequence_activation_bytes`, :func:`ulysses_layer_bytes`, :func:`ring_layer_bytes`,
  :func:`megatron_sp_layer_bytes` and :func:`ring_overlap`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import cast

from handbook_lib.core.architecture import ModelConfig
from handbook_lib.core.checks import check_int
from handbook_lib.core.config import dtype_bytes
from handbook_lib.core.parallel_layout import SP_METHODS, ParallelLayout, SpMethod
from handbook_lib.models.activations import ActivationBytes
from handbook_lib.models.collectives import estimate_collective
from handbook_lib.models.hardware import Accelerator, Link, get_accelerator, get_link
from handbook_lib.models.layout import ModelLayout, ModelLike, model_layout
from handbook_lib.models.traffic import (
    CollectiveRecord,
    StepTraffic,
    estimate_step_traffic,
)

__all__ = [
    "SP_METHODS",
    "LayerBytes",
    "RingOverlap",
    "SpCollective",
    "SpStepTraffic",
    "estimate_sp_activation_bytes",
    "estimate_sp_collectives",
    "estimate_sp_step_traffic",
    "local_tokens",
    "megatron_sp_layer_bytes",
    "parallel_layout",
    "ring_layer_bytes",
    "ring_overlap",
    "sequence_activation_bytes",
    "ulysses_layer_bytes",
]

_INDEX_BYTES = 8  # int64 token ids and targets


def _check(sp_size: int, seq_len: int, method: str | None = None, nhead: int | None = None) -> None:
    """The layout's rules for a sequence split (:meth:`ParallelLayout.check_shape`), with
    ``nhead`` (Ulysses' heads) when given."""
    check_int("sp_size", sp_size, 1)
    check_int("seq_len", seq_len, 1)
    if method is not None and method not in SP_METHODS:
        raise ValueError(f"sp_method must be one of {', '.join(SP_METHODS)}, got {method!r}")
    ParallelLayout(sp=sp_size, sp_method=cast(SpMethod, method or "ring")).check_shape(seq_len=seq_len,
                                                                             nhead=nhead)


def parallel_layout(config: ModelConfig) -> ModelLayout:
    """The layout of :class:`~handbook_lib.runtime.parallel_model.ParallelTransformer`: the
    handbook's model with each layer's fused ``in_proj_weight`` (3d, d) and ``in_proj_bias`` (3d)
    cut into ``q_proj``, ``k_proj`` and ``v_proj`` weights (d, d) and biases (d), in its
    ``named_parameters()`` order. The same parameters; FSDP2 shards (and pads) each tensor along
    dim 0, so shards and padding are those of these tensors."""
    base = model_layout(config)
    d = config.d_model
    tensors: list[tuple[str, tuple[int, ...]]] = []
    for name, shape in base.tensors:
        if name.endswith("self_attn.in_proj_weight"):
            prefix = name[: -len("in_proj_weight")]
            tensors += [(f"{prefix}{p}_proj.{w}", (d, d) if w == "weight" else (d,))
                        for p in "qkv" for w in ("weight", "bias")]
        elif not name.endswith("self_attn.in_proj_bias"):
            tensors.append((name, shape))
    return replace(base, name="the handbook's model (Q, K, V split)", tensors=tuple(tensors))


def local_tokens(micro_batch: int, seq_len: int, sp_size: int) -> int:
    """Tokens one rank holds: its ``micro_batch`` sequences times ``seq_len / sp_size`` positions."""
    _check(sp_size, seq_len)
    check_int("micro_batch", micro_batch, 1)
    return micro_batch * (seq_len // sp_size)


def estimate_sp_activation_bytes(config: ModelConfig, micro_batch: int, seq_len: int, sp_size: int,
                                 method: str = "ring", compute_dtype: str = "fp32") -> ActivationBytes:
    """Bytes autograd keeps on one rank in one forward pass of ``ParallelTransformer(config)``
    with each sequence split over ``sp_size`` ranks (``sp_size=1``: the whole sequence, the
    default causal SDPA core).

    With T = ``micro_batch · seq_len / sp_size`` tokens on the rank, width d, feed-forward width
    f, h heads and c bytes per element, one layer keeps (PyTorch's CPU kernels, fp32):

    - ``T·d·c`` ×8: the layer input (for Q, K and V's projections), Q, K and V (the attention's
      inputs), the attention's output (kept by the attention, and the output projection's input:
      the CPU kernel returns it in (batch, seq, heads) order, so the reshape is a view), and the
      inputs of norm1, linear1 and norm2;
    - ``T·f·c`` ×2: GELU's input and linear2's input;
    - ``4·T·4`` bytes: each LayerNorm's mean and reciprocal std;
    - ``4·h·T`` bytes: the attention's log-sum-exp, fp32 (no mask: the attention is causal by
      ``is_causal``, the book's model builds an s×s mask instead).

    ``ring`` keeps exactly that: its Function saves its inputs q, k, v, its output (returned, in
    the same order) and its log-sum-exp, and not the other ranks' K and V blocks (backward passes
    them around the ring again). ``ulysses`` keeps Q, K and V after the all-to-all (the whole
    sequence, h/P heads: T·d elements each), the local attention's output and its log-sum-exp
    (h/P heads over s positions: again h·T values), and one more ``T·d·c``: the output
    all-to-all's result, a new tensor the output projection keeps beside the attention's own
    output. The projections' outputs before the all-to-all are kept by nobody. DeepSpeed's
    all-to-all Functions save no tensor. Outside the layers: the token ids and targets (int64),
    the head's input ``T·d·c``, the fp32 log-softmax ``T·V·4`` and the loss's 4-byte total.

    Raises:
        ValueError: for a ``seq_len`` that ``sp_size`` does not divide, or an unknown method.
    """
    _check(sp_size, seq_len, method)
    c = dtype_bytes(compute_dtype)
    d, f, h, v = config.d_model, config.dim_feedforward, config.nhead, config.vocab_size
    tokens = local_tokens(micro_batch, seq_len, sp_size)
    extra = tokens * d * c if method == "ulysses" and sp_size > 1 else 0
    per_layer = tokens * (8 * d + 2 * f) * c + tokens * (16 + 4 * h) + extra
    head = 2 * tokens * _INDEX_BYTES + tokens * d * c + tokens * v * 4 + 4
    return ActivationBytes(per_layer=per_layer, layers=config.num_layers * per_layer, head=head, recompute=0)


@dataclass(frozen=True)
class SpCollective:
    """``count`` equal transfers one rank issues for sequence parallelism in one step."""

    kind: str
    """``all_to_all``, ``send`` or ``recv``."""
    phase: str
    """``forward`` or ``backward``."""
    buffer_bytes: int
    """Bytes of each one (all-to-all: the input the rank holds; send, recv: the tensor)."""
    group_size: int
    """Ranks of the sequence-parallel group."""
    count: int
    """How many, all layers together."""
    what: str
    """Which tensors, in words."""

    @property
    def sent_bytes(self) -> int:
        """Bytes the rank sends in all ``count`` of them."""
        return self.count * estimate_collective(self.kind, self.buffer_bytes, self.group_size).sent_bytes

    @property
    def received_bytes(self) -> int:
        """Bytes the rank receives in all ``count`` of them."""
        return self.count * estimate_collective(self.kind, self.buffer_bytes, self.group_size).received_bytes


def estimate_sp_collectives(config: ModelConfig, micro_batch: int, seq_len: int, sp_size: int, method: str,
                            compute_dtype: str = "fp32") -> tuple[SpCollective, ...]:
    """Every transfer sequence parallelism adds to one step on one rank (per kind and phase).

    With P = ``sp_size`` and B = ``T·d·c`` bytes, T = the rank's tokens (one of Q, K, V or the
    output on this rank; also one K or V block of the ring), per layer:

    - ``ulysses``: forward 4 all-to-alls of B (Q, K, V, output), backward 4 (their gradients);
    - ``ring`` (:mod:`handbook_lib.runtime.ring_attention`): forward, P-1 steps, each sending the
      K and V blocks it holds to the next rank and receiving the previous rank's: 2(P-1) sends and
      2(P-1) receives of B. Backward passes K and V around again (2(P-1) sends) and, with each
      block, its dK and dV accumulators, which go one step further, home: 2P sends. 4P-2 sends
      and 4P-2 receives of B. Every rank relays every block, also those it skips (causal: a
      block from a later rank); a causal ring could leave out the wrap-around transfers, and
      load-balance as ``context_parallel``'s head-tail sharding does.

    ``sp_size=1`` adds nothing (an empty tuple).

    Raises:
        ValueError: for a ``seq_len`` that ``sp_size`` does not divide, an unknown method, or
            (``ulysses``) ``nhead`` not divisible by ``sp_size``.
    """
    _check(sp_size, seq_len, method, config.nhead)
    p = sp_size
    if p == 1:
        return ()
    b = local_tokens(micro_batch, seq_len, p) * config.d_model * dtype_bytes(compute_dtype)
    n = config.num_layers
    if method == "ulysses":
        return (SpCollective("all_to_all", "forward", b, p, 4 * n, "Q, K, V to all tokens, h/P heads; the output back"),
                SpCollective("all_to_all", "backward", b, p, 4 * n, "the gradients of the output, V, K, Q"))
    return (SpCollective("send", "forward", b, p, 2 * (p - 1) * n, "K and V blocks to the next rank"),
            SpCollective("recv", "forward", b, p, 2 * (p - 1) * n, "K and V blocks from the previous rank"),
            SpCollective("send", "backward", b, p, (4 * p - 2) * n, "K, V blocks and their dK, dV"),
            SpCollective("recv", "backward", b, p, (4 * p - 2) * n, "K, V blocks and their dK, dV"))


@dataclass(frozen=True)
class SpStepTraffic:
    """One step's collectives on one rank: FSDP2's over the whole world, and sequence parallelism's."""

    fsdp: StepTraffic
    """FSDP2's all-gathers and reduce-scatters (the parameters are sharded over every rank)."""
    sp: tuple[SpCollective, ...]
    """Sequence parallelism's all-to-alls or sends and receives, in the sp group."""

    @property
    def fsdp_records(self) -> tuple[CollectiveRecord, ...]:
        return self.fsdp.records

    @property
    def sent_bytes(self) -> int:
        """Bytes one rank sends in the step, both kinds together."""
        return self.fsdp.sent_bytes + sum(c.sent_bytes for c in self.sp)

    def counts(self) -> dict[tuple[str, str, int], tuple[int, int]]:
        """``(kind, phase, group_size) -> (count, buffer bytes summed)`` over every collective."""
        out: dict[tuple[str, str, int], tuple[int, int]] = {}
        for r in self.fsdp.records:
            n, b = out.get((r.kind, r.phase, r.group_size), (0, 0))
            out[(r.kind, r.phase, r.group_size)] = (n + 1, b + r.buffer_bytes)
        for c in self.sp:
            n, b = out.get((c.kind, c.phase, c.group_size), (0, 0))
            out[(c.kind, c.phase, c.group_size)] = (n + c.count, b + c.count * c.buffer_bytes)
        return out


def estimate_sp_step_traffic(config: ModelConfig, world_size: int, micro_batch: int, seq_len: int, sp_size: int,
                             method: str, compute_dtype: str = "fp32") -> SpStepTraffic:
    """The collectives of one step of the ``sequence_parallel`` run on one rank.

    The parameters are the same on every rank of an sp group (each computes gradients from its
    own tokens), so FSDP2 shards them over all ``world_size`` ranks (dp × sp flattened, as
    torchtitan folds its context-parallel axis into FSDP's mesh): FULL_SHARD's schedule of
    :func:`~handbook_lib.models.traffic.estimate_step_traffic` on :func:`parallel_layout`'s
    units (one per layer and the root, kept gathered into backward), beside
    :func:`estimate_sp_collectives`.
    """
    units = parallel_layout(config).units("layer")
    fsdp = estimate_step_traffic(units, world_size, "FULL_SHARD", param_dtype=compute_dtype,
                                 reduce_dtype=compute_dtype)
    return SpStepTraffic(fsdp, estimate_sp_collectives(config, micro_batch, seq_len, sp_size, method, compute_dtype))


# ---------------------------------------------------------------- decoders at scale, for the planner


def sequence_activation_bytes(model: ModelLike, seq_len: int, sp_size: int = 1, *, micro_batch: int = 1,
                              dtype: str = "bf16", recompute: str = "none") -> int:
    """Activation bytes per GPU of ``micro_batch`` sequences of ``seq_len`` tokens split over
    ``sp_size`` ranks: the layout's activation model (for a Llama-family decoder, its saved
    tensors counted operator by operator; for GPT's, Korthikanti et al.'s ``34·s·b·h`` per layer
    in 16-bit with a fused attention; plus the head) at ``seq_len/sp`` tokens. With a fused
    attention every term is per token (but the loss's 4-byte weight total), so splitting the
    sequence divides them all by ``sp``; Ulysses' and the ring's own buffers (a few ``T·d`` per layer, in flight
    one layer at a time) are left out.

    Raises:
        ValueError: for a ``seq_len`` that ``sp_size`` does not divide, or a model without an
            activation model.
    """
    _check(sp_size, seq_len)
    acts = model_layout(model).activations(micro_batch, seq_len // sp_size, dtype,
                                           activation_checkpointing=recompute)
    if acts is None:
        raise ValueError(f"model {model_layout(model).name} has no activation model (give a shape or a config)")
    return acts.total


@dataclass(frozen=True)
class LayerBytes:
    """Bytes one rank sends for one layer in one training step, and in how many transfers."""

    forward_sent: int
    backward_sent: int
    forward_transfers: int
    backward_transfers: int

    @property
    def sent(self) -> int:
        """Forward and backward together."""
        return self.forward_sent + self.backward_sent


def _widths(model: ModelLike) -> tuple[int, int, int]:
    layout = model_layout(model)
    d = layout.d_model
    q = layout.q_width or d
    return d, q, layout.kv_width or q


def ulysses_layer_bytes(model: ModelLike, seq_len: int, sp_size: int, *, micro_batch: int = 1,
                        dtype: str = "bf16") -> LayerBytes:
    """What one rank sends per layer with Ulysses: 4 all-to-alls forward (Q, K, V: ``T·q·c``,
    ``T·k·c``, ``T·k·c``; the output ``T·q·c``, T = ``micro_batch·seq_len/sp`` tokens, q and k
    the query and key widths) and 4 backward, each sending (P-1)/P of its buffer. With M =
    ``b·s·d·c`` (q = k = d) that is ``4·M·(P-1)/P²`` each way per layer, the 4M/P of Jacobs et al.
    (2023, §3.2)."""
    _check(sp_size, seq_len)
    _, q, k = _widths(model)
    c = dtype_bytes(dtype)
    tokens = local_tokens(micro_batch, seq_len, sp_size)
    sent = sum(estimate_collective("all_to_all", tokens * w * c, sp_size).sent_bytes for w in (q, k, k, q))
    return LayerBytes(sent, sent, 4 if sp_size > 1 else 0, 4 if sp_size > 1 else 0)


def ring_layer_bytes(model: ModelLike, seq_len: int, sp_size: int, *, micro_batch: int = 1, dtype: str = "bf16",
                     grad_dtype: str | None = None) -> LayerBytes:
    """What one rank sends per layer with ring attention (the book's ring): forward, P-1 steps of
    one K and one V block (``T·k·c`` each); backward, K and V again for P-1 steps and their dK,
    dV (in ``grad_dtype``, default ``dtype``; fp32 accumulators double them) for P steps.
    Independent of P per step; ``2·(P-1)·T·k·c`` forward, about (P-1)/P · 2M with M = b·s·k·c:
    P/2 times Ulysses' with full multi-head attention; with K and V k wide and Q q wide
    (grouped-query attention) less than Ulysses' only while P < 1 + q/k (Llama-3 8B: P < 5)."""
    _check(sp_size, seq_len)
    _, _, k = _widths(model)
    p = sp_size
    block = local_tokens(micro_batch, seq_len, p) * k * dtype_bytes(dtype)
    grad = local_tokens(micro_batch, seq_len, p) * k * dtype_bytes(grad_dtype or dtype)
    if p == 1:
        return LayerBytes(0, 0, 0, 0)
    return LayerBytes(2 * (p - 1) * block, 2 * (p - 1) * block + 2 * p * grad, 2 * (p - 1), 4 * p - 2)


def megatron_sp_layer_bytes(model: ModelLike, seq_len: int, tp_size: int, *, micro_batch: int = 1,
                            dtype: str = "bf16") -> LayerBytes:
    """For comparison, what one rank sends per layer with Megatron-LM's sequence parallelism
    beside tensor parallelism over ``tp_size`` ranks (Korthikanti et al. 2022): in forward an
    all-gather of the full ``M = b·s·d·c`` before attention and before the MLP, a reduce-scatter
    after each (``4·M·(P-1)/P``), the same in backward. Jacobs et al. (2023) contrast it with
    Ulysses: it grows with M whatever P."""
    check_int("tp_size", tp_size, 1)
    check_int("seq_len", seq_len, 1)
    ParallelLayout(tp=tp_size).check_shape(seq_len=seq_len, sequence_parallel=True)
    d, _, _ = _widths(model)
    m = micro_batch * seq_len * d * dtype_bytes(dtype)
    if tp_size == 1:
        return LayerBytes(0, 0, 0, 0)
    one = estimate_collective("all_gather", m, tp_size).sent_bytes
    return LayerBytes(4 * one, 4 * one, 4, 4)


@dataclass(frozen=True)
class RingOverlap:
    """Whether one ring step's transfer hides behind that step's block attention."""

    block_tokens: int
    """Tokens of one block, ``seq_len / sp`` (times the micro-batch)."""
    compute_s: float
    """Seconds of one block's attention in forward: ``4·b·(s/P)²·q`` FLOPs (QKᵀ and PV) at
    ``utilization`` of the peak."""
    transfer_bytes: int
    """Bytes of one step's K and V blocks."""
    transfer_s: float
    """Seconds to send them: the link's latency plus bytes over its achievable bandwidth."""
    min_block_tokens: int
    """The shortest block (tokens per rank) whose attention hides its transfer on this link."""

    @property
    def hides(self) -> bool:
        """The transfer takes no longer than the computation."""
        return self.transfer_s <= self.compute_s


def ring_overlap(model: ModelLike, seq_len: int, sp_size: int, link: Link | str, accelerator: Accelerator | str,
                 *, micro_batch: int = 1, dtype: str = "bf16", utilization: float = 0.5) -> RingOverlap:
    """Does a ring of ``sp_size`` ranks over ``link`` (``"ib-ndr400"`` across nodes,
    ``"nvlink4"`` inside one) hide its transfers? Liu et al. (2023, §3): one step computes
    ``4·c²·d`` FLOPs for a block of c tokens (QKᵀ and PV, a full block; the diagonal one is half)
    and sends ``2·c·k·bytes`` (K and V), so it hides when ``c ≥ F·k·bytes / (2·d·B)`` — for
    multi-head attention in bf16, c ≥ F/B, the accelerator's FLOPs per byte of link bandwidth.
    Backward computes about 2.5× the forward's FLOPs and sends 2× its bytes (dK, dV), so forward
    is the binding step. ``utilization`` is the fraction of the bf16 (fp32 for ``dtype="fp32"``)
    peak the attention reaches.
    """
    _check(sp_size, seq_len)
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    link = get_link(link) if isinstance(link, str) else link
    acc = get_accelerator(accelerator) if isinstance(accelerator, str) else accelerator
    _, q, k = _widths(model)
    c = dtype_bytes(dtype)
    flops = acc.peak_flops(dtype) * utilization
    bandwidth = link.achievable_bytes_per_s
    block = local_tokens(micro_batch, seq_len, sp_size)
    per_seq = seq_len // sp_size
    compute = 4 * micro_batch * per_seq * per_seq * q / flops
    moved = 2 * block * k * c
    transfer = link.latency_s + moved / bandwidth
    # smallest c (per sequence) with 4·b·c²·q / F >= lat + 2·b·c·k·bytes / B
    lo, hi = 1, max(1, per_seq)
    while 4 * micro_batch * hi * hi * q / flops < link.latency_s + 2 * micro_batch * hi * k * c / bandwidth:
        hi *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        if 4 * micro_batch * mid * mid * q / flops >= link.latency_s + 2 * micro_batch * mid * k * c / bandwidth:
            hi = mid
        else:
            lo = mid + 1
    return RingOverlap(block, compute, moved, transfer, lo)
