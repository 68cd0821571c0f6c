"""The FSDP clinic's correctness cases: jobs that run and compute the wrong thing, or refuse to.

Chapter 10, "Correctness". Each case is ``(setup) -> (broken, fixed)``
(:data:`handbook_lib.runtime.clinic_common.CaseFn`). What each measures is checked against the
book's models where one exists: the parameter tensors and their shards
(:mod:`handbook_lib.models.sharding`), FSDP1's flat shards, a step's all-gathers in bf16
(:func:`~handbook_lib.models.traffic.estimate_step_traffic`), and the norm after clipping.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from contextlib import contextmanager
from collections.abc import Iterator

import torch
from torch import nn

from handbook_lib.core.architecture import ModelConfig
from handbook_lib.models.model_state import optimizer_states
from handbook_lib.models.sharding import estimate_flat_shard_bytes, estimate_tensor_shards
from handbook_lib.models.traffic import estimate_step_traffic
from handbook_lib.runtime.clinic_common import (
    CaseFn,
    CaseSetup,
    Half,
    counted,
    forward_all_gathers,
    first_line,
    raised,
    shard_model,
    step_loss,
)
from handbook_lib.runtime.diagnosis import diagnose_grad_norm, diagnose_tied_weights
from handbook_lib.runtime.grads import full_grad_norm
from handbook_lib.runtime.measure import local_tensor, measure_optimizer_bytes, measure_param_bytes, nbytes
from handbook_lib.runtime.model import SimpleTransformer, TransformerLayer

__all__ = ["tied_weights_split", "local_grad_norm", "meta_buffer_uninit", "optimizer_before_wrap",
           "ac_nondeterministic", "mixed_dtype", "forward_skips_hooks", "CORRECTNESS_CASES",
           "PositionalTransformer", "uninitialised_as_nan", "CLIP_NORM", "DROPOUT"]

CLIP_NORM = 0.01
"""``max_norm`` of the clipping case: below every rank's shard norm, so every rank clips."""
DROPOUT = 0.1
"""Dropout after each layer in the activation-checkpointing case."""


def _tie(model: SimpleTransformer) -> SimpleTransformer:
    model.output.weight = model.embedding.weight  # both (vocab, d_model): one tensor
    return model


def tied_weights_split(setup: CaseSetup) -> tuple[Half, Half]:
    """The embedding and the head share one weight, wrapped as two units: each shards
    its own copy and the first forward raises. Fixed: both in the root unit. Checked:
    the parameter tensors, the root's shard bytes, the diagnosis before wrapping."""
    tensors = setup.layout.tensors
    halves = []
    for broken in (True, False):
        half = setup.half()
        model = _tie(setup.model())
        units = [model.embedding, model.output, *model.layers] if broken else list(model.layers)  # clinic: both
        finding = diagnose_tied_weights(model, units)
        shard_model(model, setup.mesh(), units)  # clinic: both
        params = len(list(model.parameters()))
        expected = len(tensors) - (0 if broken else 1)
        half.check("parameter_tensors", expected, params, "tensors")
        half.flag("diagnosed", broken, finding is not None)
        opt = torch.optim.AdamW(model.parameters(), lr=setup.config.lr)
        steps = [setup.batch(s) for s in range(2)]  # step 1 raises if split
        err = raised(lambda: [step_loss(model, b, opt) for b in steps])  # noqa: B023
        half.flag("raised", broken, err is not None)
        if not broken:
            half.flag("tie_kept", True, model.output.weight is model.embedding.weight)
            shapes = [s for n, s in tensors if n != "output.weight"]
            shards = estimate_tensor_shards(shapes, setup.world, setup.rank)
            half.check("param_shard_bytes", shards.shard_bytes,
                       measure_param_bytes(model).shard_bytes, "bytes")
        half.symptom = err is not None
        half.metrics.update(parameter_tensors=params,
                            error=first_line(err) if err else None,
                            diagnosis=finding.message if finding else None)
        wrapped = "embedding and head in two units" if broken else "both in the root"
        half.finding = (f"{wrapped}: {params} parameter tensors; "
                        + (first_line(err) if err else "trains"))
        halves.append(half)
    return halves[0], halves[1]


def _local_norm(model: nn.Module) -> float:
    """The L2 norm of this rank's gradient shards only (what a logging line over ``to_local()``
    tensors computes)."""
    return float(torch.nn.utils.get_total_norm([local_tensor(p.grad) for p in model.parameters()
                                                if p.grad is not None]))


def local_grad_norm(setup: CaseSetup) -> tuple[Half, Half]:
    """The gradient norm taken over this rank's shards, logged and used to clip to
    :data:`CLIP_NORM`. It is low by about sqrt(N), differs between ranks, and each rank clips by
    its own factor, so the clipped gradient's norm is sqrt(N) x max_norm when every rank clips.
    Fixed: ``clip_grad_norm_`` on FSDP2's DTensor parameters (the squared norms summed over the
    ranks). Checked: the ranks' squared local norms sum to the whole norm squared; the norm after
    clipping (sqrt(N) x max_norm broken, max_norm fixed), within 1e-5; :func:`diagnose_grad_norm`."""
    halves = []
    for broken in (True, False):
        half = setup.half()
        model = shard_model(setup.model(), setup.mesh())
        step_loss(model, setup.batch(0))
        whole = full_grad_norm(model)
        if broken:  # clinic: both
            logged = _local_norm(model)  # this rank's shards only
        else:  # clip_grad_norm_'s two halves: the norm of the DTensor gradients, then the clip
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            logged = float(norm.full_tensor())
        finding = diagnose_grad_norm(model, logged)
        if broken:  # clinic: both
            scale = CLIP_NORM / (logged + 1e-6)
            for p in model.parameters():
                local_tensor(p.grad).mul_(min(1.0, scale))
        else:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), CLIP_NORM, norm)
        if broken:
            half.check("logged_sq_sum", whole ** 2, setup.all_sum(logged ** 2), "norm^2", 1e-5)
        else:
            half.check("logged_norm", whole, logged, "norm", 1e-5)
        half.flag("diagnosed", broken, finding is not None)
        clipped = full_grad_norm(model)
        half.check("clipped_norm", CLIP_NORM * (math.sqrt(setup.world) if broken else 1.0), clipped,
                   "norm", 1e-5)
        half.symptom = abs(logged - whole) > 1e-3 * whole
        half.metrics.update(logged_norm=logged, whole_norm=whole, ratio=whole / logged, clipped_norm=clipped,
                            diagnosis=finding.message if finding else None)
        half.finding = (f"logged {logged:.3g} of a whole norm {whole:.3g} ({whole / logged:.2f}x); "
                        f"after clipping to {CLIP_NORM}: {clipped:.3g}")
        halves.append(half)
    return halves[0], halves[1]


def _positions(seq_len: int, d_model: int) -> torch.Tensor:
    """A sinusoidal position table (seq_len, d_model), fp32: sin on even columns, cos on odd."""
    pos = torch.arange(seq_len, dtype=torch.float32)[:, None]
    rate = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10_000.0) / d_model))
    table = torch.zeros(seq_len, d_model)
    table[:, 0::2], table[:, 1::2] = torch.sin(pos * rate), torch.cos(pos * rate)[:, : d_model // 2]
    return table


class PositionalTransformer(SimpleTransformer):
    """The book's model with a fixed sinusoidal position table added to the token embeddings: a
    non-persistent buffer, computed, never trained or saved (as RoPE's frequencies are)."""

    def __init__(self, config: ModelConfig, seq_len: int) -> None:
        super().__init__(config)
        self.register_buffer("positions", _positions(seq_len, config.d_model), persistent=False)

    def init_buffers(self) -> None:
        """Recompute the position table (after ``to_empty``, which gives it storage, no values)."""
        with torch.no_grad():
            self.positions.copy_(_positions(*self.positions.shape))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        mask = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).triu(1)
        x = self.embedding(tokens) + self.positions[:seq]
        for layer in self.layers:
            x = layer(x, attn_mask=mask)
        return self.output(x)


@contextmanager
def uninitialised_as_nan() -> Iterator[None]:
    """Inside the block, fill new uninitialised float memory (``torch.empty``, ``to_empty``) with
    NaN: PyTorch's deterministic mode with ``torch.utils.deterministic.fill_uninitialized_memory``
    (on by default). Forgotten initialisation then shows, every time, as NaN."""
    import torch.utils.deterministic

    before, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _reset_parameters(model: nn.Module) -> None:
    """Every module's own ``reset_parameters`` (``_reset_parameters`` for attention): the
    parameters, drawn anew. Buffers are not parameters: none is touched."""
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
        if reset is not None and not isinstance(module, PositionalTransformer):
            reset()


def meta_buffer_uninit(setup: CaseSetup) -> tuple[Half, Half]:
    """A model with a computed buffer, built on the meta device, sharded, given storage with
    ``to_empty`` and initialised by each module's ``reset_parameters``: the buffer keeps
    ``to_empty``'s uninitialised memory (made NaN here by :func:`uninitialised_as_nan`, garbage
    otherwise), and so does the loss. Fixed: the model's ``init_buffers`` too. Checked: the
    buffer's non-finite elements (all seq_len x d_model of them, broken) and its mismatches with
    the table (0, fixed), exact."""
    cfg, seq = setup.config.model_config(), setup.config.seq_len
    halves = []
    for broken in (True, False):
        half = setup.half()
        with torch.device("meta"):
            model = PositionalTransformer(cfg, seq)
        shard_model(model, setup.mesh())
        with uninitialised_as_nan():
            model.to_empty(device="cpu")
        torch.manual_seed(setup.config.seed)
        _reset_parameters(model)  # clinic: both
        if not broken:  # clinic: both
            model.init_buffers()
        loss = step_loss(model, setup.batch(0))
        bad = int((~torch.isfinite(model.positions)).sum())
        if broken:
            half.check("buffer_nonfinite", seq * cfg.d_model, bad, "elements")
        else:
            half.check("buffer_mismatches", 0, int((model.positions != _positions(seq, cfg.d_model)).sum()),
                       "elements")
        half.flag("loss_finite", not broken, math.isfinite(loss))
        half.symptom = bad > 0 or not math.isfinite(loss)
        half.metrics.update(non_finite_buffer_elements=bad, loss=loss if math.isfinite(loss) else None)
        half.finding = (f"{'reset_parameters only' if broken else 'reset_parameters + init_buffers'}: "
                        f"{bad} of {seq * cfg.d_model} buffer elements non-finite, loss "
                        f"{'finite' if math.isfinite(loss) else loss}")
        halves.append(half)
    return halves[0], halves[1]


def _fsdp1(model: nn.Module, setup: CaseSetup) -> nn.Module:
    """FSDP1 over the case's group, one flat unit per layer and the root (flat parameters)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer})
    return FSDP1(model, process_group=setup.group, auto_wrap_policy=policy, device_id=torch.device("cpu"),
                 use_orig_params=False)


def optimizer_before_wrap(setup: CaseSetup) -> tuple[Half, Half]:
    """AdamW built from the model's parameters, then FSDP1 (flat parameters): FSDP1 replaces
    them with one FlatParameter per unit, the optimizer keeps the originals, which never get a
    gradient, so no weight moves, and every rank keeps the whole model alive in them. Fixed: the
    optimizer built from the wrapped model. Checked: the weights updated (0 broken), the bytes of
    the optimizer's tensors (the whole model, 4P, broken; the padded flat shards fixed,
    :func:`~handbook_lib.models.sharding.estimate_flat_shard_bytes`) and its state (0; 2x the
    shards), exact."""
    units = setup.layout.units("layer")
    flat = estimate_flat_shard_bytes(units, setup.world, setup.rank).padded_bytes
    halves = []
    for broken in (True, False):
        half = setup.half()
        model = setup.model()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if broken:  # clinic: both
                optimizer = torch.optim.AdamW(model.parameters(), lr=setup.config.lr)
                model = _fsdp1(model, setup)
            else:
                model = _fsdp1(model, setup)
                optimizer = torch.optim.AdamW(model.parameters(), lr=setup.config.lr)
            before = [p.detach().clone() for p in model.parameters()]
            losses = [step_loss(model, setup.batch(s), optimizer) for s in range(2)]
        moved = sum(int((a != p.detach()).sum()) for a, p in zip(before, model.parameters()))
        held = sum(nbytes(p) for p in optimizer.param_groups[0]["params"])
        if broken:
            half.check("weights_updated", 0, moved, "elements")
        half.check("optimizer_params_bytes", 4 * setup.layout.num_params if broken else flat, held, "bytes")
        half.check("optimizer_state_bytes", 0 if broken else optimizer_states("adamw") * flat,
                   measure_optimizer_bytes(optimizer)[0], "bytes")
        half.symptom = moved == 0
        half.metrics.update(elements_updated=moved, optimizer_param_bytes=held, losses=losses)
        half.finding = (f"optimizer built {'before' if broken else 'after'} FSDP1: it holds {held:,} B of "
                        f"parameters; the step updated {moved:,} elements")
        halves.append(half)
    return halves[0], halves[1]


class _Dropped(nn.Module):
    """A transformer layer followed by dropout (:data:`DROPOUT`): random in every forward."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.drop = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.drop(self.layer(x, attn_mask=attn_mask))


def _dropout_grads(setup: CaseSetup, preserve_rng_state: bool | None) -> list[torch.Tensor]:
    """This rank's gradient shards after one seeded step of the model with dropout, each layer
    checkpointed with ``preserve_rng_state`` (``None``: no checkpointing)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = setup.model()
    for i, layer in enumerate(model.layers):
        model.layers[i] = _Dropped(layer) if preserve_rng_state is None else \
            checkpoint_wrapper(_Dropped(layer), preserve_rng_state=preserve_rng_state)
    shard_model(model, setup.mesh(), list(model.layers))
    torch.manual_seed(setup.config.seed + 1)  # the same masks in every forward pass
    step_loss(model, setup.batch(0))
    return [local_tensor(p.grad).clone() for p in model.parameters()]


def ac_nondeterministic(setup: CaseSetup) -> tuple[Half, Half]:
    """Activation checkpointing of layers with dropout, recomputed without restoring the random
    state (``preserve_rng_state=False``): backward recomputes the layer with new masks, and the
    gradients are not those of the forward pass that was run. Fixed: the random state restored
    (``True``, the default). Checked: the gradients against the same model without
    checkpointing (relative L2 difference over all ranks): different broken, equal fixed."""
    reference = _dropout_grads(setup, None)
    ref_sq = setup.all_sum(sum(float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2 for g in reference))
    halves = []
    for broken in (True, False):
        half = setup.half()
        grads = _dropout_grads(setup, preserve_rng_state=not broken)  # clinic: both
        diff_sq = sum(float(torch.linalg.vector_norm(g - r, dtype=torch.float64)) ** 2
                      for g, r in zip(grads, reference))
        relative = math.sqrt(setup.all_sum(diff_sq) / ref_sq)
        half.flag("grads_as_without_ac", not broken, relative <= 1e-6)
        half.symptom = relative > 1e-6
        half.metrics.update(relative_grad_difference=relative)
        half.finding = (f"preserve_rng_state={not broken}: gradients differ from no checkpointing by "
                        f"{'more than 1e-3' if relative > 1e-3 else 'at most 1e-6' if relative <= 1e-6 else 'some'}"
                        " (relative L2)")
        halves.append(half)
    return halves[0], halves[1]


def _sorted_sets(text: str) -> str:
    """``text`` with each ``{a, b}`` it prints sorted: a Python set's order changes from one
    process to the next (FSDP2's dtype error prints one)."""
    return re.sub(r"\{([^{}]*)\}", lambda m: "{" + ", ".join(sorted(m.group(1).split(", "))) + "}", text)


def mixed_dtype(setup: CaseSetup) -> tuple[Half, Half]:
    """Part of the model loaded in bf16 (the head), the rest fp32, with FSDP2's bf16 mixed
    precision: a unit all-gathers one flat buffer of one dtype, and the first forward refuses
    (``FSDP expects uniform original parameter dtype``). Fixed: every parameter fp32, cast to
    bf16 by ``MixedPrecisionPolicy`` for the all-gathers. Checked: the step's all-gather and
    reduce-scatter bytes (bf16 and fp32, :func:`~handbook_lib.models.traffic.estimate_step_traffic`),
    exact."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    halves = []
    for broken in (True, False):
        half = setup.half()
        model = setup.model()
        if broken:  # clinic: both
            model.output.to(torch.bfloat16)  # the head loaded in bf16
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
        shard_model(model, setup.mesh(), mp_policy=policy)  # clinic: both
        with counted() as calls:
            err = raised(lambda: step_loss(model, setup.batch(0)))  # noqa: B023 - called here
        half.flag("raised", broken, err is not None)
        if not broken:
            traffic = estimate_step_traffic(setup.layout.units("layer"), setup.world, "FULL_SHARD",
                                            param_dtype="bf16", reduce_dtype="fp32")
            for kind in ("all_gather", "reduce_scatter"):
                half.check(f"{kind}_bytes", sum(r.buffer_bytes for r in traffic.records if r.kind == kind),
                           sum(c.buffer_bytes for c in calls if c.kind == kind), "bytes")
        message = _sorted_sets(first_line(err)) if err else None
        half.symptom = err is not None
        half.metrics.update(parameter_dtypes=dtypes, error=message)
        half.finding = f"parameters in {', '.join(dtypes)}: " + (message or "trains in bf16")
        halves.append(half)
    return halves[0], halves[1]


def forward_skips_hooks(setup: CaseSetup) -> tuple[Half, Half]:
    """``model.forward(x)`` instead of ``model(x)``: FSDP2 gathers a unit in its module's
    forward hooks, which ``forward`` (like a root's submodule called alone, or ``generate``)
    skips. The root's parameters are still sharded DTensors when the embedding uses them, and
    the first operation raises. Fixed: call the module, or register the method
    (``register_fsdp_forward_method(model, "generate")``). Checked: the error and the
    forward's all-gathers (none broken; one per unit fixed,
    :func:`~handbook_lib.models.traffic.estimate_step_traffic`), exact."""
    x, _ = setup.batch(0)
    per_forward = forward_all_gathers(setup)
    halves = []
    for broken in (True, False):
        half = setup.half()
        model = shard_model(setup.model(), setup.mesh())
        call = model.forward if broken else model  # clinic: both
        with torch.no_grad(), counted() as calls:
            err = raised(lambda: call(x))  # noqa: B023 - called here
        all_gathers = sum(c.kind == "all_gather" for c in calls)
        half.check("all_gathers", 0 if broken else per_forward, all_gathers, "collectives")
        half.flag("raised", broken, err is not None)
        half.symptom = err is not None
        half.metrics.update(all_gathers=all_gathers, error=first_line(err) if err else None)
        half.finding = ("model.forward(x): " if broken else "model(x): ") + (
            first_line(err) if err else f"{all_gathers} all-gathers, one per unit")
        halves.append(half)
    return halves[0], halves[1]


CORRECTNESS_CASES: dict[str, CaseFn] = {
    "tied_weights_split": tied_weights_split,
    "local_grad_norm": local_grad_norm,
    "meta_buffer_uninit": meta_buffer_uninit,
    "optimizer_before_wrap": optimizer_before_wrap,
    "ac_nondeterministic": ac_nondeterministic,
    "mixed_dtype": mixed_dtype,
    "forward_skips_hooks": forward_skips_hooks,
}
"""The correctness cases of this module, by name."""
