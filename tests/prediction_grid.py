"""The pure models' predictions over a grid of configurations, as one canonical JSON text.

``tests/test_predictions.py`` compares it with ``tests/data/predictions.json.gz``, recorded by
the flat package before the layered one replaced it: any change to any prediction (memory by
phase, a step's collectives, shards, init bytes, ZeRO's and FSDP's rank state, accumulation, the
planner's options and reasons) shows up as a named difference. After a deliberate change to a
model, regenerate the file and say why in the commit:

    .venv/bin/python -m tests.prediction_grid --write
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import sys
from pathlib import Path

from handbook_lib.core import ModelConfig
from handbook_lib.models import (
    estimate_accumulation_bytes,
    estimate_flat_shard_bytes,
    estimate_init_bytes,
    estimate_memory,
    estimate_rank_state,
    estimate_shard_bytes,
    estimate_step_traffic,
    get_shape,
    plan,
    wrap_units,
)

GOLDEN = Path(__file__).resolve().parent / "data" / "predictions.json.gz"


def call(fn, *args, **kwargs) -> object:
    """``fn(*args, **kwargs)``, or ``"ValueError"`` where the models refuse the configuration."""
    try:
        return fn(*args, **kwargs)
    except ValueError:
        return "ValueError"


def mem(estimate) -> object:
    """A :class:`~handbook_lib.models.memory.MemoryEstimate` as plain data (an error as is)."""
    if isinstance(estimate, str):
        return estimate
    return {"components": estimate.components, "phases": estimate.phases, "peak_phase": estimate.peak_phase,
            "forward_activations": estimate.forward_activations, "host": estimate.host,
            "notes": list(estimate.notes), "late_free_peak": estimate.late_free_peak}


def predictions() -> tuple[int, dict[str, object]]:
    """``(configurations, {key: prediction})`` over the whole grid (errors as ``"ValueError"``)."""
    models = {
        "handbook": ModelConfig(),
        "small": ModelConfig(vocab_size=1000, d_model=64, nhead=4, dim_feedforward=128, num_layers=2),
        "odd": ModelConfig(vocab_size=997, d_model=48, nhead=3, dim_feedforward=100, num_layers=3),
        "llama2-7b": get_shape("llama2-7b"), "gpt3-175b": get_shape("gpt3-175b"), "llama2-70b": get_shape("70b"),
        "count": 7_000_000_001,
    }
    out = {}
    strategies = ["NONE", "DDP", "NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
    n = 0
    for (mname, model), world, strategy, precision in itertools.product(
            models.items(), (1, 2, 4, 8), strategies, ("fp32", "bf16-mixed", "fp16-mixed")):
        group = 2 if strategy.startswith("HYBRID") and world >= 4 else None
        for mb, seq, ac, off, backend, accum in (
                (0, 0, False, False, "nccl", 1), (2, 64, False, False, "gloo", 1), (2, 64, True, False, "nccl", 1),
                (1, 32, False, True, "nccl", 1), (4, 16, False, False, "gloo", 2),
                (2, 64, "selective", False, "gloo", 1)):
            key = f"mem|{mname}|{world}|{strategy}|{precision}|{mb}x{seq}|ac{ac}|off{off}|{backend}|acc{accum}"
            out[key] = mem(call(estimate_memory, model, world, strategy, precision, "adamw", micro_batch=mb,
                                seq_len=seq, shard_group_size=group, rank=world - 1, activation_checkpointing=ac,
                                cpu_offload=off, backend=backend, grad_accum_steps=accum))
            n += 1
    # wrap policies and FSDP1 flat parameters (ModelConfig only)
    for mname in ("handbook", "small", "odd"):
        model = models[mname]
        for wrap, world, strategy, flat, precision in itertools.product(
                ("layer", "model", "size"), (2, 4), ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"), (False, True),
                ("fp32", "bf16-mixed")):
            units = wrap_units(model, wrap, 20_000)
            key = f"memwrap|{mname}|{wrap}|{world}|{strategy}|flat{flat}|{precision}"
            out[key] = mem(call(estimate_memory, model, world, strategy, precision, "sgd-momentum", micro_batch=2,
                                seq_len=32, rank=1, units=units, flat_params=flat, backend="gloo"))
            n += 1
            tr = call(estimate_step_traffic, units, world, strategy, param_dtype="bf16" if precision != "fp32" else "fp32",
                      reduce_dtype="fp32", flat_params=flat, grad_accum_steps=2,
                      sync_every_micro_step=False, grad_scaler_group=world if flat else None)
            out[f"traffic|{key}"] = tr if isinstance(tr, str) else [vars(r) for r in tr.records]
            out[f"flatshard|{key}"] = vars(estimate_flat_shard_bytes(units, world, 1))
            n += 1
    for mname in ("handbook", "small", "odd"):
        model = models[mname]
        for world, strategy, init in itertools.product((1, 2, 4, 8), strategies, ("meta", "full")):
            group = 2 if strategy.startswith("HYBRID") and world >= 4 else None
            r = call(estimate_init_bytes, model, world, strategy, init, rank=world - 1, shard_group_size=group)
            out[f"init|{mname}|{world}|{strategy}|{init}"] = r
            n += 1
        for world, strategy, opt in itertools.product((1, 2, 4), strategies + ["ZERO1", "ZERO2", "ZERO3"],
                                                      ("adamw", "sgd")):
            group = 2 if strategy.startswith("HYBRID") and world >= 4 else None
            r = call(estimate_rank_state, model, world, strategy, "bf16-mixed", opt, rank=world - 1,
                     shard_group_size=group)
            out[f"rankstate|{mname}|{world}|{strategy}|{opt}"] = r if isinstance(r, str) else vars(r)
            n += 1
        for world in (1, 2, 3, 4, 8):
            out[f"shard|{mname}|{world}"] = vars(estimate_shard_bytes(model, world, world - 1))
    for mname, model in models.items():
        for strategy in strategies:
            out[f"accum|{mname}|{strategy}"] = call(estimate_accumulation_bytes, model, strategy, "bf16-mixed")
    for mname, gpu, gpus in (("llama2-7b", "h100-80gb", 8), ("llama2-70b", "a100-80gb", 32),
                             ("gpt3-175b", "a100-80gb", 64), ("handbook", "cpu", 2), ("llama2-13b", "a100-40gb", 8)):
        model = models.get(mname) or get_shape(mname)
        p = plan(model, gpu, gpus, seq_len=4096 if mname != "handbook" else 64)
        out[f"plan|{mname}|{gpu}|{gpus}"] = {"options": [vars(o) for o in p.options], "reasons": p.reasons,
                                             "recommended": p.recommended.name if p.recommended else None,
                                             "seed": p.seed_answer}
        n += 1
    return n, out


def canonical(out: dict[str, object]) -> str:
    """The predictions as the JSON text the golden file holds (sorted keys, no spaces)."""
    return json.dumps(json.loads(json.dumps(out, sort_keys=True, default=str)), sort_keys=True,
                      separators=(",", ":"))


def main(argv: list[str]) -> int:
    n, out = predictions()
    text = canonical(out)
    print(f"{n} configurations, {len(out)} predictions, sha256 {hashlib.sha256(text.encode()).hexdigest()}")
    if "--write" in argv:
        GOLDEN.write_bytes(gzip.compress(text.encode(), mtime=0))
        print(f"wrote {GOLDEN}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
