"""What a checkpoint is, before anything is saved: its files, its commit protocol, and the
tensors it will hold. Pure: no ``torch``.

Chapter 6 teaches it. :mod:`handbook_lib.runtime.checkpoint` saves and loads with
``torch.distributed.checkpoint`` following these names and steps; the diagram of the commit
protocol is drawn from :data:`COMMIT_STEPS` and a test checks a real save against it.
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.core.checks import check_int, lookup
from handbook_lib.models.layout import ModelLike, model_layout
from handbook_lib.models.model_state import OPTIMIZER_RULES

__all__ = ["CHECKPOINT_SCHEMA", "CHECKSUM", "MANIFEST", "LATEST", "CommitStep", "COMMIT_STEPS",
           "FSDP1_STATE_DICT_TYPES", "TensorCount", "checkpoint_name", "estimate_checkpoint_count"]

CHECKPOINT_SCHEMA = "handbook.checkpoint/2"
"""Version tag of the manifest (2: with a checksum per file)."""

CHECKSUM = "sha256"
"""The hash of every file, in the manifest under this key. SHA-256 over blake2b: measured 1.35 vs
0.81 GB/s on this book's CPU (SHA extensions), and it is what ``sha256sum`` prints."""

MANIFEST = "checkpoint.json"
"""The manifest: written last, so its presence marks a complete save."""

LATEST = "latest"
"""The pointer file under the root: the directory name of the newest complete checkpoint."""


@dataclass(frozen=True)
class CommitStep:
    """One step of the commit protocol of :func:`~handbook_lib.runtime.checkpoint.save_checkpoint`,
    and what a crash there leaves."""

    name: str
    """Short name, e.g. ``"manifest"``."""
    path: str
    """What the step makes appear, relative to the root; ``{name}`` stands for ``step_K``
    (a glob pattern where one file per rank appears)."""
    who: str
    """Which ranks do it."""
    action: str
    """What is done, in a few words."""
    crash_leaves: str
    """What ``latest`` names if the job dies during or right after this step."""

COMMIT_STEPS: tuple[CommitStep, ...] = (
    CommitStep("write aside", "{name}.tmp", "DCP", "create step_K.tmp (rank 0 first removes a dead "
               "save's)", "the previous checkpoint; step_K.tmp is never loaded"),
    CommitStep("shards", "{name}.tmp/__*_*.distcp", "every rank", "write its own shards",
               "the previous checkpoint; step_K.tmp is never loaded"),
    CommitStep("index", "{name}.tmp/.metadata", "rank 0 (DCP)", "write DCP's .metadata once every "
               "rank's shards are written", "the previous checkpoint; step_K.tmp is never loaded"),
    CommitStep("manifest", "{name}.tmp/" + MANIFEST, "rank 0", "hash every file; write sizes and "
               "SHA-256 (temporary file, renamed)", "the previous checkpoint; step_K.tmp is never loaded"),
    CommitStep("rename", "{name}", "rank 0", "rename step_K.tmp to step_K (os.replace)",
               "the previous checkpoint; step_K is complete, just not latest"),
    CommitStep("point latest", LATEST, "rank 0", "write 'step_K' to a temporary file, "
               "rename it over latest", "step_K (os.replace is atomic: the old name or the new, never none)"),
)
"""The commit protocol of :func:`~handbook_lib.runtime.checkpoint.save_checkpoint`, in the order it
performs the steps: the one
list the book's diagram and the tests read."""

FSDP1_STATE_DICT_TYPES: dict[str, tuple[str, str, str]] = {
    "FULL_STATE_DICT": (
        ("every parameter all-gathered to its full shape; with rank0_only and offload_to_cpu, "
         "only rank 0 holds it, in CPU memory; one torch.save file"),
        ("get_model_state_dict(m, StateDictOptions(full_state_dict=True, cpu_offload=True)): "
         "export_full_state_dict"),
        "the final artifact: loads into a plain module, for inference or another framework",
    ),
    "SHARDED_STATE_DICT": (
        ("each rank keeps only its shards (ShardedTensor in FSDP1, DTensor in FSDP2), saved by "
         "DCP: one file per rank plus .metadata; no gather, reshardable at load"),
        "get_state_dict(m, opt) + dcp.save (FSDP2's default): save_checkpoint",
        "intermediate saves during training: fast, no rank holds the full model",
    ),
    "LOCAL_STATE_DICT": (
        ("each rank's raw flat parameter (FSDP1's FlatParameter, padded), with no shape "
         "information: loads only into the same world size and wrapping"),
        "none: FSDP2 has no flat parameters (a DTensor's to_local() is the nearest thing)",
        "rarely: fastest, but not portable; DCP's sharded format replaced it",
    ),
}
"""FSDP1 ``StateDictType`` → (what is saved, the DCP / FSDP2 counterpart, when to use it)."""

@dataclass(frozen=True)
class TensorCount:
    """Tensors and their bytes (``numel * element_size``)."""

    tensors: int
    bytes: int
    """Bytes of tensor data (no file headers)."""

    def __add__(self, other: TensorCount) -> TensorCount:
        return TensorCount(self.tensors + other.tensors, self.bytes + other.bytes)

def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint after ``step`` optimizer steps: ``step_000004``."""
    check_int("step", step, 0)
    return f"step_{step:06d}"

def estimate_checkpoint_count(config: ModelLike, optimizer: str) -> dict[str, TensorCount]:
    """Predicted ``model`` and ``optim`` counts of a checkpoint, from the model's shape alone.

    Model: one fp32 tensor per parameter tensor, 4 bytes per parameter. Optimizer: the
    parameter-shaped states (Adam's two moments, SGD's momentum) plus Adam's ``step`` scalars
    (one 4-byte tensor per parameter tensor).

    Raises:
        ValueError: for an unknown optimizer, or a model known by its sizes only.
    """
    layout = model_layout(config)
    layout.require_exact("estimate_checkpoint_count")
    tensors, rule = len(layout.tensors), lookup(OPTIMIZER_RULES, optimizer, "optimizer")
    steps = tensors if rule.step_counter else 0
    return {
        "model": TensorCount(tensors, 4 * layout.num_params),
        "optim": TensorCount(rule.states * tensors + steps, rule.states * 4 * layout.num_params + 4 * steps),
    }
