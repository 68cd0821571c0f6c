"""Pipeline parallelism, priced: which layers each stage holds, what it holds at rest, what it
sends, and the bubble. Pure: no ``torch``.

Chapter 9 teaches it. A pipeline cuts the model at layer boundaries into ``S = pp · v`` stages
(``v`` per rank with an interleaved schedule; rank r holds stages r, r + pp, ...): the first
stage holds the embedding, the last the head. Each data-parallel rank's share of a batch is cut
into ``m`` micro-batches; a stage passes each micro-batch's activations (b/m sequences of s tokens,
``d`` wide) to the next stage and receives their gradients back, point to point.

- :func:`stage_layers`: the layers of each stage, ``L / S`` each, the remainder one more on the
  first stages;
- :func:`estimate_pipeline_state_bytes`: parameters, gradients and optimizer state of one rank's
  stages, sharded by FSDP2 over its data-parallel group (chapter 2's rule on the stage's tensors);
- :func:`estimate_pipeline_p2p`: every send and receive of one step on one rank;
- :func:`estimate_pipeline_fsdp_calls`: FSDP2's collectives over a stage's data-parallel group;
- :func:`estimate_pipeline_tp_calls`: tensor parallelism's inside each stage;
- :func:`bubble_fraction`: the share of a step a rank idles, ``(p − 1) / (v·m + p − 1)``;
- :func:`in_flight`: the micro-batches a stage holds at once (what
  :mod:`handbook_lib.models.stage_memory` prices a stage's memory with);
- :func:`schedule_actions`, :func:`most_in_flight`, :func:`simulate_schedule`, :func:`idle_fraction`:
  a schedule's order of work on each rank, what it keeps in flight, and its bubble on a grid of
  unit times.
"""

from __future__ import annotations

from fractions import Fraction
from dataclasses import dataclass

from handbook_lib.core.checks import check_int
from handbook_lib.core.config import dtype_bytes, get_precision
from handbook_lib.core.parallel_config import ParallelConfig
from handbook_lib.models.axes_run import AxesCall, per_step_calls, tp_step_calls
from handbook_lib.core.strategies import get_strategy
from handbook_lib.models.sharding import policy_units
from handbook_lib.models.tensor_parallel import (
    TPStateBytes,
    state_from_shapes,
    tp_padded,
    tp_param_placements,
)

__all__ = ["stage_layers", "rank_stages", "stage_param_shapes", "estimate_pipeline_state_bytes",
           "estimate_pipeline_p2p", "estimate_pipeline_fsdp_calls", "estimate_pipeline_tp_calls", "bubble_fraction",
           "StageSpan", "in_flight", "interleaved_in_flight", "Action", "UNIT_COST",
           "schedule_actions", "most_in_flight", "stage_rank", "simulate_schedule", "idle_fraction",
           "boundary_bytes", "SPLIT_BACKWARD"]


@dataclass(frozen=True)
class StageSpan:
    """One stage's place in the model."""

    index: int
    """The stage, 0 first."""
    first_layer: int
    """Its first layer (global index)."""
    last_layer: int
    """One past its last layer."""
    embedding: bool
    """It holds the token embedding (stage 0)."""
    head: bool
    """It holds the output head (the last stage)."""

    @property
    def layers(self) -> int:
        return self.last_layer - self.first_layer


def stage_layers(num_layers: int, stages: int) -> list[StageSpan]:
    """The ``stages`` stages of a model of ``num_layers`` layers, in order: ``num_layers // stages``
    layers each, one more on each of the first ``num_layers % stages``.

    Raises:
        ValueError: for more stages than layers (a stage holds whole layers, at least one).
    """
    check_int("stages", stages, 1)
    check_int("num_layers", num_layers, 1)
    if stages > num_layers:
        raise ValueError(f"{stages} stages must be at most num_layers={num_layers} (a stage holds whole layers)")
    per, extra = divmod(num_layers, stages)
    spans, start = [], 0
    for i in range(stages):
        n = per + (1 if i < extra else 0)
        spans.append(StageSpan(i, start, start + n, i == 0, i == stages - 1))
        start += n
    return spans


def stage_rank(schedule: str, pp_size: int, stage: int) -> int:
    """The pipeline rank that holds ``stage``: stage ``s`` on rank ``s mod p`` (a loop), or for
    ``ZBVZeroBubble`` in a V (rank ``r`` holds stages ``r`` and ``2p − 1 − r``, so the middle two
    stages share the last rank and pass activations in memory)."""
    if schedule == "ZBVZeroBubble":
        return stage if stage < pp_size else 2 * pp_size - 1 - stage
    return stage % pp_size


def rank_stages(config: ParallelConfig, pp_rank: int) -> list[StageSpan]:
    """The stages pipeline rank ``pp_rank`` holds, in order (:func:`stage_rank`): ``pp_rank``,
    ``pp_rank + pp``, ... (``v`` of them), or a V's two."""
    spans = stage_layers(config.num_layers, config.pp_stages)
    return [s for s in spans if stage_rank(config.schedule, config.pp_size, s.index) == pp_rank]


def stage_param_shapes(config: ParallelConfig, span: StageSpan) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of the parameters a stage holds on one tensor-parallel rank (the
    split-attention model's names; each split tensor 1/tp of its dimension, the vocabulary
    padded to a multiple of tp)."""
    return [(p.name, p.local_shape(config.tp_size))
            for p in tp_param_placements(tp_padded(config.model_config(), config.tp_size)) if _in_stage(p.name, span)]


def _in_stage(site: str, span: StageSpan) -> bool:
    """Whether the module or parameter ``site`` (``embedding``, ``output``, ``layers.3.linear1``,
    ``layers.3.linear1.weight``) is in ``span``."""
    top = site.split(".")[0]
    if top == "layers":
        return span.first_layer <= int(site.split(".")[1]) < span.last_layer
    return span.embedding if top == "embedding" else span.head


def estimate_pipeline_state_bytes(config: ParallelConfig, world_size: int, pp_rank: int,
                                  fsdp_rank: int = 0) -> TPStateBytes:
    """Parameter, gradient and optimizer bytes of pipeline rank ``pp_rank`` (all its stages), at
    ``fsdp_rank`` of its data-parallel group: each stage's tensors sharded by FSDP2's dim-0 rule
    over the group (no FSDP on a group of one rank), fp32."""
    shapes = [shape for span in rank_stages(config, pp_rank) for _, shape in stage_param_shapes(config, span)]
    return state_from_shapes(shapes, config.parallel_layout(world_size).fsdp_size, fsdp_rank, config.optimizer)


def estimate_pipeline_p2p(config: ParallelConfig, world_size: int, pp_rank: int) -> list[AxesCall]:
    """Every send and receive pipeline rank ``pp_rank`` issues in one step: for each of its stages
    and each of the ``m`` micro-batches, the activation sent to the next stage and received from
    the previous one, and the activation's gradient the other way; each a (b/m, s, d) tensor in
    the compute dtype, ``b`` the rank's data-parallel share of the batch (each tensor rank sends
    its copy; 1/tp of it, its sequence shard, with Megatron SP). A neighbour on the same rank
    (the V's middle two stages, :func:`stage_rank`) is passed in memory: no send."""
    layout = config.parallel_layout(world_size)
    buffer = boundary_bytes(config, world_size)
    out: list[AxesCall] = []
    last = config.pp_stages - 1

    def elsewhere(stage: int) -> bool:  # a neighbour on this rank is passed in memory (a V's middle)
        return stage_rank(config.schedule, config.pp_size, stage) != pp_rank

    for span in rank_stages(config, pp_rank):
        for _ in range(config.pp_microbatches):
            if span.index < last and elsewhere(span.index + 1):  # forward out, its gradient back in
                out += [AxesCall("send", "pp", buffer, layout.pp, f"stage {span.index}"),
                        AxesCall("recv", "pp", buffer, layout.pp, f"stage {span.index}")]
            if span.index > 0 and elsewhere(span.index - 1):  # forward in, the input's gradient out
                out += [AxesCall("recv", "pp", buffer, layout.pp, f"stage {span.index}"),
                        AxesCall("send", "pp", buffer, layout.pp, f"stage {span.index}")]
    return out


def boundary_bytes(config: ParallelConfig, world_size: int) -> int:
    """Bytes of one micro-batch's activation at a stage boundary on one rank: (b/m, s, d) in the
    compute dtype, ``b`` the rank's data-parallel share of the batch; 1/tp of it with Megatron SP
    (a stage's output is then its tensor rank's sequence shard)."""
    compute, _ = get_precision(config.precision)
    rows = config.batch_size // (config.parallel_layout(world_size).dp * config.pp_microbatches)
    buffer = rows * config.seq_len * config.d_model * dtype_bytes(compute)
    return buffer // config.tp_size if config.sequence_parallel else buffer


SPLIT_BACKWARD = ("ZBVZeroBubble",)
"""Schedules that split a backward into the input's gradient and the weights' (zero-bubble)."""


def estimate_pipeline_fsdp_calls(config: ParallelConfig, world_size: int, pp_rank: int) -> list[AxesCall]:
    """FSDP2's collectives of one step on pipeline rank ``pp_rank``, over its data-parallel group
    of ``G`` ranks (none when ``G`` is 1): per unit of each stage (its layers, then the stage's
    own parameters), buffers padded for ``G`` ranks. The schedule keeps a unit gathered from
    the first micro-batch's backward to the last's and reduces gradients once, after the last
    (``torch.distributed.pipelining`` sets FSDP2's resharding and gradient sync so): with a
    strategy that reshards after forward, ``m`` all-gathers in forward and one for the
    backwards, ``m + 1``; with SHARD_GRAD_OP one; and one reduce-scatter. The stage's root
    (FSDP2's default: not resharded after forward) is gathered once. Measured on 4 ranks,
    m = 2, 4, 8, GPipe, 1F1B and interleaved."""
    layout = config.parallel_layout(world_size)
    group = layout.fsdp_size
    if group == 1:
        return []
    compute, reduce = get_precision(config.precision)
    gathers = config.pp_microbatches + 1 if get_strategy(config.strategy).reshard_after_forward else 1
    out: list[AxesCall] = []
    for span in rank_stages(config, pp_rank):
        for unit in policy_units(stage_param_shapes(config, span), "layer"):
            if not unit.numel:
                continue
            elements = unit.padded_numel(group)
            out += [AxesCall("all_gather", "fsdp", elements * dtype_bytes(compute), group, unit.name)] \
                * (1 if unit.root else gathers)
            out.append(AxesCall("reduce_scatter", "fsdp", elements * dtype_bytes(reduce), group, unit.name))
    return out


def estimate_pipeline_tp_calls(config: ParallelConfig, world_size: int, pp_rank: int) -> list[AxesCall]:
    """Tensor parallelism's collectives of one step on pipeline rank ``pp_rank``: per micro-batch
    (``b/m`` sequences), the plan's collectives of the modules its stages hold
    (:func:`~handbook_lib.models.axes_run.tp_step_calls`: each layer's, the embedding's on the
    first stage, the head's on the last; recomputed ones again under checkpointing). Megatron
    SP's norm-gradient all-reduces come with FSDP2's gradient sync, once a step after the last
    micro-batch, of gradients accumulated in the reduce dtype. None without tensor ranks."""
    if config.tp_size == 1:
        return []
    compute, _ = get_precision(config.precision)
    rows = config.batch_size // (config.parallel_layout(world_size).dp * config.pp_microbatches)
    calls = tp_step_calls(config, rows * config.seq_len, compute)
    # the schedule syncs gradients after the last micro-batch only
    return [c for span in rank_stages(config, pp_rank)
            for c in per_step_calls([c for c in calls if _in_stage(c.site, span)], config,
                                    config.pp_microbatches, sync_every=False)]


def bubble_fraction(pp_size: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The share of a step each rank idles, waiting for the pipeline to fill and drain:
    ``(p − 1) / (v·m + p − 1)`` for GPipe and 1F1B (``v`` = 1) and interleaved 1F1B (``v``
    stages per rank), with equal stages (Narayanan et al., 2021)."""
    check_int("pp_size", pp_size, 1)
    check_int("microbatches", microbatches, 1)
    check_int("stages_per_rank", stages_per_rank, 1)
    return (pp_size - 1) / (stages_per_rank * microbatches + pp_size - 1)


def in_flight(schedule: str, pp_size: int, microbatches: int, stage: int) -> int:
    """Micro-batches whose activations stage ``stage`` (0 first) of a ``pp_size``-stage pipeline
    holds at once: GPipe runs every forward before any backward (all ``m``); 1F1B starts a
    backward as soon as the last stage can, so stage ``i`` holds at most ``p − i``."""
    check_int("microbatches", microbatches, 1)
    if schedule == "GPipe":
        return microbatches
    if schedule != "1F1B":
        raise ValueError(f"pp_schedule must be GPipe or 1F1B for the planner's pricing, got {schedule!r}")
    return min(microbatches, pp_size - stage)


def interleaved_in_flight(pp_size: int, microbatches: int, rank: int, stages_per_rank: int) -> int:
    """Chunks (a stage's forward of one micro-batch) whose activations rank ``rank`` holds at
    once under interleaved 1F1B with ``stages_per_rank`` stages a rank: its warm-up forwards and
    the one its first backward waits on, ``(v − 1)·m_r + 2·(p − 1 − rank) + 1`` (``m_r``
    micro-batches a round, ``m`` over ``max(1, m // p)`` rounds), at most ``v·m``. Read from
    torch 2.13's ``ScheduleInterleaved1F1B`` (``torch/distributed/pipelining/schedules.py``,
    ``_get_warmup_ops``); the ``pipeline`` run's own orders count the same (its tests)."""
    for name, value in (("pp_size", pp_size), ("microbatches", microbatches), ("stages_per_rank", stages_per_rank)):
        check_int(name, value, 1)
    if not 0 <= rank < pp_size:
        raise ValueError(f"rank must be in [0, {pp_size}), got {rank!r}")
    per_round = microbatches // max(1, microbatches // pp_size)
    return min((stages_per_rank - 1) * per_round + 2 * (pp_size - 1 - rank) + 1, stages_per_rank * microbatches)


Action = tuple[str, int, int]
"""One unit of a schedule's work on a rank: ``(kind, stage, micro-batch)``, ``kind`` ``"F"`` (a
forward), ``"B"`` (a full backward), or a zero-bubble schedule's split backward: ``"I"`` (the
input's gradient, which the previous stage waits for) and ``"W"`` (the weights', later)."""

UNIT_COST = {"F": 1, "B": 2, "I": 1, "W": 1}
"""Each kind's time on the grid of :func:`simulate_schedule`: a backward twice a forward, split
evenly between its two halves."""


def schedule_actions(schedule: str, pp_size: int, microbatches: int, stage: int) -> list[Action]:
    """The order in which the rank of ``stage`` runs its forwards and backwards in one step, for
    the one-stage-per-rank schedules: GPipe, every forward then every backward; 1F1B, ``p − s``
    forwards (fewer if there are fewer micro-batches), then a backward and a forward in turn until
    the forwards run out, then the remaining backwards (``torch.distributed.pipelining``'s
    ``ScheduleGPipe`` and ``Schedule1F1B``; an interleaved schedule's order is the schedule's own).

    Raises:
        ValueError: for another schedule.
    """
    check_int("microbatches", microbatches, 1)
    if schedule == "GPipe":
        return [("F", stage, i) for i in range(microbatches)] + [("B", stage, i) for i in range(microbatches)]
    if schedule != "1F1B":
        raise ValueError(f"schedule_actions covers GPipe and 1F1B, got {schedule!r}")
    warmup = min(microbatches, pp_size - stage)
    order: list[Action] = [("F", stage, i) for i in range(warmup)]
    for i in range(microbatches):
        order.append(("B", stage, i))
        if warmup + i < microbatches:
            order.append(("F", stage, warmup + i))
    return order


def most_in_flight(actions: list[Action]) -> dict[int, int]:
    """Each stage's most micro-batches forwarded and not yet backwarded at once, over ``actions``
    in order: the micro-batches whose activations the stage holds together (:func:`in_flight`
    predicts it)."""
    live: dict[int, int] = {}
    most: dict[int, int] = {}
    for kind, stage, _ in actions:  # a split backward frees the micro-batch with its weights' half
        live[stage] = live.get(stage, 0) + {"F": 1, "I": 0}.get(kind, -1)
        most[stage] = max(most.get(stage, 0), live[stage])
    return most


def simulate_schedule(orders: dict[int, list[Action]], stages: int, *,
                      cost: dict[str, float] | None = None) -> dict[int, list[tuple[Action, float, float]]]:
    """When each action of ``orders`` (each pipeline rank's, in order) would start and end if each
    kind took its ``cost`` (default :data:`UNIT_COST`) and sends were free: an action starts once
    its rank is free and its input is ready (a forward, the previous stage's forward of the
    micro-batch; a backward or an input's gradient, the next stage's gradient of it, or on the
    last stage its own forward; a weights' gradient, its own input's). What a schedule's idle time
    is made of, apart from the noise of real timings.

    Raises:
        ValueError: if the orders deadlock (an action waits for one that never runs first).
    """
    costs = UNIT_COST if cost is None else cost
    done: dict[Action, float] = {}
    free: dict[int, float] = dict.fromkeys(orders, 0)
    position = dict.fromkeys(orders, 0)
    out: dict[int, list[tuple[Action, float, float]]] = {rank: [] for rank in orders}
    while any(position[r] < len(orders[r]) for r in orders):
        moved = False
        for rank, order in orders.items():
            while position[rank] < len(order):
                kind, stage, mb = action = order[position[rank]]
                if kind == "F":
                    needs = ("F", stage - 1, mb) if stage > 0 else None
                elif kind == "W":
                    needs = ("G", stage, mb)
                else:  # "B" and "I" send the input's gradient ("G") on
                    needs = ("G", stage + 1, mb) if stage < stages - 1 else ("F", stage, mb)
                if needs is not None and needs not in done:
                    break
                start = max(free[rank], done[needs] if needs is not None else 0)
                end = start + costs[kind]
                done[action], free[rank] = end, end
                if kind in ("B", "I"):
                    done[("G", stage, mb)] = end
                out[rank].append((action, start, end))
                position[rank] += 1
                moved = True
        if not moved:
            stuck = {r: orders[r][position[r]] for r in orders if position[r] < len(orders[r])}
            raise ValueError(f"the schedule's orders deadlock: waiting {stuck}")
    return out


def idle_fraction(timeline: list[tuple[Action, float, float]], span: float) -> float:
    """The share of ``span`` seconds (the step's, over every rank) a rank's ``timeline`` leaves
    idle: one minus its busy seconds over the span; on a grid of whole units, the ratio computed
    exactly and then rounded once (as ``(p − 1)/(m + p − 1)`` is)."""
    busy = sum(end - start for _, start, end in timeline)
    if isinstance(span, int) and isinstance(busy, int):
        return float(Fraction(span - busy, span))
    return 1 - busy / span
