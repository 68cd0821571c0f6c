"""Hugging Face weights in and out of a sharded model: safetensors files written and read by
every rank through DCP, and the ``config.json`` Transformers needs beside them.

Chapter 6 teaches it. :func:`save_safetensors` writes an FSDP2 model's state dict as the files
Transformers loads (``model-00001-of-00001.safetensors``, the parameters under their Transformers
names): each rank writes its own shards, then they are consolidated into whole tensors
(``HuggingFaceStorageWriter`` with ``save_distributed`` and ``enable_consolidation``).
:func:`load_safetensors` reads such files straight into a sharded model, each rank its own rows
(``HuggingFaceStorageReader``). :func:`transformers_config` is the ``config.json`` of a
:class:`~handbook_lib.models.presets.DecoderShape`, the inverse of
:func:`~handbook_lib.models.hf_config.decoder_shape_from_hf`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from handbook_lib.models.presets import DecoderShape

__all__ = ["SHARDED_DIR", "load_safetensors", "save_safetensors", "safetensors_files", "transformers_config"]

SHARDED_DIR = "sharded"
"""The folder under the save path where DCP's writer puts each rank's shards before it
consolidates them (``torch.distributed.checkpoint.hf_storage``'s name)."""


def transformers_config(shape: DecoderShape) -> dict[str, Any]:
    """The ``config.json`` with which Transformers builds ``shape`` as ``LlamaForCausalLM`` (fp32,
    RMSNorm's epsilon 1e-6, RoPE's base 10,000: :class:`~handbook_lib.runtime.decoder.Decoder`'s).

    Raises:
        ValueError: for a shape that is not the Llama family's (a two-projection feed-forward,
            learned positions, biases).
    """
    if not shape.gated_mlp or shape.max_positions or shape.bias:
        raise ValueError(f"{shape.name} is not a Llama-family shape (gated feed-forward, rotary positions, "
                         "no LayerNorm biases)")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": shape.vocab_size,
            "hidden_size": shape.d_model, "intermediate_size": shape.ffn, "num_hidden_layers": shape.num_layers,
            "num_attention_heads": shape.nhead, "num_key_value_heads": shape.kv_heads,
            "head_dim": shape.head_width, "attention_bias": shape.qkv_bias or shape.out_bias,
            "mlp_bias": shape.mlp_bias, "tie_word_embeddings": shape.tied_embeddings, "rms_norm_eps": 1e-6,
            "rope_theta": 10_000.0, "hidden_act": "silu", "torch_dtype": "float32"}


def save_safetensors(model: nn.Module, path: str | Path) -> None:
    """Write ``model``'s parameters (sharded by FSDP2, or whole) under ``path``
    as Hugging Face safetensors, in one file; every rank calls it. The ranks
    write their shards to ``path/sharded``, then the files are consolidated
    into whole tensors in ``path``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model)
    writer = dcp.HuggingFaceStorageWriter(
        str(path),
        fqn_to_index_mapping=dict.fromkeys(state, 1),  # one file
        save_distributed=True,  # each rank writes its own shards
        enable_consolidation=True,  # then whole tensors, in path
    )
    dcp.save(state, storage_writer=writer)


def load_safetensors(model: nn.Module, path: str | Path) -> None:
    """Read the safetensors files under ``path`` into ``model`` (sharded by
    FSDP2, or whole), each rank reading the rows it holds; every rank calls
    it. The files' names must be the model's parameter names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd

    state = sd.get_model_state_dict(model)  # DTensors: this rank's rows
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(path)))
    sd.set_model_state_dict(model, state)


def safetensors_files(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the consolidated ``*.safetensors`` files directly under ``path``, by name."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors
