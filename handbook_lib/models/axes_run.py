"""One pricing of a chapter-9 job: the book's model on any layout, with any of the run's levers.

Pure: no ``torch``. A :class:`~handbook_lib.core.parallel_config.ParallelConfig` names the model,
the layout (``tp_size``, ``sp_size`` and its method, Megatron's ``sequence_parallel``, the
data-parallel ranks sharded as ``strategy`` says) and the levers (``precision``,
``activation_checkpointing``, ``grad_accum_steps``, ``max_grad_norm``, FSDP2's resharding and
wrapping). From it, on ``world_size`` ranks, this module prices what one rank holds and sends in
the measured (last) step of the ``tensor_parallel`` and ``sequence_parallel`` runs:

- :func:`estimate_axes_state_bytes`: parameters, gradients and optimizer state, each parameter's
  tensor-parallel shape sharded by FSDP2 over ``dp_shard × sp`` ranks;
- :func:`estimate_axes_activation_bytes`: what autograd keeps after a micro-batch's forward;
- :func:`estimate_axes_collectives`: every collective and transfer of the step, each axis's.

Each is exact on CPU ranks (gloo) and checked by the runs against the memory tracker and the
collective counter; a formula's terms are written out in its docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from handbook_lib.core.checks import check_int
from handbook_lib.core.config import checkpointing_mode, dtype_bytes, get_precision
from handbook_lib.core.parallel_config import ParallelConfig
from handbook_lib.core.strategies import get_strategy
from handbook_lib.models.activations import ActivationBytes, checkpointed
from handbook_lib.models.collectives import estimate_collective
from handbook_lib.models.sequence_parallel import estimate_sp_collectives
from handbook_lib.models.sharding import Unit, policy_units
from handbook_lib.models.tensor_parallel import (
    TPStateBytes,
    estimate_tp_collectives,
    estimate_tp_state_bytes,
    tp_local_shapes,
    tp_param_placements,
    tp_padded,
)
from handbook_lib.models.traffic import estimate_step_traffic

__all__ = ["AxesCall", "estimate_axes_state_bytes", "estimate_axes_activation_bytes", "estimate_axes_collectives",
           "axes_micro_batch", "tp_step_calls", "per_step_calls", "axes_units"]

_INDEX_BYTES = 8
"""Bytes of one int64 token id or target."""


@dataclass(frozen=True)
class AxesCall:
    """One collective or transfer a rank issues in the step: what the collective counter records."""

    kind: str
    """``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``, ``send`` or ``recv``."""
    axis: str
    """Whose: ``tp`` (the plan's), ``sp`` (the attention's), ``fsdp`` (FSDP2's) or ``clip``
    (the gradient norm's partial sums)."""
    buffer_bytes: int
    """The buffer as the counter reads it (all-gather: the gathered output)."""
    group_size: int
    """Ranks of the group it runs in."""
    site: str
    """What issues it, e.g. ``layers.0.out_proj`` or the FSDP unit ``layers.0``."""

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank sends in it (:func:`~handbook_lib.models.collectives.estimate_collective`)."""
        return estimate_collective(self.kind, self.buffer_bytes, self.group_size).sent_bytes


def axes_micro_batch(config: ParallelConfig, world_size: int) -> int:
    """Sequences in one micro-batch of one rank: ``batch_size / (dp · grad_accum_steps)``.

    Raises:
        ValueError: what :meth:`ParallelConfig.data_parallel_size` refuses.
    """
    return config.batch_size // (config.data_parallel_size(world_size) * config.grad_accum_steps)


def estimate_axes_state_bytes(config: ParallelConfig, world_size: int, fsdp_rank: int = 0) -> TPStateBytes:
    """Parameter, gradient and optimizer bytes of the rank at ``fsdp_rank`` of its FSDP group
    (``dp_shard × sp`` ranks): each parameter's tensor-parallel shape
    (:func:`~handbook_lib.models.tensor_parallel.tp_local_shapes`, the vocabulary padded), then
    FSDP2's dim-0 rule over the group (:func:`~handbook_lib.models.tensor_parallel.estimate_tp_state_bytes`).
    fp32 parameters, gradients and states whatever the precision (FSDP2's mixed precision casts
    only what it gathers)."""
    layout = config.parallel_layout(world_size)
    return estimate_tp_state_bytes(config.model_config(), layout.tp, layout.fsdp_size, fsdp_rank, config.optimizer)


def estimate_axes_activation_bytes(config: ParallelConfig, micro_batch: int, sp_rank: int = 0) -> ActivationBytes:
    """Bytes alive after one micro-batch's forward pass on one rank, as the memory tracker files
    them (autograd's saved tensors and the loss).

    With T = ``micro_batch · seq_len / sp`` tokens on the rank, width d, feed-forward f, h heads,
    vocabulary V (padded to a multiple of t), t = ``tp_size`` and c bytes per element of the
    compute dtype, one layer keeps (PyTorch 2.x's CPU kernels):

    - ``T·d·c`` ×2 and ``T·(d/t)·c`` ×4: the layer input (Q, K and V's, gathered under Megatron's
      sequence parallelism), ``linear1``'s input; Q, K, V and the attention's output (the rank's
      heads);
    - ``T·(f/t)·c`` ×2: GELU's input and output; ``4·T·(h/t)`` bytes: the attention's fp32
      log-sum-exp;
    - the norms: their inputs ``2·T·d·c`` and statistics ``4·T·c`` (mean and reciprocal std, in
      the compute dtype); 1/t of it with ``sequence_parallel`` (the sequence shard);
    - with Ulysses (``sp`` > 1): ``T·(d/t)·c`` more, the output all-to-all's result.

    Outside the layers: the token ids and targets, each rank's own copy (int64, ``16·T``), the
    head's input ``T·d·c``, the loss's fp32 log-softmax ``4·T·V/t`` and two fp32 scalars (8 B).

    ``activation_checkpointing``: ``full`` keeps each layer's input only (``T·d·c``, 1/t with
    ``sequence_parallel``: the residual stream between blocks is the sequence shard);
    ``selective`` keeps besides the outputs of its matrix products and attention
    (:data:`~handbook_lib.models.activations.SELECTIVE_SAVE`): Q, K, V and the attention's output
    and log-sum-exp, ``linear1``'s output (``T·(4d/t + f/t)·c + 4·T·h/t``) and the two row-parallel
    outputs before their reduction, whole (``2·T·d·c``). The ring computes attention with matrix
    products of its own, one pair per block it attends to (rank ``sp_rank`` attends to
    ``sp_rank + 1``, causal), and the policy keeps both: each block's scores (``b·(h/t)·s_q²·c``,
    ``s_q = seq_len / sp``) and its share of the output (``T·(d/t)·c``), in place of the fused
    kernel's output and log-sum-exp.
    """
    check_int("micro_batch", micro_batch, 1)
    t, sp = config.tp_size, config.sp_size
    compute, _ = get_precision(config.precision)
    c = dtype_bytes(compute)
    d, f, h, layers = config.d_model, config.dim_feedforward, config.nhead, config.num_layers
    tokens = micro_batch * config.seq_len // sp
    norms = 2 * tokens * d * c + 4 * tokens * c
    per_layer = tokens * (2 * d + 4 * d // t + 2 * f // t) * c + 4 * tokens * (h // t)
    per_layer += norms // t if config.sequence_parallel else norms
    if sp > 1 and config.sp_method == "ulysses":
        per_layer += tokens * (d // t) * c
    head = 2 * _INDEX_BYTES * tokens + tokens * d * c + 4 * tokens * (config.padded_vocab_size // t) + 8
    layer_input = tokens * d * c // (t if config.sequence_parallel else 1)
    attention = tokens * (d // t) * c + 4 * tokens * (h // t)  # the fused kernel's output and log-sum-exp
    if sp > 1 and config.sp_method == "ring":
        check_int("sp_rank", sp_rank + 1, 1)
        block = config.seq_len // sp
        attention = (sp_rank + 1) * (micro_batch * (h // t) * block * block * c + tokens * (d // t) * c)
    kept = {"selective": tokens * (3 * d // t + 2 * d + f // t) * c + attention, "full": 0}
    return checkpointed(per_layer, layer_input, kept, layers, head, config.activation_checkpointing)


def _times(calls: list[AxesCall], n: int) -> list[AxesCall]:
    return [c for _ in range(n) for c in calls]


def tp_step_calls(config: ParallelConfig, tokens: int, compute: str) -> list[AxesCall]:
    """The plan's collectives of one micro-step; with checkpointing, each layer's forward ones
    again in backward (the recomputation re-issues them: the book's policy saves no collective)."""
    calls = estimate_tp_collectives(config.model_config(), config.tp_size, tokens, config.sequence_parallel, compute)
    out = [AxesCall(c.kind, "tp", c.buffer_bytes, c.group_size, c.site) for c in calls]
    if checkpointing_mode(config.activation_checkpointing) != "none":
        out += [AxesCall(c.kind, "tp", c.buffer_bytes, c.group_size, c.site) for c in calls
                if c.phase == "forward" and c.site.startswith("layers.")]
    return out


def _sp_calls(config: ParallelConfig, micro_batch: int, compute: str) -> list[AxesCall]:
    """The attention's transfers of one micro-step, for the rank's h/t heads (d/t of the width):
    :func:`~handbook_lib.models.sequence_parallel.estimate_sp_collectives`; with checkpointing the
    forward ones again in backward."""
    t = config.tp_size
    local = replace(config.model_config(), d_model=config.d_model // t, nhead=config.nhead // t)
    recompute = checkpointing_mode(config.activation_checkpointing) != "none"
    out: list[AxesCall] = []
    for c in estimate_sp_collectives(local, micro_batch, config.seq_len, config.sp_size, config.sp_method, compute):
        times = c.count * (2 if recompute and c.phase == "forward" else 1)
        out += [AxesCall(c.kind, "sp", c.buffer_bytes, c.group_size, "attention")] * times
    return out


def _fsdp_calls(config: ParallelConfig, world_size: int) -> list[AxesCall]:
    """FSDP2's collectives of the step over its group (``dp_shard × sp``, replicated over
    ``dp_replicate`` for HSDP): :func:`~handbook_lib.models.traffic.estimate_step_traffic` on the
    wrap policy's units of tensor-parallel shapes, every unit (the root too) resharded after
    forward as the strategy says."""
    layout = config.parallel_layout(world_size)
    compute, reduce = get_precision(config.precision)
    units = axes_units(config, layout.tp)
    row = get_strategy(config.strategy)
    traffic = estimate_step_traffic(
        units, layout.dp_replicate * layout.fsdp_size, config.strategy, param_dtype=compute, reduce_dtype=reduce,
        grad_accum_steps=config.grad_accum_steps,
        sync_every_micro_step=config.sync_every_micro_step,
        shard_group_size=layout.fsdp_size if row.hybrid else None,
        reshard_after_forward_size=config.reshard_after_forward_size or None,
        reshard_after_backward=config.reshard_after_backward)
    return [AxesCall(r.kind, "fsdp", r.buffer_bytes, r.group_size, r.unit) for r in traffic.records]


def _clip_calls(config: ParallelConfig, world_size: int) -> list[AxesCall]:
    """With ``max_grad_norm`` > 0: each gradient's norm, a float64 DTensor partial over every mesh
    dimension that shards it, made whole by one 8-byte all-reduce per such dimension: FSDP's
    (every parameter, when the group has more than one rank) and the tensor-parallel one (the
    parameters the plan splits)."""
    if config.max_grad_norm <= 0:
        return []
    layout = config.parallel_layout(world_size)
    out = []
    for p in tp_param_placements(tp_padded(config.model_config(), layout.tp)):
        if layout.fsdp_size > 1:
            out.append(AxesCall("all_reduce", "clip", 8, layout.fsdp_size, p.name))
        if layout.tp > 1 and p.tp_dim is not None:
            out.append(AxesCall("all_reduce", "clip", 8, layout.tp, p.name))
    return out


def estimate_axes_collectives(config: ParallelConfig, world_size: int) -> list[AxesCall]:
    """Every collective and transfer one rank issues in one optimizer step of ``config`` on
    ``world_size`` ranks: per micro-step (``grad_accum_steps`` of them) the tensor-parallel plan's
    (:func:`~handbook_lib.models.tensor_parallel.estimate_tp_collectives` on the rank's
    ``micro_batch · seq_len / sp`` tokens, in the compute dtype) and the sequence split's
    (:func:`~handbook_lib.models.sequence_parallel.estimate_sp_collectives`, h/t heads), each
    layer's forward ones again in backward under activation checkpointing; FSDP2's for the whole
    step; and the gradient norm's all-reduces with ``max_grad_norm``. Under Megatron's sequence
    parallelism the norms' gradients are partial sums, all-reduced when FSDP2 syncs gradients:
    every micro-step with ``sync_every_micro_step``, in the compute dtype; else once a step, of
    the gradients accumulated in the reduce dtype (measured on 4 ranks, fp32 and bf16).

    ``loss_parallel``'s own reductions run inside DTensor's dispatch, where the counter cannot see
    them: neither listed nor counted.
    """
    compute, _ = get_precision(config.precision)
    micro = axes_micro_batch(config, world_size)
    calls: list[AxesCall] = []
    if config.tp_size > 1:
        calls += tp_step_calls(config, micro * config.seq_len // config.sp_size, compute)
    if config.sp_size > 1:
        calls += _sp_calls(config, micro, compute)
    return (per_step_calls(calls, config, config.grad_accum_steps, config.sync_every_micro_step)
            + _fsdp_calls(config, world_size) + _clip_calls(config, world_size))


def per_step_calls(calls: list[AxesCall], config: ParallelConfig, micro_steps: int, sync_every: bool) -> list[AxesCall]:
    """One micro-step's ``calls`` made a step's: each issued ``micro_steps`` times, but Megatron
    SP's norm-gradient all-reduces (sites ending in ``.weight``/``.bias``), which come with
    FSDP2's gradient sync: every micro-step with ``sync_every``, in the compute dtype; else once a
    step, of the gradients accumulated in the reduce dtype (one micro-step: as computed)."""
    each = [c for c in calls if not c.site.endswith((".weight", ".bias"))]
    synced = [c for c in calls if c.site.endswith((".weight", ".bias"))]
    if micro_steps > 1 and not sync_every:
        _, reduce = get_precision(config.precision)
        synced = [replace(c, buffer_bytes=config.d_model * dtype_bytes(reduce)) for c in synced]
    return _times(each, micro_steps) + _times(synced, micro_steps if sync_every else 1)


def axes_units(config: ParallelConfig, tp: int) -> list[Unit]:
    """The FSDP2 units of ``config``'s wrap policy, of the tensor-parallel shapes one of ``tp``
    ranks holds: what each unit gathers and reduces."""
    return policy_units(tp_local_shapes(config.model_config(), tp), config.wrap, config.wrap_min_params)
