"""What an activation-checkpointing policy recomputes: the FLOPs backward runs again. Pure.

Chapter 2 prices what each policy keeps (:meth:`~handbook_lib.models.layout.ModelLayout.activations`);
this module prices what it costs. A :class:`CheckpointPolicy` names one policy with the run
config's keys (``activation_checkpointing``, ``ac_every``, ``ac_matmul_every``, ``ac_save``), and
:func:`recompute_flops` counts the forward FLOPs it runs a second time in backward:

- ``full``: each checkpointed layer's whole forward, matrix products and attention's core. Over
  every layer that is the familiar ``2·P·T`` plus attention's forward (P counts the embedding and
  the head, as the 6PT rule does), a third more than ``6·P·T``.
- ``selective``: only the matrix products the policy does not keep (every ``n``-th is kept
  with ``ac_matmul_every`` n, none with ``ac_save`` ``attention``), and attention's core where
  the policy does not keep its output (``ac_save`` ``matmul``). Pointwise operators (norms,
  activations, RoPE) cost no FLOPs in this count: their time, a few per cent of a step where
  memory bandwidth rather than FLOPs bounds them, is not priced.
- ``ac_every`` k: only layers 0, k, 2k, ... are checkpointed, so recompute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from handbook_lib.core.checks import check_int
from handbook_lib.core.config import AC_SAVE_POLICIES
from handbook_lib.models.activations import kept_products, saved_families
from handbook_lib.models.layout import ModelLayout

__all__ = ["CheckpointPolicy", "FULL", "check_policy_flags", "product_weights", "recompute_flops"]


@dataclass(frozen=True)
class CheckpointPolicy:
    """One activation-checkpointing policy, in the run config's words.

    Attributes:
        mode: ``full`` (keep each checkpointed layer's input) or ``selective`` (keep the outputs
            of the operators ``save`` names as well).
        every: Checkpoint layers 0, k, 2k, ... only (``ac_every``; 1: every layer).
        matmul_every: With ``selective``, keep every n-th matrix product's output only
            (``ac_matmul_every``; torchtitan's op policy is 2).
        save: With ``selective``, what it keeps: ``matmul+attention``, ``matmul`` or
            ``attention`` (``ac_save``).

    Raises:
        ValueError: for a mode other than full or selective, a count below 1, ``matmul_every``
            or ``save`` set without ``selective``, or ``matmul_every`` > 1 with a ``save`` that
            keeps no product, each naming the run config's key.
    """

    mode: str = "full"
    every: int = 1
    matmul_every: int = 1
    save: str = "matmul+attention"

    def __post_init__(self) -> None:
        if self.mode not in ("full", "selective"):
            raise ValueError(f"activation_checkpointing must be full or selective, got {self.mode!r}")
        check_int("ac_every", self.every, 1)
        if self.save not in AC_SAVE_POLICIES:
            raise ValueError(f"ac_save must be one of {', '.join(AC_SAVE_POLICIES)}, got {self.save!r}")
        if self.mode != "selective" and self.save != "matmul+attention":
            raise ValueError(f"ac_save={self.save!r} chooses what selective checkpointing keeps: it needs "
                             "activation_checkpointing 'selective'")
        kept_products((1,), self.matmul_every, self.mode, self.save)  # refuses n without selective

    @property
    def label(self) -> str:
        """The policy in words: ``full``, ``full, every 2nd layer``, ``selective``,
        ``selective (matmul), every 2nd product``."""
        words = [self.mode + (f" ({self.save})" if self.save != "matmul+attention" else "")]
        if self.matmul_every > 1:
            words.append(f"every {_nth(self.matmul_every)} product")
        if self.every > 1:
            words.append(f"every {_nth(self.every)} layer")
        return ", ".join(words)

    def memory_args(self) -> dict[str, Any]:
        """The policy as :func:`~handbook_lib.models.memory.estimate_memory`'s arguments."""
        return {"activation_checkpointing": self.mode, "ac_every": self.every,
                "ac_matmul_every": self.matmul_every, "ac_save": self.save}


FULL = CheckpointPolicy()
"""Full checkpointing of every layer: the policy ``plan`` prices unless told otherwise."""


def check_policy_flags(mode: str, every: int = 1, matmul_every: int = 1, save: str = "matmul+attention") -> None:
    """Refuse a policy's values that contradict its mode, naming the command line's flags
    (``memory``'s, ``plan``'s and the planner page's): ``--ac-every`` without checkpointing,
    ``--ac-matmul-every`` or ``--ac-save`` without ``selective``, thinning products that
    ``--ac-save`` does not keep.

    Raises:
        ValueError: one line naming the flags and what they need.
    """
    if every > 1 and mode == "none":
        raise ValueError(f"--ac-every {every} checkpoints every K-th layer: give --activation-checkpointing "
                         "(full or selective) too")
    if matmul_every > 1 and mode != "selective":
        raise ValueError(f"--ac-matmul-every {matmul_every} thins the selective policy's matrix products: give "
                         "--activation-checkpointing selective too")
    if save != "matmul+attention" and mode != "selective":
        raise ValueError(f"--ac-save {save} chooses what the selective policy keeps: give "
                         "--activation-checkpointing selective too")
    if matmul_every > 1 and "matmul" not in save:
        raise ValueError(f"--ac-matmul-every {matmul_every} thins the kept matrix products, and --ac-save {save} "
                         "keeps none: give --ac-save matmul+attention or matmul")


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def product_weights(layout: ModelLayout) -> tuple[int, ...]:
    """The weight elements of one layer's matrix products, in forward order: a gated decoder's
    separate Q, K, V, output, gate, up and down projections (``d·q, d·k, d·k, q·d, d·f, d·f,
    f·d``), other models' fused QKV, output, up and down (``d·(q+2k), q·d, d·f, f·d``). Each
    product costs ``2·weights`` FLOPs per token in forward; biases are left out."""
    d, f = layout.d_model, layout.dim_feedforward
    q = layout.q_width or d
    k = layout.kv_width or q
    if layout.gated_mlp:
        return (d * q, d * k, d * k, q * d, d * f, d * f, f * d)
    return (d * (q + 2 * k), q * d, d * f, f * d)


def recompute_flops(layout: ModelLayout, tokens: int, seq_len: int, policy: CheckpointPolicy = FULL) -> int:
    """FLOPs one rank's backward runs again under ``policy``, for ``tokens`` tokens in sequences
    of ``seq_len`` (see the module docstring). Attention's core forward is ``4·w·s`` FLOPs per
    token and layer (w: the queries' width), as
    :func:`~handbook_lib.models.timing.estimate_step_flops` counts it.

    Raises:
        ValueError: for ``tokens`` or ``seq_len`` below 0.
    """
    check_int("tokens", tokens, 0)
    check_int("seq_len", seq_len, 0)
    layers = layout.num_layers
    attention = 4 * layout.attention_width * seq_len * tokens
    checkpointed = len(range(0, layers, policy.every))
    if policy.mode == "full":
        return (2 * layout.num_params * tokens + layers * attention) * checkpointed // max(layers, 1)
    keeps_products, keeps_attention = saved_families(policy.save)
    weights = product_weights(layout)
    kept = set(range(0, len(weights), policy.matmul_every)) if keeps_products else set()
    dropped = sum(w for i, w in enumerate(weights) if i not in kept)
    return checkpointed * (2 * tokens * dropped + (0 if keeps_attention else attention))
