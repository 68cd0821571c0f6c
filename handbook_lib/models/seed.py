"""The rule this course started from (the "seed"), kept to compare with: fp32 model state only.

Pure arithmetic. Chapter 2 reproduces the seed's per-GPU bytes and shows where they are wrong;
chapter 4 runs the seed's five scenarios beside the planner (:func:`handbook_lib.models.planner.plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.core.checks import check_world
from handbook_lib.core.strategies import get_strategy
from handbook_lib.models.layout import ModelLike, model_layout

__all__ = ["SEED_STRATEGIES", "estimate_seed_model_state", "seed_recommendation", "SeedScenario",
           "SEED_SCENARIOS"]


SEED_STRATEGIES = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")
"""The three strategies the seed's memory rule knows."""

def estimate_seed_model_state(num_params: ModelLike, world_size: int, strategy: str) -> int:
    """Per-GPU bytes by the simplified model this course started from (the "seed").

    Its assumptions: fp32 training with Adam, 16 bytes per parameter, model state only (no
    activations, no transient buffers, no padding), three strategies: ``NO_SHARD`` replicates
    everything (16P), ``SHARD_GRAD_OP`` shards gradients and optimizer states (4P + 12P/N),
    ``FULL_SHARD`` shards everything (16P/N). Chapter 2 reproduces it, then shows where it is
    wrong: SHARD_GRAD_OP's parameters are unsharded during forward and backward, and at long
    sequences activations, not model state, decide what fits.
    """
    n = model_layout(num_params).num_params
    check_world(world_size)
    if strategy not in SEED_STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(SEED_STRATEGIES)} (the seed's three), "
                         f"got {strategy!r}")
    row = get_strategy(strategy)
    # bytes per parameter: 4 (fp32 weight) + 4 (gradient) + 8 (Adam's two moments); the seed
    # counts parameters as sharded only when they are freed after forward (FULL_SHARD)
    parts = ((4, row.reshard_after_forward), (4, row.shards_grads), (8, row.shards_optimizer))
    whole = sum(b for b, sharded in parts if not sharded)
    split = sum(b for b, sharded in parts if sharded)
    return whole * n + split * n // world_size


def seed_recommendation(num_params: int, gpu_memory_bytes: int, gpus: int) -> str:
    """The seed's rule: the first of NO_SHARD, SHARD_GRAD_OP, FULL_SHARD whose fp32 model state
    (16 bytes per parameter, :func:`~handbook_lib.models.seed.estimate_seed_model_state`) fits the
    GPU; ``"does not fit"`` otherwise. No activations, no buffers, no headroom."""
    for strategy in SEED_STRATEGIES:
        if estimate_seed_model_state(num_params, gpus, strategy) <= gpu_memory_bytes:
            return strategy
    return "does not fit"

@dataclass(frozen=True)
class SeedScenario:
    """One of the five scenarios the seed chapter checked its rule on (all on A100s).

    ``nominal_params`` is the round count the seed computed with (7e9 ...); ``model`` the preset
    whose real shape the planner prices (Llama-2 7B has 6.74e9 parameters, not 7e9).
    """

    label: str
    model: str
    nominal_params: int
    gpu: str
    gpus: int

SEED_SCENARIOS = (
    SeedScenario("7B", "llama2-7b", 7_000_000_000, "a100-80gb", 8),
    SeedScenario("13B", "llama2-13b", 13_000_000_000, "a100-40gb", 8),
    SeedScenario("70B", "llama2-70b", 70_000_000_000, "a100-80gb", 8),
    SeedScenario("70B", "llama2-70b", 70_000_000_000, "a100-80gb", 32),
    SeedScenario("175B", "gpt3-175b", 175_000_000_000, "a100-80gb", 64),
)
"""The seed's scenarios, in its order: model size and GPUs exactly as it gave them."""
