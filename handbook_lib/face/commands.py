"""What each command of ``python -m handbook_lib`` does once its arguments are parsed
(:mod:`handbook_lib.face.cli` parses them): it calls the library and prints what it got.

Every command prints the model it prices and its assumptions first; every line fits
:data:`~handbook_lib.core.text.TERMINAL_WIDTH` columns. A bad argument raises ``ValueError`` with
one line naming the flag, which :func:`handbook_lib.face.cli.main` prints (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from handbook_lib.core.architecture import MODEL_KEYS, ModelConfig
from handbook_lib.core.config import PRECISIONS, RunConfig, check_optimizer_impl, parse_overrides
from handbook_lib.core.parallel_layout import ParallelLayout
from handbook_lib.core.results import RunResult
from handbook_lib.core.strategies import get_strategy, strategies_where
from handbook_lib.face.display import (
    Table,
    checks_legend,
    checks_table,
    checks_verdict,
    format_bytes,
)
from handbook_lib.face.plan_axes import FLAGS, chosen_shape, wrap_line
from handbook_lib.face.flags import check_memory_flags
from handbook_lib.face.plan_text import accum_text, impl_text, print_plan
from handbook_lib.face.views import fit_table, step_time_summary, step_time_table
from handbook_lib.launch.errors import describe_failed_checks
from handbook_lib.models.allocator import RESERVE_FRACTION, RESERVE_MODEL, RESERVE_SOURCE, reserved_bytes
from handbook_lib.models.axes import estimate_job_memory
from handbook_lib.models.hardware import get_accelerator, get_link, node_preset
from handbook_lib.models.budget import MemoryBudget, layout_budget
from handbook_lib.models.hf_config import read_hf_config_keys
from handbook_lib.models.layout import ModelLayout, model_layout
from handbook_lib.models.memory import PHASE_WORDS, MemoryEstimate, estimate_memory, estimate_rank_state
from handbook_lib.models.plan_output import plan_report, zero_knobs
from handbook_lib.models.planner import check_whole_nodes
from handbook_lib.models.presets import describe_shape, get_shape
from handbook_lib.models.zero import deepspeed_own_estimate, zero_stage
from handbook_lib.models.zero_peak import estimate_zero_peak, zero_optimizer_impl, zero_step_bytes
from handbook_lib.models.timing import estimate_compute_time, estimate_step_time, expected_utilization
from handbook_lib.models.traffic import estimate_step_traffic
from handbook_lib.runs import describe_runs

__all__ = ["COMMANDS", "wrap_line"]


def torchrun(*args: Any, **kwargs: Any) -> RunResult | None:
    """:func:`handbook_lib.launch.torchrun`, imported on first use: the launcher needs torch and
    psutil, the planning commands neither."""
    from handbook_lib.launch.runner import torchrun as launch

    return launch(*args, **kwargs)

_HYBRID = strategies_where(hybrid=True)


def _model_overrides(items: list[str]) -> ModelConfig:
    """The handbook's model with ``--set`` shape keys; any other key is refused."""
    overrides = parse_overrides(items)
    for key in overrides:
        if key not in MODEL_KEYS:
            raise ValueError(f"--set {key}: not a model key; accepted here: {', '.join(MODEL_KEYS)}")
    return RunConfig.from_mapping(overrides).model_config()

def _chosen_model(args: argparse.Namespace) -> tuple[ModelLayout, str, list[str]]:
    """The layout of the model named on the command line (``--params N``, ``--model NAME``,
    ``--hf-config PATH``, or the handbook's model with ``--set`` keys), a line naming it, and the
    lines that echo what was read: its shape (:func:`~handbook_lib.models.presets.describe_shape`)
    and a config file's keys that the shape does not read."""
    params, overrides = getattr(args, "params", None), getattr(args, "overrides", [])
    hf_config = getattr(args, "hf_config", None)
    if (params is not None or args.model is not None or hf_config is not None) and overrides:
        flag = "--params" if params is not None else "--model" if args.model is not None else "--hf-config"
        raise ValueError(f"--set changes the handbook's model; do not combine it with {flag}")
    if params is not None:
        return (model_layout(params), f"model: {params:,} parameters (--params: a count only, so model state only)",
                [])
    if args.model is not None:
        shape = get_shape(args.model)
        layout = model_layout(shape)
        return (layout, f"model: {layout.name}, {layout.num_params:,} parameters (--model {args.model})",
                [describe_shape(shape)])
    if hf_config is not None:
        try:
            shape, unused = read_hf_config_keys(hf_config)
        except ValueError as err:
            raise ValueError(f"--hf-config {err}") from None
        layout = model_layout(shape)
        echo = [describe_shape(shape)]
        if unused:
            echo.append(f"not read (no effect on the count): {', '.join(unused)}")
        return layout, f"model: {layout.name}, {layout.num_params:,} parameters (--hf-config {hf_config})", echo
    config = _model_overrides(overrides)
    layout = model_layout(config)
    changed = f"; changed: {' '.join(overrides)}" if overrides else ""
    return layout, (f"model: the handbook's model, {layout.num_params:,} parameters{changed} "
                    "(other models: --model, --hf-config, --params)"), [describe_shape(config)]


def _print_model(named: str, echo: list[str]) -> None:
    """The model's line, then what was read of it (its shape, the keys left unread)."""
    for line in (named, *echo):
        print(wrap_line(line, "  "))

def _check_sharding(args: argparse.Namespace) -> None:
    """Refuse flags that the chosen strategy would ignore or cannot honour."""
    row = get_strategy(args.strategy)
    if args.shard_group_size is not None:
        if not row.hybrid:
            raise ValueError(f"--shard-group-size applies to the HYBRID strategies ({', '.join(_HYBRID)}), "
                             f"not --strategy {args.strategy}")
        ParallelLayout.for_world(args.world_size, shard_group=args.shard_group_size, names=FLAGS)
    if not row.distributed and args.world_size != 1:
        raise ValueError(f"--strategy NONE is one plain process: use --world-size 1, not {args.world_size}")

def _assumptions(args: argparse.Namespace, optimizer: str) -> str:
    group = f" (shard groups of {args.shard_group_size})" if args.shard_group_size else ""
    return (f"assumes: {args.strategy} on {args.world_size} ranks{group}, {args.precision}, "
            f"optimizer {optimizer}{impl_text(args)}")


def _gpu_budget(args: argparse.Namespace) -> MemoryBudget | None:
    """``memory --gpu``: the budget of one GPU of the flags' layout, NCCL's buffers taken off."""
    return None if args.gpu is None else layout_budget(args.gpu, get_strategy(args.strategy).layout(
        args.world_size, args.shard_group_size, tp=args.tp_size, sp=args.sp_size, sp_method="ring"))


def _zero_memory(args: argparse.Namespace) -> int:
    """``memory --strategy ZERO1|ZERO2|ZERO3``: DeepSpeed's model state on one rank, as chapter 7
    measures it, and DeepSpeed's own estimate beside it; what its optimizer step adds, or with
    ``--micro-batch`` each moment of a step (:func:`~handbook_lib.models.zero_peak.estimate_zero_peak`)."""
    asked = [flag for flag, on in (("--grad-accum", args.grad_accum > 1), ("--tp-size", args.tp_size > 1),
                                   ("--sp-size", args.sp_size > 1), ("--set-to-none", args.set_to_none),
                                   ("--float8-all-gather", args.float8_all_gather),
                                   ("--cpu-offload", args.cpu_offload and args.micro_batch)) if on]
    if asked:
        also = " and --micro-batch" if asked[0] == "--cpu-offload" else ""
        raise ValueError(f"{asked[0]} with --strategy {args.strategy}{also}: DeepSpeed's step is priced without it "
                         "(chapter 7); leave it out, or use an FSDP strategy")
    model, named, echo = _chosen_model(args)
    state = estimate_rank_state(model, args.world_size, args.strategy, args.precision, args.optimizer,
                                cpu_offload=args.cpu_offload)
    knobs = zero_knobs(args.reduce_bucket_size, True)
    impl = zero_optimizer_impl(args.optimizer_impl)  # default: DeepSpeed's own fused Adam on a GPU
    peak = estimate_zero_peak(
        model, args.world_size, args.strategy, args.precision, args.optimizer, micro_batch=args.micro_batch,
        seq_len=args.seq_len, optimizer_impl=args.optimizer_impl, knobs=knobs,
        activation_checkpointing=args.activation_checkpointing, ac_every=args.ac_every,
        ac_matmul_every=args.ac_matmul_every, ac_save=args.ac_save, loss_chunks=args.loss_chunks,
    ) if args.micro_batch else None
    step = 0 if args.cpu_offload else zero_step_bytes(model, args.world_size, args.strategy, args.precision,
                                                      args.optimizer, impl)
    theirs, budget = deepspeed_own_estimate(model, args.world_size, args.strategy), _gpu_budget(args)
    state = peak.state if peak else state  # the peak's layout: DeepSpeed's persistence threshold applied
    parts = {"params": state.params, "master": state.master, "grads": state.grads, "optimizer": state.optimizer,
             "optimizer_step": state.optimizer_step}
    notes = ([] if peak else ["activations and DeepSpeed's buckets are not priced: give --micro-batch and "
                              "--seq-len"]) + (list(peak.notes) if peak else [])
    if not model.exact:
        notes.append("tensors unknown: the parameters are one flat block (ZeRO-1/2's gradients are the "
                     "partition's own; ZeRO-3 keeps no small tensor whole)")
    total = peak.peak if peak else state.total + step
    if args.json:
        print(json.dumps({"model": named.removeprefix("model: "), "parts": parts, "at_rest": state.total,
                          "step_bytes": step, "at_step": state.total + step,
                          "phases": peak.phases if peak else None, "buckets": peak.buckets if peak else None,
                          "peak": total, "peak_reserved": reserved_bytes(total) if peak else None,
                          "deepspeed_estimate": None if args.cpu_offload else theirs, "notes": notes,
                          "budget": vars(budget) if budget else None}, indent=2))
        return 0
    _print_model(named, echo)
    tokens = f"micro-batch {args.micro_batch} x {args.seq_len} tokens" if peak else "model state only"
    print(wrap_line(f"{_assumptions(args, args.optimizer)}; DeepSpeed's layout, {tokens}; gradient bucket "
                    f"{knobs.reduce_bucket_size:,} elements", "  "))
    rows = [[name, b, format_bytes(b)] for name, b in parts.items()]
    if peak is None:
        rows += [["at rest", state.total, format_bytes(state.total)],
                 ["+ the optimizer step's", step, format_bytes(step)],
                 ["at the optimizer step", total, format_bytes(total)]]
    else:
        rows += [["buckets", peak.buckets, format_bytes(peak.buckets)]]
        rows += [[f"{'peak: ' * (name == peak.peak_phase)}{name}", b, format_bytes(b)]
                 for name, b in peak.phases.items()]
        rows += [["peak reserved (CUDA)", reserved_bytes(total), format_bytes(reserved_bytes(total))]]
    print(Table(["part", "bytes", "human"], rows))
    if not args.cpu_offload:
        print(wrap_line(f"DeepSpeed's own estimate (estimate_zero{max(zero_stage(args.strategy), 2)}"
                        f"_model_states_mem_needs, no offload): {format_bytes(theirs)}, model state only", "  "))
    for note in notes:
        print(wrap_line(f"note: {note}", "  "))
    if budget is not None:
        fits = "fits" if (reserved_bytes(total) if peak else total) <= budget.budget_bytes else "does NOT fit"
        what = "the peak reserved" if peak else "the model state at the optimizer step (activations not priced)"
        print(wrap_line(f"budget per GPU on {args.gpu}: {budget.text()}; {what} {fits}", "  "))
    return 0


def _cmd_memory(args: argparse.Namespace) -> int:
    _check_sharding(args)
    get_strategy(args.strategy).check_cpu_offload(args.cpu_offload, flag="--cpu-offload")
    check_memory_flags(args)
    if get_strategy(args.strategy).wrapper == "deepspeed":
        return _zero_memory(args)
    zero_knobs(args.reduce_bucket_size, False)  # refuses the flag without a ZeRO strategy
    check_optimizer_impl(args.optimizer, args.optimizer_impl, args.strategy,
                         names=("--optimizer-impl {}", "--optimizer {}"))
    model, named, echo = _chosen_model(args)
    axes = _axes_memory(args, model)
    est = axes[0] if axes else estimate_memory(
        model, args.world_size, args.strategy, args.precision, args.optimizer, micro_batch=args.micro_batch,
        seq_len=args.seq_len, shard_group_size=args.shard_group_size,
        activation_checkpointing=args.activation_checkpointing, cpu_offload=args.cpu_offload,
        grad_accum_steps=args.grad_accum, sync_every_micro_step=args.sync_every_micro_step,
        optimizer_impl=args.optimizer_impl, ac_every=args.ac_every, ac_matmul_every=args.ac_matmul_every,
        ac_save=args.ac_save, loss_chunks=args.loss_chunks, set_to_none=args.set_to_none,
        float8_all_gather=args.float8_all_gather)
    tokens = (f"micro-batch {args.micro_batch} x {args.seq_len} tokens" if args.micro_batch
              else "no activations") + accum_text(args, "; ")
    every = (f" (layers 0, {args.ac_every}, {2 * args.ac_every}, ...)" if args.ac_every > 1 else "") + (
        f", one matrix product in {args.ac_matmul_every} kept" if args.ac_matmul_every > 1 else "") + (
        f", keeping {args.ac_save}" if args.ac_save != "matmul+attention" else "")
    assumes = (f"{_assumptions(args, args.optimizer)}; {tokens}; activation checkpointing "
               f"{args.activation_checkpointing}{every}; CPU offload "
               f"{'on' if args.cpu_offload else 'off'}{axes[1] if axes else ''}"
               f"{'; gradients freed after each step' if args.set_to_none else ''}"
               f"{'; Float8 all-gather of the layers (unverified on CPU ranks)' if args.float8_all_gather else ''}")
    budget = _gpu_budget(args)
    if args.json:
        print(json.dumps({"model": named.removeprefix("model: "), "assumptions": assumes.removeprefix("assumes: "),
                          "components": est.components, "peak": est.peak, "peak_reserved": est.peak_reserved,
                          "peak_phase": est.peak_phase, "phases": est.phases, "host": est.host,
                          "reserve": {"fraction": RESERVE_FRACTION, "model": RESERVE_MODEL,
                                      "source": RESERVE_SOURCE},
                          "notes": list(est.notes), "budget": vars(budget) if budget else None},
                         indent=2))
        return 0
    _print_model(named, echo)
    print(wrap_line(assumes, "  "))
    if args.precision != "fp32":  # this command's default is bf16-mixed; the library's and the runs' fp32
        print(wrap_line(f"(runs default to fp32: add --precision fp32 to compare with "
                        f"{'a run' + chr(39) + 's measurements or ' if model.runnable else ''}estimate_memory(), "
                        "whose default it is too)", "  "))
    rows = [[name, b, format_bytes(b)] for name, b in est.components.items()]
    rows.append([f"peak ({est.peak_phase})", est.peak, format_bytes(est.peak)])
    rows.append(["peak reserved (CUDA)", est.peak_reserved, format_bytes(est.peak_reserved)])
    if est.host:
        rows.append(["host (offloaded)", est.host, format_bytes(est.host)])
    print(Table(["component", "bytes", "human"], rows))
    what = PHASE_WORDS.get(est.peak_phase, ("", ""))[1]
    print(wrap_line(f"peak reserved = the peak as CUDA's caching allocator holds it (nvidia-smi, less "
                    f"the process's context): {RESERVE_MODEL}", "  "))
    print(wrap_line(f"peak = the step's largest phase; {est.peak_phase} = {what}",
                "  "))
    for note in est.notes:
        if note.startswith("activations not included"):
            note = ("activations not included: give --micro-batch and --seq-len (with --model, "
                    "--hf-config or the handbook's model)" if args.params is None else
                    "activations not included: --params has no shape to compute them from (use --model "
                    "or --hf-config)")
        print(wrap_line(f"note: {note}", "  "))
    if budget is not None:
        fits = "fits" if est.peak_reserved <= budget.budget_bytes else "does NOT fit"
        print(wrap_line(f"budget per GPU on {args.gpu}: {budget.text()}; the peak reserved {fits}", "  "))
    return 0

def _axes_memory(args: argparse.Namespace, layout: ModelLayout) -> tuple[MemoryEstimate, str] | None:
    """``memory --tp-size/--sp-size``: the flags mapped onto a layout, priced by
    :func:`~handbook_lib.models.axes.estimate_job_memory` (which refuses what it does not price), and
    the words of its assumption."""
    tp, sp = args.tp_size, args.sp_size
    if tp == 1 and sp == 1:
        return None
    flag = "--tp-size" if tp > 1 else "--sp-size"
    if not args.micro_batch:
        raise ValueError(f"{flag} divides activations: give --micro-batch and --seq-len too (with --model, "
                         "--hf-config or the handbook's model)")
    row = get_strategy(args.strategy)
    # the memory does not depend on the sequence split's method: no heads rule (the ring's)
    job = ParallelLayout.for_world(args.world_size, tp=tp, sp=sp, sp_method="ring",
                                   shard_group=args.shard_group_size if row.hybrid else None,
                                   replicate=not row.sharded, nhead=layout.nhead, seq_len=args.seq_len,
                                   names=FLAGS | {"world": "the GPUs ({})"})
    model = chosen_shape(args) if tp > 1 else layout
    est = estimate_job_memory(model, job, micro_batch=args.micro_batch, seq_len=args.seq_len,
                              strategy=args.strategy, precision=args.precision, optimizer=args.optimizer,
                              activation_checkpointing=args.activation_checkpointing,
                              cpu_offload=args.cpu_offload, grad_accum_steps=args.grad_accum,
                              sync_every_micro_step=args.sync_every_micro_step)
    split = f"the sequence split over {sp} ranks ({args.seq_len // sp} tokens per GPU)"
    if tp == 1:
        return est, f"; {split}, FSDP over all {args.world_size}"
    words = f"; TP {tp} x FSDP {args.world_size // tp} (sequence parallel on the norms), micro-batch per TP group"
    return est, words + (f"; {split}, inside the FSDP ranks" if sp > 1 else "")


def _cmd_comm(args: argparse.Namespace) -> int:
    _check_sharding(args)
    if bool(args.gpu) != bool(args.tokens) or (args.seq_len and not args.tokens):
        raise ValueError("compute time needs both --gpu and --tokens (> 0; --seq-len needs them too): give both, "
                         "or neither")
    model, named, echo = _chosen_model(args)
    if args.seq_len and not model.num_layers:
        raise ValueError("--seq-len needs a model's layers: use --model or --hf-config, not --params")
    param_dtype, reduce_dtype = PRECISIONS[args.precision]
    traffic = estimate_step_traffic(model.units(), args.world_size, args.strategy, param_dtype=param_dtype,
                                    reduce_dtype=reduce_dtype, shard_group_size=args.shard_group_size)
    link = get_link(args.link)
    compute_s, u = 0.0, 0.0
    if args.gpu:
        acc = get_accelerator(args.gpu)
        u = expected_utilization(acc, model.d_model)
        compute_s = estimate_compute_time(model.num_params, args.tokens, acc.peak_flops_bf16, u, seq_len=args.seq_len,
                                          num_layers=model.num_layers, attention_width=model.attention_width)
    plain = estimate_step_time(traffic, link, compute_s, overlap=False)
    hidden = estimate_step_time(traffic, link, compute_s, overlap=True)
    assumes = (f"{_assumptions(args, 'any (it adds no traffic)')}; parameters gathered in "
               f"{param_dtype}, gradients reduced in {reduce_dtype}; link {link.name}")
    if args.json:
        print(json.dumps({"model": named.removeprefix("model: "), "assumptions": assumes.removeprefix("assumes: "),
                          "counts": traffic.counts, "sent_bytes": traffic.sent_bytes,
                          "received_bytes": traffic.received_bytes, "comm_s": plain.comm_s,
                          "compute_s": compute_s, "step_s_no_overlap": plain.total_s,
                          "step_s_overlap": hidden.total_s, "bound": hidden.bound}, indent=2))
        return 0
    rows = []
    for kind, count in traffic.counts.items():
        if count:
            sent = sum(r.sent_bytes for r in traffic.records if r.kind == kind)
            rows.append([kind, count, sent, format_bytes(sent)])
    rows.append(["total", sum(traffic.counts.values()), traffic.sent_bytes, format_bytes(traffic.sent_bytes)])
    _print_model(named, echo)
    print(wrap_line(assumes, "  "))
    print("per rank and step:")
    print(Table(["collective", "calls", "bytes sent", "human"], rows))
    print(f"communication: {plain.comm_s * 1e3:.2f} ms on {link.name}")
    if compute_s:
        flops = (f"6PT and attention's at {args.seq_len:,} tokens a sequence" if args.seq_len else
                 "6PT; attention's FLOPs left out: give --seq-len")
        print(wrap_line(f"compute ({flops}; {u:.0%} of {args.gpu}'s bf16 peak): {compute_s * 1e3:.2f} ms"))
        print(f"step: {plain.total_s * 1e3:.2f} ms without overlap, {hidden.total_s * 1e3:.2f} ms with; "
              f"{hidden.bound}-bound")
        print(wrap_line("bound = what sets the step time with overlap: compute (the links' time hides "
                    "behind it) or communication (the links are the bottleneck)", "  "))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    per_node = args.gpus_per_node or node_preset(args.gpu).gpus_per_node
    check_whole_nodes(args.gpus, per_node, names=("--gpus {}", "--gpus-per-node {}"))
    model, named, echo = _chosen_model(args)
    asked = args.tp_size > 1 or args.sp_size > 1 or args.pp_size is not None or args.batch_tokens is not None
    decoder = (chosen_shape(args) if asked or getattr(args, "model", None) is not None
               or getattr(args, "hf_config", None) is not None else None)
    report = plan_report(model, args.gpu, args.gpus, decoder=decoder, gpus_per_node=per_node,
                         inter_link=args.inter_link, nics_per_node=args.nics_per_node, micro_batch=args.micro_batch,
                         seq_len=args.seq_len, precision=args.precision, optimizer=args.optimizer,
                         optimizer_impl=args.optimizer_impl, grad_accum=args.grad_accum,
                         sync_every_micro_step=args.sync_every_micro_step, headroom=args.headroom,
                         activation_checkpointing=args.activation_checkpointing, ac_every=args.ac_every,
                         ac_matmul_every=args.ac_matmul_every, ac_save=args.ac_save,
                         shard_group_size=args.shard_group_size, loss_chunks=args.loss_chunks,
                         strategy=args.strategy, reduce_bucket_size=args.reduce_bucket_size,
                         sensitivity=args.sensitivity,
                         tp_size=args.tp_size, sp_size=args.sp_size, sp_method=args.sp_method,
                         pp_size=args.pp_size, batch_tokens=args.batch_tokens)
    if args.json:
        print(json.dumps(report.to_json(), indent=2, allow_nan=False))
        return 0
    _print_model(named, echo)
    print_plan(report, args, per_node)
    return 0


def _cmd_runs() -> int:
    for name, doc in describe_runs().items():
        print(wrap_line(f"{name:19s}{doc}", " " * 19))
    return 0

def _cmd_run(args: argparse.Namespace) -> int:
    """Launch, print every check with its verdict; exit 1 if any is outside its own tolerance."""
    result = torchrun(args.name, args.nproc, parse_overrides(args.overrides), out=args.out,
                      timeout_s=args.timeout, stream=not args.quiet, allow_failed_checks=True,
                      overwrite=args.overwrite, nnodes=args.nnodes, node_rank=args.node_rank,
                      rdzv_endpoint=args.rdzv_endpoint, force_resources=args.force_resources)
    if result is None:  # one node of a real multi-node job, not rank 0's
        print(wrap_line(f"node {args.node_rank}: its ranks finished; rank 0 ran on another node "
                        "(torchrun's rendezvous numbers the nodes), whose --out folder holds "
                        "result.json", "  "))
        return 0
    if result.checks:
        print(checks_table(result))
        print(checks_verdict(result))
        legend = checks_legend(result)
        if legend:
            print(wrap_line(legend, "  "))
    if result.run == "comm_bench":
        print("alpha-beta fit: time = steps x alpha + bytes sent / beta, per collective")
        print(fit_table(result))
        for note in result.extra.get("notes", []):
            print(wrap_line(f"note: {note}", "  "))
    if result.run == "step_time":
        print(step_time_table(result))
        print(step_time_summary(result))
    print(f"result: {result.path}" if result.path else "result: not kept (its folder was temporary); pass --out DIR "
          "to keep result.json and the logs")
    failed = result.failed_checks()
    if failed:
        print(f"error: {len(failed)} of {len(result.checks)} checks are outside their tolerance:\n"
              f"{describe_failed_checks(result)}", file=sys.stderr)
        return 1
    return 0

def _cmd_slurm(args: argparse.Namespace) -> int:
    """Check everything, then print the script or write it to ``--output``."""
    from handbook_lib.launch.slurm import build_job, render_sbatch, write_script

    if args.overwrite and args.output is None:
        raise ValueError("--overwrite applies to --output FILE: give --output, or leave --overwrite out")
    job = build_job(args.name, args.nodes, args.gpus_per_node, parse_overrides(args.overrides),
                    time=args.time, partition=args.partition, account=args.account, job_name=args.job_name,
                    out_dir=args.out, log=args.log, cpus_per_task=args.cpus_per_task, port=args.port)
    text = render_sbatch(job)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    path = write_script(args.output, text, overwrite=args.overwrite)
    print(f"wrote {path}: {job.run} on {job.nodes} x {job.gpus_per_node} GPUs = {job.world_size} ranks; "
          f"submit it with: sbatch {path}")
    return 0

def _cmd_params(args: argparse.Namespace) -> int:
    model, named, echo = _chosen_model(args)
    parts, total = dict(model.breakdown), model.num_params
    if args.json:
        print(json.dumps({"total": total, "model": named.removeprefix("model: "), "components": parts}, indent=2))
        return 0
    _print_model(named, echo)
    rows = [[name, count, format_bytes(4 * count)] for name, count in parts.items()]
    rows.append(["total", total, format_bytes(4 * total)])
    print(Table(["component", "parameters", "fp32 bytes"], rows))
    return 0

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "runs": lambda args: _cmd_runs(), "run": _cmd_run, "params": _cmd_params, "memory": _cmd_memory,
    "comm": _cmd_comm, "plan": _cmd_plan, "slurm": _cmd_slurm,
}
"""Each command's function: it takes the parsed arguments and returns the exit status."""
