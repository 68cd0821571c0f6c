"""Write an FSDP2-sharded Llama as Hugging Face safetensors, read it back sharded and into Transformers.

The torch-free half of :mod:`handbook_lib.runs.hf_weights`: its config (the model's size as its
``config.json`` spells it, and the folder the weights go to) and the checks the launcher makes
before any process starts (:class:`~handbook_lib.core.run_spec.RunSpec`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from handbook_lib.core.config import FlatConfig
from handbook_lib.core.files import check_writable_dir
from handbook_lib.core.run_spec import RunSpec
from handbook_lib.models.hf_config import decoder_shape_from_hf
from handbook_lib.models.presets import DecoderShape


@dataclass(frozen=True)
class HFWeightsConfig(FlatConfig):
    """A Llama-family model's size, by its ``config.json`` keys (counts), its seed, and the folder
    its safetensors files are written to."""

    MINIMUMS: ClassVar[Mapping[str, int]] = {"vocab_size": 1, "hidden_size": 1, "intermediate_size": 1,
                                             "num_hidden_layers": 1, "num_attention_heads": 1,
                                             "num_key_value_heads": 1, "seed": 0}

    vocab_size: int = 1001
    """Tokens of the vocabulary: rows of the embedding and the head (1,001 divides by no rank
    count, so FSDP2 pads their shards)."""
    hidden_size: int = 64
    """Width of the residual stream."""
    intermediate_size: int = 176
    """Width of the SwiGLU feed-forward."""
    num_hidden_layers: int = 2
    """Decoder layers, one FSDP2 unit each."""
    num_attention_heads: int = 4
    """Query heads; they divide ``hidden_size``."""
    num_key_value_heads: int = 2
    """Key and value heads (grouped-query attention); they divide the query heads."""
    seed: int = 0
    """Seeds the weights and the batch the logits are compared on."""
    save_dir: str = ""
    """The folder the safetensors files and ``config.json`` are written to (required; created,
    and refused if it already holds anything)."""

    def shape(self) -> DecoderShape:
        """The model, read as Transformers reads these keys (one line naming a key that cannot be)."""
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads")
        return decoder_shape_from_hf({"model_type": "llama", **{k: getattr(self, k) for k in keys}},
                                     "a Llama of this config")


CONFIG = HFWeightsConfig


def validate(config: HFWeightsConfig, world_size: int) -> None:
    """Reject, before any process starts, a config this run cannot execute.

    Raises:
        ValueError: naming the key and what it accepts.
    """
    config.shape()
    if not config.save_dir:
        raise ValueError("hf_weights needs save_dir (the folder the safetensors files are written to)")
    check_writable_dir("save_dir", config.save_dir)
    path = Path(config.save_dir)
    if path.is_dir() and any(path.iterdir()):
        raise ValueError(f"config key 'save_dir'={config.save_dir!r} already holds files: give a new or empty "
                         "folder (nothing in it is overwritten or deleted)")


SPEC = RunSpec("hf_weights", __doc__, CONFIG, validate)
