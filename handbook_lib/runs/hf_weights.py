"""Write an FSDP2-sharded Llama as Hugging Face safetensors, read it back sharded and into Transformers.

Chapter 6 launches it. Every rank builds the seeded
:class:`~handbook_lib.runtime.decoder.Decoder` of the config's size (Transformers' Llama written
out, with its parameter names), shards it with FSDP2 (one unit per layer and the root) and writes
it with :func:`~handbook_lib.runtime.hf_weights.save_safetensors`: each rank its shards, then one
consolidated ``model-00001-of-00001.safetensors``; rank 0 writes ``config.json`` beside it
(:func:`~handbook_lib.runtime.hf_weights.transformers_config`). Then a model built on the meta
device, sharded the same way and given empty shards (``to_empty``), as a job that starts from
pretrained weights builds it, reads the files back
(:func:`~handbook_lib.runtime.hf_weights.load_safetensors`), and Transformers'
``LlamaForCausalLM.from_pretrained`` loads the folder.

Checks, each exact: the files hold ``4·P`` bytes of fp32 tensors; their names are the names
Transformers gives the same config's parameters; no element of the files differs from the model
that was saved; no element of the model loaded back differs (every rank, each gathering the whole
state); Transformers' logits on a seeded batch equal the saved model's, to the bit; and each
rank's activations of one forward of the sharded Llama (grouped-query attention, SwiGLU, RMSNorm
in fp32) are what :meth:`~handbook_lib.models.layout.ModelLayout.activations` counts, operator by
operator.

Keys: the model's size by its ``config.json`` names (``vocab_size``, ``hidden_size``,
``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``),
``seed`` and ``save_dir`` (required; a new or empty folder: nothing in it is overwritten).

Launch::

    python -m handbook_lib run hf_weights --nproc 2 --set save_dir=runs/llama-st --out runs/hf
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from handbook_lib.core.files import write_json_atomic
from handbook_lib.core.results import Check
from handbook_lib.models.layout import model_layout
from handbook_lib.models.presets import DecoderShape
from handbook_lib.runs.entry import RankReport, main
from handbook_lib.runs.specs.hf_weights import CONFIG as CONFIG, HFWeightsConfig
from handbook_lib.runtime.decoder import Decoder
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.measure import StepMemoryTracker
from handbook_lib.runtime.hf_weights import (
    SHARDED_DIR,
    load_safetensors,
    safetensors_files,
    save_safetensors,
    transformers_config,
)


def _sharded(config: HFWeightsConfig, ctx: RankContext, seed: int | None) -> torch.nn.Module:
    """The decoder on this rank's device, each layer and the root an FSDP2 unit: seeded, or
    (``seed`` None) built on the meta device and given empty shards, as a job that loads
    pretrained weights builds it."""
    from torch.distributed.fsdp import fully_shard

    if seed is None:
        with torch.device("meta"):
            model = Decoder(config.shape())
    else:
        torch.manual_seed(seed)
        model = Decoder(config.shape()).to(ctx.device)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    if seed is None:
        model.to_empty(device=ctx.device)
    return model


ACTIVATION_BATCH = (2, 32)
"""Sequences and tokens of the forward whose saved bytes the run measures on each rank."""


def _activation_bytes(model: torch.nn.Module, shape: DecoderShape, ctx: RankContext, seed: int) -> int:
    """What one forward and its loss leave saved for backward on this rank of the sharded
    ``model``, bytes: the activations of FSDP2's memory tracker
    (:class:`~handbook_lib.runtime.measure.StepMemoryTracker`, which files parameters, gathered
    or not, apart), token ids and targets included and the 4-byte loss value not, as
    :meth:`~handbook_lib.models.layout.ModelLayout.activations` prices them."""
    micro_batch, seq_len = ACTIVATION_BATCH
    gen = torch.Generator().manual_seed(seed + 1 + ctx.rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    tracker = StepMemoryTracker(model, optimizer, ctx.device)
    with tracker:
        tokens, targets = (torch.randint(0, shape.vocab_size, (micro_batch, seq_len), generator=gen).to(ctx.device)
                           for _ in range(2))
        loss = F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
        tracker.after_forward(settle=True)
        value = loss.nbytes  # the loss itself, which the tracker files with the activations
        loss.backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)
    assert tracker.result is not None
    return tracker.result.activation_bytes - value


def _differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> int:
    """Elements of ``want`` that ``got`` does not hold bit for bit (all of a missing or misshapen tensor's)."""
    return sum(want[k].numel() if k not in got or got[k].shape != want[k].shape
               else int((got[k].cpu() != want[k]).sum()) for k in want)


def run(config: HFWeightsConfig, ctx: RankContext) -> RankReport:
    """Save, reload and hand to Transformers; check every name, byte and element."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    shape, out = config.shape(), Path(config.save_dir)
    torch.manual_seed(config.seed)
    whole = Decoder(shape)  # the reference, whole, on the CPU
    saved = {k: v.detach().clone() for k, v in whole.state_dict().items()}
    save_safetensors(_sharded(config, ctx, config.seed), out)
    if ctx.is_main:
        write_json_atomic(out / "config.json", transformers_config(shape))
    dist.barrier()
    fresh = _sharded(config, ctx, None)  # shapes only, then empty shards: every value comes from the files
    load_safetensors(fresh, out)
    reloaded = get_model_state_dict(fresh, options=StateDictOptions(full_state_dict=True))
    checks = [Check("elements_differing_after_reload", ctx.rank, 0, _differing(reloaded, saved), "elements")]
    activations = model_layout(shape).activations(*ACTIVATION_BATCH, "fp32")
    assert activations is not None  # a decoder's shape prices its activations
    measured = _activation_bytes(fresh, shape, ctx, config.seed)
    checks.append(Check("activation_bytes", ctx.rank, activations.total, measured, "bytes"))
    metrics: dict[str, object] = {"params": shape.num_params, "activation_bytes": measured}
    if ctx.is_main:
        files = safetensors_files(out)
        checks += [Check("safetensors_tensor_bytes", None, 4 * shape.num_params,
                         sum(t.nbytes for t in files.values()), "bytes"),
                   Check("names_not_transformers", None, 0, len(set(files) ^ _transformers_names(shape)), "names"),
                   Check("elements_differing_in_files", None, 0, _differing(files, saved), "elements"),
                   Check("logits_max_abs_diff_vs_transformers", None, 0.0, _vs_transformers(config, whole), "logits")]
        metrics["files"] = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
        metrics["sharded_dir"] = SHARDED_DIR
    dist.barrier()
    return RankReport(metrics=metrics, checks=checks)


def _transformers_names(shape: DecoderShape) -> set[str]:
    """The parameter names Transformers gives this shape's ``LlamaForCausalLM`` (built on meta)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**transformers_config(shape)))
    return set(model.state_dict())


def _vs_transformers(config: HFWeightsConfig, whole: torch.nn.Module) -> float:
    """Largest absolute difference between the logits of Transformers' model loaded from the
    folder and ``whole``'s, on a seeded batch of 2 × 16 tokens."""
    from transformers import LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    hf = LlamaForCausalLM.from_pretrained(config.save_dir, dtype=torch.float32, attn_implementation="sdpa")
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(config.seed))
    with torch.no_grad():
        return float((hf(input_ids=tokens).logits - whole(tokens)).abs().max())


if __name__ == "__main__":
    main(sys.modules[__name__])
