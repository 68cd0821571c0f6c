"""What a rank does to train through Hugging Face Accelerate, and to find out what Accelerate did.

Chapter 7 uses it through the ``accelerate_fsdp`` run, and shows :func:`train_with_accelerate`,
the ``train.py`` that ``accelerate launch`` starts on every rank. :func:`launch_env` turns the run config
into the environment ``accelerate launch --config_file`` would give each process: it writes
:func:`handbook_lib.integrations.frameworks.accelerate_config` to a file and passes it through Accelerate's
own launch code. :func:`what_accelerate_did` then reports what ``Accelerator.prepare`` really
built, whatever was asked: the distributed type, the wrapper, whether the parameters are
sharded (DTensors for FSDP2, flat shards for FSDP1), and the parameter bytes this rank holds.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from handbook_lib.core.config import RunConfig
from handbook_lib.integrations.frameworks import accelerate_config
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.measure import local_tensor, measure_param_bytes
from handbook_lib.runtime.model import build_model
from handbook_lib.runtime.optimization import build_optimizer
from handbook_lib.runtime.train_log import TrainLog
from handbook_lib.runtime.training import train

__all__ = ["launch_env", "accelerate_launch_env", "fsdp_plugin", "what_accelerate_did", "train_with_accelerate",
           "AccelerateJob"]


def accelerate_launch_env(file: dict[str, Any], *flags: str) -> dict[str, str]:
    """The ``ACCELERATE_*`` and ``FSDP_*`` variables ``accelerate launch <flags> --config_file
    <file> train.py`` hands each process, computed by the launcher's own code: the file is
    written as YAML, loaded, checked by ``_validate_launch_command`` and turned into the
    environment by ``prepare_multi_gpu_env`` (an invalid file raises there, as at launch). On
    one machine the port is the launcher's pick of a free one (``--main_process_port 0``), so
    that a busy 29500 on this machine says nothing about the file."""
    from accelerate.commands.launch import (
        _validate_launch_command,
        launch_command_parser,
    )
    from accelerate.utils import prepare_multi_gpu_env

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "accelerate.yaml"
        path.write_text(yaml.safe_dump(file))
        args = launch_command_parser().parse_args([*flags, "--config_file", str(path), "train.py"])
        args, _, _ = _validate_launch_command(args)
        if file.get("num_machines", 1) == 1 and args.main_process_port is None:
            args.main_process_port = 0
        env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}


def launch_env(config: RunConfig, num_processes: int) -> dict[str, str]:
    """The ``ACCELERATE_*`` and ``FSDP_*`` variables ``accelerate launch`` sets for ``config``
    (:func:`accelerate_launch_env` of :func:`accelerate_config`; the rendezvous variables
    torchrun already set are left out)."""
    return accelerate_launch_env(accelerate_config(config, num_processes=num_processes))


def fsdp_plugin(config: RunConfig) -> Any:
    """Accelerate's ``FullyShardedDataParallelPlugin`` for an FSDP2 run, built in code, with the
    run's own mixed-precision policy: ``param_dtype`` and ``output_dtype`` the compute dtype,
    ``reduce_dtype`` the reduce dtype (``bf16-mixed``: bf16 and fp32). The escape hatch the
    config file lacks: ``Accelerator(mixed_precision="bf16", fsdp_plugin=fsdp_plugin(config))``
    keeps this policy (``set_mixed_precision`` replaces only a policy left unset), where
    ``mixed_precision: bf16`` in the file reduces in bf16. Wrapping, resharding, offload and
    state-dict type as :func:`accelerate_config` writes them."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from handbook_lib.core.config import DTYPES, PRECISIONS

    file = accelerate_config(config, num_processes=1, reduce_in_compute_dtype=True)["fsdp_config"]
    if file["fsdp_version"] != 2:
        raise ValueError(f"fsdp_plugin: api={config.api!r}; this writes FSDP2's policy (api='fsdp2')")
    compute, reduce = (getattr(torch, DTYPES[name].torch_name) for name in PRECISIONS[config.precision])
    keywords: dict[str, Any] = {
        "fsdp_version": 2,
        "reshard_after_forward": file["fsdp_reshard_after_forward"],
        "state_dict_type": file["fsdp_state_dict_type"],
        "cpu_offload": file["fsdp_offload_params"],
        "activation_checkpointing": file["fsdp_activation_checkpointing"],
        "cpu_ram_efficient_loading": file["fsdp_cpu_ram_efficient_loading"],
        "auto_wrap_policy": file["fsdp_auto_wrap_policy"].lower(),
    }
    if "fsdp_transformer_layer_cls_to_wrap" in file:
        keywords["transformer_cls_names_to_wrap"] = [file["fsdp_transformer_layer_cls_to_wrap"]]
    if compute != torch.float32:
        keywords["mixed_precision_policy"] = {"param_dtype": compute, "reduce_dtype": reduce,
                                              "output_dtype": compute}
    return FullyShardedDataParallelPlugin(**keywords)


def what_accelerate_did(accelerator: Any, model: nn.Module) -> dict[str, Any]:
    """What ``accelerator.prepare`` made of ``model``: ``distributed_type`` (Accelerate's
    name), ``wrapper`` (the prepared module's class), ``sharded`` (parameters are DTensors or
    FSDP1 flat shards) and ``param_bytes`` (the parameter bytes this rank holds)."""
    params = list(model.parameters())
    flat = any(hasattr(p, "_shard_numel_padded") for p in params)
    return {
        "distributed_type": str(accelerator.distributed_type).rsplit(".", 1)[-1],
        "wrapper": type(model).__name__,
        "dtensor_params": any(isinstance(p, DTensor) for p in params),
        "sharded": flat or any(isinstance(p, DTensor) for p in params),
        "param_bytes": measure_param_bytes(model).shard_bytes,
    }


@dataclass
class AccelerateJob:
    """What :func:`train_with_accelerate` did on this rank."""

    log: TrainLog
    """The training steps' losses and times."""
    did: dict[str, Any]
    """:func:`what_accelerate_did` after ``prepare``."""
    moved_max_abs_diff: float
    """Largest change the step after ``save_state`` made to this rank's parameters (> 0)."""
    reload_max_abs_diff: float
    """Largest difference between this rank's parameters as saved by ``save_state`` and as
    ``load_state`` brought them back after that step (0: restored)."""
    exported_elements: int
    """Elements of ``get_state_dict``'s whole model on the main process (0 elsewhere)."""


def train_with_accelerate(config: RunConfig, ctx: RankContext,
                          folder: Path) -> AccelerateJob:
    """``train.py`` under ``accelerate launch``: FSDP's settings come from the
    environment the launcher sets (:func:`launch_env`), so the script names none. It
    trains in the book's loop, saves the sharded state (``save_state``), takes one
    more step, restores (``load_state``) and exports the whole model on the main
    process. On a CPU it asks for ``cpu=True``, else each process trains alone."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=ctx.device.type != "cuda")
    model = build_model(config.model_config(), seed=config.seed)
    optimizer = build_optimizer(model.parameters(), config.optimizer, config.lr,
                                config.optimizer_impl)
    model, optimizer = accelerator.prepare(model.to(accelerator.device), optimizer)
    log = train(model, optimizer, config, ctx)
    did = what_accelerate_did(accelerator, model)

    accelerator.save_state(str(folder / "state"))  # model, optimizer, RNG: per rank
    saved = [local_tensor(p).detach().clone() for p in model.parameters()]
    train(model, optimizer, config, ctx, start_step=config.steps - 1, progress=False)
    moved = _max_abs_diff(model, saved)  # the extra step changed them
    accelerator.load_state(str(folder / "state"))
    restored = _max_abs_diff(model, saved)

    whole = accelerator.get_state_dict(model)  # gathered on the main process
    exported = sum(t.numel() for t in whole.values())
    accelerator.wait_for_everyone()
    return AccelerateJob(log, did, moved, restored, exported if ctx.is_main else 0)


def _max_abs_diff(model: nn.Module, saved: list[torch.Tensor]) -> float:
    """Largest difference between this rank's parameters and ``saved`` (the same order)."""
    return max(float((local_tensor(p).detach() - s).abs().max()) for p, s in zip(model.parameters(), saved))
