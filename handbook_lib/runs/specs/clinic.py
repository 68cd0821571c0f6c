"""The FSDP clinic: one failure users met, run as they wrote it and fixed, each half checked.

The torch-free half of :mod:`handbook_lib.runs.clinic`: its config and the checks the launcher
makes before any process starts (:class:`~handbook_lib.core.run_spec.RunSpec`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from handbook_lib.core.architecture import MODEL_KEYS, ModelConfig
from handbook_lib.core.config import DataConfig, RunConfig
from handbook_lib.core.run_spec import RunSpec
from handbook_lib.models.clinic_cases import CLINIC_CASES

CaseName = Literal[
    "wrap_class_missing", "init_full_copy", "frozen_params", "accumulation_unsharded_grads",
    "tied_weights_split", "local_grad_norm", "meta_buffer_uninit",
    "optimizer_before_wrap", "ac_nondeterministic", "mixed_dtype", "forward_skips_hooks",
    "rank0_only_forward", "uneven_batches", "rank0_only_state_dict", "full_state_dict_every_rank",
    "resume_other_world_size", "compiled_key_prefix",
]


if get_args(CaseName) != tuple(CLINIC_CASES):  # pragma: no cover - caught at import and by a test
    raise AssertionError("CaseName and models.clinic_cases.CLINIC_CASES list different cases")


@dataclass(frozen=True)
class ClinicConfig(RunConfig):
    """One case of the clinic, on a tiny model (each half takes well under a second, a hang
    its timeout). The cases choose their own strategy, wrapping, precision and steps: only the
    model's keys, the batch, the seed, the learning rate and the two keys below may change."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(
        vocab_size=96, d_model=32, nhead=2, dim_feedforward=64, num_layers=2))
    """A tiny model: 96 tokens (rows of the embedding and of the tied head), width 32, 2 heads,
    feed-forward width 64, 2 layers (one FSDP unit each, when the wrapping is right)."""
    data: DataConfig = field(default_factory=lambda: DataConfig(batch_size=4, seq_len=16))
    """A global batch of 4 sequences (divisible by 2 x the ranks: the accumulation case's
    micro-steps) of 16 tokens."""
    case: CaseName = "wrap_class_missing"
    """Which failure: a key of :data:`handbook_lib.models.clinic_cases.CLINIC_CASES`."""
    hang_timeout_s: float = 1.0
    """Seconds a hang case's collective waits before it raises (0.5 to 60): its symptom. Only
    the collective that hangs runs under it (the group is made, and met in, with a long one)."""


CONFIG = ClinicConfig


FREE_KEYS = (*MODEL_KEYS, "batch_size", "seq_len", "seed", "lr", "case", "hang_timeout_s")
"""The keys a clinic config may set; every other key stays at its default (the cases set theirs)."""


def validate(config: ClinicConfig, world_size: int) -> None:
    """Refuse, before any process starts, what the clinic cannot run.

    Raises:
        ValueError: one line naming the key and what is accepted.
    """
    if world_size < 2:
        raise ValueError(f"clinic needs >= 2 ranks (its cases shard, and hang, between ranks), got {world_size}")
    default = ClinicConfig()
    for key in ClinicConfig.keys():
        if key not in FREE_KEYS and getattr(config, key) != getattr(default, key):
            raise ValueError(f"config key {key!r}={getattr(config, key)!r} is set by each clinic case itself; "
                             f"a clinic config sets {', '.join(FREE_KEYS)}")
    if not 0.5 <= config.hang_timeout_s <= 60:
        raise ValueError(f"config key 'hang_timeout_s' must be in [0.5, 60] seconds, got {config.hang_timeout_s}")
    if config.batch_size % (2 * world_size):
        raise ValueError(f"config key 'batch_size'={config.batch_size} must be divisible by 2 x {world_size} "
                         "ranks (the accumulation case cuts each rank's share into 2 micro-batches)")


SPEC = RunSpec("clinic", __doc__, CONFIG, validate)
