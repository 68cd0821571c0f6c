"""What a rank does to train through Hugging Face Accelerate, and to find out what Accelerate did.

Chapter 7 uses it through the ``accelerate_fsdp`` run. :func:`launch_env` turns the run config
into the environment ``accelerate launch --config_file`` would give each process: it writes
:func:`handbook_lib.integrations.frameworks.accelerate_config` to a file and passes it through Accelerate's
own launch code. :func:`what_accelerate_did` then reports what ``Accelerator.prepare`` really
built, whatever was asked: the distributed type, the wrapper, whether the parameters are
sharded (DTensors for FSDP2, flat shards for FSDP1), and the parameter bytes this rank holds.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml
from torch import nn
from torch.distributed.tensor import DTensor

from handbook_lib.core.config import RunConfig
from handbook_lib.integrations.frameworks import accelerate_config
from handbook_lib.runtime.measure import measure_param_bytes

__all__ = ["launch_env", "what_accelerate_did"]


def launch_env(config: RunConfig, num_processes: int) -> dict[str, str]:
    """The ``ACCELERATE_*`` and ``FSDP_*`` variables ``accelerate launch`` sets for ``config``
    (the launcher's own ``_validate_launch_command`` and ``prepare_multi_gpu_env`` compute
    them; the rendezvous variables torchrun already set are left out)."""
    from accelerate.commands.launch import (
        _validate_launch_command,
        launch_command_parser,
    )
    from accelerate.utils import prepare_multi_gpu_env

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "accelerate.yaml"
        path.write_text(yaml.safe_dump(accelerate_config(config, num_processes=num_processes)))
        args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
        args, _, _ = _validate_launch_command(args)
        env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}


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
