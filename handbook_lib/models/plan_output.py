"""One plan, whole: what ``python -m handbook_lib plan`` prints, as data. Pure: no ``torch``.

Chapter 4 and the book's planner page use it. :func:`plan_report` prices every FSDP option
(:func:`~handbook_lib.models.planner.plan`, with its sensitivity if asked), the memory budget and
the step-time band of the GPU, and, where the job needs them, the layouts beyond FSDP (chapter 9:
tensor, sequence and pipeline parallelism, :func:`~handbook_lib.models.axes_table.compare_axes`)
with the verdict. :meth:`PlanReport.to_json` is ``plan --json``'s output; the terminal prints the
same report as tables, and the planner page in the book runs this module in the reader's browser
(:func:`plan_page`), so the three cannot disagree.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from handbook_lib.core.checks import BadText, check_int, parse_float, parse_int
from handbook_lib.core.parallel_layout import ParallelLayout
from handbook_lib.core.strategies import get_strategy
from handbook_lib.models.axes import AxesVerdict, estimate_axes
from handbook_lib.models.axes_table import AxisOption, axes_reason, compare_axes, recommend_axes
from handbook_lib.models.bands import StepTimeBand, step_time_band
from handbook_lib.models.budget import MemoryBudget, memory_budget
from handbook_lib.models.hardware import get_accelerator, node_preset
from handbook_lib.models.hf_config import hf_config_from_text
from handbook_lib.models.layout import ModelLike
from handbook_lib.models.nccl_buffers import strategy_nccl
from handbook_lib.models.plan_search import PlanSearch, search_plan
from handbook_lib.models.planner import Plan, check_whole_nodes, plan, shard_groups
from handbook_lib.models.recompute import FULL, CheckpointPolicy, check_policy_flags
from handbook_lib.models.presets import DecoderShape, describe_shape, get_shape
from handbook_lib.models.sensitivity import FlipPoints, Sensitivity, flip_points, plan_sensitivity
from handbook_lib.models.zero_peak import DEEPSPEED_DEFAULTS, ZeroKnobs

__all__ = ["PLAN_NAMES", "SCALES", "SEARCH_ROWS", "PlanReport", "not_modelled", "plan_report", "short_of_fsdp",
           "plan_page", "zero_knobs"]

PLAN_NAMES = {"world": "--gpus ({})", "dp_shard": "--shard-group-size {}", "tp": "--tp-size {}",
              "sp": "--sp-size {}", "sp_method": "--sp-method {}", "gpus_per_node": "the GPUs per node ({})",
              "nhead": "the heads ({})", "kv_heads": "the KV heads ({})", "seq_len": "--seq-len ({})",
              "pp": "--pp-size {}", "layers": "the layers ({})"}
"""How a plan's refusals name the layout's quantities: by ``plan``'s flags, or in words."""

SEARCH_ROWS = 8
"""The fastest layouts that fit, shown by ``plan``'s search on the terminal and the page (``--json`` lists
every one)."""

SCALES = 0.10
"""Exposed communication, as a fraction of compute, past which a layout is said not to scale: the
planner then prices pipelines beside it."""


@dataclass(frozen=True)
class PlanReport:
    """A plan and everything printed with it."""

    plan: Plan
    budget: MemoryBudget
    band: StepTimeBand | None
    sensitivity: tuple[Sensitivity, ...] | None = None
    """The plan again with one assumption changed each (``None``: not asked)."""
    flips: FlipPoints | None = None
    axes: tuple[AxisOption, ...] = ()
    """The layouts beyond FSDP (empty: not asked, and not needed)."""
    verdict: AxesVerdict | None = None
    not_modelled: tuple[str, ...] = ()
    """What the plan leaves out, in words (:func:`not_modelled`)."""
    search: PlanSearch | None = None
    """Every layout searched and the fastest that fits (:func:`~handbook_lib.models.plan_search.search_plan`;
    ``None`` for one strategy asked alone, or the nominal ``cpu`` preset, whose ranks are this
    machine's processes)."""

    def to_json(self) -> dict[str, Any]:
        """``plan --json``'s object: strict JSON, a number that is not finite (an option with no
        collective to hide has an infinite compute margin) written as ``null``."""
        return _finite(self._data())

    def _data(self) -> dict[str, Any]:
        data = dataclasses.asdict(self.plan) | {"budget": dataclasses.asdict(self.budget),
                                                "step_time_band": dataclasses.asdict(self.band) if self.band else None,
                                                "not_modelled": list(self.not_modelled)}
        if self.sensitivity is not None:
            data["sensitivity"] = [dataclasses.asdict(c) for c in self.sensitivity]
            data["flip_points"] = dataclasses.asdict(self.flips) if self.flips else None
        if self.search is not None:
            data["search"] = {"searched": self.search.searched, "verdict": self.search.verdict(),
                              "lead": self.search.lead,
                              "candidates": [dataclasses.asdict(c) for c in self.search.candidates]}
        if self.verdict is not None:
            data["axes"] = {"options": [dataclasses.asdict(r) for r in self.axes],
                            "why": axes_reason(list(self.axes), self.band), "verdict": dataclasses.asdict(self.verdict)}
        return data


def _finite(value: Any) -> Any:
    """``value`` with every float that is not finite (inf, NaN) replaced by ``None``, through
    dicts and lists: JSON has no such numbers, and a browser's parser refuses them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def not_modelled(policy: CheckpointPolicy, axes: bool, deepspeed: bool = False) -> tuple[str, ...]:
    """What a plan leaves out, in words, for a reader to weigh: always the reuse of the blocks a
    job's freed gradients leave, the allocator's fragmentation beyond its priced reserve, ``torch.compile``
    and Float8; the pointwise recomputation's time under a selective ``policy``; with the
    layouts beyond FSDP (``axes``), the zero-bubble pipeline schedules; with DeepSpeed's
    stages, what its peak model approximates."""
    out = ["which of the blocks a job's freed gradients leave (zero_grad's set_to_none, PyTorch's default) the "
           "caching allocator reuses: the reserved peak the verdicts use keeps them all (memory --set-to-none prices "
           "the allocated peak without them)",
           "the caching allocator's fragmentation beyond the reserve priced (the published page measures more)",
           "torch.compile's fusions, and Float8's casts and all-gathers"]
    if policy.mode == "selective":
        out.append("the time of the pointwise operators selective checkpointing recomputes (no FLOPs counted)")
    if axes:
        out.append("zero-bubble pipeline schedules (1F1B and interleaved 1F1B are priced)")
    if deepspeed:
        out.append("DeepSpeed's own hooks in forward and backward (ZeRO-3's moment there is the unsharded model's "
                   "plus a gathered module and its gradient: 24 % low to 45 % high on the CPU runs' small models), its "
                   "prefetching's timing, and a bucket's worth of gradients for a model larger than a bucket "
                   "(read from its source; the runs' models fit in one)")
    return tuple(out)


def short_of_fsdp(result: Plan, rows: list[AxisOption]) -> bool:
    """Whether FSDP and TP alone fall short, so that the plan prices pipelines too: none of FSDP's
    options fits; or the fastest layout that fits (and keeps within the batch) spends more than
    :data:`SCALES` of its compute on communication it does not hide."""
    if not any(o.fits for o in result.options):
        return True
    best = recommend_axes(rows)
    return best is None or best.step_s > (1 + SCALES) * best.compute_s


def zero_knobs(reduce_bucket_size: int | None, deepspeed: bool) -> ZeroKnobs:
    """DeepSpeed's keys as ``--reduce-bucket-size`` sets them (its defaults where ``None``).

    Raises:
        ValueError: for a bucket size without a ZeRO strategy (``deepspeed``), or below 1.
    """
    if reduce_bucket_size is None:
        return DEEPSPEED_DEFAULTS
    if not deepspeed:
        raise ValueError(f"--reduce-bucket-size {reduce_bucket_size} sizes DeepSpeed's gradient buckets: give "
                         "--strategy ZERO1, ZERO2 or ZERO3 too")
    return ZeroKnobs(reduce_bucket_size=check_int("--reduce-bucket-size", reduce_bucket_size, 1,
                                                  noun="a whole number of elements"))


def plan_report(model: ModelLike, gpu: str, gpus: int, *, decoder: DecoderShape | None = None,
                gpus_per_node: int | None = None, inter_link: str = "ib-ndr400", nics_per_node: int | None = None,
                micro_batch: int = 1, seq_len: int = 2048, precision: str = "bf16-mixed", optimizer: str = "adamw",
                optimizer_impl: str = "default", grad_accum: int = 1, sync_every_micro_step: bool = False,
                headroom: float = 0.0, activation_checkpointing: str = "full", ac_every: int = 1,
                ac_matmul_every: int = 1, ac_save: str = "matmul+attention", shard_group_size: int | None = None,
                loss_chunks: int = 1, strategy: str | None = None, reduce_bucket_size: int | None = None,
                sensitivity: bool = False, tp_size: int = 1, sp_size: int = 1, sp_method: str = "ulysses",
                pp_size: int | None = None, batch_tokens: int | None = None,
                names: Mapping[str, str] = PLAN_NAMES) -> PlanReport:
    """The whole plan of ``plan``'s command line, its flags by name: every FSDP option priced
    (and with ``sensitivity``, again with each assumption changed); the layouts beyond FSDP when
    ``tp_size``, ``sp_size``, ``pp_size`` or ``batch_tokens`` ask for them, or, for a ``decoder``'s
    shape, when none of FSDP's options fits. On more than one node, where FSDP and TP alone fall
    short (:func:`short_of_fsdp`), pipelines are priced too (every stage count, the best shown),
    unless ``pp_size`` says which (1: none). ``activation_checkpointing``, ``ac_every``,
    ``ac_matmul_every`` and ``ac_save`` are the policy of the options with checkpointing
    (:class:`~handbook_lib.models.recompute.CheckpointPolicy`); ``shard_group_size``
    HYBRID_SHARD's (:func:`~handbook_lib.models.planner.shard_groups`); ``loss_chunks`` the
    cross-entropy's chunks (:func:`~handbook_lib.models.memory.estimate_memory`); ``strategy``
    one strategy's options only (DeepSpeed's ZeRO stages among them, with
    ``reduce_bucket_size`` elements a gradient bucket, DeepSpeed's default where ``None``).

    Raises:
        ValueError: one line naming the flag (``names``) and what is accepted.
    """
    per_node = gpus_per_node or node_preset(gpu).gpus_per_node
    check_whole_nodes(gpus, per_node, names=("--gpus {}", "--gpus-per-node {}"))
    if sync_every_micro_step and grad_accum < 2:
        raise ValueError(f"--sync-every-micro-step needs --grad-accum >= 2, got {grad_accum}")
    if activation_checkpointing not in ("full", "selective"):
        raise ValueError(f"--activation-checkpointing {activation_checkpointing}: plan prices full or selective "
                         "(and every option without checkpointing besides)")
    check_policy_flags(activation_checkpointing, ac_every, ac_matmul_every, ac_save)
    policy = CheckpointPolicy(activation_checkpointing, ac_every, ac_matmul_every, ac_save)
    shard_groups(gpus, per_node, shard_group_size, flag="--shard-group-size {}")
    if seq_len % check_int("--loss-chunks", loss_chunks, 1, noun="a whole number"):
        raise ValueError(f"--loss-chunks {loss_chunks} must divide --seq-len {seq_len} (equal chunks of each sequence)")
    deepspeed = strategy is not None and get_strategy(strategy).wrapper == "deepspeed"
    zero = zero_knobs(reduce_bucket_size, deepspeed)
    kwargs: dict[str, Any] = {"micro_batch": micro_batch, "seq_len": seq_len, "gpus_per_node": per_node,
                              "inter_link": inter_link, "nics_per_node": nics_per_node, "precision": precision,
                              "optimizer": optimizer, "optimizer_impl": optimizer_impl, "headroom": headroom,
                              "grad_accum_steps": grad_accum, "sync_every_micro_step": sync_every_micro_step,
                              "checkpointing": policy, "shard_group_size": shard_group_size,
                              "loss_chunks": loss_chunks, "strategy": strategy, "zero": zero}
    changes: tuple[Sensitivity, ...] | None = None
    if sensitivity:
        result, listed = plan_sensitivity(model, gpu, gpus, **kwargs)
        changes = tuple(listed)
    else:
        result = plan(model, gpu, gpus, **kwargs)
    searched = _search(result, model, decoder, gpu, gpus, policy, shard_group_size, strategy, kwargs)
    pick = result.recommended or result.options[0]
    node = node_preset(gpu, inter_link=inter_link, gpus_per_node=min(per_node, pick.gpus), nics_per_node=nics_per_node)
    nccl = strategy_nccl(node, pick.strategy, pick.gpus, pick.shard_group_size)
    report = PlanReport(result, memory_budget(gpu, headroom, nccl),
                        step_time_band(gpu), changes,
                        flip_points(result) if sensitivity else None,
                        not_modelled=not_modelled(policy, False, deepspeed), search=searched)
    asked = tp_size > 1 or sp_size > 1 or pp_size is not None or batch_tokens is not None
    if asked and strategy is not None:
        raise ValueError(f"--strategy {strategy} prices one strategy alone: leave out --tp-size, --sp-size, "
                         "--pp-size and --batch-tokens, or --strategy")
    if not asked and (decoder is None or strategy is not None or any(o.fits for o in result.options)):
        return report
    if optimizer != "adamw":
        raise ValueError(f"--optimizer {optimizer}: the layouts beyond FSDP are priced with adamw only; give "
                         "--optimizer adamw, or leave out --tp-size, --sp-size, --pp-size and --batch-tokens")
    if precision == "bf16":
        raise ValueError("--precision bf16: the layouts beyond FSDP are priced with an fp32 state; give "
                         "bf16-mixed, or leave out --tp-size, --sp-size, --pp-size and --batch-tokens")
    for flag, value, usual in (("--optimizer-impl", optimizer_impl, "default"), ("--grad-accum", grad_accum, 1),
                               ("--activation-checkpointing", activation_checkpointing, "full"),
                               ("--ac-every", ac_every, 1), ("--loss-chunks", loss_chunks, 1)):
        if value != usual:
            raise ValueError(f"{flag} {value}: the layouts beyond FSDP are priced with {flag} {usual}; leave "
                             "it out, or leave out --tp-size, --sp-size, --pp-size and --batch-tokens")
    if shard_group_size is not None:
        raise ValueError(f"--shard-group-size {shard_group_size}: the layouts beyond FSDP shard within a node; leave "
                         "it out, or leave out --tp-size, --sp-size, --pp-size and --batch-tokens")
    if decoder is None:
        flag = "--tp-size" if tp_size > 1 else "--sp-size" if sp_size > 1 else "--pp-size"
        raise ValueError(f"{flag} prices a decoder at scale: give --model (e.g. llama2-70b) or --hf-config, "
                         "not the handbook's model or --params")
    shape: dict[str, Any] = {"nhead": decoder.nhead, "kv_heads": decoder.kv_heads, "seq_len": seq_len}
    ParallelLayout.for_world(gpus, tp=tp_size, gpus_per_node=per_node, names=names, **shape)  # each axis
    ParallelLayout.for_world(gpus, sp=sp_size, sp_method=sp_method, gpus_per_node=per_node, names=names,
                             **shape)  # priced beside FSDP, alone
    common: dict[str, Any] = {"micro_batch": micro_batch, "gpus_per_node": per_node, "inter_link": inter_link,
              "precision": precision, "headroom": headroom}
    verdict = estimate_axes(decoder, gpu, gpus, seq_len=seq_len, batch_tokens=batch_tokens, **common)
    # the table also prices the axis the verdict calls for, so that its pick and the verdict agree
    method = sp_method if sp_size > 1 or verdict.sp_size == 1 else verdict.sp_method
    tp, sp = (tp_size if tp_size > 1 else verdict.tp_size), (sp_size if sp_size > 1 else verdict.sp_size)
    axes: dict[str, Any] = {"seq_len": seq_len, "sp_size": sp, "sp_method": method, "batch_tokens": batch_tokens,
                            **common}
    rows = compare_axes(decoder, gpu, gpus, tp_size=tp, pp_size=1 if pp_size is None else pp_size, **axes)
    if pp_size is None and gpus > per_node and short_of_fsdp(result, rows):
        if tp == 1 and ParallelLayout.allows(gpus, tp=per_node, gpus_per_node=per_node, nhead=decoder.nhead,
                                             kv_heads=decoder.kv_heads, ffn=decoder.ffn):
            tp = per_node  # a pipeline across nodes, TP inside each (where the heads allow a node's)
        rows = compare_axes(decoder, gpu, gpus, tp_size=tp, pp_size=0, **axes)
    return dataclasses.replace(report, axes=tuple(rows), verdict=verdict, not_modelled=not_modelled(policy, True))


def _search(result: Plan, model: ModelLike, decoder: DecoderShape | None, gpu: str, gpus: int,
            policy: CheckpointPolicy, shard_group_size: int | None, strategy: str | None,
            kwargs: dict[str, Any]) -> PlanSearch | None:
    """:func:`plan_report`'s search, with ``result`` (its own plan) reused where it is the search's
    first plan: none for one strategy asked alone, nor for the nominal ``cpu`` preset (the search
    ranks GPU layouts)."""
    if strategy is not None or get_accelerator(gpu).backend != "nccl":
        return None
    return search_plan(decoder or model, gpu, gpus, first=result if policy == FULL and shard_group_size is None
                       else None, **{k: v for k, v in kwargs.items()
                                     if k not in ("checkpointing", "shard_group_size", "strategy", "zero")})


_PAGE_NUMBERS = {"gpus": 1, "seq_len": 1, "micro_batch": 1, "gpus_per_node": 1, "nics_per_node": 1,
                 "tp_size": 1, "sp_size": 1, "pp_size": 0, "batch_tokens": 1, "grad_accum": 1, "ac_every": 1,
                 "ac_matmul_every": 1, "shard_group_size": 0, "loss_chunks": 1}
"""The planner page's whole-number fields and their least values (``plan``'s flags')."""


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def plan_page(request: str) -> str:
    """The book's planner page: ``request``, a JSON object of the page's fields (``model``, a preset,
    or ``config``, a pasted ``config.json``; ``gpu``; and ``plan``'s flags by their keys, numbers
    as typed), priced by :func:`plan_report`. Returns a JSON object: ``report`` (``plan --json``'s
    object), ``view`` (what the page draws: the rows and the recommended option's memory by part),
    ``shape`` (the model's shape in one line) and ``command`` (the ``plan`` command that prints
    the same), or ``error`` and ``field``: the one line the command line would print, and the
    field it names."""
    fields = json.loads(request)
    try:
        values: dict[str, Any] = {}
        for key, least in _PAGE_NUMBERS.items():
            text = str(fields.get(key, "") or "").strip()
            if text:
                try:
                    values[key] = parse_int(text, least)
                except BadText as err:
                    return json.dumps({"error": f"argument {_flag(key)}: {err}", "field": key})
        headroom = str(fields.get("headroom", "") or "0").strip()
        try:
            values["headroom"] = parse_float(headroom, 0.0, below=1.0)
        except BadText as err:
            return json.dumps({"error": f"argument --headroom: {err} (a fraction, e.g. 0.1)", "field": "headroom"})
        if fields.get("config"):
            try:
                decoder = hf_config_from_text(str(fields["config"]))
            except ValueError as err:
                return json.dumps({"error": f"--hf-config {err}", "field": "config"})
            model_flag = "--hf-config config.json"
        else:
            decoder = get_shape(str(fields.get("model") or "llama2-7b"))
            model_flag = f"--model {fields.get('model') or 'llama2-7b'}"
        if "gpus" not in values:
            return json.dumps({"error": "argument --gpus: give the GPUs in the job", "field": "gpus"})
        options = {k: fields[k] for k in ("inter_link", "precision", "optimizer", "optimizer_impl", "sp_method",
                                          "activation_checkpointing", "ac_save") if fields.get(k)}
        if "sp_method" in options and values.get("sp_size", 1) == 1:
            return json.dumps({"error": f"--sp-method {options['sp_method']} applies to the sequence split: give "
                                        "--sp-size N (N >= 2) too, or leave --sp-method out", "field": "sp_method"})
        report = plan_report(decoder, str(fields.get("gpu") or "h100-80gb"), decoder=decoder,
                             sensitivity=bool(fields.get("sensitivity")),
                             sync_every_micro_step=bool(fields.get("sync_every_micro_step")),
                             **{k: v for k, v in values.items() if k != "gpus"}, gpus=values["gpus"], **options)
    except ValueError as err:  # the field of the first flag the line names, if the page has it
        words = str(err).split(":")[0].split()
        named = [k for k in (*_PAGE_NUMBERS, "sp_method", "ac_save") if _flag(k) in words]
        first = min(named, key=lambda k: words.index(_flag(k)), default=None)
        return json.dumps({"error": str(err), "field": first})
    command = ["python -m handbook_lib plan", model_flag, f"--gpu {fields.get('gpu') or 'h100-80gb'}"]
    command += [f"{_flag(k)} {v}" for k, v in values.items() if not (k == "headroom" and v == 0.0)]
    command += [f"{_flag(k)} {v}" for k, v in options.items()]
    command += ["--sync-every-micro-step"] if fields.get("sync_every_micro_step") else []
    command += ["--sensitivity"] if fields.get("sensitivity") else []
    return json.dumps({"report": report.to_json(), "view": _finite(_view(report)), "shape": describe_shape(decoder),
                       "command": " ".join(command)}, allow_nan=False)


def _view(report: PlanReport) -> dict[str, Any]:
    """What the page draws, as the terminal shows it: each option's row (its margin a fraction of
    the budget), the recommended option's (else the smallest's) peak by part, and each layout's row."""
    plan = report.plan
    pick = plan.recommended or min(plan.options, key=lambda o: o.peak_reserved_bytes)
    state, acts = pick.model_state_bytes, pick.activation_bytes
    return {
        "options": [{"name": o.name, "gpus": o.gpus, "allocated": o.peak_bytes, "reserved": o.peak_reserved_bytes,
                     "budget": o.budget_bytes, "margin": o.margin,
                     "fits": o.fits, "host": o.host_bytes, "comm_s": o.comm_s, "compute_s": o.compute_s,
                     "step_s": o.step_s, "bound": o.bound} for o in plan.options],
        "pick": {"name": pick.name, "peak": pick.peak_bytes, "reserved": pick.peak_reserved_bytes,
                 "budget": pick.budget_bytes, "fits": pick.fits,
                 "parts": {"model state": state, "activations": acts,
                           "gathered units, buffers, logits": max(0, pick.peak_bytes - state - acts)}},
        "search": [] if report.search is None or report.search.winner is None else [
            {"name": c.name, "reserved": c.peak_reserved_bytes, "step_s": c.step_s,
             "tokens_per_s_per_gpu": c.tokens_per_s_per_gpu,
             "vs_best": c.tokens_per_s_per_gpu / report.search.winner.tokens_per_s_per_gpu - 1,
             "tie": c in report.search.tied}
            for c in report.search.fitting[:SEARCH_ROWS]],
        "axes": [{"name": r.name, "reserved": r.peak_reserved_bytes, "margin": r.margin_bytes / r.budget_bytes,
                  "fits": r.fits, "within_batch": r.within_batch, "bubble_s": r.bubble_s, "step_s": r.step_s,
                  "tokens_per_s_per_gpu": r.tokens_per_s_per_gpu} for r in report.axes],
    }
