"""Bad inputs of part A of issue 12: the launcher, the ``run`` command, run configs, checkpoints.

``ROWS`` is imported by ``tests/test_bad_inputs.py``, which runs each row in a fresh, empty
current directory (``TMP`` in an argv names it) and checks the exit code or exception, that the
fragment (the flag or config key at fault) is in the message, that no process is left and no
file outside the row's folder is touched. Every row is refused before torchrun starts, except
the one marked ``launches`` (a NaN loss is only seen at run time).
"""

from __future__ import annotations

import math
from pathlib import Path

from handbook_lib.core import ModelConfig
from tests.bad_input_row import TMP, BadInputRow, api, cli, later

RUN = ["run", "fsdp_train", "--quiet"]
CKPT = ["run", "checkpoint_resume", "--quiet"]
TINY = ["--set", "vocab_size=101", "--set", "d_model=16", "--set", "nhead=2", "--set", "dim_feedforward=24",
        "--set", "num_layers=1", "--set", "seq_len=8"]


def _torchrun(*args, **kwargs):
    return later("handbook_lib.launch", "torchrun", *args, **kwargs)


def _torchrun_out_parent(folder: Path):
    """``out`` at the row folder's parent: not empty (it holds the row's folder), no run marker."""
    from handbook_lib.launch import torchrun

    return torchrun("fault", 2, {"mode": "none"}, out=folder.parent, overwrite=True)


def _overwrite_a_runs_folder_holding_a_users_files():
    """An earlier run's folder (its manifest lists config.json) into which the user put
    ``logs/MY_NOTES.txt``: overwrite refuses it, naming the file (the folder is removed after)."""
    import tempfile

    from handbook_lib.launch import torchrun
    from handbook_lib.launch.outdir import prepare_out_dir

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        claimed = prepare_out_dir("fault", out)
        (out / "config.json").write_text("{}")
        claimed.release()
        (out / "logs").mkdir()
        (out / "logs" / "MY_NOTES.txt").write_text("mine")
        return torchrun("fsdp_train", 2, {"steps": 3}, out=out, overwrite=True)


def _config(**values):
    return later("handbook_lib.core", "RunConfig.from_mapping", values)


def _memory(*args, **kwargs):
    return later("handbook_lib.models", "estimate_memory", *args, **kwargs)


def _load_missing_checkpoint(folder: Path):
    from handbook_lib.core import ModelConfig
    from handbook_lib.runtime import build_model, load_checkpoint

    model = build_model(ModelConfig(vocab_size=11, d_model=8, nhead=2, dim_feedforward=8, num_layers=1))
    return load_checkpoint(folder / "no-such-checkpoint", model)


def _validate_file_as_checkpoint():
    from handbook_lib.runtime import validate_checkpoint

    return validate_checkpoint("/dev/null")


def _ckpt_dir_of_another_job(folder: Path):
    """A d_model=128 job launched, resuming if present, into the ``ckpt_dir`` that a d_model=64
    job's first save recorded as its own."""
    from handbook_lib.launch import torchrun
    from handbook_lib.runtime.checkpoint_job import claim_job, job_identity

    shape = {"vocab_size": 101, "nhead": 2, "dim_feedforward": 24, "num_layers": 1}
    ckpt = folder.parent / "ck"  # beside the row's folder, which must stay empty
    ckpt.mkdir()
    claim_job(ckpt, job_identity("checkpoint_resume", ModelConfig(d_model=64, **shape), "adamw"))
    return torchrun("checkpoint_resume", 2, {**shape, "d_model": 128, "seq_len": 8, "ckpt_dir": str(ckpt),
                                             "save_every": 2, "resume": True, "resume_if_present": True},
                    out=folder / "out")


ROWS: list[BadInputRow] = [
    # --- issue 12, Bad 1: --out never wipes or shares a folder --------------------------------
    cli("run-out-not-empty-no-marker", ["run", "fault", "--quiet", "--out", f"{TMP}/.."], "--out"),
    cli("run-out-not-empty-overwrite", ["run", "fault", "--quiet", "--overwrite", "--out", f"{TMP}/.."], "--out"),
    cli("run-out-empty-string", ["run", "fault", "--quiet", "--out", ""], "--out"),
    cli("run-out-under-dev-null", ["run", "fault", "--quiet", "--out", "/dev/null/x/y"], "--out"),
    api("api-out-not-empty-no-marker", _torchrun_out_parent, "out (--out)"),
    api("api-out-is-a-file", _torchrun("fault", 2, {"mode": "none"}, out="/dev/null"), "out (--out)"),
    api("api-out-impossible", _torchrun("fault", 2, {"mode": "none"}, out="/proc/1/handbook"), "out (--out)"),
    api("api-out-not-a-path", _torchrun("fault", 2, {"mode": "none"}, out=3), "out (--out)"),
    api("api-overwrite-not-bool", _torchrun("fault", 2, {"mode": "none"}, overwrite="yes"), "overwrite"),
    # --- --out: overwrite removes only what a run wrote (its manifest) and refuses anything else
    api("api-out-overwrite-a-users-files", _overwrite_a_runs_folder_holding_a_users_files,
        "no run wrote (logs/MY_NOTES.txt)"),
    # --- issue 12, Poor: the launcher API -----------------------------------------------------
    api("api-timeout-none", _torchrun("fault", 2, {"mode": "none"}, timeout_s=None), "timeout_s"),
    api("api-timeout-nan", _torchrun("fault", 2, {"mode": "none"}, timeout_s=math.nan), "timeout_s"),
    api("api-timeout-text", _torchrun("fault", 2, {"mode": "none"}, timeout_s="10"), "timeout_s"),
    api("api-config-a-string", _torchrun("fault", 2, "mode=none"), "config"),
    api("api-config-a-list", _torchrun("fault", 2, [("mode", "none")]), "config"),
    api("api-env-int-value", _torchrun("fault", 2, {"mode": "none"}, env={"X": 1}), "env"),
    api("api-env-not-a-dict", _torchrun("fault", 2, {"mode": "none"}, env=["X=1"]), "env"),
    api("api-nproc-bool", _torchrun("fault", True), "nproc"),
    # --- issue 12, Bad 2: non-finite config values --------------------------------------------
    cli("run-grad-scale-inf", [*RUN, "--set", "grad_scale_init=inf"], "grad_scale_init"),
    cli("run-lr-infinity-word", [*RUN, "--set", "lr=Infinity"], "lr"),
    cli("run-lr-overflow", [*RUN, "--set", "lr=1e400"], "lr"),
    cli("fault-sleep-nan", ["run", "fault", "--quiet", "--set", "sleep_s=nan"], "sleep_s"),
    cli("ckpt-lr-nan", [*CKPT, "--set", f"ckpt_dir={TMP}/ck", "--set", "lr=nan"], "lr"),
    api("api-config-lr-inf", _config(lr=math.inf), "lr"),
    api("api-config-grad-scale-nan-text", _config(grad_scale_init="nan"), "grad_scale_init"),
    api("api-config-unknown-key-hint", _config(stepz=3), "did you mean 'steps'"),
    # a NaN loss at run time: the run fails (exit 1) naming the step, the rank and lr
    cli("run-loss-becomes-nan", [*RUN, *TINY, "--nproc", "2", "--set", "lr=1e6", "--set", "steps=3",
                                 "--out", f"{TMP}/run"], "lr", exit_code=1, launches=True),
    # --- issue 12, Bad 4: resume never starts over silently -----------------------------------
    cli("ckpt-resume-missing-dir", [*CKPT, "--set", f"ckpt_dir={TMP}/typo", "--set", "resume=true"], "ckpt_dir"),
    cli("ckpt-resume-empty-dir", [*CKPT, "--set", f"ckpt_dir={TMP}", "--set", "resume=true"], "resume_if_present"),
    cli("ckpt-resume-step-missing", [*CKPT, "--set", f"ckpt_dir={TMP}", "--set", "resume=true",
                                     "--set", "resume_step=4"], "step_000004"),
    cli("ckpt-if-present-without-resume", [*CKPT, "--set", f"ckpt_dir={TMP}/ck", "--set", "resume_if_present=true"],
        "resume_if_present"),
    cli("ckpt-no-ckpt-dir", CKPT, "ckpt_dir"),
    # --- issue 26, item 2: a path key that cannot be created is refused before anything starts
    cli("ckpt-dir-under-proc", [*CKPT, "--set", "ckpt_dir=/proc/handbook-x", "--set", "save_every=2"],
        "config key 'ckpt_dir'='/proc/handbook-x' cannot be created"),
    cli("ckpt-dir-a-file", [*CKPT, "--set", "ckpt_dir=/dev/null", "--set", "save_every=2"],
        "config key 'ckpt_dir'='/dev/null' is a file"),
    cli("ckpt-dir-under-a-file", [*CKPT, "--set", "ckpt_dir=/dev/null/ck", "--set", "save_every=2"],
        "config key 'ckpt_dir'='/dev/null/ck' cannot be created: /dev/null is a file"),
    cli("trainer-dir-under-proc", ["run", "trainer_deepspeed", "--nproc", "1", "--quiet", "--set",
                                   "trainer_dir=/proc/handbook-t"],
        "config key 'trainer_dir'='/proc/handbook-t' cannot be created"),
    cli("ckpt-resume-step-without-resume", [*CKPT, "--set", f"ckpt_dir={TMP}/ck", "--set", "resume_step=2"],
        "resume_step"),
    cli("ckpt-kill-in-save-without-save", [*CKPT, "--set", f"ckpt_dir={TMP}/ck", "--set", "kill_at_step=2",
                                           "--set", "kill_in_save=true"], "kill_in_save"),
    cli("ckpt-kill-step-out-of-range", [*CKPT, "--set", f"ckpt_dir={TMP}/ck", "--set", "kill_at_step=9"],
        "kill_at_step"),
    cli("ckpt-ddp", [*CKPT, "--set", f"ckpt_dir={TMP}/ck", "--set", "strategy=DDP"], "strategy"),
    cli("ckpt-offload", [*CKPT, "--set", f"ckpt_dir={TMP}/ck", "--set", "cpu_offload=true"], "cpu_offload"),
    cli("ckpt-resume-not-bool", [*CKPT, "--set", f"ckpt_dir={TMP}/ck", "--set", "resume=if-present"], "resume"),
    # issue 26: the whole job's state, preemption and node loss
    cli("ckpt-dataset-not-whole-batches", [*CKPT, "--set", f"ckpt_dir={TMP}/ck", "--set", "dataset_size=20"],
        "dataset_size"),
    cli("ckpt-preempt-signal-mid-save", [*CKPT, "--set", f"ckpt_dir={TMP}/ck", "--set", "save_every=2",
                                         "--set", "kill_at_step=2", "--set", "kill_in_save=true",
                                         "--set", "kill_signal=SIGTERM"], "kill_signal"),
    cli("ckpt-kill-node-without-step", [*CKPT, "--set", f"ckpt_dir={TMP}/ck", "--set", "kill_node=true"],
        "kill_at_step"),
    cli("ckpt-warmup-as-long-as-the-run", [*CKPT, "--set", f"ckpt_dir={TMP}/ck", "--set", "steps=3",
                                           "--set", "warmup_steps=3"], "warmup_steps"),
    cli("ckpt-unknown-schedule", [*CKPT, "--set", f"ckpt_dir={TMP}/ck", "--set", "lr_schedule=step"],
        "lr_schedule"),
    api("api-load-missing-checkpoint", _load_missing_checkpoint, "no checkpoint at",
        raises=RuntimeError),  # CheckpointError is a RuntimeError
    api("api-validate-a-file", _validate_file_as_checkpoint, "no checkpoint at", raises=RuntimeError),
    # --- issue 12, Bad 5 and 7: combinations the models cannot price --------------------------
    api("api-memory-none-offload", _memory(1000, 1, "NONE", cpu_offload=True), "cpu_offload"),
    cli("run-hybrid-one-replica-default", ["run", "fsdp_train", "--quiet", "--nproc", "3", "--set", "batch_size=9",
                                           "--set", "strategy=HYBRID_SHARD"], "shard_group_size"),
    cli("run-hybrid-one-replica-explicit", [*RUN, "--nproc", "2", "--set", "strategy=HYBRID_SHARD",
                                            "--set", "shard_group_size=2"], "shard_group_size"),
    cli("run-fsdp1-hybrid-zero2-one-replica", [*RUN, "--nproc", "2", "--set", "api=fsdp1",
                                               "--set", "strategy=HYBRID_SHARD_ZERO2"], "shard_group_size"),
    # --- issue 13: the one loop's levers, the build, the table's API rules --------------------
    cli("run-grad-accum-zero", [*RUN, "--set", "grad_accum_steps=0"], "grad_accum_steps"),
    cli("run-grad-accum-not-dividing", [*RUN, "--nproc", "2", "--set", "grad_accum_steps=3"], "grad_accum_steps"),
    cli("run-max-grad-norm-negative", [*RUN, "--set", "max_grad_norm=-1"], "max_grad_norm"),
    cli("run-optimizer-impl-unknown", [*RUN, "--set", "optimizer_impl=apex"], "default, for-loop, foreach, fused"),
    cli("run-fused-sgd-on-fsdp2", [*RUN, "--set", "optimizer=sgd-momentum", "--set", "optimizer_impl=fused"],
        "'optimizer_impl'='fused' cannot step sgd-momentum"),
    cli("memory-zero-offload-with-activations", ["memory", "--model", "7b", "--strategy", "ZERO3", "--micro-batch",
                                                 "1", "--seq-len", "2048", "--cpu-offload"],
        "--cpu-offload with --strategy ZERO3 and --micro-batch"),
    cli("memory-bucket-without-zero", ["memory", "--model", "7b", "--reduce-bucket-size", "1000"],
        "--reduce-bucket-size 1000 sizes DeepSpeed's gradient buckets: give --strategy ZERO1"),
    cli("plan-bucket-without-zero", ["plan", "--model", "7b", "--gpu", "h100-80gb", "--gpus", "8",
                                     "--reduce-bucket-size", "1000"], "--reduce-bucket-size 1000 sizes DeepSpeed's"),
    cli("memory-set-to-none-with-tp", ["memory", "--model", "7b", "--micro-batch", "1", "--seq-len", "2048",
                                       "--tp-size", "2", "--set-to-none"], "--set-to-none with --tp-size or --sp-size"),
    cli("memory-float8-fp32", ["memory", "--model", "7b", "--precision", "fp32", "--float8-all-gather"],
        "--float8-all-gather gathers float8 weights for bf16 compute"),
    cli("memory-float8-ddp", ["memory", "--model", "7b", "--strategy", "DDP", "--float8-all-gather"],
        "--float8-all-gather gathers float8 weights for bf16 compute"),
    cli("memory-zero-set-to-none", ["memory", "--model", "7b", "--strategy", "ZERO2", "--set-to-none"],
        "--set-to-none with --strategy ZERO2"),
    cli("plan-strategy-unknown", ["plan", "--model", "7b", "--gpu", "h100-80gb", "--gpus", "8", "--strategy",
                                  "ZERO4"], "argument --strategy: invalid choice: 'ZERO4'"),
    cli("memory-fused-sgd-on-fsdp2", ["memory", "--model", "7b", "--optimizer", "sgd", "--optimizer-impl", "fused"],
        "--optimizer-impl fused cannot step --optimizer sgd"),
    cli("plan-optimizer-impl-unknown", ["plan", "--model", "7b", "--gpu", "h100-80gb", "--gpus", "8",
                                        "--optimizer-impl", "apex"], "--optimizer-impl"),
    cli("plan-sync-without-accumulation", ["plan", "--model", "7b", "--gpu", "h100-80gb", "--gpus", "8",
                                           "--sync-every-micro-step"], "--sync-every-micro-step needs --grad-accum >= 2"),
    cli("plan-grad-accum-zero", ["plan", "--model", "7b", "--gpu", "h100-80gb", "--gpus", "8", "--grad-accum", "0"],
        "--grad-accum"),
    cli("plan-pure-bf16-beyond-fsdp", ["plan", "--model", "70b", "--gpu", "h100-80gb", "--gpus", "64",
                                       "--tp-size", "8", "--precision", "bf16"], "--precision bf16: the layouts beyond"),
    cli("run-pure-bf16-full-init", [*RUN, "--set", "precision=bf16", "--set", "init=full"], "init='meta'"),
    cli("run-ac-every-without-checkpointing", [*RUN, "--set", "ac_every=2"], "'ac_every'=2 checkpoints every k-th"),
    cli("run-ac-every-zero", [*RUN, "--set", "activation_checkpointing=full", "--set", "ac_every=0"], "ac_every"),
    cli("zero-bf16-offload", ["run", "deepspeed_zero", "--nproc", "2", "--set", "precision=bf16", "--set",
                              "cpu_offload=true"], "'precision'='bf16' with 'cpu_offload'=True"),
    cli("memory-zero-bf16-offload", ["memory", "--model", "7b", "--strategy", "ZERO3", "--precision", "bf16",
                                     "--cpu-offload"], "--precision bf16 with --cpu-offload"),
    cli("run-ac-matmul-every-with-full", [*RUN, "--set", "activation_checkpointing=full", "--set", "ac_matmul_every=2"],
        "'ac_matmul_every'=2 thins the selective policy's matrix products"),
    cli("run-ac-matmul-every-zero", [*RUN, "--set", "activation_checkpointing=selective", "--set", "ac_matmul_every=0"],
        "ac_matmul_every"),
    cli("run-hf-weights-kv-heads", ["run", "hf_weights", "--quiet", "--set", "save_dir=/tmp/handbook-never-made",
                                    "--set", "num_key_value_heads=3"],
        "num_key_value_heads=3 must divide num_attention_heads=4"),
    cli("memory-ac-save-without-selective", ["memory", "--model", "7b", "--micro-batch", "1", "--seq-len", "2048",
                                             "--activation-checkpointing", "full", "--ac-save", "matmul"],
        "--ac-save matmul chooses what the selective policy keeps"),
    cli("memory-ac-save-unknown", ["memory", "--model", "7b", "--ac-save", "products"], "--ac-save"),
    cli("run-ac-save-attention-thinned", [*RUN, "--set", "activation_checkpointing=selective", "--set",
                                          "ac_save=attention", "--set", "ac_matmul_every=2"],
        "'ac_matmul_every'=2 thins the kept matrix products"),
    cli("memory-ac-matmul-every-without-selective", ["memory", "--model", "7b", "--micro-batch", "1", "--seq-len",
                                                     "2048", "--activation-checkpointing", "full", "--ac-matmul-every",
                                                     "2"], "--ac-matmul-every 2 thins the selective policy's"),
    cli("memory-ac-every-without-checkpointing", ["memory", "--model", "7b", "--micro-batch", "1", "--seq-len", "2048",
                                                  "--ac-every", "2"], "--ac-every 2 checkpoints every K-th layer"),
    cli("plan-grad-accum-beyond-fsdp", ["plan", "--model", "70b", "--gpu", "h100-80gb", "--gpus", "64",
                                        "--sp-size", "8", "--grad-accum", "2"], "--grad-accum 2: the layouts beyond FSDP"),
    cli("plan-optimizer-impl-beyond-fsdp", ["plan", "--model", "70b", "--gpu", "h100-80gb", "--gpus", "16",
                                            "--tp-size", "8", "--optimizer-impl", "fused"],
        "--optimizer-impl fused: the layouts beyond FSDP"),
    cli("run-init-unknown", [*RUN, "--set", "init=lazy"], "meta, full"),
    cli("run-no-shard-fsdp2", [*RUN, "--nproc", "2", "--set", "strategy=NO_SHARD"], "api='fsdp2'"),
    api("api-accumulation-unknown-strategy", later("handbook_lib.models", "estimate_accumulation_bytes", 10, "ZERO4"),
        "strategy must be one of"),
    api("api-init-bytes-unknown-init", later("handbook_lib.models", "estimate_init_bytes", ModelConfig(), 2,
                                             "FULL_SHARD", "lazy"), "init must be one of meta, full"),
    # --- checkpoints: a ckpt_dir holds one job's saves (resumed or not, another shape is refused)
    api("api-ckpt-dir-of-another-job", _ckpt_dir_of_another_job, "d_model=128 here, 64 in its job.json"),
]
"""Part A's rows: the launcher, ``run``, run configs, checkpoints and resume."""
