"""A model of your own: a Transformers ``config.json`` read as a :class:`DecoderShape`. Pure Python.

Every planning tool of the book (``params``, ``memory``, ``comm``, ``plan`` and the functions
behind them) prices a model through its layout (:func:`~handbook_lib.models.layout.model_layout`),
and a :class:`~handbook_lib.models.presets.DecoderShape` is what the layout needs of a large
decoder. :func:`decoder_shape_from_hf` turns the ``config.json`` that ships with a Hugging Face
checkpoint into one, for the families below; nothing is downloaded and ``transformers`` is not
imported (the tests build each family with Transformers on the meta device and check the count
to the parameter).

Families (``model_type``) and what their layers hold:

- ``llama``: gated (SwiGLU) feed-forward, grouped-query attention, RMSNorm without bias, Q/K/V/O
  biases only with ``attention_bias``, feed-forward biases only with ``mlp_bias``;
- ``mistral``: as Llama, no biases;
- ``qwen2``: as Llama, with Q/K/V biases (never on the output projection);
- ``gpt2``: two-projection feed-forward (``n_inner``, default ``4·n_embd``), learned positions
  (``n_positions``), LayerNorm and every projection with a bias, head tied to the embedding.

A key the file leaves out takes the family's default in Transformers (:data:`HF_DEFAULTS`; a
test compares them with Transformers' config classes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from handbook_lib.core.checks import check_int
from handbook_lib.models.presets import DecoderShape

__all__ = ["HF_FAMILIES", "HF_DEFAULTS", "decoder_shape_from_hf", "read_hf_config"]

_LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32_000, "hidden_size": 4096, "intermediate_size": 11_008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "tie_word_embeddings": False,
}
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_LLAMA_DEFAULTS, "attention_bias": False, "mlp_bias": False},
    "mistral": {**_LLAMA_DEFAULTS, "intermediate_size": 14_336, "num_key_value_heads": 8},
    "qwen2": {**_LLAMA_DEFAULTS, "vocab_size": 151_936, "intermediate_size": 22_016},
    "gpt2": {"vocab_size": 50_257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
             "n_positions": 1024, "tie_word_embeddings": True},
}
"""Each family's defaults in Transformers' config classes, for the keys a shape reads
(``None``: derived, e.g. ``num_key_value_heads`` = ``num_attention_heads``)."""

HF_FAMILIES: tuple[str, ...] = tuple(HF_DEFAULTS)
"""The ``model_type`` values :func:`decoder_shape_from_hf` reads."""

_GPT2_KEYS = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head"}


def decoder_shape_from_hf(config: Mapping[str, Any], name: str = "") -> DecoderShape:
    """The :class:`DecoderShape` of a Transformers config (the parsed ``config.json``).

    Args:
        config: The config's keys; ``model_type`` must be one of :data:`HF_FAMILIES`.
        name: How the model is named in sentences (default: ``_name_or_path``, else the family).

    Raises:
        ValueError: one line naming the key and what is accepted: an unknown ``model_type``, a
            size that is not a whole number >= 1, heads that do not divide ``hidden_size`` (without
            ``head_dim``), key/value heads that do not divide the heads.
    """
    family = config.get("model_type")
    if family not in HF_DEFAULTS:
        raise ValueError(f"model_type {family!r} is not covered; accepted: {', '.join(HF_FAMILIES)} "
                         "(decoder-only, dense)")
    keys = {**HF_DEFAULTS[family], **{k: v for k, v in config.items() if k in HF_DEFAULTS[family]}}
    shown = _GPT2_KEYS if family == "gpt2" else {}  # GPT-2's files spell three sizes their own way
    keys.update({std: keys[gpt] for std, gpt in shown.items()})
    sizes = {key: _whole(keys, key, shown.get(key, key)) for key in ("vocab_size", "hidden_size",
                                                                     "num_hidden_layers", "num_attention_heads")}
    d, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    head_dim = _whole(keys, "head_dim") if keys.get("head_dim") is not None else 0
    if not head_dim and d % heads:
        raise ValueError(f"{shown.get('num_attention_heads', 'num_attention_heads')}={heads} must divide "
                         f"{shown.get('hidden_size', 'hidden_size')}={d} (or give head_dim)")
    kv_heads = _whole(keys, "num_key_value_heads") if keys.get("num_key_value_heads") is not None else heads
    if heads % kv_heads:
        raise ValueError(f"num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
    label = name or str(config.get("_name_or_path") or f"a {family} model")
    common = dict(num_layers=sizes["num_hidden_layers"], d_model=d, nhead=heads, vocab_size=sizes["vocab_size"],
                  tied_embeddings=bool(keys["tie_word_embeddings"]), source="a Transformers config.json")
    if family == "gpt2":
        ffn = _whole(keys, "n_inner") if keys["n_inner"] is not None else 4 * d
        return DecoderShape(label, **common, dim_feedforward=ffn, bias=True,
                            max_positions=_whole(keys, "n_positions"))
    attention_bias = bool(keys.get("attention_bias", False))  # a key of Llama's only
    return DecoderShape(label, **common, dim_feedforward=_whole(keys, "intermediate_size"), gated_mlp=True,
                        num_kv_heads=kv_heads if kv_heads != heads else 0, head_dim=head_dim,
                        qkv_bias=family == "qwen2" or attention_bias, out_bias=attention_bias,
                        mlp_bias=bool(keys.get("mlp_bias", False)))


def read_hf_config(path: str | Path) -> DecoderShape:
    """Read a Transformers ``config.json`` at ``path`` as a :class:`DecoderShape`
    (:func:`decoder_shape_from_hf`), named after its ``_name_or_path`` or the file.

    Raises:
        ValueError: one line naming the file: missing, unreadable, not JSON, not a JSON object,
            or a config :func:`decoder_shape_from_hf` refuses.
    """
    where = Path(path)
    try:
        text = where.read_text()
    except OSError as err:
        raise ValueError(f"{where}: cannot read it ({err.strerror or err}); "
                         "accepted: a Transformers config.json") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON (line {err.lineno}: {err.msg}); "
                         "accepted: a Transformers config.json") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: a JSON {type(config).__name__}, not an object; "
                         "accepted: a Transformers config.json")
    try:
        return decoder_shape_from_hf(config, str(config.get("_name_or_path") or where.name))
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _whole(keys: Mapping[str, Any], key: str, shown: str = "") -> int:
    """``keys[key]``, refused unless a whole number >= 1 (named ``shown``, the file's spelling)."""
    return check_int(shown or key, keys.get(key), 1, noun="a whole number")
