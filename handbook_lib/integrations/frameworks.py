"""One run config, three frameworks' configs: Accelerate, the Transformers Trainer, DeepSpeed.

Chapter 7 uses it. A :class:`~handbook_lib.core.config.RunConfig` (what every run of this book
takes) names a strategy, a precision, the memory levers, the batch and its accumulation; this
module writes the same job in the words of the library that will run it:

- :func:`accelerate_config`: the ``accelerate launch --config_file`` YAML, as a dict;
- :func:`trainer_fsdp_args`: the ``fsdp`` / ``fsdp_config`` arguments of ``TrainingArguments``;
- :func:`deepspeed_config`: a DeepSpeed JSON config, as a dict;
- :func:`trainer_deepspeed_args`: ``TrainingArguments`` for the Trainer with that DeepSpeed config.

Pure: no ``torch``, no framework imported. Each function says what it cannot express and refuses
it, rather than writing a config that silently does something else; the tests hand each result to
the library that owns it (Accelerate's plugin, ``TrainingArguments``, DeepSpeed's config class)
and compare what that library understood with what the run config asked for.

The two FSDP writers target Accelerate 1.15 and Transformers 5.24 (the Trainer builds its FSDP
plugin with Accelerate), whose key names and defaults they follow; both refuse:

- a strategy that is not FSDP (``NONE``, ``DDP``, DeepSpeed's ``ZERO1``/``ZERO2``/``ZERO3``:
  :func:`deepspeed_config` writes those), one the API has not (FSDP2 has no ``NO_SHARD``), and
  the hybrid ones (their 2-D mesh is Accelerate's ``parallelism_config``, not written here);
- ``wrap="size"`` with FSDP2: Accelerate's FSDP2 size policy shards every module holding more
  than ``min_num_params`` parameters in all, children included, where the book's (FSDP1's
  ``size_based_auto_wrap_policy``) counts only those not already in a unit;
- ``activation_checkpointing`` with a ``wrap`` other than ``layer``: Accelerate checkpoints the
  modules its wrap policy selects, where the book checkpoints each transformer layer;
- a mixed precision, unless ``reduce_in_compute_dtype=True``: the run config reduces gradients
  in fp32 (:data:`~handbook_lib.core.config.PRECISIONS`), but Accelerate turns ``bf16``/``fp16`` into
  an FSDP policy with ``param_dtype`` and ``reduce_dtype`` both that dtype
  (``FullyShardedDataParallelPlugin.set_mixed_precision``), and neither its config file nor
  ``TrainingArguments`` can ask for another reduce dtype; with fp16 also a run without the
  loss scaler or with a first scale other than PyTorch's 2**16, which Accelerate always uses.

What no key of theirs changes, and so stays different whatever is written: Accelerate's FSDP2
shards the root with ``reshard_after_forward=None`` (PyTorch then keeps the root's parameters
gathered from forward to backward), where the book's FULL_SHARD reshards the root too.
"""

from __future__ import annotations

import math
from typing import Any

from handbook_lib.core.checks import check_int
from handbook_lib.core.config import PRECISIONS, RunConfig
from handbook_lib.core.strategies import STRATEGY_TABLE, Strategy, get_strategy

__all__ = ["LAYER_CLASS", "MACHINE_RANK_FLAG", "accelerate_config", "trainer_fsdp_args", "deepspeed_config",
           "trainer_deepspeed_args", "fsdp_strategies", "DEEPSPEED_STAGE3_DEFAULTS", "MEASUREMENT_OVERRIDES",
           "production_configs"]

LAYER_CLASS = "TransformerLayer"
"""The class FSDP wraps as a unit (:class:`handbook_lib.runtime.model.TransformerLayer`)."""

_TORCH_INIT_SCALE = 65536.0
"""``torch.amp.GradScaler``'s default ``init_scale`` (2**16): the first loss scale of the scaler
Accelerate builds for fp16 (with no ``GradScalerKwargs``, which a config file cannot give)."""

_WRAP_POLICY = {"layer": "TRANSFORMER_BASED_WRAP", "size": "SIZE_BASED_WRAP", "model": "NO_WRAP"}
"""``wrap`` → Accelerate's auto-wrap policy (``accelerate.utils.constants.FSDP_AUTO_WRAP_POLICY``).
``NO_WRAP`` shards the root alone: one unit holding every parameter, as ``wrap="model"``."""

_OPTIMIZERS = {"adamw": ("adamw_torch", 0.01, None), "adam": ("adamw_torch", 0.0, None),
               "sgd": ("sgd", 0.0, None), "sgd-momentum": ("sgd", 0.0, "momentum=0.9")}
"""``optimizer`` → the Trainer's ``(optim, weight_decay, optim_args)`` for the optimizer
:func:`handbook_lib.runtime.training.build_optimizer` builds: ``torch.optim.AdamW(lr)`` (weight decay
0.01, PyTorch's default), ``Adam(lr)`` (no weight decay: AdamW with none is the same update),
``SGD(lr)``, ``SGD(lr, momentum=0.9)``."""


ACCELERATE_FSDP1_DEFAULT = "FULL_SHARD"
"""The FSDP1 ``ShardingStrategy`` member Accelerate's plugin uses when the
``FSDP_SHARDING_STRATEGY`` environment variable is unset (the Trainer never sets it)."""


def fsdp_strategies(api: str) -> list[str]:
    """The strategies the FSDP writers accept with ``api``: FSDP, not hybrid, in that API."""
    return [row.name for row in STRATEGY_TABLE.values()
            if row.wrapper == "fsdp" and not row.hybrid and row.runs_with(api)]


def _refuse(what: str, key: str, value: Any, why: str, accepted: str) -> ValueError:
    return ValueError(f"{what}: config key {key!r} got {value!r}: {why}; accepted: {accepted}")


def _check_fsdp(config: RunConfig, what: str) -> Strategy:
    """The run's strategy row, after refusing what neither FSDP writer can express."""
    row = get_strategy(config.strategy)
    accepted = ", ".join(fsdp_strategies(config.api)) + f" (with api={config.api!r})"
    if row.wrapper != "fsdp":
        why = ("a DeepSpeed ZeRO stage, not FSDP (write it with deepspeed_config)" if row.wrapper == "deepspeed"
               else "not an FSDP strategy")
        raise _refuse(what, "strategy", row.name, why, accepted)
    if row.hybrid:
        raise _refuse(what, "strategy", row.name, "a hybrid strategy needs a 2-D (replicate, shard) mesh, "
                      "Accelerate's parallelism_config, which this writer does not write", accepted)
    if not row.runs_with(config.api):
        raise _refuse(what, "strategy", row.name, f"{config.api} has no {row.name} (use api='fsdp1')", accepted)
    if config.shard_group_size:
        raise _refuse(what, "shard_group_size", config.shard_group_size,
                      "only the hybrid strategies take a shard group", "0")
    if config.wrap == "size" and config.api == "fsdp2":
        raise _refuse(what, "wrap", config.wrap, "Accelerate's FSDP2 size policy shards every module of more "
                      "than min_num_params parameters, its children's included, where the book's (FSDP1's) "
                      "counts those not yet in a unit", "'layer', 'model'; 'size' with api='fsdp1'")
    if config.activation_checkpointing == "selective":
        raise _refuse(what, "activation_checkpointing", config.activation_checkpointing,
                      "Accelerate's fsdp_activation_checkpointing recomputes whole layers; the selective "
                      "policy is fsdp_train's", "'none', 'full'")
    if config.activation_checkpointing == "full" and config.wrap != "layer":
        raise _refuse(what, "wrap", config.wrap, "Accelerate checkpoints the modules its wrap policy selects; "
                      "the book checkpoints each transformer layer", "'layer' with activation_checkpointing")
    return row


def _mixed_precision(config: RunConfig, what: str, reduce_in_compute_dtype: bool) -> str:
    """Accelerate's ``mixed_precision`` (``no``, ``bf16``, ``fp16``) for the run's precision."""
    compute, reduce = PRECISIONS[config.precision]
    if compute == "fp32":
        return "no"
    if reduce != compute and not reduce_in_compute_dtype:
        raise _refuse(what, "precision", config.precision,
                      f"it reduces gradients in {reduce}, but Accelerate's mixed_precision={compute!r} makes FSDP "
                      f"reduce them in {compute} (param_dtype = reduce_dtype), and no key of its config asks "
                      "for another reduce dtype", f"'fp32'; {config.precision!r} with reduce_in_compute_dtype=True")
    if compute == "fp16":
        if not config.grad_scaler:
            raise _refuse(what, "grad_scaler", config.grad_scaler,
                          "Accelerate always scales the loss with fp16", "True")
        if config.grad_scale_init != _TORCH_INIT_SCALE:
            raise _refuse(what, "grad_scale_init", config.grad_scale_init,
                          "Accelerate's fp16 scaler starts at PyTorch's default", f"{_TORCH_INIT_SCALE}")
    return compute


_ACCELERATE_SPELLING = {"cpu_offload": "offload_params"}
"""Where Accelerate's config file names a setting of :func:`_fsdp_settings` otherwise than with
``fsdp_`` + the Trainer's key."""


def _fsdp_settings(config: RunConfig, row: Strategy) -> dict[str, Any]:
    """The FSDP settings both writers write, keyed as the Trainer's ``fsdp_config`` spells them
    (:func:`accelerate_config` prefixes each key with ``fsdp_``): version, wrap policy,
    ``reshard_after_forward``, sharded state dicts, offload, activation checkpointing, efficient
    loading; the wrapped class (``wrap="layer"``) or the size threshold (``"size"``); for FSDP1
    also module-state sync, flat parameters and ``BACKWARD_PRE`` prefetch, as the book's runs."""
    version = 2 if config.api == "fsdp2" else 1
    settings: dict[str, Any] = {
        "version": version,
        "auto_wrap_policy": _WRAP_POLICY[config.wrap],
        "reshard_after_forward": row.reshard_after_forward if version == 2 else row.fsdp1,
        "state_dict_type": "SHARDED_STATE_DICT",
        "cpu_offload": config.cpu_offload,
        "activation_checkpointing": config.activation_checkpointing == "full",
        "cpu_ram_efficient_loading": config.init == "meta",
    }
    if config.wrap == "layer":
        settings["transformer_layer_cls_to_wrap"] = LAYER_CLASS
    elif config.wrap == "size":
        settings["min_num_params"] = config.wrap_min_params
    if version == 1:
        settings.update(sync_module_states=config.init == "meta", use_orig_params=False,
                        backward_prefetch="BACKWARD_PRE", forward_prefetch=False)
    return settings


MACHINE_RANK_FLAG = "--machine_rank $SLURM_NODEID"
"""How each node says its own ``machine_rank`` to ``accelerate launch``: one file serves every
node (it writes 0), and the flag overrides it, since ``_validate_launch_command`` fills from the
file only the arguments the command line left unset. ``$SLURM_NODEID`` is Slurm's 0-based index
of the node in the job, as ``srun`` sets it in each node's task."""


def accelerate_config(config: RunConfig, *, num_processes: int, num_machines: int = 1,
                      main_process_ip: str | None = None, main_process_port: int = 29500,
                      machine_rank: int = 0, reduce_in_compute_dtype: bool = False) -> dict[str, Any]:
    """The ``accelerate launch --config_file`` file of an FSDP run, as a dict (write it with
    ``yaml.safe_dump``).

    ``fsdp_config`` holds: ``fsdp_version`` 2, or 1 when ``config.api`` is ``fsdp1``; the wrap
    policy (``wrap="layer"``: ``TRANSFORMER_BASED_WRAP`` of :data:`LAYER_CLASS`; ``"size"``:
    ``SIZE_BASED_WRAP`` with ``fsdp_min_num_params`` = ``wrap_min_params`` elements; ``"model"``:
    ``NO_WRAP``, the root alone); ``fsdp_reshard_after_forward`` from the strategy table (FSDP2:
    a bool); sharded state dicts; ``fsdp_offload_params`` (``cpu_offload``);
    ``fsdp_activation_checkpointing``; ``fsdp_cpu_ram_efficient_loading`` on when ``init`` is
    ``meta`` (a Transformers model is then loaded on rank 0 only, the other ranks start on the
    meta device, and Accelerate broadcasts rank 0's weights into the shards: the whole model is
    still in rank 0's host memory once, not in every rank's). For FSDP1 also
    ``fsdp_sharding_strategy`` (the one key ``accelerate launch`` turns into the plugin's
    strategy: it exports it, default ``FULL_SHARD``, and the plugin then ignores
    ``fsdp_reshard_after_forward``), ``fsdp_sync_module_states`` (required with the efficient
    loading), flat parameters (``fsdp_use_orig_params: false``) and ``BACKWARD_PRE`` prefetch,
    as the book's FSDP1 runs (Accelerate's default is no prefetch). Top level:
    ``mixed_precision`` and the process counts.

    With ``num_machines`` > 1 also the rendezvous: ``main_process_ip`` and ``main_process_port``
    (machine 0's address, where every node's launcher meets: the launcher hands torchrun
    ``--rdzv_endpoint ip:port`` with its default static rendezvous) and ``machine_rank``: this
    file's node. One file can serve every node: it
    says ``machine_rank: 0`` and each node's command adds :data:`MACHINE_RANK_FLAG`
    (``accelerate launch --config_file f.yaml --machine_rank $SLURM_NODEID train.py``), which
    the launcher prefers to the file's value.

    Not written, because the file has no key for it: the batch, ``grad_accum_steps``,
    ``max_grad_norm``, the optimizer and ``lr`` (the training script's ``Accelerator(...)``,
    ``accelerator.clip_grad_norm_`` and optimizer).

    Args:
        config: The run.
        num_processes: Processes in all, over every machine (one per GPU).
        num_machines: Machines (nodes); must divide ``num_processes``.
        main_process_ip: Machine 0's address (host name or IP) as the other nodes reach it;
            required with ``num_machines`` > 1 (under Slurm, the first host of
            ``scontrol show hostnames $SLURM_JOB_NODELIST``), not written with one machine.
        main_process_port: The free TCP port on machine 0 (written with ``num_machines`` > 1).
        machine_rank: This node's index, ``0 <= machine_rank < num_machines``.
        reduce_in_compute_dtype: Accept that with ``bf16-mixed``/``fp16-mixed`` Accelerate
            reduces gradients in bf16/fp16 rather than the run config's fp32 (see the module).

    Raises:
        ValueError: naming the key, for what the file cannot express (see the module: a strategy
            that is not FSDP, not in this API, or hybrid; ``shard_group_size``; ``wrap="size"``
            with FSDP2; activation checkpointing without ``wrap="layer"``; a mixed precision
            without ``reduce_in_compute_dtype``; fp16 without the default loss scaler), or for
            process counts that are not ints >= 1 with ``num_machines`` dividing ``num_processes``,
            for ``num_machines`` > 1 without ``main_process_ip``, a port outside 1..65535 or a
            ``machine_rank`` outside ``0..num_machines-1``.
    """
    what = "accelerate_config"
    row = _check_fsdp(config, what)
    mixed = _mixed_precision(config, what, reduce_in_compute_dtype)
    for name, value in (("num_processes", num_processes), ("num_machines", num_machines)):
        check_int(f"{what}: {name}", value, 1)
    if num_processes % num_machines:
        raise ValueError(f"{what}: num_processes={num_processes} (processes in all) must be a multiple of "
                         f"num_machines={num_machines}")
    check_int(f"{what}: machine_rank", machine_rank, 0)
    if machine_rank >= num_machines:
        raise ValueError(f"{what}: machine_rank={machine_rank} must be below num_machines={num_machines}")
    rendezvous: dict[str, Any] = {}
    if num_machines > 1:
        if not main_process_ip or not isinstance(main_process_ip, str):
            raise ValueError(f"{what}: num_machines={num_machines} needs main_process_ip, machine 0's address "
                             f"as the other nodes reach it, got {main_process_ip!r}")
        check_int(f"{what}: main_process_port", main_process_port, 1)
        if main_process_port > 65535:
            raise ValueError(f"{what}: main_process_port={main_process_port} is not a TCP port (1..65535)")
        rendezvous = {"main_process_ip": main_process_ip, "main_process_port": main_process_port}
    fsdp = {f"fsdp_{_ACCELERATE_SPELLING.get(key, key)}": value
            for key, value in _fsdp_settings(config, row).items()}
    if config.api == "fsdp1":
        fsdp["fsdp_sharding_strategy"] = row.fsdp1
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "mixed_precision": mixed,
        "num_processes": num_processes,
        "num_machines": num_machines,
        "machine_rank": machine_rank,
        **rendezvous,
        "main_training_function": "main",
        "fsdp_config": fsdp,
    }


def trainer_fsdp_args(config: RunConfig, *, reduce_in_compute_dtype: bool = False) -> dict[str, Any]:
    """``TrainingArguments`` keywords for an FSDP run: ``fsdp``, ``fsdp_config``, the precision,
    accumulation, clipping, optimizer and learning-rate keys.

    ``fsdp_config`` says what :func:`accelerate_config` says, in the Trainer's spelling (no ``fsdp_`` prefix;
    ``transformer_layer_cls_to_wrap`` a list); for FSDP1 also ``sync_module_states`` (the Trainer's default is
    on), ``use_orig_params: false`` (its default is on) and ``backward_prefetch: BACKWARD_PRE`` (its default
    is none). ``bf16``/``fp16`` from the precision; ``gradient_accumulation_steps``; ``max_grad_norm`` always
    written (the Trainer clips at 1.0 by default; 0 turns clipping off); ``learning_rate`` held constant
    (``lr_scheduler_type`` and ``warmup_steps`` from :func:`_trainer_schedule`: the Trainer decays linearly by
    default, the book's runs keep ``lr_schedule="constant"`` unless told);
    ``optim``/``weight_decay``/``optim_args`` for the book's optimizer (PyTorch's AdamW, not the fused one the
    Trainer picks by default). One difference remains with ``adamw``: the Trainer exempts biases and norm
    weights from weight decay, PyTorch's ``AdamW(params)`` decays every parameter.

    Not written: the batch (``per_device_train_batch_size`` is ``batch_size / (world size x
    grad_accum_steps)``, and the world size is the launcher's), ``steps``, ``seed``. With
    ``precision="fp32"`` the Trainer still takes a mixed precision from the environment when
    ``accelerate launch`` set ``ACCELERATE_MIXED_PRECISION``.

    Raises:
        ValueError: as :func:`accelerate_config`, and for FSDP1 with a strategy other than
            FULL_SHARD: the Trainer's plugin takes FSDP1's strategy from the environment
            (``FSDP_SHARDING_STRATEGY``, default FULL_SHARD) over ``fsdp_config``.
    """
    what = "trainer_fsdp_args"
    row = _check_fsdp(config, what)
    if config.api == "fsdp1" and row.fsdp1 != ACCELERATE_FSDP1_DEFAULT:
        raise _refuse(what, "strategy", row.name, "with FSDP1, Accelerate's plugin takes the strategy from the "
                      "FSDP_SHARDING_STRATEGY environment variable (default FULL_SHARD) and ignores "
                      "fsdp_config['reshard_after_forward']", "FULL_SHARD with api='fsdp1'; "
                      + ", ".join(fsdp_strategies("fsdp2")) + " with api='fsdp2'")
    mixed = _mixed_precision(config, what, reduce_in_compute_dtype)
    fsdp_config = _fsdp_settings(config, row)
    if "transformer_layer_cls_to_wrap" in fsdp_config:  # the Trainer takes a list of classes
        fsdp_config["transformer_layer_cls_to_wrap"] = [LAYER_CLASS]
    optim, weight_decay, optim_args = _OPTIMIZERS[config.optimizer]
    out: dict[str, Any] = {
        "fsdp": True,
        "fsdp_config": fsdp_config,
        "bf16": mixed == "bf16",
        "fp16": mixed == "fp16",
        "gradient_accumulation_steps": config.grad_accum_steps,
        "max_grad_norm": config.max_grad_norm,
        "learning_rate": config.lr,
        **_trainer_schedule(config),
        "optim": optim,
        "weight_decay": weight_decay,
    }
    if optim_args is not None:
        out["optim_args"] = optim_args
    return out


DEEPSPEED_STAGE3_DEFAULTS: dict[str, int] = {
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "stage3_param_persistence_threshold": 100_000,
}
"""DeepSpeed 0.19's defaults of the three ZeRO-3 keys the book's measurement runs set to 0
(``deepspeed/runtime/zero/config.py``, ``DeepSpeedZeroConfig``; a test reads them there)."""

MEASUREMENT_OVERRIDES: dict[str, tuple[str, str, str]] = {
    "stage3_prefetch_bucket_size": (
        "0", "5e7 (DeepSpeed)",
        ("no prefetch: each module is gathered when it runs, so the count of gathers is exact; "
         "on a real model every gather is then exposed")),
    "stage3_max_reuse_distance": (
        "0", "1e9 (DeepSpeed)",
        ("gather again in backward, as FSDP's reshard_after_forward; production keeps a "
         "parameter gathered if it is reused soon")),
    "stage3_param_persistence_threshold": (
        "0", "1e5 (DeepSpeed)",
        ("shard every tensor, so the bytes match FSDP's; production keeps norms and biases "
         "whole rather than gather each in its own tiny all-gather")),
    "communication_data_type": (
        "fp32 (bf16-mixed)", "omitted: bf16",
        ("reduce gradients in fp32 as the book's FSDP runs do; doubles the reduction bytes of a "
         "bf16 job, a numerical choice, not a default")),
    "overlap_comm": (
        "omitted (stage 3 on, 1/2 off)", "true",
        ("the measurement runs count collectives one at a time; production overlaps the "
         "reduction with backward")),
}
"""The keys :func:`deepspeed_config` writes for the book's measurements and what the production
config (``production=True``) writes instead: key → (measurement, production, why)."""


_BF16_STATE = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}  # precision "bf16"


def deepspeed_config(config: RunConfig, world_size: int, *, persistence_threshold: int = 0,
                     prefetch_bucket_size: int = 0, max_reuse_distance: int = 0,
                     production: bool = False, reduce_in_compute_dtype: bool = False) -> dict[str, Any]:
    """A DeepSpeed config with the run's sharding, batch, precision, optimizer and clipping.

    By default the config of the book's *measurement* runs (:data:`MEASUREMENT_OVERRIDES`): with ZeRO-3, no
    prefetch, no reuse, every tensor sharded, or the three keys given (elements). ``production=True`` writes:
    DeepSpeed's own ZeRO-3 defaults (:data:`DEEPSPEED_STAGE3_DEFAULTS`, written out so that they show)
    and ``overlap_comm: true``; the three keys are then ignored. With ``reduce_in_compute_dtype=True`` no
    ``communication_data_type`` is written: a bf16 job reduces in bf16, as Accelerate's and the Trainer's do.

    ``zero_optimization`` comes from the strategy table (``Strategy.deepspeed_config``: ZERO1/2/3 their own
    stage; DDP → 0, SHARD_GRAD_OP → 2, FULL_SHARD → 3; the hybrid strategies have none). With stage 3 and the
    three keys 0, each module is gathered when it runs, in forward and again in backward, as FSDP's
    ``reshard_after_forward`` (:func:`handbook_lib.models.zero.zero3_gathers` replays the others).

    ``cpu_offload`` offloads the optimizer (master weights, gradients, optimizer state: ``offload_optimizer``)
    and, with stage 3, the parameters (``offload_param``); PyTorch's optimizer then runs on the offloaded state
    (``zero_force_ds_cpu_optimizer: false``: no compiled CPU Adam). The precision's reduce dtype becomes
    ``communication_data_type`` (DeepSpeed would otherwise reduce bf16 gradients in bf16). Clipping is always
    written: DeepSpeed clips at 1.0 when the key is absent, so ``max_grad_norm=0`` becomes
    ``"gradient_clipping": 0.0``. The optimizer is PyTorch's AdamW/Adam/SGD inside DeepSpeed (``torch_adam``: no
    compiled op; ``adam_w_mode: false`` for Adam, which DeepSpeed would otherwise run as AdamW).

    ``optimizer.params`` always holds ``weight_decay`` (the book's: 0.01 for AdamW, else 0): DeepSpeed's AdamW
    would take 0.01, and the Trainer checks only the keys written.

    ZeRO-1/2 reduce with DeepSpeed's default ``use_multi_rank_bucket_allreduce: true``: every gradient bucket
    all-reduced (twice a reduce-scatter's bytes); ``false`` reduces it to its partitions' owners. Precision
    ``bf16`` keeps the master weights, gradients and optimizer states in bf16 (:data:`_BF16_STATE`).

    Raises:
        ValueError: for a strategy with no ZeRO stage, a world size the batch does not divide,
            or a negative threshold, bucket or distance.
    """
    row = get_strategy(config.strategy)
    section = row.deepspeed_config()
    if section is None or not row.distributed:
        raise ValueError(f"strategy {row.name!r} has no DeepSpeed ZeRO counterpart ({row.zero_note or 'none'})")
    config.check_batch(check_int("world_size", world_size, 1))
    for key, value in (("persistence_threshold", persistence_threshold),
                       ("prefetch_bucket_size", prefetch_bucket_size), ("max_reuse_distance", max_reuse_distance)):
        check_int(key, value, 0, noun="a whole number of elements")
    if production:
        if section["stage"] == 3:
            section.update(DEEPSPEED_STAGE3_DEFAULTS)
        section["overlap_comm"] = True
    elif section["stage"] == 3:
        section.update(stage3_param_persistence_threshold=persistence_threshold,
                       stage3_prefetch_bucket_size=prefetch_bucket_size, stage3_max_reuse_distance=max_reuse_distance)
    if config.cpu_offload:
        section["offload_optimizer"] = {"device": "cpu"}
        if section["stage"] == 3:
            section["offload_param"] = {"device": "cpu"}
    optimizer = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "sgd-momentum": "SGD"}[config.optimizer]
    params: dict[str, Any] = {"lr": config.lr, "weight_decay": _OPTIMIZERS[config.optimizer][1]}
    if optimizer.startswith("Adam"):
        params["torch_adam"] = True
    if config.optimizer == "adam":  # DeepSpeed's "Adam" is AdamW unless told otherwise
        params["adam_w_mode"] = False
    if config.optimizer == "sgd-momentum":
        params["momentum"] = 0.9
    compute, reduce = PRECISIONS[config.precision]
    out: dict[str, Any] = {
        "train_batch_size": config.batch_size,
        "train_micro_batch_size_per_gpu": config.batch_size // (world_size * config.grad_accum_steps),
        "gradient_accumulation_steps": config.grad_accum_steps,
        "gradient_clipping": config.max_grad_norm,
        "optimizer": {"type": optimizer, "params": params},
        "bf16": {"enabled": compute == "bf16", **(_BF16_STATE if config.precision == "bf16" else {})},
        "fp16": {"enabled": compute == "fp16"},
        "communication_data_type": reduce,
        "zero_optimization": section,
    }
    if reduce_in_compute_dtype and compute != "fp32":
        del out["communication_data_type"]
    if compute == "fp16":
        out["fp16"].update(initial_scale_power=round(math.log2(config.grad_scale_init)),
                           loss_scale=0 if config.grad_scaler else 1)
    if config.cpu_offload:
        out["zero_force_ds_cpu_optimizer"] = False
    if optimizer == "SGD":  # ZeRO refuses an optimizer outside its tested list unless told
        out["zero_allow_untested_optimizer"] = True
    return out


def trainer_deepspeed_args(config: RunConfig, world_size: int, *, persistence_threshold: int = 0) -> dict[str, Any]:
    """``TrainingArguments`` keywords for a DeepSpeed run of the Trainer: ``deepspeed`` (the
    :func:`deepspeed_config` dict) and the keys the Trainer checks against it — batch per rank,
    accumulation, clipping, learning rate, weight decay — spelled the Trainer's way, plus a constant learning
    rate (the Trainer's default schedule decays it to 0) and the optimizer steps to run.

    With ZeRO-3, ``save_model`` gathers the whole 16-bit weights into one file
    (``stage3_gather_16bit_weights_on_model_save``: DeepSpeed's counterpart of FSDP's
    FULL_STATE_DICT), so ``from_pretrained`` loads them as any other checkpoint.

    Raises:
        ValueError: as :func:`deepspeed_config`.
    """
    ds = deepspeed_config(config, world_size, persistence_threshold=persistence_threshold)
    if ds["zero_optimization"]["stage"] == 3:
        ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    compute = PRECISIONS[config.precision].compute
    return {
        "deepspeed": ds,
        "per_device_train_batch_size": ds["train_micro_batch_size_per_gpu"],
        "gradient_accumulation_steps": config.grad_accum_steps,
        "max_grad_norm": config.max_grad_norm,
        "learning_rate": config.lr,
        "weight_decay": ds["optimizer"]["params"]["weight_decay"],
        **_trainer_schedule(config),
        "max_steps": config.steps,
        "bf16": compute == "bf16",
        "fp16": compute == "fp16",
    }


def _trainer_schedule(config: RunConfig) -> dict[str, Any]:
    """The Trainer's ``lr_scheduler_type`` and ``warmup_steps``: the schedules ``lr_factor`` follows."""
    warm = config.lr_schedule == "constant" and config.warmup_steps
    return {"lr_scheduler_type": "constant_with_warmup" if warm else config.lr_schedule,
            "warmup_steps": config.warmup_steps}


def production_configs(config: RunConfig, *, num_processes: int, num_machines: int = 1,
                       main_process_ip: str | None = None) -> dict[str, dict[str, Any]]:
    """The three configs of one production job, as chapter 7 shows them: ``accelerate`` (the
    ``accelerate launch`` file, :func:`accelerate_config`), ``trainer`` (``TrainingArguments``
    keywords, :func:`trainer_fsdp_args`) and ``deepspeed`` (:func:`deepspeed_config` with
    ``production=True``, the ZeRO stage of the same strategy: FULL_SHARD → 3).

    Mixed precision reduces in the compute dtype in all three (``reduce_in_compute_dtype``), as
    ``mixed_precision: bf16``, ``bf16=True`` and DeepSpeed's ``bf16`` do; to reduce in fp32,
    pass Accelerate a plugin with that policy in code
    (:func:`handbook_lib.integrations.accelerate_job.fsdp_plugin`) and give DeepSpeed
    ``communication_data_type: fp32``.
    """
    return {
        "accelerate": accelerate_config(config, num_processes=num_processes, num_machines=num_machines,
                                        main_process_ip=main_process_ip, reduce_in_compute_dtype=True),
        "trainer": trainer_fsdp_args(config, reduce_in_compute_dtype=True),
        "deepspeed": deepspeed_config(config, num_processes, production=True, reduce_in_compute_dtype=True),
    }
