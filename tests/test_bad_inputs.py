"""The table of bad inputs (issue 12): every one gets a short, clear refusal that names the flag.

Each row (a :class:`~tests.bad_input_row.BadInputRow`) is one bad input to the CLI
(``handbook_lib.face.cli.main(argv)``, in-process) or to the Python API (a callable). The runner
asserts, for each row: the exit code (2: bad argument, 1: failed run) or exception type; the
fragment naming the flag or key in stderr / the message; a short message (first line under 200
characters, no raw traceback); no child process left alive; no file touched outside the row's
own folder (each row runs in a fresh, empty current directory that must stay empty, and the
repository's top level and ``notebooks/`` must keep their modification times).

The launcher/config/checkpoint rows of part A live in ``tests/bad_inputs_runs.py`` (``ROWS``)
and are run by the same runner. Rows fail before any torchrun process starts, except the few
marked ``launches=True`` (bad inputs only visible at run time; at most 3).

``python -m tests.test_bad_inputs`` (from the repository root) classifies every row as clear /
poor / bad and prints the counts:

- clear: right exit code or exception, fragment present, short message;
- poor: right exit code or exception, but the fragment is missing or the message is long;
- bad: wrong exit code (including 0) or exception type, or a raw traceback.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import math
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.bad_input_row import TMP, BadInputRow, api, cli, later

try:
    from tests.bad_inputs_runs import ROWS as RUN_ROWS
except ImportError:
    RUN_ROWS = []

REPO = Path(__file__).resolve().parent.parent
MAX_FIRST_LINE = 200


def _memory(*args, **kwargs):
    return later("handbook_lib.models", "estimate_memory", *args, **kwargs)


def _plan(model="llama2-7b", gpu="h100-80gb", gpus=8, **kwargs):
    return later("handbook_lib.models", "plan", model, gpu, gpus, **kwargs)


def _traffic(**kwargs):
    from handbook_lib.models import Unit, estimate_step_traffic

    args = {"units": [Unit("model", ((1000,),))], "world_size": 8, "strategy": "FULL_SHARD", **kwargs}
    return lambda: estimate_step_traffic(**args)


def _torchrun(*args, **kwargs):
    return later("handbook_lib.launch", "torchrun", *args, **kwargs)


PLAN = ["plan", "--model", "llama2-7b", "--gpu", "h100-80gb"]
HF = REPO / "tests" / "data" / "hf_configs"
RUN = ["run", "fsdp_train", "--quiet"]

ROWS: list[BadInputRow] = [
    # --- issue 12, "Poor": the planning commands -------------------------------------------
    cli("memory-params-inf", ["memory", "--params", "inf"], "--params"),
    cli("memory-params-nan", ["memory", "--params", "nan"], "--params"),
    cli("memory-params-1e30", ["memory", "--params", "1e30"], "--params"),
    cli("memory-params-0", ["memory", "--params", "0"], "--params"),
    cli("comm-params-0", ["comm", "--params", "0"], "--params"),
    cli("comm-params-inf", ["comm", "--params", "inf"], "--params"),
    cli("comm-params-1e30", ["comm", "--params", "1e30"], "--params"),
    cli("plan-gpus-per-node-0", [*PLAN, "--gpus", "16", "--gpus-per-node", "0"], "--gpus-per-node"),
    cli("plan-gpus-per-node-3", [*PLAN, "--gpus", "16", "--gpus-per-node", "3"], "--gpus-per-node"),
    cli("plan-nics-per-node-0", [*PLAN, "--gpus", "16", "--nics-per-node", "0"], "--nics-per-node"),
    cli("memory-group-size-not-hybrid", ["memory", "--shard-group-size", "3", "--strategy", "FULL_SHARD",
                                         "--world-size", "6"], "--shard-group-size"),
    cli("memory-params-with-activations", ["memory", "--params", "7e9", "--micro-batch", "1",
                                           "--seq-len", "4096"], "--model"),
    # --- issue 12, "Bad" 5: a combination that cannot run -----------------------------------
    cli("memory-ddp-offload", ["memory", "--strategy", "DDP", "--cpu-offload"], "--cpu-offload"),
    # --- memory -------------------------------------------------------------------------------
    cli("memory-params-negative", ["memory", "--params", "-5"], "--params"),
    cli("memory-params-fraction", ["memory", "--params", "7.5"], "--params"),
    cli("memory-params-text", ["memory", "--params", "seven"], "--params"),
    cli("memory-params-and-model", ["memory", "--params", "7e9", "--model", "7b"], "--model"),
    cli("memory-params-and-set", ["memory", "--params", "7e9", "--set", "num_layers=2"], "--set"),
    cli("memory-set-not-a-model-key", ["memory", "--set", "precision=fp32"], "--set"),
    cli("memory-set-bad-shape", ["memory", "--set", "nhead=5"], "nhead"),
    cli("memory-unknown-model", ["memory", "--model", "llama2-8b"], "--model"),
    cli("params-hf-config-missing", ["params", "--hf-config", str(HF / "missing.json")], "--hf-config"),
    cli("memory-hf-config-not-json", ["memory", "--hf-config", str(HF / "bad-not-json.json")], "--hf-config"),
    cli("plan-hf-config-moe", [*PLAN[:1], "--hf-config", str(HF / "bad-mixtral.json"), *PLAN[3:], "--gpus", "8"],
        "model_type"),
    cli("comm-hf-config-heads", ["comm", "--hf-config", str(HF / "bad-heads.json")], "num_attention_heads"),
    cli("memory-hf-config-and-model", ["memory", "--hf-config", str(HF / "gpt2.json"), "--model", "7b"],
        "--hf-config"),
    cli("memory-group-size-not-dividing", ["memory", "--strategy", "HYBRID_SHARD", "--shard-group-size", "3",
                                           "--world-size", "8"], "--shard-group-size"),
    cli("memory-group-size-0", ["memory", "--strategy", "HYBRID_SHARD", "--shard-group-size", "0"],
        "--shard-group-size"),
    cli("memory-micro-batch-alone", ["memory", "--model", "7b", "--micro-batch", "1"], "--seq-len"),
    cli("memory-seq-len-alone", ["memory", "--model", "7b", "--seq-len", "128"], "--micro-batch"),
    cli("memory-micro-batch-negative", ["memory", "--micro-batch", "-1", "--seq-len", "10"], "--micro-batch"),
    cli("memory-world-size-0", ["memory", "--world-size", "0"], "--world-size"),
    cli("memory-world-size-text", ["memory", "--world-size", "eight"], "--world-size"),
    cli("memory-unknown-strategy", ["memory", "--strategy", "ZERO4"], "--strategy"),
    cli("memory-unknown-precision", ["memory", "--precision", "fp8"], "--precision"),
    cli("memory-unknown-optimizer", ["memory", "--optimizer", "lion"], "--optimizer"),
    cli("memory-none-on-8-ranks", ["memory", "--strategy", "NONE", "--world-size", "8"], "--world-size"),
    cli("memory-ac-without-activations", ["memory", "--activation-checkpointing"], "--activation-checkpointing"),
    # --- comm ---------------------------------------------------------------------------------
    cli("comm-no-model", ["comm"], "--params"),
    cli("comm-unknown-link", ["comm", "--params", "1e6", "--link", "carrier-pigeon"], "--link"),
    cli("comm-gpu-without-tokens", ["comm", "--params", "1e6", "--gpu", "h100-80gb"], "--tokens"),
    cli("comm-tokens-without-gpu", ["comm", "--params", "1e6", "--tokens", "100"], "--gpu"),
    cli("comm-unknown-gpu", ["comm", "--params", "1e6", "--gpu", "tpu-v5"], "--gpu"),
    cli("comm-tokens-negative", ["comm", "--params", "1e6", "--tokens", "-1"], "--tokens"),
    cli("comm-group-size-not-hybrid", ["comm", "--params", "1e6", "--shard-group-size", "2"], "--shard-group-size"),
    cli("comm-group-size-not-dividing", ["comm", "--params", "1e6", "--strategy", "HYBRID_SHARD",
                                         "--shard-group-size", "3"], "--shard-group-size"),
    cli("comm-world-size-0", ["comm", "--params", "1e6", "--world-size", "0"], "--world-size"),
    cli("comm-unknown-strategy", ["comm", "--params", "1e6", "--strategy", "ZeRO-3"], "--strategy"),
    cli("comm-unknown-precision", ["comm", "--params", "1e6", "--precision", "fp64"], "--precision"),
    # --- plan ---------------------------------------------------------------------------------
    cli("plan-no-model", ["plan", "--gpu", "h100-80gb", "--gpus", "8"], "--model"),
    cli("plan-unknown-model", ["plan", "--model", "llama9", "--gpu", "h100-80gb", "--gpus", "8"], "--model"),
    cli("plan-unknown-gpu", ["plan", "--model", "7b", "--gpu", "h100", "--gpus", "8"], "--gpu"),
    cli("plan-gpus-0", [*PLAN, "--gpus", "0"], "--gpus"),
    cli("plan-gpus-negative", [*PLAN, "--gpus", "-8"], "--gpus"),
    cli("plan-gpus-fraction", [*PLAN, "--gpus", "1.5"], "--gpus"),
    cli("plan-headroom-1.5", [*PLAN, "--gpus", "8", "--headroom", "1.5"], "--headroom"),
    cli("plan-headroom-nan", [*PLAN, "--gpus", "8", "--headroom", "nan"], "--headroom"),
    cli("plan-seq-len-0", [*PLAN, "--gpus", "8", "--seq-len", "0"], "--seq-len"),
    cli("plan-micro-batch-0", [*PLAN, "--gpus", "8", "--micro-batch", "0"], "--micro-batch"),
    cli("plan-unknown-link", [*PLAN, "--gpus", "16", "--inter-link", "ethernet"], "--inter-link"),
    cli("plan-unknown-precision", [*PLAN, "--gpus", "8", "--precision", "fp64"], "--precision"),
    cli("plan-loss-chunks-3", [*PLAN, "--gpus", "8", "--loss-chunks", "3"], "--loss-chunks"),
    cli("plan-loss-chunks-with-tp", [*PLAN, "--gpus", "16", "--loss-chunks", "2", "--tp-size", "8"], "--loss-chunks"),
    cli("memory-loss-chunks-no-tokens", ["memory", "--loss-chunks", "4"], "--loss-chunks"),
    cli("memory-loss-chunks-3", ["memory", "--micro-batch", "1", "--seq-len", "64", "--loss-chunks", "3"],
        "--loss-chunks"),
    cli("memory-loss-chunks-with-tp", ["memory", "--model", "7b", "--world-size", "8", "--micro-batch", "1",
                                       "--seq-len", "64", "--loss-chunks", "2", "--tp-size", "2"], "--loss-chunks"),
    cli("run-loss-chunks-0", [*RUN, "--set", "loss_chunks=0"], "loss_chunks"),
    cli("run-loss-chunks-not-dividing", [*RUN, "--set", "loss_chunks=3"], "loss_chunks"),
    cli("run-loss-chunks-with-tp", ["run", "tensor_parallel", "--quiet", "--nproc", "2", "--set", "tp_size=2",
                                    "--set", "loss_chunks=2"], "loss_chunks"),
    cli("run-set-to-none-not-a-bool", [*RUN, "--set", "set_to_none=maybe"], "set_to_none"),
    cli("run-set-to-none-with-tp", ["run", "tensor_parallel", "--quiet", "--nproc", "2", "--set", "tp_size=2",
                                    "--set", "set_to_none=true"], "set_to_none"),
    cli("run-set-to-none-deepspeed", ["run", "deepspeed_zero", "--quiet", "--nproc", "2", "--set",
                                      "set_to_none=true"], "set_to_none"),
    cli("plan-shard-group-12", [*PLAN, "--gpus", "64", "--shard-group-size", "12"], "--shard-group-size"),
    cli("plan-shard-group-one-node", [*PLAN, "--gpus", "8", "--shard-group-size", "8"], "--shard-group-size"),
    cli("plan-shard-group-negative", [*PLAN, "--gpus", "64", "--shard-group-size", "-8"], "--shard-group-size"),
    cli("plan-checkpointing-none", [*PLAN, "--gpus", "8", "--activation-checkpointing", "none"],
        "--activation-checkpointing"),
    cli("plan-ac-save-without-selective", [*PLAN, "--gpus", "8", "--ac-save", "matmul"], "--ac-save"),
    cli("plan-ac-matmul-every-full", [*PLAN, "--gpus", "8", "--ac-matmul-every", "2"], "--ac-matmul-every"),
    cli("plan-ac-every-0", [*PLAN, "--gpus", "8", "--ac-every", "0"], "--ac-every"),
    cli("plan-selective-with-tp", [*PLAN, "--gpus", "16", "--activation-checkpointing", "selective",
                                   "--tp-size", "8"], "--activation-checkpointing"),
    cli("plan-shard-group-with-tp", [*PLAN, "--gpus", "16", "--shard-group-size", "8", "--tp-size", "8"],
        "--shard-group-size"),
    # --- params -------------------------------------------------------------------------------
    cli("params-bad-nhead", ["params", "--set", "nhead=5"], "nhead"),
    cli("params-zero-layers", ["params", "--set", "num_layers=0"], "num_layers"),
    cli("params-text-width", ["params", "--set", "d_model=wide"], "d_model"),
    cli("params-set-without-equals", ["params", "--set", "num_layers"], "--set"),
    cli("params-unknown-key", ["params", "--set", "layers=2"], "layers"),
    cli("params-run-key", ["params", "--set", "steps=3"], "--set"),
    cli("params-unknown-model", ["params", "--model", "gpt5"], "--model"),
    cli("params-model-and-set", ["params", "--model", "7b", "--set", "num_layers=2"], "--set"),
    # --- the command line itself --------------------------------------------------------------
    cli("no-command", [], "command"),
    cli("unknown-command", ["train"], "train"),
    cli("runs-extra-argument", ["runs", "fsdp_train"], "fsdp_train"),
    # --- run: refused before torchrun starts --------------------------------------------------
    cli("run-unknown-name", ["run", "fsdp-train"], "available runs"),
    cli("run-nproc-0", [*RUN, "--nproc", "0"], "--nproc"),
    cli("run-nproc-negative", [*RUN, "--nproc", "-2"], "--nproc"),
    cli("run-timeout-0", [*RUN, "--timeout", "0"], "--timeout"),
    cli("run-timeout-nan", [*RUN, "--timeout", "nan"], "--timeout"),
    cli("run-timeout-inf", [*RUN, "--timeout", "inf"], "--timeout"),
    cli("run-set-without-equals", [*RUN, "--set", "steps"], "--set"),
    cli("run-unknown-key", [*RUN, "--set", "stepz=3"], "stepz"),
    cli("run-steps-0", [*RUN, "--set", "steps=0"], "steps"),
    cli("run-unknown-strategy", [*RUN, "--set", "strategy=ZERO4"], "strategy"),
    cli("run-batch-not-divisible", [*RUN, "--nproc", "3"], "batch_size"),
    cli("run-out-is-a-file", [*RUN, "--out", "/dev/null"], "--out"),
    cli("run-out-under-a-file", [*RUN, "--out", "/dev/null/result"], "--out"),
    cli("step-time-one-rank", ["run", "step_time", "--nproc", "1", "--quiet"], "nproc"),
    cli("step-time-variants", ["run", "step_time", "--set", "variants=FULL_SHARD,DDP"], "variants"),
    cli("step-time-bf16", ["run", "step_time", "--set", "precision=bf16-mixed"], "precision"),
    cli("comm-bench-one-rank", ["run", "comm_bench", "--nproc", "1"], "nproc"),
    cli("comm-bench-sizes", ["run", "comm_bench", "--set", "min_bytes=10", "--set", "max_bytes=5"], "min_bytes"),
    cli("fault-rank-out-of-range", ["run", "fault", "--nproc", "2", "--set", "fail_rank=2"], "fail_rank"),
    cli("fault-unknown-mode", ["run", "fault", "--set", "mode=explode"], "mode"),
    cli("run-lr-inf", [*RUN, "--set", "lr=inf"], "lr"),
    cli("run-lr-nan", [*RUN, "--set", "lr=nan"], "lr"),
    cli("run-lr-negative", [*RUN, "--set", "lr=-0.1"], "lr"),
    cli("run-batch-size-text", [*RUN, "--set", "batch_size=eight"], "batch_size"),
    cli("run-bool-maybe", [*RUN, "--set", "activation_checkpointing=maybe"], "activation_checkpointing"),
    cli("run-unknown-api", [*RUN, "--set", "api=fsdp3"], "api"),
    cli("run-none-on-2-ranks", [*RUN, "--set", "strategy=NONE"], "NONE"),
    cli("run-ddp-offload", [*RUN, "--set", "strategy=DDP", "--set", "cpu_offload=true"], "cpu_offload"),
    cli("run-nproc-text", [*RUN, "--nproc", "two"], "--nproc"),
    # --- the Python API -----------------------------------------------------------------------
    api("api-memory-inf-params", _memory(math.inf, 8), "model"),
    api("api-memory-world-0", _memory(1000, 0), "world_size"),
    api("api-memory-strategy", _memory(1000, 8, "ZERO4"), "strategy"),
    api("api-memory-precision", _memory(1000, 8, precision="fp8"), "precision"),
    api("api-memory-optimizer", _memory(1000, 8, optimizer="lion"), "optimizer"),
    api("api-memory-micro-batch-alone", _memory(1000, 8, micro_batch=1), "seq_len"),
    api("api-memory-ddp-offload", _memory(1000, 8, "DDP", cpu_offload=True), "cpu_offload"),
    api("api-memory-negative-params", _memory(-1, 8), "model"),
    api("api-runs-unknown-config", later("handbook_lib.runs", "run_config_fields", "fsdp-train"), "available runs"),
    api("api-plan-gpus-per-node-0", _plan(gpus=16, gpus_per_node=0), "gpus_per_node"),
    api("api-plan-gpus-per-node-3", _plan(gpus=16, gpus_per_node=3), "gpus_per_node"),
    api("api-plan-gpus-0", _plan(gpus=0), "gpus"),
    api("api-plan-headroom", _plan(headroom=1.5), "headroom"),
    api("api-plan-precision", _plan(precision="fp8"), "precision"),
    api("api-plan-micro-batch", _plan(micro_batch=0), "micro_batch"),
    api("api-plan-unknown-model", _plan(model="llama9"), "model"),
    api("api-plan-unknown-link", _plan(gpus=16, inter_link="ethernet"), "link"),
    api("api-plan-nics-per-node-0", _plan(gpus=16, nics_per_node=0), "nics_per_node"),
    api("api-plan-memory-0", _plan(memory_bytes=0), "memory_bytes"),
    api("api-plan-reserve-1", _plan(reserve_fraction=1.0), "fraction"),
    api("api-plan-utilization-0", _plan(utilization=0.0), "utilization"),
    api("api-plan-cpu-speed-0", _plan(cpu_params_per_s_per_core=0.0), "cpu_params_per_s_per_core"),
    api("api-traffic-group-not-hybrid", _traffic(shard_group_size=2), "shard_group_size"),
    api("api-shape-unknown", later("handbook_lib.models", "get_shape", "gpt5"), "model"),
    api("api-link-unknown", later("handbook_lib.models", "get_link", "carrier-pigeon"), "link"),
    api("api-gpu-unknown", later("handbook_lib.models", "get_accelerator", "tpu"), "accelerator"),
    api("api-config-steps-0", later("handbook_lib.core", "RunConfig", steps=0), "steps"),
    api("api-config-unknown-key", lambda: __import__("handbook_lib.core").core.RunConfig.from_mapping(
        {"stepz": 3}), "stepz"),
    api("api-overrides-no-equals", later("handbook_lib.core", "parse_overrides", ["steps"]), "--set"),
    api("api-compute-time-no-flops", later("handbook_lib.models", "estimate_compute_time", 10**9, 100, 0.0),
        "peak_flops"),
    api("api-torchrun-unknown-run", _torchrun("fsdp-train"), "available runs"),
    api("api-torchrun-nproc-0", _torchrun("fault", 0), "nproc"),
    api("api-torchrun-timeout-0", _torchrun("fault", 2, timeout_s=0), "timeout_s"),
    api("api-torchrun-unknown-key", _torchrun("fault", 2, {"bogus": 1}), "bogus"),
    # --- strict model input: a config.json read as Transformers types it; every model form ------
    cli("params-hf-config-tie-string", ["params", "--hf-config", str(HF / "bad-tie-string.json")],
        "tie_word_embeddings"),
    cli("memory-hf-config-mlp-bias-string", ["memory", "--hf-config", str(HF / "bad-mlp-bias-string.json")],
        "mlp_bias"),
    cli("params-hf-config-misspelt-key", ["params", "--hf-config", str(HF / "bad-misspelt-layers.json")],
        "did you mean num_hidden_layers?"),
    cli("plan-hf-config-layers-huge", [*PLAN[:1], "--hf-config", str(HF / "bad-layers-huge.json"), *PLAN[3:],
                                       "--gpus", "8"], "num_hidden_layers"),
    cli("params-hf-config-dev-zero", ["params", "--hf-config", "/dev/zero"], "not a regular file"),
    cli("params-hf-config-folder", ["params", "--hf-config", str(HF)], "not a regular file"),
    cli("params-hf-config-not-utf8", ["params", "--hf-config", str(HF / "bad-not-utf8.json")], "not UTF-8"),
    cli("plan-hf-config-moe-architecture", [*PLAN[:1], "--hf-config", str(HF / "bad-moe-architecture.json"),
                                            *PLAN[3:], "--gpus", "8"], "architectures"),
    cli("comm-hf-config-gemma", ["comm", "--hf-config", str(HF / "bad-gemma.json")], "model_type 'gemma2'"),
    api("api-param-count-preset-name", later("handbook_lib.core", "param_count", "llama2-7b"), "get_shape"),
    api("api-param-count-hf-dict", later("handbook_lib.core", "param_count", {"model_type": "llama"}),
        "decoder_shape_from_hf"),
    api("api-param-shapes-decoder", lambda: __import__("handbook_lib.core").core.param_shapes(
        __import__("handbook_lib.models").models.get_shape("7b")), "param_shapes takes a ModelConfig"),
    api("api-hf-dict-tie-string", later("handbook_lib.models", "decoder_shape_from_hf",
                                        {"model_type": "qwen2", "tie_word_embeddings": "false"}),
        "tie_word_embeddings"),
    api("api-decoder-shape-layers", later("handbook_lib.models", "DecoderShape", "deep", 10**12, 4096, 32),
        "DecoderShape.num_layers"),
    api("api-model-config-layers", later("handbook_lib.core", "ModelConfig", num_layers=10**12),
        "ModelConfig.num_layers"),
    # --- end of strict model input ----------------------------------------------------------------
    # --- numbers, resources and the poor list ---------------------------------------------------
    # every number typed as text is read by one parser per type, which names the accepted range
    cli("set-int-with-a-point", [*RUN, "--set", "steps=3.0"], "--set steps=3.0: steps takes a whole number >= 1"),
    cli("set-int-in-exponent-form", [*RUN, "--set", "steps=1e1"], "steps takes a whole number >= 1"),
    cli("set-int-empty", [*RUN, "--set", "steps="], "--set steps=: steps takes a whole number >= 1"),
    cli("set-int-garbled", [*RUN, "--set", "steps=1e-3x"], "steps takes a whole number >= 1"),
    cli("set-float-garbled", [*RUN, "--set", "lr=1e-3x"], "--set lr=1e-3x: lr takes a finite number > 0"),
    cli("set-float-empty", [*RUN, "--set", "lr="], "lr takes a finite number > 0"),
    cli("set-bool-text", [*RUN, "--set", "cpu_offload=maybe"], "cpu_offload takes a boolean, true or false"),
    cli("set-model-key-with-a-point", ["params", "--set", "num_layers=2.5"], "--set num_layers=2.5: num_layers takes"),
    cli("set-key-twice", [*RUN, "--set", "steps=3", "--set", "steps=4"], "--set steps given twice"),
    cli("params-set-key-twice", ["params", "--set", "num_layers=2", "--set", "num_layers=3"],
        "--set num_layers given twice"),
    cli("run-nproc-with-a-point", [*RUN, "--nproc", "3.0"], "--nproc: must be a whole number >= 1, got '3.0'"),
    cli("memory-world-size-exponent", ["memory", "--world-size", "1e1"], "--world-size: must be a whole number"),
    cli("memory-params-empty", ["memory", "--params", ""], "--params: must be a whole number of parameters"),
    cli("run-timeout-garbled", [*RUN, "--timeout", "1e-3x"], "--timeout: must be a finite number > 0"),
    cli("plan-headroom-empty", [*PLAN, "--gpus", "8", "--headroom", ""], "--headroom: must be a number in [0, 1)"),
    cli("slurm-port-out-of-range", ["slurm", "fsdp_train", "--nodes", "1", "--gpus-per-node", "1", "--port", "70000"],
        "--port: must be a whole number in [1, 65536)"),
    # the poor list: each refused in one line before anything starts
    cli("run-rdzv-port-out-of-range", [*RUN, "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint",
                                       "127.0.0.1:99999"], "--rdzv-endpoint: must be HOST:PORT with a TCP port"),
    api("api-rdzv-port-out-of-range", _torchrun("fault", 1, {"mode": "none"}, nnodes=2, node_rank=0,
                                                rdzv_endpoint="127.0.0.1:99999"), "(port 1-65535)"),
    cli("slurm-output-read-only", ["slurm", "fsdp_train", "--nodes", "1", "--gpus-per-node", "1", "--output",
                                   "/sys/handbook-fsdp_train.sbatch"], "--output /sys/handbook-fsdp_train.sbatch: cannot be written"),
    api("api-device-gpu-without-a-gpu", _torchrun("fault", 2, {"mode": "none"},
                                                  env={"HANDBOOK_DEVICE": "gpu", "CUDA_VISIBLE_DEVICES": ""}),
        "HANDBOOK_DEVICE=gpu runs on GPUs only"),
    cli("plan-sp-method-without-sp-size", [*PLAN, "--gpus", "8", "--sp-method", "ring"], "--sp-size"),
    cli("memory-gpu-unknown", ["memory", "--gpu", "h900"], "argument --gpu: invalid choice: 'h900'"),
    cli("run-name-with-escapes", ["run", "fsdp\n\x1b[31mtrain"], "'fsdp\\n\\x1b[31mtrain'"),
    cli("hf-config-path-with-an-escape", ["params", "--hf-config", "no\x1b[2J.json"], "no\\x1b[2J.json"),
    # resources: checked against this machine before anything starts (--force-resources goes ahead)
    # one rank more than launch.preflight.RANKS_PER_CORE (8) per core of this machine
    cli("run-more-ranks-than-cores-hold", ["run", "fault", "--quiet", "--nproc", str(8 * len(os.sched_getaffinity(0)) + 1)],
        "per core"),
    cli("run-model-larger-than-memory", [*RUN, "--set", "d_model=65536", "--set", "nhead=4"],
        "of host memory by its own prediction"),
    cli("comm-bench-buffers-larger-than-memory", ["run", "comm_bench", "--quiet", "--set", "max_bytes=1000000000000"],
        "of host memory by its own prediction"),
    api("api-torchrun-more-ranks-than-cores-hold", _torchrun("fault", 8 * len(os.sched_getaffinity(0)) + 1,
                                                             {"mode": "none"}), "per core"),
    api("api-torchrun-benchmark-larger-than-memory", _torchrun("comm_bench", 2, {"max_bytes": 10**12}),
        "of host memory by its own prediction"),
    api("api-torchrun-force-resources-not-bool", _torchrun("fault", 2, {"mode": "none"}, force_resources="yes"),
        "force_resources"),
]
"""The planning-command, CLI and API rows (part B of issue 12)."""

ALL_ROWS: list[BadInputRow] = ROWS + list(RUN_ROWS)


@dataclass
class Outcome:
    """What one row did."""

    exit_code: int | None = None
    raised: BaseException | None = None
    message: str = ""
    """stderr (CLI rows) or the exception's text (API rows)."""
    traceback: bool = False
    """An exception escaped a CLI call, or a raw traceback was printed."""


def _substitute(argv: list[str], folder: Path) -> list[str]:
    return [str(folder) if a == TMP else a.replace(TMP, str(folder)) for a in argv]


def run_row(row: BadInputRow, folder: Path) -> Outcome:
    """Run one row with ``folder`` as the current directory; capture what it says."""
    from handbook_lib.face import main

    out, err = io.StringIO(), io.StringIO()
    outcome = Outcome()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        if row.argv is not None:
            try:
                outcome.exit_code = main(_substitute(row.argv, folder))
            except SystemExit as stop:  # argparse's way out; main should return instead
                outcome.exit_code = stop.code if isinstance(stop.code, int) else 1
            except Exception:  # noqa: BLE001 - an escaped exception is what we classify as bad
                traceback.print_exc()
                outcome.traceback = True
            outcome.message = err.getvalue()
        else:
            call = row.call
            try:
                call(folder) if len(inspect.signature(call).parameters) == 1 else call()
            except BaseException as exc:  # noqa: BLE001 - the exception is the outcome
                outcome.raised = exc
                outcome.message = str(exc)
    # A raw traceback is one that comes before (or instead of) the one-line diagnosis. A failed
    # run's message may go on, after the diagnosis, with a labelled section quoting the failing
    # rank's traceback ("--- traceback of rank 1 ---"): that is the launcher's report, not raw.
    if "Traceback (most recent call last)" in outcome.message.split("\n--- ")[0]:
        outcome.traceback = True
    return outcome


def problems(row: BadInputRow, outcome: Outcome) -> tuple[str, list[str]]:
    """Classify an outcome: ``("clear" | "poor" | "bad", [what is wrong])``."""
    wrong = []
    if row.argv is not None:
        if outcome.traceback or outcome.exit_code != row.exit_code:
            wrong.append(f"exit code {outcome.exit_code} (expected {row.exit_code})"
                         + (", with a traceback" if outcome.traceback else ""))
    elif outcome.raised is None or not isinstance(outcome.raised, row.raises):
        wrong.append(f"raised {type(outcome.raised).__name__ if outcome.raised else 'nothing'} "
                     f"(expected {row.raises.__name__})")
    if wrong:
        return "bad", wrong + [f"said: {outcome.message.strip()[:300]!r}"]
    first = outcome.message.strip().splitlines()[0] if outcome.message.strip() else ""
    if row.fragment not in outcome.message:
        wrong.append(f"message lacks {row.fragment!r}: {first[:300]!r}")
    if len(first) >= MAX_FIRST_LINE:
        wrong.append(f"first line is {len(first)} characters: {first[:300]!r}")
    return ("poor" if wrong else "clear"), wrong


def _listing(folder: Path) -> dict[str, float | None]:
    """Names in ``folder`` with the modification time of each file (None for a folder, whose
    time changes whenever anything below it is written, e.g. a ``__pycache__``)."""
    if not folder.is_dir():
        return {}
    return {p.name: (p.stat().st_mtime if p.is_file() else None) for p in folder.iterdir()}


XFAIL: dict[str, str] = {}
"""Rows still failing in the other half's files, by id, with the reason (strict: once fixed, the
mark must go)."""


def _params(rows: list[BadInputRow]):
    mine = {r.id for r in ROWS}
    return [pytest.param(row, id=row.id if i < len(ROWS) or row.id not in mine else f"runs-{row.id}",
                         marks=[pytest.mark.xfail(strict=True, reason=XFAIL[row.id])] if row.id in XFAIL else [])
            for i, row in enumerate(rows)]


@pytest.mark.parametrize("row", _params(ALL_ROWS))
def test_bad_input_is_refused_clearly(row: BadInputRow, tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "cwd"
    folder.mkdir()
    monkeypatch.chdir(folder)
    before_children = {p.pid for p in psutil.Process().children(recursive=True)}
    repo_before, notebooks_before = _listing(REPO), _listing(REPO / "notebooks")

    outcome = run_row(row, folder)

    verdict, wrong = problems(row, outcome)
    assert verdict == "clear", f"{row.id}: {verdict}: " + "; ".join(wrong)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before_children]
    psutil.wait_procs(left, timeout=10)
    alive = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"{row.id}: processes left alive: {[p.pid for p in alive]}"
    out_inside = row.argv is not None and any(TMP in a for a in row.argv)
    if not out_inside:
        assert list(folder.iterdir()) == [], f"{row.id}: files left in the current directory"
    assert _listing(REPO) == repo_before, f"{row.id}: the repository's top level changed"
    assert _listing(REPO / "notebooks") == notebooks_before, f"{row.id}: notebooks/ changed"


def test_the_table_is_large_enough_and_fast() -> None:
    assert len(ALL_ROWS) >= 60
    assert sum(r.argv is not None for r in ROWS) >= 60  # CLI rows of part B alone
    assert len({r.id for r in ROWS}) == len(ROWS), "row ids must be unique"
    assert sum(r.launches for r in ALL_ROWS) <= 3, "at most 3 rows may start a real job"
    assert all(isinstance(r, BadInputRow) for r in ALL_ROWS)


def classify_all(rows: list[BadInputRow] | None = None) -> dict[str, list[tuple[str, list[str]]]]:
    """Run every row (each in a fresh temporary directory) and group the ids by verdict."""
    import tempfile

    groups: dict[str, list[tuple[str, list[str]]]] = {"clear": [], "poor": [], "bad": []}
    home = os.getcwd()
    for row in rows if rows is not None else ALL_ROWS:
        with tempfile.TemporaryDirectory() as tmp:
            os.chdir(tmp)
            try:
                verdict, wrong = problems(row, run_row(row, Path(tmp)))
            finally:
                os.chdir(home)
        groups[verdict].append((row.id, wrong))
    return groups


if __name__ == "__main__":
    counts = classify_all()
    for verdict in ("poor", "bad"):
        for row_id, wrong in counts[verdict]:
            print(f"{verdict:5s} {row_id}: {'; '.join(wrong)}"[:400])
    print(", ".join(f"{len(v)} {k}" for k, v in counts.items()) + f" (of {len(ALL_ROWS)} rows)")
    sys.exit(0 if not counts["poor"] and not counts["bad"] else 1)
