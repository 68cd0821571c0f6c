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
test compares them with Transformers' config classes). The file is read strictly, as
Transformers types its fields: a size is a JSON whole number within :data:`HF_BOUNDS`, a
switch is ``true`` or ``false`` (``"false"``, a string, is refused: Transformers would keep it,
and a non-empty string is true); a key that looks like a misspelt size the file leaves out
(``num_layers`` for ``num_hidden_layers``) is refused naming the key it resembles, since the
default would be used in silence; a mixture of experts is refused. The keys the shape does not
read are returned by :func:`read_hf_config_keys`, for a tool to list them once.
"""

from __future__ import annotations

import difflib
import json
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from handbook_lib.core.architecture import MAX_LAYERS
from handbook_lib.core.checks import is_int
from handbook_lib.models.presets import DecoderShape

__all__ = ["HF_FAMILIES", "HF_DEFAULTS", "HF_BOUNDS", "MAX_CONFIG_BYTES", "decoder_shape_from_hf",
           "hf_config_from_text", "read_hf_config", "read_hf_config_keys", "unused_hf_keys"]

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

HF_BOUNDS: dict[str, int] = {
    "num_hidden_layers": MAX_LAYERS, "n_layer": MAX_LAYERS, "hidden_size": 1 << 17, "n_embd": 1 << 17,
    "intermediate_size": 1 << 20, "n_inner": 1 << 20, "num_attention_heads": 1 << 12, "n_head": 1 << 12,
    "num_key_value_heads": 1 << 12, "head_dim": 1 << 12, "vocab_size": 1 << 24, "n_positions": 1 << 22,
}
"""The largest value each size may take: far above every published dense decoder (126 layers,
hidden 16,384, a vocabulary of 256,000), and low enough that every tool answers within a second
(the tools walk the layers)."""

MAX_CONFIG_BYTES = 1 << 20
"""The largest ``config.json`` read, bytes (published ones are a few kB); a larger file, or
anything but a regular file (``/dev/zero``, a pipe), is refused unread."""

_SWITCHES = ("tie_word_embeddings", "attention_bias", "mlp_bias")
_CAUSAL_LM = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "gpt2": "GPT2LMHeadModel"}
_COVERED = f"covered: {', '.join(_CAUSAL_LM.values())} (dense decoders; no mixture of experts, no Gemma)"
_GPT2_KEYS = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head"}
_GPT2_ALIASES = {**{std: gpt for std, gpt in _GPT2_KEYS.items()}, "max_position_embeddings": "n_positions"}
"""GPT2Config's ``attribute_map``: Transformers reads these standard names as GPT-2's own."""
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok",
            "moe_intermediate_size", "n_shared_experts", "shared_expert_intermediate_size")
_OTHER_SPELLINGS = {"n_layer": "num_hidden_layers", "n_embd": "hidden_size", "n_head": "num_attention_heads",
                    "n_inner": "intermediate_size", "num_layers": "num_hidden_layers", "d_model": "hidden_size",
                    "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
                    "ffn_dim": "intermediate_size", "intermediate_size": "n_inner", "n_layers": "num_hidden_layers"}
"""Other models' names for a size a family reads: each suggests the family's own key."""
_TRANSFORMERS_KEYS = frozenset((
    "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache", "bos_token_id",
    "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "initializer_range",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "is_encoder_decoder",
    "is_decoder", "add_cross_attention", "tie_encoder_decoder", "chunk_size_feed_forward",
    "pruned_heads", "id2label", "label2id", "num_labels", "problem_type", "tokenizer_class", "prefix",
    "task_specific_params", "finetuning_task", "quantization_config", "auto_map", "attn_implementation",
    "hidden_act", "max_position_embeddings", "rms_norm_eps", "pretraining_tp", "rope_theta",
    "rope_scaling", "rope_parameters", "attention_dropout", "sliding_window", "use_sliding_window",
    "max_window_layers", "layer_types", "n_ctx", "activation_function", "resid_pdrop", "embd_pdrop",
    "attn_pdrop", "layer_norm_epsilon", "summary_type", "summary_use_proj", "summary_activation",
    "summary_proj_to_labels", "summary_first_dropout", "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "max_length", "min_length",
))
"""Keys of Transformers' configs that a shape does not read: never taken for a misspelling."""


def decoder_shape_from_hf(config: Mapping[str, Any], name: str = "") -> DecoderShape:
    """The :class:`DecoderShape` of a Transformers config (the parsed ``config.json``).

    Args:
        config: The config's keys; ``model_type`` must be one of :data:`HF_FAMILIES`.
        name: How the model is named in sentences (default: ``_name_or_path``, else the family).

    Raises:
        ValueError: one line naming the key and what is accepted: an unknown ``model_type``, an
            architecture or a mixture-of-experts key outside the covered families, a size that is
            not a JSON whole number within :data:`HF_BOUNDS`, a switch that is not ``true`` or
            ``false``, a key that looks like a misspelt size the file leaves out, a size given
            under both of GPT-2's names, heads that do not divide ``hidden_size`` (without
            ``head_dim``), key/value heads that do not divide the heads.
    """
    family = config.get("model_type")
    if not isinstance(family, str) or family not in HF_DEFAULTS:
        raise ValueError(f"model_type {_brief(family)} is not covered; accepted: {', '.join(HF_FAMILIES)} "
                         "(dense decoders; mixtures of experts and Gemma's families are not covered)")
    _check_covered(config, family)
    _check_spelling(config, family)
    keys = {**HF_DEFAULTS[family], **{k: v for k, v in config.items() if k in HF_DEFAULTS[family]}}
    if family == "gpt2":  # GPT-2's files spell sizes their own way; Transformers maps the usual names
        keys.update(_gpt2_aliases(config))
    shown = _GPT2_KEYS if family == "gpt2" else {}
    keys.update({std: keys[gpt] for std, gpt in shown.items()})
    for key in _SWITCHES:
        if key in keys and not isinstance(keys[key], bool):
            raise ValueError(f"{key} must be true or false (a JSON boolean), got {_brief(keys[key])}")
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
    label = name or _label(config) or f"a {family} model"
    common = dict(num_layers=sizes["num_hidden_layers"], d_model=d, nhead=heads, vocab_size=sizes["vocab_size"],
                  tied_embeddings=keys["tie_word_embeddings"], source="a Transformers config.json")
    if family == "gpt2":
        ffn = _whole(keys, "n_inner") if keys["n_inner"] is not None else 4 * d
        return DecoderShape(label, **common, dim_feedforward=ffn, bias=True,
                            max_positions=_whole(keys, "n_positions"))
    attention_bias = keys.get("attention_bias", False)  # a key of Llama's only
    return DecoderShape(label, **common, dim_feedforward=_whole(keys, "intermediate_size"), gated_mlp=True,
                        num_kv_heads=kv_heads if kv_heads != heads else 0, head_dim=head_dim,
                        qkv_bias=family == "qwen2" or attention_bias, out_bias=attention_bias,
                        mlp_bias=keys.get("mlp_bias", False))


def unused_hf_keys(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys of ``config`` that its shape does not read (in the file's order): everything but
    ``model_type``, ``_name_or_path``, ``architectures`` (checked) and the family's sizes and
    switches (:data:`HF_DEFAULTS`, and GPT-2's usual aliases)."""
    read = {"model_type", "_name_or_path", "architectures", *HF_DEFAULTS.get(str(config.get("model_type")), ())}
    if config.get("model_type") == "gpt2":
        read |= set(_GPT2_ALIASES)
    return tuple(key for key in config if key not in read)


def read_hf_config_keys(path: str | Path) -> tuple[DecoderShape, tuple[str, ...]]:
    """Read the Transformers ``config.json`` at ``path``: its :class:`DecoderShape`
    (:func:`decoder_shape_from_hf`, named after its ``_name_or_path`` or the file) and the keys
    the shape does not read (:func:`unused_hf_keys`).

    The file is checked before it is read: a regular file of at most :data:`MAX_CONFIG_BYTES`,
    then UTF-8 text, then one JSON object, each key once.

    Raises:
        ValueError: one line naming the file and what is accepted: missing, unreadable, not a
            regular file, too large, not UTF-8, not JSON, not a JSON object, a key given twice,
            or a config :func:`decoder_shape_from_hf` refuses.
    """
    where = Path(path)
    config = _load(where)
    try:
        return decoder_shape_from_hf(config, _label(config) or where.name), unused_hf_keys(config)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def hf_config_from_text(text: str, name: str = "config.json") -> DecoderShape:
    """The :class:`DecoderShape` of a Transformers ``config.json`` given as ``text`` (pasted into the
    book's planner page), checked as :func:`read_hf_config_keys` checks a file, and named after its
    ``_name_or_path`` or ``name``.

    Raises:
        ValueError: one line naming ``name`` and what is accepted: too large, not JSON, not a JSON
            object, a key given twice, or a config :func:`decoder_shape_from_hf` refuses.
    """
    if len(text.encode("utf-8")) > MAX_CONFIG_BYTES:
        raise ValueError(f"{name}: over the {MAX_CONFIG_BYTES:,} bytes a config.json may have; accepted: a "
                         "Transformers config.json (a JSON object in UTF-8)")
    config = _parse(text, name)
    try:
        return decoder_shape_from_hf(config, _label(config) or name)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


def read_hf_config(path: str | Path) -> DecoderShape:
    """Read a Transformers ``config.json`` at ``path`` as a :class:`DecoderShape`: the shape of
    :func:`read_hf_config_keys`, which says what is refused."""
    return read_hf_config_keys(path)[0]


def _load(where: Path) -> dict[str, Any]:
    """The JSON object in the file ``where``, checked before and while it is read."""
    accepted = "accepted: a Transformers config.json (a JSON object in UTF-8)"
    try:
        info = where.stat()
        if not stat.S_ISREG(info.st_mode):
            kind = "a folder" if stat.S_ISDIR(info.st_mode) else "a device, pipe or socket"
            raise ValueError(f"{where}: {kind}, not a regular file; {accepted}")
        if info.st_size > MAX_CONFIG_BYTES:
            raise ValueError(f"{where}: {info.st_size:,} bytes, over the {MAX_CONFIG_BYTES:,} a config.json "
                             f"may have (published ones are a few kB); {accepted}")
        with where.open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ValueError(f"{where}: cannot read it ({err.strerror or err}); {accepted}") from None
    if len(data) > MAX_CONFIG_BYTES:  # it grew since it was looked at
        raise ValueError(f"{where}: over the {MAX_CONFIG_BYTES:,} bytes a config.json may have; {accepted}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: not UTF-8 text (byte {err.start} is {data[err.start]:#04x}); {accepted}") from None
    return _parse(text, str(where))


def _parse(text: str, where: str) -> dict[str, Any]:
    """The JSON object ``text`` holds (read from ``where``), each key once."""
    accepted = "accepted: a Transformers config.json (a JSON object in UTF-8)"
    try:
        config = json.loads(text, object_pairs_hook=_once)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON (line {err.lineno}: {err.msg}); {accepted}") from None
    except (ValueError, RecursionError) as err:  # a key twice, a number of 4,300 digits, nesting too deep
        first = str(err).split(";")[0][:100] if str(err) else "nested too deeply"
        raise ValueError(f"{where}: not a config ({first}); {accepted}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: a JSON {type(config).__name__}, not an object; {accepted}")
    return config


def _once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's keys, refused if one is given twice (Transformers would keep the last)."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"key {_brief(key)} given twice")
        seen[key] = value
    return seen


def _check_covered(config: Mapping[str, Any], family: str) -> None:
    """Refuse an architecture other than the family's causal LM, or a mixture of experts."""
    names = config.get("architectures")
    if names is not None:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"architectures must be a list of class names, got {_brief(names)}")
        for arch in names:
            if arch != _CAUSAL_LM[family]:
                raise ValueError(f"architectures: {_brief(arch)} is not covered; {_COVERED}")
    for key in _EXPERTS:
        if key in config:
            raise ValueError(f"{key}: a mixture of experts is not covered; {_COVERED}")


def _check_spelling(config: Mapping[str, Any], family: str) -> None:
    """Refuse a key that looks like one of the family's sizes or switches the file leaves out
    (its default would be used in silence), naming the closest."""
    own = set(HF_DEFAULTS[family]) | (set(_GPT2_ALIASES) if family == "gpt2" else set())
    absent = [key for key in HF_DEFAULTS[family] if key not in config
              and not (family == "gpt2" and key in _GPT2_ALIASES.values()
                       and any(k in config for k, v in _GPT2_ALIASES.items() if v == key))]
    for key in config:
        if key in own or key in _TRANSFORMERS_KEYS or key.startswith("_") or key == "model_type":
            continue
        other = _OTHER_SPELLINGS.get(key)
        close = [other] if other in absent else difflib.get_close_matches(key, absent, n=1, cutoff=0.6)
        if close:
            default = HF_DEFAULTS[family][close[0]]
            used = "a value derived from the others" if default is None else f"{close[0]}={default}"
            raise ValueError(f"{_brief(key)} is not a key of {family} configs: did you mean {close[0]}? "
                             f"(without it, Transformers uses {used})")


def _gpt2_aliases(config: Mapping[str, Any]) -> dict[str, Any]:
    """GPT-2's sizes given under the usual names (GPT2Config's ``attribute_map``)."""
    found = {}
    for std, gpt in _GPT2_ALIASES.items():
        if std in config:
            if gpt in config:
                raise ValueError(f"{std} and {gpt} name one size of GPT-2: give one of them")
            found[gpt] = config[std]
    return found


def _label(config: Mapping[str, Any]) -> str:
    """``_name_or_path`` if it is printable text (a name reaches the terminal), else ``''``."""
    name = config.get("_name_or_path")
    if name is None or name == "":
        return ""
    if not isinstance(name, str) or not name.isprintable() or len(name) > 200:
        raise ValueError(f"_name_or_path must be printable text of at most 200 characters, got {_brief(name)}")
    return name


def _whole(keys: Mapping[str, Any], key: str, shown: str = "") -> int:
    """``keys[key]``, refused unless a whole number from 1 to its :data:`HF_BOUNDS` (named
    ``shown``, the file's spelling)."""
    value, name = keys.get(key), shown or key
    top = HF_BOUNDS[name]
    if not is_int(value) or not 1 <= value <= top:
        raise ValueError(f"{name} must be a whole number from 1 to {top:,}, got {_brief(value)}")
    return value


def _brief(value: object) -> str:
    """``repr(value)``, cut to 60 characters (a value from a file may be long)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
