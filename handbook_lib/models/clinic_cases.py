"""The FSDP clinic's cases: what users met, where they reported it, its cause and its fix. Pure.

Chapter 10 reproduces each case twice in one job, as users wrote it and fixed
(``python -m handbook_lib run clinic --set case=NAME``; :mod:`handbook_lib.runs.clinic`). This module
is the table the chapter and the run share: each case's group (memory, correctness, hangs,
checkpoints), the pain point of the field notes it reproduces (one of :data:`FIELD_NOTES`), the
public threads where users met it, and one line each for the symptom, the cause and the fix.
No ``torch``: the chapter lists the cases without starting a process.
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.core.checks import lookup

__all__ = ["ClinicCase", "CLINIC_GROUPS", "FIELD_NOTES", "CLINIC_CASES", "get_case", "cases_in",
           "notes_left_out", "thread_url"]

CLINIC_GROUPS: tuple[str, ...] = ("memory", "correctness", "hangs", "checkpoints")
"""The chapter's sections, in order."""

FIELD_NOTES: dict[int, str] = {
    1: "OOM, or memory that does not fall with more ranks",
    2: "meta-device init and loading pretrained weights",
    3: "wrapping-policy mistakes",
    4: "tied or shared weights split across units",
    5: "frozen parameters, LoRA and PEFT",
    6: "mixed-precision and dtype surprises",
    7: "gathering a full state dict to save",
    8: "resuming under Trainer or Accelerate",
    9: "DCP resharding, a change of world size",
    10: "hangs and watchdog timeouts",
    11: "gradient clipping and grad-norm logging",
    12: "gradient accumulation: memory and communication",
    13: "activation checkpointing interplay",
    14: "torch.compile interplay",
    15: "'slow', 'ZeRO-3 uses more memory than ZeRO-2'",
}
"""The fifteen things FSDP users struggle with most, by number (the project's field notes, §2,
gathered from public GitHub threads)."""


def thread_url(ref: str) -> str:
    """The GitHub address of a thread written ``owner/repo#N`` (an issue) or ``owner/repo!N`` (a
    pull request), e.g. ``"pytorch/pytorch#80581"``.

    Raises:
        ValueError: for a reference in neither form.
    """
    for mark, kind in (("#", "issues"), ("!", "pull")):
        repo, sep, number = ref.partition(mark)
        if sep and repo.count("/") == 1 and number.isdigit():
            return f"https://github.com/{repo}/{kind}/{number}"
    raise ValueError(f"a thread is 'owner/repo#N' (issue) or 'owner/repo!N' (pull request), got {ref!r}")


@dataclass(frozen=True)
class ClinicCase:
    """One failure of the clinic, as the chapter tells it."""

    name: str
    """The run's ``case`` key, e.g. ``"wrap_class_missing"``."""
    group: str
    """One of :data:`CLINIC_GROUPS`."""
    note: int | None
    """The pain point of :data:`FIELD_NOTES` it reproduces (``None``: none of them)."""
    title: str
    """A few words for a table row."""
    threads: tuple[str, ...]
    """Where users met it: ``owner/repo#N`` (issue) or ``owner/repo!N`` (pull request)."""
    symptom: str
    """What the user sees (the broken half measures it)."""
    cause: str
    """Why."""
    fix: str
    """What the fixed half does instead."""

    @property
    def urls(self) -> tuple[str, ...]:
        """The threads' addresses (:func:`thread_url`)."""
        return tuple(thread_url(t) for t in self.threads)


_CASES = (
    ClinicCase(
        "wrap_class_missing", "memory", 3, "wrap policy finds no layer class",
        ("huggingface/accelerate#1943", "huggingface/accelerate#2872"),
        "the job runs, but every rank gathers the whole model at once: one unit",
        "the policy names a layer class (LlamaDecoderLayer) the model does not have, so no "
        "layer becomes a unit and the root holds every parameter",
        "name the model's own block class (TransformerLayer): one unit per layer"),
    ClinicCase(
        "init_full_copy", "memory", 1, "every rank builds the full model",
        ("huggingface/transformers#35636",),
        "host memory at init does not fall with more ranks",
        "each rank builds the whole model on the CPU before FSDP shards it",
        "build on the meta device, shard, then materialise only the shards"),
    ClinicCase(
        "frozen_params", "memory", 5, "frozen and trainable in one flat unit",
        ("pytorch/pytorch#91167", "pytorch/pytorch#104690"),
        "FSDP1 refuses: 'Must flatten tensors with uniform requires_grad'",
        "FSDP1 flattens a unit into one FlatParameter, which has one requires_grad",
        "FSDP2 shards per parameter: frozen ones get no gradient and no optimizer state"),
    ClinicCase(
        "accumulation_unsharded_grads", "memory", 12, "accumulation holds unsharded grads",
        ("meta-pytorch/tnt!1057", "meta-pytorch/torchtune#1275"),
        "memory jumps between micro-steps with gradient sync off",
        "without sync the gradients are not reduce-scattered: each rank keeps them whole until "
        "the last micro-step",
        "keep sync on (the shards accumulate in place) and pay one reduce-scatter per unit "
        "per micro-step"),
    ClinicCase(
        "tied_weights_split", "correctness", 4, "tied weights in two units",
        ("Lightning-AI/pytorch-lightning!21613", "linkedin/Liger-Kernel#332"),
        "the tie is lost when wrapping, and the first forward raises",
        "the embedding and the head share one tensor, but each unit shards its own copy",
        "keep both in one unit (the root, or fully_shard([embedding, output]))"),
    ClinicCase(
        "local_grad_norm", "correctness", 11, "grad norm of the local shard",
        ("pytorch/pytorch#170862", "radixark/miles_diffusion!35"),
        "the logged norm is low by about sqrt(N), and clipping by it misses max_norm",
        "the norm is summed over this rank's shards only",
        "reduce the squared norms across ranks (a DTensor's norm, clip_grad_norm_ on them)"),
    ClinicCase(
        "meta_buffer_uninit", "correctness", 2, "buffer left empty after to_empty",
        ("pytorch/torchtitan#110", "NVIDIA-BioNeMo/bionemo-recipes!1368"),
        "the loss is NaN, or silently wrong",
        "to_empty gives buffers storage but no values, and reset_parameters resets "
        "parameters only",
        "initialise the buffers too (torchtitan's init_weights)"),
    ClinicCase(
        "optimizer_before_wrap", "correctness", None, "optimizer built before FSDP1",
        ("huggingface/accelerate#3256", "huggingface/accelerate#2665"),
        "the loss does not fall: no weight moves",
        "FSDP1 replaces the parameters by FlatParameters; the optimizer holds the old ones, "
        "which get no gradient (and keep the full model alive)",
        "build the optimizer from the wrapped model's parameters"),
    ClinicCase(
        "ac_nondeterministic", "correctness", 13, "recomputation differs from forward",
        ("huggingface/transformers#34928", "pytorch/torchtitan#1117"),
        "gradients differ from the same model without checkpointing",
        "the recomputed forward draws new dropout masks (preserve_rng_state=False)",
        "restore the random state on recomputation (preserve_rng_state=True)"),
    ClinicCase(
        "mixed_dtype", "correctness", 6, "bf16 and fp32 parameters in one unit",
        ("huggingface/accelerate!3985", "pytorch/pytorch#156784"),
        "'FSDP expects uniform original parameter dtype'",
        "one unit all-gathers one flat buffer, of one dtype",
        "keep the parameters fp32 and let MixedPrecisionPolicy cast them to bf16"),
    ClinicCase(
        "forward_skips_hooks", "correctness", None, "a forward that skips FSDP's hooks",
        ("pytorch/pytorch!125394",),
        "'got mixed torch.Tensor and DTensor' at the first operation",
        "FSDP2 gathers a unit in its module's forward hooks; model.forward(x), a submodule of the "
        "root called alone, or generate() skip them",
        "call the module (model(x)), or register_fsdp_forward_method(model, 'generate')"),
    ClinicCase(
        "rank0_only_forward", "hangs", 10, "a forward on rank 0 only",
        ("deepspeedai/DeepSpeed#8262", "deepspeedai/DeepSpeed#7998"),
        "the job hangs until the collective timeout",
        "FSDP gathers each unit before it runs: a forward on one rank waits in an all-gather "
        "the other ranks never join",
        "run the forward on every rank (each evaluates its share), or on an unsharded copy"),
    ClinicCase(
        "uneven_batches", "hangs", 10, "ranks with different numbers of batches",
        ("pytorch/torchtitan#1618", "PrimeIntellect-ai/prime-rl#2515"),
        "an evaluation loop hangs at its end",
        "each rank reads its own slice of a finite set, and one gets a batch more: its last "
        "forward all-gathers with ranks that have left the loop",
        "give every rank as many batches (DistributedSampler pads the set, or a fixed step count)"),
    ClinicCase(
        "rank0_only_state_dict", "hangs", 7, "full state dict gathered on rank 0 only",
        ("pytorch/pytorch#80581", "huggingface/accelerate!1181"),
        "saving hangs",
        "a full state dict all-gathers every tensor: every rank must take part",
        "call it on every rank with cpu_offload=True: only rank 0 keeps the copy"),
    ClinicCase(
        "full_state_dict_every_rank", "checkpoints", 7, "full state dict on every rank",
        ("axolotl-ai-cloud/axolotl!1828", "pytorch/pytorch#104143"),
        "every rank holds the whole model at save time (on the device, or on the host with FSDP1's "
        "offload_to_cpu alone)",
        "full_state_dict=True without cpu_offload leaves the gathered copy on every rank",
        "cpu_offload=True (rank 0 keeps it), or save sharded with DCP"),
    ClinicCase(
        "resume_other_world_size", "checkpoints", 9, "local shards loaded at another world size",
        ("pytorch/torchtitan#811", "pytorch/pytorch#91205"),
        "'size mismatch' when resuming on a different number of ranks",
        "each rank saved its own shards; another world size cuts them differently",
        "save with DCP, which records each tensor's global shape and reshards on load"),
    ClinicCase(
        "compiled_key_prefix", "checkpoints", 14, "a compiled model's keys, loaded non-strict",
        ("FareedKhan-dev/train-llm-from-scratch#36", "meta-pytorch/float8_experimental!190"),
        "the resumed or exported model has its initial weights, and nothing was raised",
        "torch.compile's wrapper prefixes every key with '_orig_mod.': a strict=False load "
        "matches none",
        "get_model_state_dict, which names each tensor without its wrappers' prefixes"),
)

CLINIC_CASES: dict[str, ClinicCase] = {case.name: case for case in _CASES}
"""Every case of the clinic, by name, in the chapter's order (grouped as :data:`CLINIC_GROUPS`)."""


def get_case(name: str) -> ClinicCase:
    """The case named ``name``.

    Raises:
        ValueError: ``"case must be one of wrap_class_missing, ..., got 'x'"``.
    """
    return lookup(CLINIC_CASES, name, "case")


def cases_in(group: str) -> list[ClinicCase]:
    """The cases of one of :data:`CLINIC_GROUPS`, in order.

    Raises:
        ValueError: for another group, naming the accepted ones.
    """
    lookup(dict.fromkeys(CLINIC_GROUPS), group, "group")
    return [case for case in _CASES if case.group == group]


def notes_left_out() -> list[int]:
    """The numbers of :data:`FIELD_NOTES` no case reproduces."""
    covered = {case.note for case in _CASES}
    return [n for n in FIELD_NOTES if n not in covered]
