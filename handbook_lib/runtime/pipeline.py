"""What a pipeline rank does: hold its stages of the model, run the schedule, step.

Chapter 9 runs it. :func:`~handbook_lib.runtime.build.apply_axes` cuts the book's split-attention
model (:class:`~handbook_lib.runtime.parallel_model.ParallelTransformer`) at layer boundaries into
the stages :func:`~handbook_lib.models.pipeline.rank_stages` gives this rank (:func:`cut_stages`),
shards each with FSDP2 over its data-parallel group, and hands them to a
:class:`PipelinedModel`, which wraps them in ``torch.distributed.pipelining``'s
``PipelineStage`` over the ``pp`` group and builds the schedule (``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleZBVZeroBubble``). The book's one training loop
(:func:`~handbook_lib.runtime.training.train`) runs it through :func:`pipeline_step`: the
schedule's step in place of one forward and backward, then the optimizer's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from handbook_lib.core.parallel_config import ParallelConfig
from handbook_lib.models.pipeline import StageSpan, rank_stages
from handbook_lib.runtime.measure import NewBytesPeak
from handbook_lib.runtime.parallel_model import ParallelTransformer
from handbook_lib.runtime.train_log import check_loss_finite

__all__ = ["PipelineStageModule", "cut_stages", "PipelinedModel", "pipeline_step"]


class PipelineStageModule(nn.Module):
    """One stage: the embedding if it is the first, its layers, the head if it is the last.

    ``forward`` takes token ids (the first stage) or the previous stage's hidden states
    (batch, seq, d_model) and returns hidden states, or logits from the last stage."""

    def __init__(self, model: ParallelTransformer, span: StageSpan) -> None:
        super().__init__()
        self.span = span
        self.embedding = model.embedding if span.embedding else None
        self.layers = nn.ModuleList(model.layers[span.first_layer:span.last_layer])
        self.output = model.output if span.head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        for layer in self.layers:
            x = layer(x)
        return self.output(x) if self.output is not None else x


def cut_stages(model: ParallelTransformer, config: ParallelConfig, pp_rank: int) -> list[PipelineStageModule]:
    """This pipeline rank's stages of ``model`` (:func:`~handbook_lib.models.pipeline.rank_stages`)."""
    return [PipelineStageModule(model, span) for span in rank_stages(config, pp_rank)]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One micro-batch's mean next-token cross-entropy, in fp32 (the last stage's loss; on logits
    split by vocabulary too, inside ``loss_parallel``)."""
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class PipelinedModel(nn.Module):
    """This rank's stages and the schedule that runs them; its parameters are the stages'.

    Args:
        stages: This rank's stage modules, in stage order (already sharded, if at all).
        config: The run: ``schedule``, ``pp_microbatches``, the stage count.
        group: The pipeline's process group (this rank's row of the ``pp`` mesh dimension).
        device: Where the stages compute.
    """

    def __init__(self, stages: list[PipelineStageModule], config: ParallelConfig, group: dist.ProcessGroup,
                 device: torch.device) -> None:
        super().__init__()
        from torch.distributed import pipelining

        self.stages = nn.ModuleList(stages)
        self.pp_size = config.pp_size
        self.pipeline_stages = [pipelining.PipelineStage(s, s.span.index, config.pp_stages, device, group=group)
                                for s in stages]
        kind = getattr(pipelining, f"Schedule{config.schedule}")
        target = self.pipeline_stages if config.pp_stages_per_rank > 1 else self.pipeline_stages[0]
        self.schedule = kind(target, n_microbatches=config.pp_microbatches, loss_fn=_loss)
        self.loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        if config.tp_size > 1:  # the head's logits are split by vocabulary
            from torch.distributed.tensor.parallel import loss_parallel

            self.loss_context = loss_parallel
        self.first = any(s.span.embedding for s in stages)
        self.last = any(s.span.head for s in stages)
        self.pp_rank = dist.get_rank(group)
        self.timeline: list[tuple[str, int, int, float, float]] = []
        """The last step's forwards and backwards on this rank, in the order they ran:
        ``(kind, stage, micro-batch, start, end)``, ``kind`` one of
        :data:`~handbook_lib.models.pipeline.Action`'s (``"F"``, ``"B"``, ``"I"``, ``"W"``), the times in seconds
        of this host's monotonic clock (comparable between the ranks of one host)."""
        self.memory_step = config.steps
        """The step (1-based) whose new bytes :meth:`run` follows: the last."""
        self.held: list[tuple[str, int, int, int, int]] = []
        """That step's bytes allocated since it began and still alive before and after each forward
        and backward, in order: ``(kind, stage, micro-batch, before, after)`` (what the
        micro-batches in flight keep, their saved activations, outputs and loss, and what the step
        allocates for good, such as gradients set to ``None`` before it; nothing older, such as
        parameters or the receive buffers, counts)."""
        self._tracker: NewBytesPeak | None = None
        for stage in self.pipeline_stages:
            self._record(stage)

    def _record(self, stage: Any) -> None:
        """Time each forward and backward this stage runs (the schedule calls its
        ``forward_one_chunk``, ``backward_one_chunk``, split or not, and a zero-bubble schedule
        ``backward_weight_one_chunk``), into :attr:`timeline`."""
        for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk"), ("W", "backward_weight_one_chunk")):
            method = getattr(stage, name)

            def timed(chunk: int, *args: Any, _method: Any = method, _kind: str = kind, **kwargs: Any) -> Any:
                start, before = time.monotonic(), self._tracker.live if self._tracker is not None else 0
                out = _method(chunk, *args, **kwargs)
                split = _kind == "B" and kwargs.get("full_backward", args[1] if len(args) > 1 else True) is False
                action = ("I" if split else _kind, stage.stage_index, chunk)
                self.timeline.append((*action, start, time.monotonic()))
                if self._tracker is not None:
                    self.held.append((*action, before, self._tracker.live))
                return out

            setattr(stage, name, timed)

    def schedule_order(self, pp_rank: int | None = None) -> list[tuple[str, int, int]]:
        """The schedule's own list of this rank's (or ``pp_rank``'s) forwards and backwards, in
        order (its ``pipeline_order``, without its idle slots and its other actions): what an interleaved
        schedule's executor runs, and :attr:`timeline` is checked against. (GPipe's and 1F1B's
        executors follow their own loops; torch 2.13's list for 1F1B's last rank starts at
        micro-batch 1 and ends at ``m``, so those are checked against
        :func:`~handbook_lib.models.pipeline.schedule_actions`.)"""
        order = self.schedule.pipeline_order[self.pp_rank if pp_rank is None else pp_rank]
        return [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in order
                if a is not None and a.computation_type.value in ("F", "B", "I", "W")]

    def recv_buffer_bytes(self) -> dict[str, int]:
        """Bytes of the receive buffers this rank's ``PipelineStage`` objects keep between steps:
        ``activations``, one per micro-batch on every stage but the first, allocated once and reused
        (leaves that require grad); ``activation_grads``, the gradients autograd accumulated into
        them in the last backward (dropped at the next step's start); ``grads``, one per micro-batch
        on every stage but the last, for the gradient the next stage sends back. Each storage once."""
        seen: set[int] = set()
        out = {"activations": 0, "activation_grads": 0, "grads": 0}

        def count(kind: str, t: torch.Tensor | None) -> None:
            if t is None:
                return
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen and storage.nbytes():
                seen.add(storage.data_ptr())
                out[kind] += storage.nbytes()

        for stage in self.pipeline_stages:
            for infos in stage.args_recv_info.values():
                for info in infos:
                    if not info.is_root_arg and info.buffer is not None:
                        count("activations", info.buffer)
                        count("activation_grads", info.buffer.grad)
            for infos in stage.grad_recv_info.values():
                for info in infos:
                    count("grads", info.buffer)
        return out

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, *, measure: bool = False) -> torch.Tensor:
        """One step's forwards and backwards over the micro-batches, in the schedule's order
        (``measure``: the new bytes alive after each, into :attr:`held`).
        Returns the loss this rank contributes to the loop's mean over ranks: ``pp`` times the mean
        of its micro-batches' losses on the rank of the last stage, 0 elsewhere (so the mean over
        a data-parallel group's ``pp`` ranks is its share's mean loss)."""
        losses: list[torch.Tensor] = []
        self.timeline = []
        args = (inputs,) if self.first else ()
        kwargs: dict[str, Any] = {"target": targets, "losses": losses} if self.last else {}
        self._tracker = NewBytesPeak() if measure else None
        with self.loss_context(), self._tracker or contextlib.nullcontext():
            self.schedule.step(*args, **kwargs)
        self._tracker = None
        if not self.last:
            return torch.zeros((), device=inputs.device)
        local = [loss.to_local() if hasattr(loss, "to_local") else loss for loss in losses]
        return torch.stack([loss.detach() for loss in local]).mean() * self.pp_size

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("a pipelined model runs by its schedule: PipelinedModel.run(inputs, targets)")


def pipeline_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor,
                  tracker: Any = None, *, after_backward: Callable[[nn.Module], None] | None = None,
                  step: int | None = None, **_: Any) -> torch.Tensor:
    """:func:`~handbook_lib.runtime.training.train_step` for a :class:`PipelinedModel`: the
    schedule's forwards and backwards (its micro-batches are the accumulation), the caller's
    ``after_backward`` hook, the optimizer step, gradients zeroed (kept, not freed, as the loop's
    own step does). Returns the loss to average over ranks (:meth:`PipelinedModel.run`)."""
    assert isinstance(model, PipelinedModel)
    loss = model.run(inputs, targets, measure=step == model.memory_step)
    if model.last:
        check_loss_finite(float(loss), step)
    if after_backward is not None:
        after_backward(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return loss
