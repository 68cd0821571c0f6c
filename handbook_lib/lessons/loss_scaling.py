"""fp16 without a gradient scaler, in a regime where it fails: gradients that underflow to zero.

Chapter 5 (section "Mixed precision") shows it. The course's seed computes in fp16
(``MixedPrecision(param_dtype=torch.float16, ...)``) and never scales its loss. fp16's smallest
positive value is 2**-24 (about 5.96e-8, subnormal): a gradient element below half of it rounds
to exactly zero. On a small model and a batch mean over a few hundred tokens that happens to
almost nothing. It happens to almost everything when each token's loss carries a small weight:
the loss of a large batch is a mean over *all* its tokens, so a micro-batch of 256 tokens of a
2**22-token global batch (4.2 M, the order of Llama 2's) carries 256 / 2**22 of it, and each of
its per-token gradients is 2**-22 of that token's own. fp32 keeps such gradients, and Adam,
which divides each update by the gradient's own running size, makes full-sized steps of them;
fp16 stores zeros.

:func:`measure_loss_scaling` trains the handbook's model in one process three ways from the same
seed, through the book's training loop (:func:`handbook_lib.runtime.training.train`, given an
fp16 forward and the micro-batch's share of the loss), on the book's synthetic data
(:func:`handbook_lib.runtime.data.make_batch`): fp32; fp16
compute without a scaler; fp16 compute with the gradient scaler the training loop builds
(:func:`handbook_lib.runtime.training.build_grad_scaler`). fp16 compute is FSDP's mixed precision on
one rank: the fp32 parameters are cast to fp16 for forward and backward, every activation
gradient is computed in fp16, and each parameter's gradient lands, cast back, on its fp32
parameter (``reduce_dtype=float32``), which the optimizer updates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from handbook_lib.core.config import RunConfig
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.model import build_model
from handbook_lib.runtime.optimization import build_grad_scaler, build_optimizer
from handbook_lib.runtime.training import LossFn, one_thread, train

__all__ = ["UNDERFLOW_SETUP", "GLOBAL_BATCH_TOKENS", "PRECISION_VARIANTS", "PrecisionRun",
           "LossScalingResult", "measure_loss_scaling"]

UNDERFLOW_SETUP: dict[str, int | float | str] = {
    "vocab_size": 128, "d_model": 64, "nhead": 4, "dim_feedforward": 128, "num_layers": 2,
    "batch_size": 8, "seq_len": 32, "steps": 30, "seed": 0, "optimizer": "adam", "lr": 3e-3,
}
"""The run config of the demonstration (the book's vocabulary): a small handbook model, one
micro-batch of 8 x 32 = 256 tokens per step, 30 steps of Adam. fp16 is emulated on a CPU, so
the model is kept small; the underflow depends on the size of the gradients, not of the model."""

GLOBAL_BATCH_TOKENS = 2**22
"""Tokens the loss is averaged over (the global batch): each token's loss is divided by it."""

PRECISION_VARIANTS = ("fp32", "fp16, no scaler", "fp16 + scaler")
"""The three runs of :func:`measure_loss_scaling`, in order."""


@dataclass(frozen=True)
class PrecisionRun:
    """One of the three runs: what each step measured."""

    label: str
    """One of :data:`PRECISION_VARIANTS`."""
    losses: list[float]
    """Per step, the micro-batch's mean cross-entropy (nats per token), before the update."""
    grad_zero_fraction: list[float]
    """Per step, the fraction (0-1) of all gradient elements that are exactly zero."""
    body_zero_fraction: list[float]
    """The same over every parameter except the output head's (embedding and layers)."""
    head_input_grad_max: float = 0.0
    """At step 1, the largest gradient element (absolute) that reached the output head's input,
    the hidden state every gradient of the layers below flows from; as computed, in the run's
    precision and, with a scaler, multiplied by its factor."""
    grad_scale: list[float] = field(default_factory=list)
    """Per step, the scaler's factor (empty without a scaler)."""
    skipped_steps: list[int] = field(default_factory=list)
    """Steps (1-based) whose update the scaler skipped because a gradient overflowed."""
    seconds: float = 0.0
    """Wall time of the run, seconds (varies from machine to machine)."""


@dataclass(frozen=True)
class LossScalingResult:
    """The three runs of :func:`measure_loss_scaling` and what they shared."""

    config: RunConfig
    """The run config (model, data, optimizer)."""
    global_batch_tokens: int
    """Tokens the loss is averaged over; each micro-batch token's loss is divided by it."""
    runs: dict[str, PrecisionRun]
    """Keyed by :data:`PRECISION_VARIANTS`."""

    def table_rows(self) -> list[list[str]]:
        """One row per run: first and last loss (1 decimal: the gaps are whole nats), zero
        gradients at step 1, overall and below the head (whole percent), the scale per step."""
        rows = []
        for label, run in self.runs.items():
            scale = sorted({f"2^{s.bit_length() - 1}" for s in map(int, run.grad_scale)}) or ["-"]
            rows.append([label, f"{run.losses[0]:.1f}", f"{run.losses[-1]:.1f}",
                         f"{100 * run.grad_zero_fraction[0]:.0f} %",
                         f"{100 * run.body_zero_fraction[0]:.0f} %", ", ".join(scale)])
        return rows

    def max_loss_difference(self, label: str) -> float:
        """Largest absolute difference (nats per token) between run ``label``'s losses and the
        fp32 run's, over all steps."""
        return max(abs(a - b) for a, b in zip(self.runs[label].losses, self.runs["fp32"].losses))




def _fp16_forward(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Forward in fp16 from the fp32 parameters: each is cast (a differentiable op), so backward
    runs in fp16 and the cast's backward hands each gradient to the fp32 parameter, as FSDP's
    ``param_dtype=float16``, ``reduce_dtype=float32`` does."""
    half = {name: p.to(torch.float16) for name, p in model.named_parameters()}
    return functional_call(model, half, (tokens,))


def _zero_fraction(params: list[nn.Parameter]) -> float:
    """Fraction (0-1) of the elements of ``params``' gradients that are exactly zero."""
    zeros = sum(int((p.grad == 0).sum()) for p in params)
    return zeros / sum(p.numel() for p in params)


def _micro_batch_share(global_batch_tokens: int) -> LossFn:
    """The loss of one micro-batch as the training loop should see it: its summed token losses
    divided by ``global_batch_tokens`` to backpropagate (its share of the global mean, the regime
    of the demonstration), its mean token loss (nats per token) to report."""

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        token_losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
        return token_losses.sum() / global_batch_tokens, token_losses.mean()

    return loss_fn


def _train(config: RunConfig, label: str, global_batch_tokens: int) -> PrecisionRun:
    """Train one variant through the book's training loop, in this process."""
    start = time.perf_counter()
    model = build_model(config.model_config(), seed=config.seed)
    optimizer = build_optimizer(model.parameters(), config.optimizer, config.lr, config.optimizer_impl)
    # one process, the whole batch: no process group exists
    one = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none")
    scaler = None
    if label == "fp16 + scaler":
        scaler = build_grad_scaler(config.replace(precision="fp16-mixed"), one)
    body = [p for name, p in model.named_parameters() if not name.startswith("output.")]
    body_zeros: list[float] = []
    head_inputs: list[torch.Tensor] = []
    head_grad_max: list[float] = []

    def keep_head_input(_module: nn.Module, args: tuple, _out: torch.Tensor) -> None:
        args[0].retain_grad()  # the hidden state is no leaf: autograd keeps its gradient only if asked
        head_inputs.append(args[0])

    hook = model.output.register_forward_hook(keep_head_input)

    def after_backward(_model: nn.Module, step: int) -> None:
        if step == 1:  # only step 1's head input is read
            hook.remove()
            head_grad_max.append(float(head_inputs.pop().grad.abs().max()))
        body_zeros.append(_zero_fraction(body))

    log = train(model, optimizer, config, one, progress=False, scaler=scaler,
                forward=None if label == "fp32" else _fp16_forward,
                loss_fn=_micro_batch_share(global_batch_tokens), after_backward=after_backward)
    return PrecisionRun(label, log.losses, log.grad_zero_fraction, body_zeros, head_grad_max[0],
                        log.grad_scale, log.skipped_steps, time.perf_counter() - start)


def measure_loss_scaling(setup: dict[str, int | float | str] | None = None, *,
                         global_batch_tokens: int = GLOBAL_BATCH_TOKENS) -> LossScalingResult:
    """Train the same seeded model in fp32, in fp16 without a scaler and in fp16 with one.

    Each step trains on one micro-batch (``batch_size`` x ``seq_len`` tokens, from
    :func:`~handbook_lib.runtime.data.make_batch`) whose summed token losses are divided by
    ``global_batch_tokens``: its share of the mean over a global batch of that many tokens.
    Underflow happens inside each micro-batch's backward, before any accumulation, so one
    micro-batch per step shows it; the other micro-batches' gradients would underflow alike.

    Args:
        setup: Run-config keys (:data:`UNDERFLOW_SETUP` by default, which these update).
        global_batch_tokens: Tokens the loss is averaged over (2**22 by default).

    Returns:
        The three runs, keyed ``fp32``, ``fp16, no scaler``, ``fp16 + scaler``. Deterministic
        in the setup; a few seconds on one CPU thread (fp16 is emulated there).

    Raises:
        ValueError: on a bad setup key or value (as :class:`RunConfig` reports it), if
            ``grad_accum_steps`` is not 1, or if ``global_batch_tokens`` is smaller than one
            micro-batch.
    """
    config = RunConfig.from_mapping({**UNDERFLOW_SETUP, **(setup or {})})
    if config.grad_accum_steps != 1:  # the loop would divide each micro-batch's share by k again
        raise ValueError(f"config key 'grad_accum_steps' must be 1 here (one micro-batch per step), "
                         f"got {config.grad_accum_steps}")
    if global_batch_tokens < config.batch_size * config.seq_len:
        raise ValueError(f"global_batch_tokens must be at least one micro-batch "
                         f"({config.batch_size * config.seq_len} tokens), got {global_batch_tokens}")
    with one_thread():
        runs = {label: _train(config, label, global_batch_tokens) for label in PRECISION_VARIANTS}
    return LossScalingResult(config, global_batch_tokens, runs)

