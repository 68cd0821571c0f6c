"""The planner's reasons, in words: why each option that does not fit does not, and why the
recommended one wins (:func:`plan_reasons`). Pure; :mod:`handbook_lib.models.planner` calls it."""

from __future__ import annotations

from handbook_lib.models.hardware import Accelerator
from handbook_lib.models.memory import PHASE_WORDS
from handbook_lib.models.zero_peak import ZERO_PHASE_WORDS
from handbook_lib.models.plan_option import Option

__all__ = ["STEP_TIE", "gb", "plan_reasons", "ties"]

STEP_TIE = 0.01
"""Step times within this fraction of the fastest count as equal: the time model is not finer
than that (a latency of a few microseconds never decides a plan)."""


def gb(n: float) -> str:
    """``n`` bytes in decimal GB, one decimal: ``"58.4 GB"``."""
    return f"{n / 1e9:.1f} GB"


def ties(options: list[Option], step_s: float) -> list[Option]:
    """The ``options`` whose step is within :data:`STEP_TIE` of ``step_s``, seconds."""
    return [o for o in options if o.step_s <= step_s * (1 + STEP_TIE)]


def plan_reasons(options: list[Option], chosen: Option | None, acc: Accelerator, gpus: int,
                 gpus_per_node: int, policy: tuple[str, float] | None = None) -> list[str]:
    """Why: each of DDP, SHARD_GRAD_OP, FULL_SHARD and DeepSpeed's ZeRO stages that does not fit,
    and what decides it; an offload option the host cannot hold; the recommended option
    ``chosen`` with its margin and step, what it needs (offload, more GPUs, checkpointing), the
    tie it wins and the runner-up.
    ``policy``: the checkpointing policy's label and the share of the model's FLOPs it
    recomputes, where it is not full recomputation of every layer (``None``)."""
    reasons = []
    by_name = {o.name: o for o in options}
    for name in ("DDP", "SHARD_GRAD_OP", "FULL_SHARD", "ZERO1", "ZERO2", "ZERO3"):
        o = by_name.get(name)
        if o and not o.fits:
            if o.peak_phase == "optimizer_step":  # no activations then: Adam's temporary on the state
                what, parts = "the optimizer step decides", (
                    f"{gb(o.model_state_bytes)} model state, "
                    f"{gb(o.peak_bytes - o.model_state_bytes)} of Adam's temporaries and buckets")
            else:
                what = ("activations decide" if o.activation_bytes > o.model_state_bytes
                        else "model state decides")
                parts = f"{gb(o.activation_bytes)} activations, {gb(o.model_state_bytes)} model state"
            reasons.append(f"{name} does not fit: {gb(o.peak_reserved_bytes)} reserved per GPU against "
                           f"{gb(o.budget_bytes)} usable on {acc.name}; {what} ({parts}).")
    for o in options:
        if o.cpu_offload and not o.fits and o.margin_bytes >= 0 and acc.host is not None:
            reasons.append(f"{o.name} fits the GPU ({gb(o.peak_reserved_bytes)} reserved) but not the host: "
                           f"{gb(o.host_node_bytes)} of host RAM per node against {gb(acc.host.memory_bytes)} "
                           f"in a {acc.host.name} host.")
    if chosen is None:
        return reasons  # plan() says what would fit
    faster = [o for o in options if o.gpus == gpus and o.fits and o is not chosen]
    when = {**PHASE_WORDS, **ZERO_PHASE_WORDS}.get(chosen.peak_phase, (chosen.peak_phase,))[0]
    reasons.append(f"Recommended: {chosen.name.removesuffix(f' on {chosen.gpus} GPUs')} on {chosen.gpus} GPUs — "
                   f"peak {gb(chosen.peak_reserved_bytes)} reserved per GPU {when}, "
                   f"margin {gb(chosen.margin_bytes)} ({100 * chosen.margin:.1f} % of {gb(chosen.budget_bytes)} "
                   "usable), "
                   f"step {chosen.step_s:.3f} s, {chosen.bound}-bound.")
    if chosen.cpu_offload:
        host = acc.host
        assert host is not None
        per_node = min(gpus_per_node, chosen.gpus)
        reasons.append(f"CPU offload needs {gb(chosen.host_bytes)} of host RAM per GPU, "
                       f"{gb(chosen.host_node_bytes)} per node of {per_node} GPUs against "
                       f"{gb(host.memory_bytes)} in a {host.name} host; its optimizer step runs "
                       f"on that CPU: {chosen.cpu_step_s:.2f} s of the step, never hidden.")
    elif acc.host is None:
        reasons.append(f"CPU offload not priced: the {acc.name} preset names no host machine "
                       "(its CPU cores, RAM and PCIe).")
    if chosen.gpus > gpus:
        reasons.append(f"Nothing fits on {gpus} GPUs; {chosen.gpus} are the fewest on which {chosen.strategy} + AC "
                       f"fits (of the powers of two above {gpus}, each priced as every option is).")
    plain = next((o for o in options if (o.strategy, o.shard_group_size, o.gpus) == (
        chosen.strategy, chosen.shard_group_size, chosen.gpus) and not o.activation_checkpointing
        and not o.cpu_offload), None)
    if chosen.activation_checkpointing and chosen.gpus == gpus and plain is not None and not plain.fits:
        if policy is None:
            reasons.append("Activation checkpointing is needed: it trades one more forward pass "
                           "(a third more compute) for keeping only each layer's input.")
        elif policy[1] < 5e-4:
            reasons.append(f"Activation checkpointing ({policy[0]}) is needed: it recomputes pointwise operators "
                           "only, no matrix product (their time is not priced here).")
        else:
            reasons.append(f"Activation checkpointing ({policy[0]}) is needed: it recomputes "
                           f"{100 * policy[1]:.1f} % of the model's FLOPs in backward for what it does not keep.")
    tied = [o for o in ties(faster, chosen.step_s) if (o.activation_checkpointing, o.cpu_offload)
            == (chosen.activation_checkpointing, chosen.cpu_offload)]
    for o in tied:
        if o.comm_s > chosen.comm_s:
            reasons.append(f"{o.name} takes the same step time (compute hides both), but "
                           f"{chosen.name} spends {o.comm_s - chosen.comm_s:.3f} s less per step "
                           "on the links; it wins the tie.")
    if faster:
        runner = min(faster, key=lambda o: o.step_s)
        reasons.append(f"Next best: {runner.name} ({runner.step_s:.3f} s per step, "
                       f"{gb(runner.peak_reserved_bytes)} reserved per GPU).")
    if chosen.bound == "communication":
        reasons.append("Communication is not hidden by compute on these links: a faster "
                       "interconnect, HYBRID_SHARD, or a larger micro-batch would help.")
    return reasons
