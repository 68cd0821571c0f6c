"""What a checkpoint is, before anything is saved: its files, its commit protocol, and the
tensors it will hold. Pure: no ``torch``.

Chapter 6 teaches it. :mod:`handbook_lib.runtime.checkpoint` saves and loads with
``torch.distributed.checkpoint`` following these names and steps; the diagram of the commit
protocol is drawn from :data:`COMMIT_STEPS` and a test checks a real save against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from handbook_lib.core.checks import check_int, lookup
from handbook_lib.models.layout import ModelLike, model_layout
from handbook_lib.models.model_state import OPTIMIZER_RULES

__all__ = ["CHECKPOINT_SCHEMA", "CHECKSUM", "MANIFEST", "LATEST", "CommitStep", "COMMIT_STEPS",
           "FSDP1_STATE_DICT_TYPES", "TensorCount", "checkpoint_name", "estimate_checkpoint_count",
           "NCCL_DEFAULT_TIMEOUT_S", "JOB_INTERRUPTIONS", "NOT_SAVED_ON_GPU", "CheckpointCost",
           "estimate_checkpoint_cost", "job_mtbf_s", "checkpoint_interval_s"]

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
    CommitStep("rename", "{name}", "rank 0", "rename step_K.tmp to step_K (os.replace), "
               "an old step_K to .old first",
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


NCCL_DEFAULT_TIMEOUT_S = 600
"""``torch.distributed.init_process_group``'s default timeout with NCCL, seconds: 10 minutes
(30 with the other backends; the function's documentation). A rank that waits longer in a
collective (a barrier too) is aborted by NCCL's watchdog."""

JOB_INTERRUPTIONS = (419, 54 * 24 * 3600, 16_384)
"""Unexpected interruptions, over seconds, of a job on GPUs: Llama 3's pre-training, 419
interruptions in a 54-day snapshot on 16,384 H100s (Grattafiori et al. 2024, section 3.3.4),
about one every 3 hours; as a rate per GPU, one every ~6 years."""

NOT_SAVED_ON_GPU: dict[str, tuple[str, str]] = {
    "CUDA RNG": (("not needed: the runs use no dropout, and torch.get_rng_state() is the "
                  "CPU generator only"), "torch.cuda.get_rng_state() of each rank, for dropout"),
    "Python, NumPy RNG": ("not used by the runs", "random.getstate(), numpy.random.get_state()"),
    "LR scheduler": ("none: the learning rate is constant", "scheduler.state_dict()"),
    "GradScaler": ("none in fp32; in fp16 the loss scale would restart at 2**16",
                   "scaler.state_dict() (scale and growth tracker)"),
    "data position": (("the step alone: make_batch(config, step) is a pure function of the "
                       "step"), "a shuffling DataLoader's place: torchdata's StatefulDataLoader"),
    "kernels": ("the CPU kernels add in a fixed order",
                ("torch.use_deterministic_algorithms(True): atomics in index_add and the "
                 "embedding's backward add in no fixed order")),
}
"""What :func:`~handbook_lib.runtime.checkpoint.save_checkpoint` does not save: item → (why the
book's CPU runs resume exactly without it, what a GPU job adds). The
idiomatic home of all of it is one ``Stateful`` app state handed to ``dcp.save`` (PyTorch's
DCP recipe)."""


@dataclass(frozen=True)
class CheckpointCost:
    """The bytes and seconds of saving and verifying one resumable checkpoint of a job
    (:func:`estimate_checkpoint_cost`). Seconds assume every node writes and reads at its
    ``storage_bps`` and the file system can serve all nodes at once."""

    params: int
    bytes_per_param: int
    nodes: int
    gpus_per_node: int
    storage_bps: float
    """Bytes per second one node writes to (or reads from) the shared file system."""
    hash_bps: float
    """Bytes per second one process hashes (SHA-256 on one core)."""

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def total_bytes(self) -> int:
        return self.params * self.bytes_per_param

    @property
    def bytes_per_rank(self) -> int:
        return -(-self.total_bytes // self.ranks)

    @property
    def write_s(self) -> float:
        """Every rank writes its shard, a node's ranks sharing its bandwidth."""
        return self.bytes_per_rank * self.gpus_per_node / self.storage_bps

    @property
    def rank0_hash_s(self) -> float:
        """The book's save: rank 0 reads back and hashes every file, one after another, while
        every other rank waits in a barrier (the slower of reading and hashing)."""
        return self.total_bytes / min(self.hash_bps, self.storage_bps)

    @property
    def load_read_bytes(self) -> int:
        """The book's load: every rank reads every file to verify its checksum."""
        return self.ranks * self.total_bytes

    @property
    def own_hash_s(self) -> float:
        """Each rank hashing only the file it wrote (issue 26): its shard, in parallel."""
        return self.bytes_per_rank / self.hash_bps


def estimate_checkpoint_cost(params: int, *, nodes: int, gpus_per_node: int = 8,
                             bytes_per_param: int = 12, storage_gbps: float = 5.0,
                             hash_gbps: float = 1.35) -> CheckpointCost:
    """Bytes and seconds of one resumable checkpoint of a ``params``-parameter job.

    ``bytes_per_param`` 12: fp32 parameters (or bf16 training's fp32 master) and AdamW's two
    fp32 moments; gradients are not saved. ``storage_gbps``: GB/s one node writes to a shared
    parallel file system (a few GB/s per client is common; the whole system's aggregate must be
    at least ``nodes`` times that for the result to hold). ``hash_gbps``: SHA-256 on one core,
    as :data:`CHECKSUM` measured on this book's CPU.
    """
    check_int("params", params, 1)
    check_int("nodes", nodes, 1)
    check_int("gpus_per_node", gpus_per_node, 1)
    check_int("bytes_per_param", bytes_per_param, 1)
    if not (storage_gbps > 0 and hash_gbps > 0):
        raise ValueError(f"bandwidths must be > 0, got storage {storage_gbps}, hash {hash_gbps} GB/s")
    return CheckpointCost(params, bytes_per_param, nodes, gpus_per_node, storage_gbps * 1e9, hash_gbps * 1e9)


def job_mtbf_s(gpus: int, interruptions: tuple[int, float, int] = JOB_INTERRUPTIONS) -> float:
    """Mean seconds between interruptions of a job on ``gpus`` GPUs, at the per-GPU rate of
    ``interruptions`` (count, seconds, GPUs): failures of independent GPUs add up."""
    check_int("gpus", gpus, 1)
    count, seconds, observed = interruptions
    return seconds * observed / (count * gpus)


def checkpoint_interval_s(save_s: float, mtbf_s: float) -> float:
    """The compute time between checkpoints that wastes least, Young's first-order optimum
    sqrt(2·δ·M) for a save of ``save_s`` (δ) and a mean time between failures ``mtbf_s`` (M)
    (Young 1974; Daly 2006 refines it, by a few per cent when δ is far below M). Too often and
    the saves cost; too rarely and each failure throws away up to an interval of work."""
    if not (save_s > 0 and mtbf_s > 0):
        raise ValueError(f"save_s and mtbf_s must be > 0, got {save_s}, {mtbf_s}")
    return math.sqrt(2 * save_s * mtbf_s)
