"""The phases of a training step, one function each: what is alive on one rank at that moment.

Pure arithmetic. Chapter 2 teaches it; :func:`handbook_lib.models.memory.estimate_memory` takes
the largest phase as the step's peak, and every ``fsdp_train`` run checks it against a memory
tracker. The symbols of the docstrings, all read from one :class:`StepShape`:

- ``c``, ``r``: bytes per element of the compute and the reduce dtype; N the shard group;
- ``U_i``: elements of layer unit i, padded to a multiple of N (per tensor; once per unit with
  FSDP1's flat parameters); ``R`` the root unit's (the embedding and the output head); P all
  parameters; ``S`` the model state at rest (parameters, gradients, optimizer states);
- ``A``: activation bytes at the end of forward; ``a`` those each layer's backward frees;
- ``T``: tokens of the micro-batch, ``d`` its width, ``V`` the vocabulary; ``H`` the output
  head's elements; ``L = 4·T·V``: the loss's fp32 log-softmax.

Each function returns the bytes of each component (:data:`handbook_lib.models.memory.COMPONENTS`)
alive in its phase, or ``None`` where the strategy or the inputs have no such phase. The
sharding strategies (FULL_SHARD, SHARD_GRAD_OP and their hybrids) follow what FSDP2 does on
every rank (torch 2.x); the replicating ones (DDP, NO_SHARD, NONE) keep the whole state, plus
what each wrapper adds.

What to carry to a GPU, and what is there to match the CPU runs to the byte: FULL_SHARD's peak
is ``S`` plus, at the worst moment, the root and two layers gathered (the one computing and the
next, prefetched: FSDP2 issues its backward prefetch on every backend, so it is counted), one
layer's gradient buffers, and the activations and logits still alive. Two terms exist for
exactness on the CPU: gloo's flattened copy of a reduce-scatter's input (``gloo``; NCCL has
none) and the gradient FSDP2's post-backward loop variable still holds (``lasts``). One
exists for a GPU only (``backend="nccl"``, which in this project means CUDA ranks): with CPU
offload, the device copies of a unit's shards in :func:`offload_gather` (``gathers``). The
optimizer step's temporaries (``step_temp``) depend on its implementation, whose default
differs by device (foreach on CUDA, the for-loop on the CPU). Not modelled: the
forward all-gathers a GPU issues ahead on their own stream, which can hold one more gathered
unit in forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from handbook_lib.core.strategies import Strategy
from handbook_lib.models.activations import ActivationBytes

__all__ = ["StepShape", "Moment", "backward_walk", "forward_start", "layer_forward", "forward_end", "loss_backward",
           "backward_start", "head_backward", "layer_backward", "layer_reduce", "root_reduce",
           "layer_recompute", "optimizer_step", "offload_gather", "PHASES", "late_free_bound"]

Components = dict[str, int]

@dataclass(frozen=True)
class StepShape:
    """One step's sizes, resolved once from the layout, the strategy row and the dtypes; bytes
    unless a field says elements."""

    row: Strategy
    """The strategy's row of the table."""
    state: dict[str, int]
    """``params``, ``grads`` and ``optimizer`` on the device at rest (all 0 with CPU offload)."""
    c: int
    """Bytes per element of the compute dtype."""
    r: int
    """Bytes per element of the reduce dtype."""
    group: int
    """N: ranks sharding one copy of the model."""
    replicas: int
    """HSDP's replicas whose all-reduce buffers stay alive (1 otherwise, and with FSDP1)."""
    layers: tuple[int, ...]
    """U_i: padded elements of each layer unit, forward order (empty when unknown)."""
    root: int
    """R: padded elements of the root unit (0 when unknown)."""
    known: bool
    """The units' sizes are known (a bare parameter count knows none)."""
    params: int
    """P: all parameters (elements)."""
    acts: ActivationBytes | None
    """Activations of the micro-batch (``None``: not counted)."""
    head: int
    """H: elements of the output head."""
    hidden: int
    """T·d: elements of the micro-batch's hidden states."""
    logits: int
    """T·V: elements of the micro-batch's logits."""
    mask: int
    """Bytes of the causal mask built before the first layer."""
    saved: tuple[int, ...]
    """a_i: activation bytes each layer unit saves in forward and frees in backward, forward
    order (0s when the units are not the layers; a checkpointed layer's differ from the others'
    when only every k-th is checkpointed)."""
    lasts: tuple[int, ...]
    """Bytes of each unit's last gradient, which outlives its reduce-scatter, root first (FSDP2
    with more than one shard; 0 where the tensors are unknown)."""
    plain: tuple[int, ...]
    """Unpadded elements of each layer unit (with gradient accumulation, else 0)."""
    biggest: tuple[int, ...]
    """Elements of each layer unit's largest tensor (with accumulation and known tensors, else 0)."""
    optimizer_states: int
    """Parameter-shaped states of the optimizer (Adam's 2)."""
    accumulated: int
    """Bytes of unsharded gradients held between micro-steps (gradient accumulation)."""
    gloo: bool
    """gloo with more than one shard: its reduce-scatter flattens its input into a copy."""
    flat: bool
    """FSDP1's flat parameters."""
    checkpointing: bool
    """Activation checkpointing."""
    step_temp: int = 0
    """Bytes the optimizer step allocates at its worst moment
    (:func:`~handbook_lib.models.model_state.optimizer_temporary_bytes`: 0 for SGD, a fused step,
    or a GPU's step offloaded to its host)."""
    gathers: tuple[int, ...] = ()
    """With CPU offload on a GPU: the bytes each unit's all-gather holds at its worst moment,
    root first, its output and the shards copied to the device included
    (:func:`~handbook_lib.models.offload.estimate_offload_gather_bytes`); empty otherwise."""
    loss_chunks: tuple[int, int] = (1, 0)
    """``(k, b)``: the cross-entropy computed in k chunks of the sequence (``loss_chunks``), of a
    micro-batch of b sequences."""
    float8_gather: bool = False
    """torchao's Float8 all-gather (``enable_fsdp_float8_all_gather``): each layer unit's weights
    are cast to float8 before their all-gather, so the buffer and the gathered weights hold 1 B an
    element (:attr:`g`); the root (embedding and output head) stays in the compute dtype."""
    root_resharded: bool = False
    """The root resharded after forward too (``fully_shard(model, reshard_after_forward=True)``)
    and gathered again as backward starts; FSDP2's default keeps it gathered."""
    grads_freed: bool = False
    """The gradients are freed after each optimizer step (``zero_grad(set_to_none=True)``,
    PyTorch's default) and one micro-step makes the step: none exist until backward makes them."""

    def alive(self, unsharded: int = 0, grad_buffers: int = 0, activations: int = 0, loss: int = 0,
              accumulating: bool = True, early: bool = False, after: int | None = None) -> Components:
        """The components alive at a moment: the state at rest, plus what is given, plus the
        gradients held between micro-steps (unless ``accumulating`` is False: they are gone).
        With the gradients freed (:attr:`grads_freed`), the state holds only those backward has
        made: none ``early`` (the forward, the loss's backward, the head's), or ``after`` the
        layer of that index, those of the layers after it (-1: every layer, the root not yet)."""
        state = self.state
        if self.grads_freed and early:
            state = {**state, "grads": 0}
        elif self.grads_freed and after is not None:  # each unit's share of the shards: U_j of ΣU + R
            total = sum(self.layers) + self.root
            made = self.state["grads"] * sum(self.layers[after + 1:]) // total if self.known and total else 0
            state = {**state, "grads": made}
        return {**state, "unsharded_params": unsharded,
                "grad_buffers": grad_buffers + (self.accumulated if accumulating else 0),
                "activations": activations, "loss_buffers": loss}

    @property
    def g(self) -> int:
        """Bytes per element of a gathered layer unit: 1 with the Float8 all-gather (its norms
        too, under 0.1 % of a layer), else the compute dtype's ``c``."""
        return 1 if self.float8_gather else self.c

    @property
    def act_total(self) -> int:
        """A: activation bytes at the end of forward."""
        return self.acts.total if self.acts else 0

    @property
    def log_softmax(self) -> int:
        """L = 4·T·V: the loss's fp32 log-softmax output."""
        return 4 * self.logits

    @property
    def copies(self) -> int:
        """Copies of a gathered unit: FSDP's all-gather buffer and the unsharded parameters (one
        on a single rank, which copies)."""
        return 2 if self.group > 1 else 1

    @property
    def kept(self) -> int:
        """Bytes gathered in forward and kept to backward: the root's, ``c·R``, when the layers
        are resharded after forward (FSDP2's default keeps the root gathered, as FSDP1 does; 0
        for a bare count), else every unit, ``c·(ΣU_i + R)`` (``c·P`` for a bare count)."""
        if self.row.reshard_after_forward:
            return 0 if self.root_resharded else self.c * self.root
        return self.g * sum(self.layers) + self.c * self.root if self.known else self.c * self.params

    @property
    def buckets(self) -> int:
        """DDP's gradient buckets, ``r·P``, a second copy of every gradient (``grad_bucket_copy``)."""
        return self.r * self.params if self.row.grad_bucket_copy else 0

    @property
    def root_copy(self) -> int:
        """FSDP1 NO_SHARD with mixed precision: the compute-dtype copy of the root's flat
        parameters, ``c·R``, kept through backward."""
        return self.c * self.root if self.row.wrapper == "fsdp" and self.c != 4 else 0


def forward_start(s: StepShape) -> Components | None:
    """Forward begins: the root and the first layer gathered, each with its all-gather buffer
    (FSDP2 keeps the root's until the next unit's all-gather), the embedding's output and the
    causal mask: ``S + 2c·(R + U_0) + c·T·d + mask`` (one copy on one rank)."""
    if not s.row.shards_params or not s.acts:
        return None
    first = s.layers[0] if s.layers else 0
    return s.alive(s.copies * (s.c * s.root + s.g * first), 0, s.c * s.hidden + s.mask, 0, early=True)


def layer_forward(s: StepShape) -> Components | None:
    """Layer i's all-gather in forward, the largest over i: its parameters copied out of the
    all-gather buffer (``2c·U_i``), the previous unit's buffer still kept (``c·U_{i-1}``, the
    root's for i = 0), the root gathered (``c·R``; SHARD_GRAD_OP: every unit gathered so far),
    and the activations so far: ``S + c·(R + U_{i-1} + 2U_i) + c·T·d + mask + i·a``."""
    if not s.row.shards_params or not s.acts or not s.layers or s.group == 1:
        return None
    reshard = s.row.reshard_after_forward
    moments = []
    for i, unit in enumerate(s.layers):
        prev = s.g * s.layers[i - 1] if i else s.c * s.root
        gathered = s.c * s.root + (0 if reshard else s.g * sum(s.layers[:i]))
        moments.append(s.alive(gathered + prev + 2 * s.g * unit, 0,
                               s.c * s.hidden + s.mask + sum(s.saved[:i]), 0, early=True))
    return _largest(moments)


def forward_end(s: StepShape) -> Components | None:
    """Forward ends, the logits just computed (``c·T·V``) beside the activations saved so far
    (``A - L``), the root gathered and the last all-gather's buffer, which FSDP2 frees in the
    root's post-forward (the last layer's, ``c·U_last``; one unit: the root's own, ``c·R``):
    ``S + c·(R + U_last) + A - L + c·T·V`` (SHARD_GRAD_OP: every unit gathered)."""
    if not s.row.shards_params or not s.acts:
        return None
    buffer = 0 if s.group == 1 else s.g * s.layers[-1] if s.layers else s.c * s.root
    gathered = s.c * s.root if s.row.reshard_after_forward else s.kept
    return s.alive(gathered + buffer, 0, s.act_total - s.log_softmax + s.c * s.logits, 0, early=True)


def loss_backward(s: StepShape) -> Components | None:
    """The loss's backward, with every activation still saved and the loss's two fp32 (T × V)
    gradients: ``S + kept + A + 2L`` (sharded: ``kept`` is what stays gathered after forward;
    DDP adds its buckets ``r·P``; FULL_SHARD keeps the root, ``c·R``). In k > 1 chunks
    (``loss_chunks``) the largest of three
    moments: one chunk's two fp32 gradients, ``2L/k``; the chunks' gradients joined into the
    logits' (``c·T·V`` beside the k chunks' own, the log-softmax freed), ``2c·T·V − L``; and the
    end of the loss's forward, the logits (``c·T·V``) still held with the last chunk's fp32 copy
    (``L/k``: an upcast, or in fp32 the flattening of a chunk that more than one sequence makes
    non-contiguous). In fp32 that is ``L + L/k``, in bf16 ``2·T·V + L/k`` or ``2L/k``."""
    loss = 2 * s.log_softmax
    k, micro_batch = s.loss_chunks
    if k > 1:
        copy = s.log_softmax // k if s.c != 4 or micro_batch > 1 else 0
        loss = max(loss // k, 2 * s.c * s.logits - s.log_softmax, s.c * s.logits + copy)
    if s.row.shards_params:
        return s.alive(s.kept, 0, s.act_total, loss, early=True)
    return s.alive(0, s.buckets, s.act_total, loss, early=True)


def backward_start(s: StepShape) -> Components | None:
    """Backward begins: the log-softmax freed, the logits' gradient alive (``c·T·V``), the
    root still gathered from forward (FULL_SHARD: ``c·R``): ``S + c·R + A - L + c·T·V``; with
    the root resharded after forward, gathered again, its buffer too (``2c·R``)."""
    loss = s.c * s.logits
    if s.row.shards_params:
        again = s.row.reshard_after_forward and s.root_resharded
        return s.alive(s.copies * s.c * s.root if again else s.kept, 0, s.act_total - s.log_softmax, loss,
                       early=True)
    return s.alive(s.root_copy, s.buckets, s.act_total - s.log_softmax, loss, early=True)


def head_backward(s: StepShape) -> Components | None:
    """The output head's backward: the logits' gradient, the head's weight gradients and the
    hidden states' gradient alive together: ``S + c·R + c·(H + T·d) + A - L + c·T·V``."""
    if not s.acts:
        return None
    grads = s.c * s.head + s.c * s.hidden
    loss = s.c * s.logits
    if s.row.shards_params:
        gathered = s.c * s.root if s.row.reshard_after_forward else s.kept
        return s.alive(gathered, grads, s.act_total - s.log_softmax, loss, early=True)
    return s.alive(s.root_copy, s.buckets + grads, s.act_total - s.log_softmax, loss, early=True)


@dataclass(frozen=True)
class Moment:
    """One layer unit's backward (last layer first), and what it finds alive besides itself."""

    index: int
    """The unit's position in forward order."""
    unit: int
    """U_i, elements."""
    others: int
    """Bytes of unsharded parameters besides the unit: the root and the next unit's prefetched
    all-gather buffer (resharded), or every unit not yet resharded after its backward."""
    held: int
    """Gradient-buffer bytes alive from before: the head's gradients (``c·H``, unless
    accumulating), the previous unit's reduce-scatter input and HSDP's all-reduce buffers."""
    held_rs: int
    """The previous unit's reduce-scatter input, ``r·U_{i+1}``, which FSDP2 keeps until this
    unit's post-backward (``reduce_scatter_states``; not with FSDP1)."""
    left: int
    """Activation bytes still saved as its backward starts: ``A - L - Σ a`` over the layers
    whose backward came before."""
    done: int
    """Accumulated gradient bytes already reduce-scattered before this unit."""
    done_after: int
    """... and after it."""


def backward_walk(s: StepShape) -> list[Moment]:
    """Every layer unit's backward in order (last layer first), each with what it finds alive.

    FSDP2 keeps, besides the unit being computed: the root unsharded and the head's gradients
    (reduced at the end of backward); the next unit's all-gather buffer (prefetched); the
    previous unit's reduce-scatter input; with HSDP (replicas > 1) every reduced unit's
    all-reduce buffer, its reduce-scatter output (``r·U/N``), to the end of backward
    (``_all_reduce_state``: with gradients zeroed, not freed, they are extra memory).
    """
    if not s.row.shards_params:
        return []
    order = list(range(len(s.layers)))[::-1]
    moments = []
    held_rs = held_ar = freed = done = released = 0
    for j, i in enumerate(order):
        unit = s.layers[i]
        following = s.layers[order[j + 1]] if j + 1 < len(order) else 0
        if s.row.reshard_after_forward:
            others = s.c * s.root + (s.g * following if s.group > 1 else 0)
        else:
            others = s.kept - freed - s.g * unit
        held = (0 if s.accumulated else s.c * s.head) + held_rs + held_ar
        after = done + s.plain[i] * s.r
        moments.append(Moment(i, unit, others, held, held_rs, s.act_total - s.log_softmax - released,
                              done, after))
        released += s.saved[i] if s.saved else 0
        done = after
        held_rs = s.r * unit if not s.flat else 0
        held_ar += s.r * unit // s.group if s.replicas > 1 else 0
        freed += s.g * unit
    return moments


def layer_backward(s: StepShape) -> Components | None:
    """A layer's backward, the largest over the layers: the unit gathered (``c·U_i``) besides
    what the walk finds (:func:`backward_walk`), its gradients computed (``c·U_i``; with
    accumulation only its largest tensor's, added in place), the activations left:
    ``S + others + c·U_i + held + c·U_i + left``."""
    moments = backward_walk(s)
    if not moments:
        return None
    return _largest([s.alive(m.others + s.g * m.unit, m.held + _new_grads(s, m) - m.done, m.left, 0,
                             after=m.index) for m in moments])


def layer_reduce(s: StepShape) -> Components | None:
    """A layer's reduce-scatter (FSDP2), the largest over the layers: the unit resharded, the
    previous input released, the larger of two moments: its gradients copied into the
    reduce-scatter input (``c·U_i + r·U_i``), then that input, its 1/N output, gloo's flattened
    copy and the unit's last gradient (``r·U_i·(1 + 1/N [+ 1]) + last_i``)."""
    moments = backward_walk(s)
    if not moments or s.flat:
        return None
    return _largest([s.alive(m.others, m.held - m.held_rs + _reduce_buffers(s, m.unit, s.lasts[m.index + 1])
                             - m.done_after, m.left - (s.saved[m.index] if s.saved else 0), 0, after=m.index)
                     for m in moments])


def root_reduce(s: StepShape) -> Components | None:
    """End of backward. Sharded: the root's reduce-scatter, as :func:`layer_reduce`, with every
    HSDP all-reduce buffer (``Σ r·U_i/N``) and nothing accumulated left. FSDP1 NO_SHARD: the
    root's gradients and the flat gradient autograd concatenates from them, or its cast to the
    reduce dtype when larger (``root_copy + c·R + max(c·R, r·R)``)."""
    if s.row.shards_params:
        held_ar = sum(s.r * unit // s.group for unit in s.layers) if s.replicas > 1 else 0
        return s.alive(0, held_ar + _reduce_buffers(s, s.root, s.lasts[0]), 0, 0, accumulating=False, after=-1)
    if s.row.wrapper != "fsdp" or not s.root:
        return None
    cast = s.r * s.root if s.root_copy else 0
    return s.alive(s.root_copy, s.c * s.root + max(s.c * s.root, cast), 0, 0)


def layer_recompute(s: StepShape) -> Components | None:
    """With activation checkpointing, a layer's activations recomputed in backward, the largest
    over the layers: its unit gathered, the buffers :func:`layer_backward` finds, and one layer's
    activations more: ``S + others + c·U_i + held + left + a_recompute``."""
    moments = backward_walk(s)
    if not moments or not s.checkpointing or not s.acts:
        return None
    marks = s.acts.checkpointed_layers
    if len(marks) == len(s.layers):  # the units are the layers: only the checkpointed recompute
        moments = [m for m in moments if marks[m.index]]
    return _largest([s.alive(m.others + s.g * m.unit, m.held - m.done, m.left + s.acts.recompute, 0,
                             after=m.index) for m in moments])


def optimizer_step(s: StepShape) -> Components | None:
    """The optimizer step: the state, DDP's buckets and the step's temporaries,
    ``S + buckets + step_temp`` (``step_temp``:
    :func:`~handbook_lib.models.model_state.optimizer_temporary_bytes`, by implementation;
    torch's default is foreach on CUDA and the for-loop on the CPU). A sharding strategy holds
    nothing else then: its unsharded gradients and buffers are gone. No phase where the step
    allocates nothing (SGD, a fused step, a GPU's step offloaded to its host)."""
    if not s.step_temp:
        return None
    return s.alive(0, s.buckets + s.step_temp, 0, 0, accumulating=not s.row.shards_params)


def offload_gather(s: StepShape) -> Components | None:
    """CPU offload on a GPU: a unit's shards copied to the device for its all-gather, ``G_i``
    bytes with its output (:func:`~handbook_lib.models.offload.estimate_offload_gather_bytes`),
    the largest over the moments a unit is gathered:

    - forward, the root before the embedding: ``S + G_R``; a layer: the root (SHARD_GRAD_OP:
      every unit so far) gathered, the previous unit's all-gather buffer kept (N > 1), the
      activations so far: ``S + c·R + c·U_{i-1} + G_i + c·T·d + mask + i·a``;
    - backward (units resharded after forward; the root stays gathered from forward, else it
      is copied in again, ``S + G_R + A - L + c·T·V``): the last layer's all-gather prefetched
      (N > 1) with the logits' gradient alive,
      ``S + c·R + G_last + A - L + c·T·V``; in a layer's backward, before
      its gradients, the next unit's prefetched all-gather, ``S + c·R + c·U_i + G_next + held
      + left`` (N = 1: the layer's own copy, ``S + c·R + G_i + held + left``).

    The reduce-scatter's output stays on the device until its copy to the host: that is the
    ``1/N`` output :func:`layer_reduce` already counts, as on the CPU. With N > 1 this phase
    stays under :func:`layer_forward` and :func:`layer_backward` for equal layers
    (``G ≤ 2c·U``); on one rank the root's copy can lead. ``None`` without CPU offload on a GPU.
    """
    if not s.gathers or not s.row.shards_params:
        return None
    reshard, one = s.row.reshard_after_forward, s.group == 1
    root, layers = s.gathers[0], s.gathers[1:]
    moments = [s.alive(root, 0, 0, 0)]
    if s.acts:
        for i, gather in enumerate(layers):
            prev = 0 if one else s.c * (s.layers[i - 1] if i else s.root)
            gathered = s.c * s.root + (0 if reshard else s.c * sum(s.layers[:i]))
            moments.append(s.alive(gathered + prev + gather, 0, s.c * s.hidden + s.mask + sum(s.saved[:i]), 0))
    if reshard:
        loss, left = s.c * s.logits, s.act_total - s.log_softmax
        if s.root_resharded:  # the root copied in again as backward starts
            moments.append(s.alive(root, 0, left, loss))
        walk = backward_walk(s)
        if layers and not one:
            moments.append(s.alive(s.c * s.root + layers[-1], 0, left, loss))
        for j, m in enumerate(walk):
            if one:
                moments.append(s.alive(s.c * s.root + layers[m.index], m.held - m.done, m.left, 0))
            elif j + 1 < len(walk):
                nxt = walk[j + 1].index
                moments.append(s.alive(s.c * s.root + s.c * m.unit + layers[nxt], m.held - m.done, m.left, 0))
    return _largest(moments)


PHASES: tuple[Callable[[StepShape], Components | None], ...] = (
    forward_start, layer_forward, forward_end, loss_backward, backward_start, head_backward, layer_backward,
    layer_reduce, root_reduce, layer_recompute, optimizer_step, offload_gather,
)
"""Every phase, in the order they are evaluated (a tie goes to the first)."""


def late_free_bound(s: StepShape, peak: int, backward_start_bytes: int) -> int:
    """On gloo with sharded parameters: the peak if a finished collective's buffers are freed
    late by gloo's worker thread (bytes; 0 where that cannot raise the peak above ``peak``).

    Under load a layer's all-gather buffer freed late can meet backward's start
    (``backward_start + c·U_last``), or a unit's flattened reduce-scatter copy the next unit's
    start (``S + c·R + 2c·U_i + held + held_rs + left``, or ``others + c·U_i`` with everything
    gathered). A bound for a run under load, not a prediction for an idle one.
    """
    if not (s.row.shards_params and s.gloo and s.layers and not s.flat):
        return 0
    reshard = s.row.reshard_after_forward
    late = []
    for j, m in enumerate(backward_walk(s)):
        if j:
            start = s.c * s.root + 2 * s.g * m.unit if reshard else m.others + s.g * m.unit
            late.append(sum(s.alive(start, m.held + m.held_rs, m.left, 0, after=m.index).values()))
    if reshard:
        late.append(backward_start_bytes + s.g * s.layers[-1])
    worst = max(late, default=0)
    return worst if worst > peak else 0


def _largest(moments: list[Components]) -> Components:
    """The moment with the most bytes alive (the first, at a tie)."""
    return max(moments, key=lambda p: sum(p.values()))


def _new_grads(s: StepShape, m: Moment) -> int:
    """Bytes of a unit's gradients as its backward computes them: the whole unit, or with
    accumulation only its largest tensor's at a time (added in place to those held)."""
    return s.c * (s.biggest[m.index] if s.accumulated and s.biggest[m.index] else m.unit)


def _reduce_buffers(s: StepShape, unit: int, last: int) -> int:
    """A unit's post-backward, the larger of two moments: the gradients copied into the
    reduce-scatter input, ``c·U + r·U``; then the input, its 1/N output, gloo's copy and the
    unit's last gradient, ``r·U + r·U/N (+ r·U) + last``."""
    copy_in = s.c * unit + s.r * unit
    scatter = s.r * unit + s.r * unit // s.group + (s.r * unit if s.gloo else 0) + last
    return max(copy_in, scatter)
