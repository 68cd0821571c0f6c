"""The planner's search: the layouts a practitioner chooses from, every one priced, and the fastest
that fits named with its lead and the model's error band. Pure arithmetic: no ``torch``.

:func:`~handbook_lib.models.planner.plan` prices each strategy once with the checkpointing policy
it is given. :func:`search_plan` prices, on the same GPUs and batch:

- every strategy of :func:`~handbook_lib.models.planner.plan`, HYBRID_SHARD at every shard group
  of whole nodes the layout allows (on more than one node), and CPU offload;
- each with no checkpointing and with every policy of :data:`SEARCH_POLICIES` (full; full on
  every 2nd layer; selective; selective keeping every 2nd matrix product, torchtitan's);
- tensor parallelism over 2, 4, ... GPUs of a node with FSDP2 across, plain and asynchronous
  (:func:`~handbook_lib.models.axes_table.tp_rows`), without and with full checkpointing;
- the same batch cut another way (:func:`batch_splits`): fewer, larger micro-batches where it is
  accumulated, more, smaller ones reduced every micro-step where a micro-batch holds several
  sequences (every FSDP option, full checkpointing);

and ranks those that fit by tokens per second per GPU (one rate for layouts whose batches
differ: a TP group shares its sequences). The winner's lead over the next is read against the
model's error on the GPU's published runs (:func:`~handbook_lib.models.bands.step_time_band`):
a lead inside it is a tie to time, never a rule. Fused Adam is not searched: its missing
temporary never turned an option that does not fit into one that fits, for Llama-2 7B, 13B and
70B and GPT-3 175B on A100 40 and 80 GB, H100 and L4, 2 to 64 GPUs, 512 to 8,192 tokens (the
layer's backward peaks close by).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from handbook_lib.core.checks import check_int
from handbook_lib.core.parallel_layout import ParallelLayout
from handbook_lib.core.strategies import get_strategy
from handbook_lib.models.axes_table import AxisOption, tp_rows
from handbook_lib.models.bands import StepTimeBand, step_time_band
from handbook_lib.models.hardware import Accelerator, get_accelerator
from handbook_lib.models.layout import ModelLike
from handbook_lib.models.plan_option import Option
from handbook_lib.models.plan_reasons import STEP_TIE
from handbook_lib.models.planner import Plan, plan
from handbook_lib.models.presets import DecoderShape, get_shape
from handbook_lib.models.recompute import FULL, CheckpointPolicy

__all__ = ["SEARCH_POLICIES", "Candidate", "PlanSearch", "batch_splits", "search_plan"]

SEARCH_POLICIES: tuple[CheckpointPolicy, ...] = (
    FULL, CheckpointPolicy(every=2), CheckpointPolicy("selective"), CheckpointPolicy("selective", matmul_every=2))
"""The checkpointing policies :func:`search_plan` prices each strategy with, beside none."""


@dataclass(frozen=True)
class Candidate:
    """One layout the search priced."""

    name: str
    """The option's name, its policy in it: ``FULL_SHARD + AC (selective, every 2nd product)``."""
    checkpointing: str
    """``none``, or the policy in words (:attr:`CheckpointPolicy.label`)."""
    tp_size: int
    fits: bool
    peak_reserved_bytes: int
    budget_bytes: int
    step_s: float
    """Seconds per optimizer step."""
    tokens_per_s_per_gpu: float
    bound: str
    """``compute`` or ``communication``."""
    comm_s: float
    """The links' time per step (:attr:`~handbook_lib.models.timing.StepTime.comm_s`)."""
    cpu_offload: bool = False
    compute_margin: float = math.nan
    """How far compute may shrink before a phase waits on its links
    (:attr:`~handbook_lib.models.plan_option.Option.compute_margin`; NaN where not priced by phase:
    the layouts beyond FSDP)."""


@dataclass(frozen=True)
class PlanSearch:
    """Every layout searched, and the verdict."""

    candidates: tuple[Candidate, ...]
    """Those that fit first, the fastest first (ties within :data:`STEP_TIE` to fewer levers, then
    less communication, then less memory), then those that do not, the smallest peak first."""
    searched: str
    """What was searched, in words."""
    band: StepTimeBand | None
    """The model's error on the GPU's published runs (``None``: no published run tests it)."""
    utilization: float = math.nan
    """The utilization the search priced compute at (the GPU's at the model's width)."""

    @property
    def fitting(self) -> tuple[Candidate, ...]:
        return tuple(c for c in self.candidates if c.fits)

    @property
    def winner(self) -> Candidate | None:
        return self.fitting[0] if self.fitting else None

    @property
    def tied(self) -> tuple[Candidate, ...]:
        """The others that fit within :data:`STEP_TIE` of the winner's rate: the same step, told
        apart by fewer levers, less communication, then less memory."""
        w = self.winner
        return () if w is None else tuple(c for c in self.fitting[1:]
                                          if c.tokens_per_s_per_gpu >= w.tokens_per_s_per_gpu * (1 - STEP_TIE))

    @property
    def runner_up(self) -> Candidate | None:
        """The fastest that fits beyond the tie (``None``: none)."""
        rest = self.fitting[1 + len(self.tied):]
        return rest[0] if rest else None

    @property
    def lead(self) -> float | None:
        """The winner's tokens per second per GPU over the runner-up's, minus one (``None``: no
        runner-up)."""
        w, r = self.winner, self.runner_up
        return None if w is None or r is None else w.tokens_per_s_per_gpu / r.tokens_per_s_per_gpu - 1

    def verdict(self) -> str:
        """The winner, its step with the band, the layouts tied with it, and its lead over the next,
        in words."""
        w, r, lead, band = self.winner, self.runner_up, self.lead, self.band
        if w is None:
            least = self.candidates[0]
            return (f"None of the {len(self.candidates)} layouts searched fits: the smallest peak is {least.name}'s, "
                    f"{least.peak_reserved_bytes / 1e9:.1f} GB reserved per GPU against "
                    f"{least.budget_bytes / 1e9:.1f} GB usable.")
        spread = f" ±{100 * band.median:.0f} %" if band else ""
        text = (f"Fastest of the {len(self.fitting)} that fit: {w.name}, {w.tokens_per_s_per_gpu:,.0f} tokens/s per "
                f"GPU, {w.step_s:.3f} s a step{spread}, {self._bound(w)}.")
        if self.tied:
            text += (f" Tied within {100 * STEP_TIE:.0f} % (chosen for fewer levers, then less communication): "
                     + ", ".join(c.name for c in self.tied) + ".")
        if r is None or lead is None:
            return text
        text += f" Next: {r.name}, {100 * lead:.1f} % slower"
        if band is None:
            return text + "; no published run on this GPU tests the model's step times: time both."
        if lead <= band.median:
            return (text + f": a tie within the model's median error on this GPU ({100 * band.median:.1f} %, "
                    f"{band.runs} published runs): time both.")
        if lead <= band.p80:
            return (text + f": beyond the model's median error on this GPU ({100 * band.median:.1f} %), within what "
                    f"4 runs in 5 stay within ({100 * band.p80:.1f} %).")
        return text + f": beyond the model's error for 4 runs in 5 on this GPU ({100 * band.p80:.1f} %)."


    def _bound(self, c: Candidate) -> str:
        """``compute-bound unless utilization exceeds 62 % (priced at 45 %)``: the bound, and the
        utilization at which it flips, said to be inside the model's error where it is."""
        flip = self.utilization * c.compute_margin
        if c.bound == "compute" and flip >= 1:  # an infinite margin too: nothing to hide
            return "compute-bound at any utilization"
        if not 0 < flip < 1:  # NaN: a layout not priced by phase
            return f"{c.bound}-bound"
        inside = self.band is not None and abs(c.compute_margin - 1) <= self.band.median
        words = "exceeds" if c.compute_margin > 1 else "falls below"
        return (f"{c.bound}-bound unless utilization {words} {100 * flip:.0f} % (priced at "
                f"{100 * self.utilization:.0f} %{': inside the model' + chr(39) + 's error' if inside else ''})")


def _order(candidates: list[Candidate]) -> tuple[Candidate, ...]:
    """Those that fit, fastest first, a tie within :data:`STEP_TIE` going to fewer levers (no
    tensor parallelism, no checkpointing, full before selective, no offload), then less
    communication, then less memory; then the rest, smallest peak first."""
    fits = [c for c in candidates if c.fits]
    ordered: list[Candidate] = []
    while fits:
        best = max(c.tokens_per_s_per_gpu for c in fits)
        tied = [c for c in fits if c.tokens_per_s_per_gpu >= best * (1 - STEP_TIE)]
        pick = min(tied, key=lambda c: (c.tp_size, c.checkpointing != "none", c.checkpointing != "full",
                                        c.cpu_offload, round(c.comm_s, 6), c.peak_reserved_bytes))
        ordered.append(pick)
        fits.remove(pick)
    rest = sorted((c for c in candidates if not c.fits), key=lambda c: c.peak_reserved_bytes)
    return (*ordered, *rest)


def batch_splits(micro_batch: int, grad_accum_steps: int, sync_every_micro_step: bool) -> list[tuple[int, int, bool]]:
    """The other ways :func:`search_plan` cuts a step's batch, each ``(micro-batch, micro-steps,
    reduce every micro-step)``, the sequences per GPU a step (their product) kept:

    - fewer, larger micro-batches (2, 4 or 8 times, where the micro-steps divide): fewer gathers,
      more activations;
    - more, smaller micro-batches (where the micro-batch divides), their gradients
      reduce-scattered every micro-step (FSDP2's default), so they stay sharded: less activation
      memory, a gather and a reduction more per micro-step;
    - the micro-steps given, reduced every micro-step, where they were to be held unsharded.
    """
    check_int("micro_batch", micro_batch, 1)
    check_int("grad_accum_steps", grad_accum_steps, 1)
    cuts = [(micro_batch * k, grad_accum_steps // k, sync_every_micro_step and k < grad_accum_steps)
            for k in (2, 4, 8) if grad_accum_steps % k == 0]
    if grad_accum_steps > 1 and not sync_every_micro_step:
        cuts.append((micro_batch, grad_accum_steps, True))
    cuts += [(micro_batch // k, grad_accum_steps * k, True) for k in (2, 4, 8) if micro_batch % k == 0]
    return cuts


def _from_option(o: Option, policy: CheckpointPolicy, tokens: int) -> Candidate:
    label = policy.label if o.activation_checkpointing else "none"
    name = o.name if label in ("none", "full") else o.name.replace(" + AC", f" + AC ({label})")
    return Candidate(name, label, 1, o.fits, o.peak_reserved_bytes, o.budget_bytes, o.step_s,
                     tokens / o.step_s, o.bound, o.comm_s, o.cpu_offload, o.compute_margin)


def _from_row(r: AxisOption) -> Candidate:
    return Candidate(r.name, "full" if r.activation_checkpointing else "none", r.tp_size, r.fits,
                     r.peak_reserved_bytes, r.budget_bytes, r.step_s, r.tokens_per_s_per_gpu,
                     "communication" if r.comm_s > r.compute_s else "compute", r.comm_s)


def search_plan(model: ModelLike, gpu: Accelerator | str, gpus: int, *, micro_batch: int = 1, seq_len: int = 2048,
                gpus_per_node: int | None = None, inter_link: str = "ib-ndr400", nics_per_node: int | None = None,
                precision: str = "bf16-mixed", optimizer: str = "adamw", optimizer_impl: str = "default",
                grad_accum_steps: int = 1, sync_every_micro_step: bool = False, headroom: float = 0.0,
                utilization: float | None = None, loss_chunks: int = 1, first: Plan | None = None) -> PlanSearch:
    """Price the layouts of the module docstring for ``model`` on ``gpus`` GPUs, the arguments as
    :func:`~handbook_lib.models.planner.plan`'s; ``first``: the plan already priced with full
    checkpointing and these arguments (HYBRID_SHARD's group a node), not priced again. Tensor
    parallelism is priced for a decoder's shape, with AdamW, bf16-mixed or fp32, no accumulation
    and one loss chunk (what :func:`~handbook_lib.models.axes_table.price_layout` prices)."""
    acc = get_accelerator(gpu) if isinstance(gpu, str) else gpu
    model = get_shape(model) if isinstance(model, str) else model
    common = dict(micro_batch=micro_batch, seq_len=seq_len, gpus_per_node=gpus_per_node, inter_link=inter_link,
                  nics_per_node=nics_per_node, precision=precision, optimizer=optimizer,
                  optimizer_impl=optimizer_impl, grad_accum_steps=grad_accum_steps,
                  sync_every_micro_step=sync_every_micro_step, headroom=headroom, utilization=utilization,
                  loss_chunks=loss_chunks)
    base = first or plan(model, acc, gpus, **common)  # type: ignore[arg-type]
    several = gpus > base.gpus_per_node
    tokens = micro_batch * seq_len * grad_accum_steps
    candidates: list[Candidate] = []
    for policy in SEARCH_POLICIES:
        again = policy != FULL  # the options without checkpointing, and offload, priced once
        priced = (base if not again else plan(model, acc, gpus, checkpointing=policy, checkpointed_only=True,
                                                **common)).options  # type: ignore[arg-type]
        if several:  # every shard group of whole nodes in place of a node's
            priced = [o for o in priced if not get_strategy(o.strategy).hybrid] + plan(
                model, acc, gpus, checkpointing=policy, shard_group_size=0, strategy="HYBRID_SHARD",
                checkpointed_only=again, **common).options  # type: ignore[arg-type]
        candidates += [_from_option(o, policy, tokens) for o in priced
                       if o.gpus == gpus and (not again or (o.activation_checkpointing and not o.cpu_offload))]
    splits = batch_splits(micro_batch, grad_accum_steps, sync_every_micro_step)
    for m, a, sync in splits:  # the same tokens a step, cut another way (module docstring)
        split = {**common, "micro_batch": m, "grad_accum_steps": a, "sync_every_micro_step": sync}
        other = plan(model, acc, gpus, shard_group_size=0 if several else None, **split)  # type: ignore[arg-type]
        label = f"{m} x {a}" + (", reduced each" if sync and a > 1 else "")  # micro-batch x micro-steps
        candidates += [dataclasses.replace(_from_option(o, FULL, tokens), name=f"{o.name} ({label})")
                       for o in other.options if o.gpus == gpus]
    cuts = ("; the batch also as micro-batch x micro-steps " + ", ".join(
        f"{m} x {a}" + (" reduced each" if s and a > 1 else "") for m, a, s in splits)) if splits else ""
    tps = ""
    if (isinstance(model, DecoderShape) and optimizer == "adamw" and precision in ("bf16-mixed", "fp32")
            and grad_accum_steps == 1 and loss_chunks == 1):
        node = base.gpus_per_node
        sizes = [t for t in range(2, node + 1) if node % t == 0 and ParallelLayout.allows(
            gpus, tp=t, gpus_per_node=node, nhead=model.nhead, kv_heads=model.kv_heads)]
        rows = tp_rows(model, acc, gpus, sizes, seq_len=seq_len, micro_batch=micro_batch, gpus_per_node=node,
                       inter_link=inter_link, precision=precision, utilization=base.utilization, headroom=headroom)
        candidates += [_from_row(r) for r in rows]
        tps = f"; TP {', '.join(map(str, sizes))} (plain and async) x FSDP" if sizes else ""
    groups = "HYBRID_SHARD at every shard group of whole nodes, " if several else ""
    searched = (f"{len(candidates)} layouts: DDP, SHARD_GRAD_OP, FULL_SHARD, {groups}CPU offload{tps}; "
                "checkpointing none | " + " | ".join(p.label for p in SEARCH_POLICIES) + cuts)
    return PlanSearch(_order(candidates), searched, step_time_band(acc), base.utilization)
