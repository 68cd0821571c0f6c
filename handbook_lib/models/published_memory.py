"""Other people's peak memory per GPU, and the memory model's beside it. Pure: no ``torch``.

Each published peak is compared with :attr:`~handbook_lib.models.memory.MemoryEstimate.peak_reserved`
(the sources print ``torch.cuda``'s reserved peak: torchtitan's ``memory:`` log line is
``max_reserved_gib``), in absolute terms where the model expresses the run's configuration, and
as the change between two runs that differ only in their GPU count, where the activations, the
logits and the checkpointing policy cancel and the sharded model state remains. A row whose
configuration the model does not express (``torch.compile``'s fused kernels, Float8) says so
and is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.models.axes import estimate_sp_memory, estimate_tp_fsdp_memory
from handbook_lib.models.memory import estimate_memory
from handbook_lib.models.presets import DecoderShape
from handbook_lib.models.published import published_model

__all__ = [
    "PUBLISHED_AXIS_MEMORY",
    "PUBLISHED_MEMORY_CHANGE",
    "AxisMemoryRow",
    "MemoryChangeRow",
    "PublishedAxisMemory",
    "PublishedMemoryChange",
    "axis_memory_rows",
    "memory_change_rows",
    "PeakRow",
    "peak_rows",
    "TORCHTITAN_OP_POLICY",
    "PUBLISHED_ZERO_STATE",
    "PublishedZeroState",
    "zero_state_rows",
    "PUBLISHED_PEAKS",
    "PublishedPeak",
    "published_peak_rows",
]


_TITAN_H100 = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (2024): Llama 3.1 8B, FSDP "
               "over every GPU, local batch 2, selective activation checkpointing, bf16 (the 8,192-token "
               "sequence is the run's default config), on H100 96GB (HBM2e) hosts; peak memory per GPU "
               "in GiB, Tables 1 (8 GPUs) and 3 (128 GPUs); the config's selective_ac_option 'op' and "
               "parallelize_llama.py's policy at the time (train_configs/llama3_8b.toml, "
               "torchtitan/parallelisms/parallelize_llama.py, 2024-10): keep every second aten.mm")
_COMPILE = ("torch.compile's fused kernels save other intermediates than the eager operators the model "
            "counts (77.0 against eager's 82.4 GiB)")
TORCHTITAN_OP_POLICY = 2
"""torchtitan's op-level selective checkpointing keeps every second matrix product's output
(``ac_matmul_every``)."""


@dataclass(frozen=True)
class PublishedMemoryChange:
    """Two published runs that differ only in their GPU count, and their peaks per GPU."""

    label: str
    model: str
    gpus: tuple[int, int]
    seq_len: int
    micro_batch: int
    peaks_gib: tuple[float, float]
    """The published peak per GPU of each run, GiB."""
    source: str
    why: str = ""
    """What of the runs the model does not express, in words ("": nothing; the peaks are
    compared in absolute terms)."""


PUBLISHED_MEMORY_CHANGE: tuple[PublishedMemoryChange, ...] = (
    PublishedMemoryChange("Llama 3.1 8B, FSDP, eager", "llama3.1-8b", (8, 128), 8192, 2, (82.4, 67.0), _TITAN_H100),
    PublishedMemoryChange("Llama 3.1 8B, FSDP + compile", "llama3.1-8b", (8, 128), 8192, 2, (77.0, 62.0),
                          _TITAN_H100, _COMPILE),
    PublishedMemoryChange("Llama 3.1 8B, FSDP + compile + Float8", "llama3.1-8b", (8, 128), 8192, 2, (76.8, 61.8),
                          _TITAN_H100, _COMPILE + "; nor Float8's casts and scales"),
)
"""Published peak-memory pairs (torchtitan's tables)."""


@dataclass(frozen=True)
class MemoryChangeRow:
    """A published change of peak memory beside the model's."""

    published: PublishedMemoryChange
    model_peaks_bytes: tuple[int, int]
    """The model's reserved peaks on each GPU count (full activation checkpointing: its
    activations, like the runs' selective ones, cancel in the change)."""

    @property
    def model_change_bytes(self) -> int:
        """The model's reserved peak on the fewer GPUs less that on the more, bytes."""
        return self.model_peaks_bytes[0] - self.model_peaks_bytes[1]

    @property
    def published_change_bytes(self) -> float:
        a, b = self.published.peaks_gib
        return (a - b) * 2**30

    @property
    def error(self) -> float:
        """Model over published, minus one."""
        return self.model_change_bytes / self.published_change_bytes - 1

    def model_peaks_gib(self, gpus: int, mode: str, matmul_every: int = 1) -> float:
        """The model's reserved peak per GPU on ``gpus`` GPUs under checkpointing ``mode``
        (``"full"`` or ``"selective"``, keeping every ``matmul_every``-th product), GiB."""
        return _reserved_peak(self.published, gpus, mode, matmul_every) / 2**30


def _reserved_peak(row: PublishedMemoryChange, gpus: int, mode: str, matmul_every: int = 1) -> int:
    """The model's reserved peak per GPU for ``row``'s run on ``gpus`` GPUs (bf16 mixed
    precision, FULL_SHARD, AdamW, activation checkpointing ``mode``, the gradients freed after
    each step as torchtitan's loop does), bytes."""
    model = published_model(row.model)
    return estimate_memory(model, gpus, "FULL_SHARD", "bf16-mixed", micro_batch=row.micro_batch,
                           seq_len=row.seq_len, activation_checkpointing=mode,
                           ac_matmul_every=matmul_every, set_to_none=True).peak_reserved


@dataclass(frozen=True)
class PeakRow:
    """One published peak per GPU beside the model's, in absolute terms."""

    label: str
    gpus: int
    published_gib: float
    model_gib: float
    why: str
    """What the model does not express of the run, or why a counted row misses ("": nothing)."""
    counted: bool = True
    """The model expresses the run's configuration: the row is evidence, hit or miss."""

    @property
    def error(self) -> float:
        """Model over published, minus one."""
        return self.model_gib / self.published_gib - 1


def peak_rows(rows: tuple[PublishedMemoryChange, ...] = PUBLISHED_MEMORY_CHANGE) -> list[PeakRow]:
    """Every run of ``rows`` on its own: the model's reserved peak with the runs' own policy,
    torchtitan's op-level selective checkpointing (:data:`TORCHTITAN_OP_POLICY`)."""
    return [PeakRow(r.label, gpus, peak, _reserved_peak(r, gpus, "selective", TORCHTITAN_OP_POLICY) / 2**30, r.why,
                    not r.why) for r in rows for gpus, peak in zip(r.gpus, r.peaks_gib)]


def memory_change_rows(rows: tuple[PublishedMemoryChange, ...] = PUBLISHED_MEMORY_CHANGE) -> list[MemoryChangeRow]:
    """Each published pair with the model's change: the reserved peak (bf16 mixed precision,
    FULL_SHARD, AdamW) on the first GPU count less that on the second."""
    return [MemoryChangeRow(row, (_reserved_peak(row, row.gpus[0], "full"),
                                  _reserved_peak(row, row.gpus[1], "full"))) for row in rows]


_TITAN_CP = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (2024), Table 2: Llama 3.1 8B, "
             "FSDP + CP + torch.compile + Float8, 8 H100 96GB (HBM2e), local batch 1, full activation "
             "checkpointing; peak memory per GPU in GiB. FSDP shards over the CP ranks too "
             "(torchtitan/models/llama/parallelize_llama.py: fully_shard on the 'dp_shard_cp' mesh)")
_TITAN_2D = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (2024), Table 4: Llama 3.1 70B, "
             "2D (FSDP 32, TP 8) + torch.compile + Float8, 256 H100 96GB, local batch 16, full activation "
             "checkpointing, 8,192-token sequences (train_configs/llama3_70b.toml seq_len); TP with "
             "SequenceParallel on the norms and a loss-parallel output (parallelize_llama.py apply_tp)")
_FLOAT8 = ("Float8 and torch.compile buffers, NCCL's own memory and the allocator's fragmentation are not "
           "in the model")
_FLOAT8_TP = (_FLOAT8 + "; nor are TP's in-flight (T, d) buffers of 16 sequences of 8,192 tokens (2 GiB "
              "each in bf16), which NCCL's streams can hold past their use")


@dataclass(frozen=True)
class PublishedAxisMemory:
    """One published peak memory per GPU of a run with an axis beyond FSDP (TP or CP)."""

    label: str
    model: str
    gpus: int
    tp_size: int
    """Tensor-parallel ranks (1: none)."""
    cp_size: int
    """Context-parallel ranks one sequence is split over (1: none)."""
    seq_len: int
    micro_batch: int
    """Sequences per data-parallel replica (a TP group shares them)."""
    peak_gib: float
    """The published peak per GPU, GiB."""
    source: str
    why: str = _FLOAT8
    """What the model leaves out, in words."""


PUBLISHED_AXIS_MEMORY: tuple[PublishedAxisMemory, ...] = (
    PublishedAxisMemory("8B, FSDP 8, CP 1, 32k", "llama3.1-8b", 8, 1, 1, 32768, 1, 83.9, _TITAN_CP),
    PublishedAxisMemory("8B, FSDP 4, CP 2, 64k", "llama3.1-8b", 8, 1, 2, 65536, 1, 84.2, _TITAN_CP),
    PublishedAxisMemory("8B, FSDP 2, CP 4, 128k", "llama3.1-8b", 8, 1, 4, 131072, 1, 84.0, _TITAN_CP),
    PublishedAxisMemory("8B, FSDP 1, CP 8, 256k", "llama3.1-8b", 8, 1, 8, 262144, 1, 84.5, _TITAN_CP),
    PublishedAxisMemory("70B, FSDP 32 x TP 8", "llama3-70b", 256, 8, 1, 8192, 16, 71.9, _TITAN_2D, _FLOAT8_TP),
    PublishedAxisMemory("70B, FSDP 32 x TP 8, AsyncTP", "llama3-70b", 256, 8, 1, 8192, 16, 67.6, _TITAN_2D,
                        _FLOAT8_TP + "; AsyncTP's symmetric-memory buffers instead of NCCL's"),
)
"""Published peaks per GPU of context-parallel and 2-D runs (torchtitan's H100 tables)."""


@dataclass(frozen=True)
class AxisMemoryRow:
    """A published peak per GPU beside the model's."""

    published: PublishedAxisMemory
    model_bytes: int
    """The model's reserved peak per GPU, bytes."""

    @property
    def model_gib(self) -> float:
        return self.model_bytes / 2**30

    @property
    def error(self) -> float:
        """Model over published, minus one."""
        return self.model_bytes / (self.published.peak_gib * 2**30) - 1


def axis_memory_rows(rows: tuple[PublishedAxisMemory, ...] = PUBLISHED_AXIS_MEMORY) -> list[AxisMemoryRow]:
    """Each published peak with the model's reserved peak (bf16 mixed precision, AdamW, full
    checkpointing): the sequence split over ``cp_size`` ranks with FSDP over every GPU
    (:func:`~handbook_lib.models.axes.estimate_sp_memory`), or TP over ``tp_size`` x FSDP over
    the rest (:func:`~handbook_lib.models.axes.estimate_tp_fsdp_memory`)."""
    out = []
    for row in rows:
        model = published_model(row.model)
        if row.tp_size > 1:
            assert isinstance(model, DecoderShape)  # tensor parallelism splits a shape's heads
            est = estimate_tp_fsdp_memory(model, row.gpus, row.tp_size, micro_batch=row.micro_batch,
                                          seq_len=row.seq_len)
        else:
            est = estimate_sp_memory(model, row.gpus, row.seq_len, row.cp_size, micro_batch=row.micro_batch)
        out.append(AxisMemoryRow(row, est.peak_reserved))
    return out


_DS_BF16 = ("deepspeedai/DeepSpeed examples, bf16 low-precision master weights (2026, PR #7700): README tables, "
            "'Allocated Memory' = torch.cuda.memory_allocated() after the last step (train.py; its format_memory "
            "divides by 1024**3: GiB, labelled GB), ZeRO-3 with DeepSpeed's defaults, the example's "
            "SimpleTransformerModel (nn.MultiheadAttention, LayerNorms, a 4d GELU feed-forward with biases, "
            "learned positions, vocabulary 50,000, a biased output projection), 512-token sequences")
_DS_RESIDUE = ("a fixed 0.15-0.16 GiB on every row, whatever the model's size, is not priced: on a 1 GiB "
               "state it is more than 10 %")


_DS_VOCAB, _DS_SEQ = 50_000, 512
"""The example's vocabulary and sequence length, the same in every row."""


@dataclass(frozen=True)
class PublishedZeroState:
    """A published allocated memory per GPU of a ZeRO-3 job between steps: its model state."""

    label: str
    d_model: int
    layers: int
    gpus: int
    micro_batch: int
    precision: str
    """``bf16-mixed`` (bf16 parameters, fp32 master and states) or ``bf16`` (DeepSpeed's bf16 master)."""
    allocated_gib: float
    source: str = _DS_BF16

    @property
    def params(self) -> int:
        """The example model's parameters: per layer 12d² + 13d, the token and position embeddings
        and the biased output projection (vocabulary 50,000, 512 positions)."""
        d, vocab = self.d_model, _DS_VOCAB
        return self.layers * (12 * d * d + 13 * d) + vocab * d + _DS_SEQ * d + vocab * d + vocab


PUBLISHED_ZERO_STATE: tuple[PublishedZeroState, ...] = (
    PublishedZeroState("254M, 1 GPU, fp32 master", 1024, 12, 1, 4, "bf16-mixed", 4.14),
    PublishedZeroState("254M, 1 GPU, bf16 master", 1024, 12, 1, 4, "bf16", 2.71),
    PublishedZeroState("254M, 4 GPUs, fp32 master", 1024, 12, 4, 4, "bf16-mixed", 1.29),
    PublishedZeroState("254M, 4 GPUs, bf16 master", 1024, 12, 4, 4, "bf16", 0.94),
    PublishedZeroState("6.86B, 4 GPUs, fp32 master", 4096, 32, 4, 1, "bf16-mixed", 25.74),
    PublishedZeroState("6.86B, 4 GPUs, bf16 master", 4096, 32, 4, 1, "bf16", 16.17),
)
"""DeepSpeed's published ZeRO-3 model state, with and without its bf16 master."""


def zero_state_rows(rows: tuple[PublishedZeroState, ...] = PUBLISHED_ZERO_STATE) -> list[PeakRow]:
    """Each published allocation beside the model's: DeepSpeed's ZeRO-3 layout at rest
    (:func:`~handbook_lib.models.zero.estimate_zero_rank_bytes`: parameters, master, gradients,
    optimizer state) plus what the script keeps of its last step, its bf16 logits and int64 ids
    and labels (``b·s·(2V + 16)`` bytes). A row more than 10 % off says why."""
    from handbook_lib.models.zero import estimate_zero_rank_bytes

    out = []
    for r in rows:
        state = estimate_zero_rank_bytes(r.params, r.gpus, "ZERO3", r.precision)
        tokens = r.micro_batch * _DS_SEQ
        held = state.total + tokens * (2 * _DS_VOCAB + 16)
        error = held / 2**30 / r.allocated_gib - 1
        out.append(PeakRow(r.label, r.gpus, r.allocated_gib, held / 2**30, _DS_RESIDUE if abs(error) > 0.10 else ""))
    return out


_H100_95 = 95.0396
"""The H100 (HBM2e) torchtitan's pull request logged its memory against, GiB."""
_PR165 = ("pytorch/torchtitan pull request #165, 'Used per-parameter FSDP' (merged 2024-03-28; the eager "
          "figures first posted in #116 on 2024-03-06): torchtitan's '7B' (Llama-2 7B's shape, the Llama-2 "
          "tokenizer's 32,000 tokens), 8 H100, local batch 8 x 2,048 tokens, bf16 mixed precision with fp32 "
          "reduce-scatter, AdamW with foreach; peak active and peak reserved as percentages of 95.0396 GiB "
          "(torchtitan's metrics.py: active_bytes.all.peak, reserved_bytes.all.peak). SAC is the op-level "
          "policy of the code when the figures were first posted (parallelize_llama.py: every compute "
          "operator's output kept but every second aten.mm's, the attention's kept)")
_TORCHTUNE = ("pytorch/torchtune README, 'Optimization flags' (PR #2003, 2024-11): Llama 3.2 3B "
              "(config.json: 28 layers, hidden 3,072, 24 heads, 8 KV heads, FFN 8,192, 128,256 tokens, tied), "
              "full_finetune_single_device, batch 2, packed 4,096-token sequences, pure bf16, "
              "torch.optim.AdamW, one A100; 'Peak Memory Active (GiB)' (torchtune/training/memory.py: "
              "active_bytes.all.peak), the row '+ Packed Dataset' (no compile, no checkpointing, the "
              "standard cross-entropy)")
_PR165_COMPILE = "torch.compile's fused kernels save other intermediates than the eager operators the model counts"
_FMS = ("foundation-model-stack/fms-acceleration scripts/benchmarks/refs/a100_80gb.csv (commit 24bdadb, 2025-02-07), "
        "framework 'none', full fine-tuning: Mistral 7B v0.1 on A100 80GB, the Hugging Face Trainer (transformers "
        "4.48.1, torch 2.4.1) in pure bf16 (torch_dtype bfloat16, accelerate.yaml mixed_precision 'no'), "
        "torch.optim.AdamW (the Trainer's default), gradient checkpointing, FlashAttention 2, 4,096-token packed "
        "sequences; one process on 1 GPU, FSDP1 FULL_SHARD (accelerate) on 2; mem_peak_torch_mem_alloc_in_bytes, "
        "the Trainer's memory tracker: torch.cuda.max_memory_allocated, rank 0, bytes")
_FMS_GRANITE = ("foundation-model-stack/fms-acceleration scripts/benchmarks/refs/a100_80gb_granite.csv (commit "
                "fc78b55, 2024-10-18), framework 'none', full fine-tuning of ibm/PowerLM-3b, set up as the Mistral "
                "rows (transformers 4.45.2, torch 2.4.1, the Trainer's bf16 autocast over bf16 weights), 4,096-token "
                "packed sequences (tokens per second x runtime = 100 steps x batch x 4,096)")
_FMS_SANTACODER = ("foundation-model-stack/fms-acceleration scripts/benchmarks/refs/a100_80gb.csv (commit 24bdadb), "
                   "framework 'none', full fine-tuning of bigcode/gpt_bigcode-santacoder, set up as the Mistral rows, "
                   "2,048-token packed sequences (its n_positions; tokens per second x runtime = 100 x batch x 2,048)")


@dataclass(frozen=True)
class PublishedPeak:
    """One published peak per GPU of a run the memory model expresses (or says why not), in the
    counter the source printed."""

    label: str
    model: str
    """A preset name, or ``llama3.2-3b`` (its published ``config.json``)."""
    gpus: int
    strategy: str
    """``FULL_SHARD``, or ``NONE`` for one process without a wrapper."""
    fsdp1: bool
    """FSDP1's flat parameters (``False``: FSDP2's per-parameter sharding)."""
    micro_batch: int
    seq_len: int
    precision: str
    checkpointing: tuple[str, int]
    """The mode (``none``, ``full``, ``selective``) and, selective, the kept products' stride."""
    counter: str
    """``active`` or ``allocated`` (compared with the model's allocated peak), or ``reserved``."""
    peak_gib: float
    source: str
    why: str = ""
    """What of the run the model does not express ("": nothing, the row is counted)."""
    miss: str = ""
    """What of the run the model prices otherwise, said when the row misses by 10 % or more."""


def _fms(gpus: int, micro_batch: int, allocated: int, model: str = "mistral-7b", seq_len: int = 4096,
         source: str = _FMS, miss: str = "") -> PublishedPeak:
    """One of the IBM benchmark's rows: ``allocated`` bytes, published (Mistral 7B by default)."""
    name = {"mistral-7b": "Mistral 7B", "powerlm-3b": "PowerLM 3B", "santacoder": "SantaCoder 1.1B"}[model]
    return PublishedPeak(f"{name}, {gpus} A100, batch {micro_batch}", model, gpus,
                         "FULL_SHARD" if gpus > 1 else "NONE", gpus > 1, micro_batch, seq_len, "bf16", ("full", 1),
                         "allocated", allocated / 2**30, source, miss=miss)


_BF16_LOSS = ("transformers 4.48's GPTBigCode takes its cross-entropy on the bf16 logits (a shifted bf16 copy, no "
              "upcast), where the model prices an fp32 log-softmax and its fp32 gradient")


def _pr165(label: str, fsdp1: bool, mode: str, active: float | None, reserved: float,
           why: str = "") -> list[PublishedPeak]:
    """The pull request's rows of one run: its active and reserved peaks, as percentages of the
    95.0396 GiB card (``None``: not published), or a reserved peak in GiB where ``why`` is set."""
    checkpointing = ("selective", 2) if mode == "SAC" else (mode, 1)
    common = ("llama2-7b", 8, "FULL_SHARD", fsdp1, 8, 2048, "bf16-mixed", checkpointing)
    rows = [] if active is None else [PublishedPeak(label, *common, "active", active / 100 * _H100_95, _PR165)]
    gib = reserved if why else reserved / 100 * _H100_95
    return rows + [PublishedPeak(label, *common, "reserved", gib, _PR165, why)]


PUBLISHED_PEAKS: tuple[PublishedPeak, ...] = (
    *_pr165("7B, FSDP1, full AC", True, "full", 24.81, 33.82),
    *_pr165("7B, FSDP1, SAC", True, "SAC", 52.98, 67.23),
    *_pr165("7B, FSDP2, full AC", False, "full", 23.92, 32.64),
    *_pr165("7B, FSDP2, SAC", False, "SAC", 52.13, 62.51),
    *_pr165("7B, FSDP2, full AC, compile", False, "full", None, 28.72, _PR165_COMPILE),
    *_pr165("7B, FSDP2, SAC, compile", False, "SAC", None, 53.83, _PR165_COMPILE),
    PublishedPeak("3B, one A100, no AC", "llama3.2-3b", 1, "NONE", False, 2, 4096, "bf16", ("none", 1),
                  "active", 60.0, _TORCHTUNE),
    _fms(1, 4, 72_434_837_504), _fms(1, 8, 72_435_230_720),
    _fms(2, 2, 36_225_939_968), _fms(2, 4, 36_226_136_576),
    *(_fms(g, b, peak, "powerlm-3b", source=_FMS_GRANITE) for g, b, peak in (
        (1, 4, 35_134_836_736), (1, 8, 47_059_390_976), (2, 2, 17_626_672_128), (2, 4, 23_781_051_904))),
    *(_fms(g, b, peak, "santacoder", 2048, _FMS_SANTACODER, _BF16_LOSS) for g, b, peak in (
        (1, 4, 11_267_745_280), (1, 8, 15_193_274_880), (2, 2, 5_716_304_896), (2, 4, 7_819_433_984))),
)
"""Published peaks per GPU from torchtitan's FSDP2 pull request, torchtune's README and IBM's
fms-acceleration benchmarks."""


def published_peak_rows(rows: tuple[PublishedPeak, ...] = PUBLISHED_PEAKS) -> list[PeakRow]:
    """Each published peak beside the model's in the same counter: the allocated peak
    (:attr:`~handbook_lib.models.memory.MemoryEstimate.peak`) against a peak of active or allocated bytes, the
    reserved peak against a reserved one; on a GPU's backend, with torch's default AdamW there
    (foreach), the gradients freed after each step as every source's loop does
    (``zero_grad()``: torchtitan's, torchtune's, the Trainer's). A counted row that misses by 10 % or
    more says why: its ``miss``; for a reserved peak, how far the run's stood above its active one,
    where both were published; for another, the model with the gradients kept, where the run's
    peak holds them all the same."""
    from handbook_lib.models.allocator import RESERVE_FRACTION

    out = []
    for r in rows:
        model = published_model(r.model)
        mode, every = r.checkpointing
        est = estimate_memory(model, r.gpus, r.strategy, r.precision, micro_batch=r.micro_batch, seq_len=r.seq_len,
                              flat_params=r.fsdp1, activation_checkpointing=mode, ac_matmul_every=every,
                              backend="nccl", optimizer_impl="foreach", set_to_none=True)
        model_gib = (est.peak_reserved if r.counter == "reserved" else est.peak) / 2**30
        why = r.why or (r.miss if abs(model_gib / r.peak_gib - 1) >= 0.10 else "")
        if not why and r.counter == "reserved" and abs(model_gib / r.peak_gib - 1) >= 0.10:
            active = next((a.peak_gib for a in rows if a.label == r.label and a.counter == "active"), None)
            if active:
                why = (f"the run reserved {r.peak_gib / active:.2f}x its active peak; the model's allocator "
                       f"reserve is {1 + RESERVE_FRACTION:.2f}x")
        kept = est.kept_grads_peak / 2**30
        if not why and r.counter != "reserved" and abs(model_gib / r.peak_gib - 1) >= 0.10 and kept:
            why = (f"the run's peak holds the gradients its loop frees at each step (zero_grad()): with them "
                   f"kept the model is {100 * (kept / r.peak_gib - 1):+.1f} %")
        out.append(PeakRow(f"{r.label} ({r.counter})", r.gpus, r.peak_gib, model_gib, why, not r.why))
    return out
