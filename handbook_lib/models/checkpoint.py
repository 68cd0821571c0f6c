"""What a checkpoint is, before anything is saved: its files, its commit protocol, and the
tensors it will hold. Pure: no ``torch``.

Chapter 6 teaches it. :mod:`handbook_lib.runtime.checkpoint` saves and loads with
``torch.distributed.checkpoint`` following these names and steps; the diagram of the commit
protocol is drawn from :data:`COMMIT_STEPS` and a test checks a real save against it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from statistics import median

from handbook_lib.core.architecture import ModelConfig
from handbook_lib.core.checks import check_int, lookup
from handbook_lib.models.layout import ModelLike, model_layout
from handbook_lib.models.model_state import OPTIMIZER_RULES

__all__ = ["CHECKPOINT_SCHEMA", "CHECKSUM", "MANIFEST", "LATEST", "CommitStep", "COMMIT_STEPS",
           "FSDP1_STATE_DICT_TYPES", "TensorCount", "checkpoint_name", "estimate_checkpoint_count",
           "NCCL_DEFAULT_TIMEOUT_S", "JOB_INTERRUPTIONS", "JOB_STATE", "CheckpointCost",
           "estimate_checkpoint_cost", "job_mtbf_s", "checkpoint_interval_s", "scale_model_width",
           "cost_fraction"]

CHECKPOINT_SCHEMA = "handbook.checkpoint/3"
"""Version tag of the manifest (2: a checksum per file; 3: a checksum per item of every file,
hashed by the rank that wrote it)."""

CHECKSUM = "sha256"
"""The hash in the manifest, under this key: for every file, the SHA-256 of each of its items
(DCP's unit of reading: one tensor piece or one pickled value), as ``[offset, length, hex]``
covering the file. SHA-256 over blake2b: measured 1.35 vs 0.81 GB/s on this book's CPU (SHA
extensions). Per item, not per file, so that a rank verifies exactly the bytes it reads: at
load every rank reads a few bytes of many files (the replicated ``step`` counters and
hyperparameters that DCP wrote once, into whichever rank's file it chose)."""

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
    (a glob pattern where one file per rank appears); empty for a step that writes nothing."""
    who: str
    """Which ranks do it."""
    action: str
    """What is done, in a few words."""
    crash_leaves: str
    """What ``latest`` names if the job dies during or right after this step."""
    background: bool = False
    """Done in the background by an asynchronous save (``save_checkpoint(asynchronous=True)``),
    while training goes on; the other steps run in the save call or in ``wait()``."""


_BEFORE = "the previous checkpoint; step_K.tmp is never loaded"

COMMIT_STEPS: tuple[CommitStep, ...] = (
    CommitStep("write aside", "{name}.tmp", "DCP", "create step_K.tmp (rank 0 first removes a dead "
               "save's)", _BEFORE),
    CommitStep("shards", "{name}.tmp/__*_*.distcp", "every rank", "write its own shards", _BEFORE,
               background=True),
    CommitStep("hash", "", "every rank", "hash its own file, item by item, in parallel", _BEFORE,
               background=True),
    CommitStep("index", "{name}.tmp/.metadata", "rank 0 (DCP)", "write DCP's index once all "
               "shards are written", _BEFORE, background=True),
    CommitStep("manifest", "{name}.tmp/" + MANIFEST, "rank 0", "gather every rank's sizes and "
               "hashes, add the index's; write them (temporary file, renamed)", _BEFORE),
    CommitStep("rename", "{name}", "rank 0", "rename step_K.tmp to step_K (os.replace), "
               "an old step_K to .old first",
               "the previous checkpoint; step_K is complete, just not latest"),
    CommitStep("point latest", LATEST, "rank 0", "write 'step_K' to a temporary file, "
               "rename it over latest", "step_K (os.replace is atomic: the old name or the new, never none)"),
)
"""The commit protocol of :func:`~handbook_lib.runtime.checkpoint.save_checkpoint`, in the order it
performs the steps: the one list the book's diagram and the tests read. A step's ``path`` is
empty when it writes nothing to disk (``hash``: each rank's digests travel to rank 0 in a
gather). An asynchronous save does the ``background`` steps in a thread, after copying the
state to CPU memory; the manifest, the rename and the pointer wait for ``wait()``."""

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

JOB_STATE: dict[str, tuple[str, str]] = {
    "model": ("every parameter, each rank its shard (DTensor)", "the weights: nothing to resume"),
    "optim": ("both AdamW moments and each tensor's step counter, sharded like the weights",
              "moments restart at 0: the next steps differ, bias correction restarts"),
    "rng": ("per rank: torch's CPU generator, the rank's CUDA one on a GPU, Python's, NumPy's",
            "dropout masks and any sampling differ from the uninterrupted job's"),
    "scheduler": ("the LR scheduler's steps (LambdaLR over lr_schedule, warmup_steps)",
                  "the warm-up starts again: a learning rate of 0, then the wrong curve"),
    "scaler": ("fp16 only: the gradient scaler's factor and its count of good steps",
               "the factor restarts at 2**16: overflowing, skipped steps after every resume"),
    "data": ("the data loader's place: epoch, batches handed out, the sampler's generator",
             "the epoch starts over: batches seen twice, others never"),
}
"""What :func:`~handbook_lib.runtime.checkpoint.save_checkpoint` saves for chapter 6's run, by the
checkpoint's top-level key: key → (what it holds, what a resume without it gets wrong). The first
three are every checkpoint's; the others are the run's ``Stateful`` parts, each an object with
``state_dict()`` and ``load_state_dict()`` that DCP calls (the "app state" of PyTorch's DCP
recipe). Not in any checkpoint: the order in which GPU kernels add (bit-identical on a GPU also
needs ``torch.use_deterministic_algorithms(True)``)."""


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
        """The book's first design: rank 0 read back and hashed every file, one after another,
        while every other rank waited in a barrier (the slower of reading and hashing)."""
        return self.total_bytes / min(self.hash_bps, self.storage_bps)

    @property
    def load_read_bytes(self) -> int:
        """The first design's load: every rank read every file to verify its checksum."""
        return self.ranks * self.total_bytes

    @property
    def own_hash_s(self) -> float:
        """Each rank hashing only the file it wrote (issue 26, today's save): its shard, all
        ranks in parallel."""
        return self.bytes_per_rank / self.hash_bps

    @property
    def verify_read_bytes(self) -> int:
        """Today's load at the saving world size: each rank verifies the items it reads, its own
        shard and a few replicated bytes of the others; the job reads the checkpoint about once."""
        return self.total_bytes


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


def scale_model_width(config: ModelConfig, scale: int) -> ModelConfig:
    """``config`` widened so that it has about ``scale`` times its parameters (and checkpoint
    bytes): ``d_model`` (a multiple of ``nhead``) and ``dim_feedforward`` grow by the same
    factor, the vocabulary and the layers stay. The width whose parameter count is nearest to
    ``scale`` times ``config``'s is chosen; ``scale`` 1 returns ``config``.

    Raises:
        ValueError: if ``scale`` is not an int >= 1.
    """
    check_int("scale", scale, 1)
    if scale == 1:
        return config
    target = scale * model_layout(config).num_params

    def widened(d_model: int) -> ModelConfig:
        return replace(config, d_model=d_model,
                       dim_feedforward=max(1, round(config.dim_feedforward * d_model / config.d_model)))

    # parameters grow at most quadratically with the width: scale x params needs at most scale x width
    widths = range(config.d_model, scale * config.d_model + config.nhead, config.nhead)
    return min((widened(d) for d in widths), key=lambda m: abs(model_layout(m).num_params - target))


def cost_fraction(part_s: Sequence[float], whole_s: Sequence[float]) -> float:
    """The median of ``part_s`` over the median of ``whole_s`` (seconds, one value per repeat):
    e.g. the hashing inside a save as a fraction of the save. Medians, so one slow repeat on a
    busy machine moves neither.

    Raises:
        ValueError: if either is empty, or the median of ``whole_s`` is not > 0.
    """
    if not part_s or not whole_s:
        raise ValueError("cost_fraction needs at least one time in part_s and in whole_s")
    whole = median(whole_s)
    if not whole > 0:
        raise ValueError(f"whole_s must have a median > 0 s, got {whole}")
    return median(part_s) / whole
