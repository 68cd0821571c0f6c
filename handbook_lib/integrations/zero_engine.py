"""What a rank does to train with DeepSpeed ZeRO: build the engine, step it in the book's loop,
and measure where DeepSpeed keeps each byte.

Chapter 7 uses it through the ``deepspeed_zero`` run. The engine is built from the same seeded
model as every other run (:func:`handbook_lib.runtime.model.build_model`: DeepSpeed partitions it in
``deepspeed.initialize``), with the config :func:`handbook_lib.integrations.frameworks.deepspeed_config`
writes from the run config, and trained by :func:`handbook_lib.runtime.training.train` — the loop every
run uses — through :class:`EngineOptimizer`, which turns the loop's ``optimizer.step()`` into
``engine.step()``.

On a machine without a GPU, DeepSpeed runs on its CPU accelerator (``DS_ACCELERATOR=cpu``) over
the gloo process group the run already has. Two of DeepSpeed's CPU defaults are turned off here:
its shared-memory all-reduce, a C++ extension compiled at the first start (about a minute, and a
compiler on the machine) whose traffic would bypass ``torch.distributed`` — where the book counts
collectives —, and its compiled CPU Adam (the config asks for PyTorch's).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import MutableMapping
from typing import Any

import torch
from torch import nn

from handbook_lib.core.architecture import ModelConfig, param_count
from handbook_lib.core.config import RunConfig
from handbook_lib.integrations.frameworks import deepspeed_config
from handbook_lib.models.model_state import RankState
from handbook_lib.models.zero import gather_units
from handbook_lib.models.zero_peak import BOOK_RUNS, ZeroKnobs
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.collectives import tensors_in
from handbook_lib.runtime.measure import NewBytesPeak, smallest_soon
from handbook_lib.runtime.model import build_model
from handbook_lib.runtime.training import train_step

__all__ = ["set_ds_accelerator", "import_deepspeed", "EngineOptimizer", "build_engine", "measure_zero_bytes",
           "measure_zero_grad_bytes", "measure_zero_step", "deepspeed_estimates", "parse_deepspeed_config"]


def set_ds_accelerator(environ: MutableMapping[str, str], cuda: bool) -> str | None:
    """Point DeepSpeed at this machine's accelerator through ``environ`` (``os.environ`` for a
    rank): ``DS_ACCELERATOR=cpu`` when there is no GPU, and with a GPU a ``cpu`` value a notebook
    kernel or a parent left there removed, since DeepSpeed would move the model to the CPU inside
    NCCL ranks (issue 29, S1-3).

    Returns:
        One line saying what was dropped, or ``None`` when nothing was.
    """
    if not cuda:
        environ.setdefault("DS_ACCELERATOR", "cpu")
        return None
    if environ.get("DS_ACCELERATOR", "").strip().lower() != "cpu":
        return None
    del environ["DS_ACCELERATOR"]
    return "DS_ACCELERATOR=cpu ignored: this process sees a CUDA GPU, so DeepSpeed uses it"


def import_deepspeed() -> Any:
    """Import DeepSpeed for this machine: its CPU accelerator where there is no GPU, and no
    compiled shared-memory all-reduce (gloo's is used; see the module docstring).

    Raises:
        ImportError: naming the extra to install, when DeepSpeed is missing.
    """
    dropped = set_ds_accelerator(os.environ, torch.cuda.is_available())
    if dropped:
        warnings.warn(dropped, stacklevel=2)
    try:
        import deepspeed
    except ImportError as err:
        raise ImportError("DeepSpeed is not installed: pip install -e '.[frameworks]' "
                          f"(make setup does) ({err})") from None
    # DeepSpeed calls torch.distributed's old names; the FutureWarning is not the reader's to act on
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`")
    comm: Any = sys.modules["deepspeed.comm.torch"]
    comm.build_shm_op = lambda: None  # gloo's all-reduce, visible to the collective counter
    return deepspeed


class EngineOptimizer:
    """The optimizer as :func:`handbook_lib.runtime.training.train` sees it, for a DeepSpeed engine:
    ``step()`` is ``engine.step()`` (DeepSpeed's optimizer step, its gradient clipping and the
    all-gather of the updated parameters) and ``zero_grad()`` does nothing, because
    ``engine.step()`` already released the gradients. Before each step it measures the
    gradient bytes DeepSpeed holds (:func:`measure_zero_grad_bytes`): ``grad_bytes``."""

    def __init__(self, engine: nn.Module) -> None:
        self.engine = engine
        self.grad_bytes = 0
        """Gradient bytes held between the last backward and its step."""

    def step(self) -> None:
        self.grad_bytes = measure_zero_grad_bytes(self.engine)
        self.engine.step()

    def zero_grad(self, set_to_none: bool = False) -> None:  # noqa: ARG002 - the loop's signature
        pass


def build_engine(config: RunConfig, ctx: RankContext, knobs: ZeroKnobs = BOOK_RUNS
                 ) -> tuple[nn.Module, EngineOptimizer, dict[str, Any]]:
    """``(engine, optimizer, ds_config)``: the seeded model of ``config`` under DeepSpeed ZeRO,
    with ZeRO-3's persistence threshold, prefetch bucket and reuse distance from ``knobs``
    (:func:`~handbook_lib.integrations.frameworks.deepspeed_config`).

    The process group must exist (the run's); DeepSpeed joins it.
    """
    deepspeed = import_deepspeed()
    ds_config = deepspeed_config(config, ctx.world_size, persistence_threshold=knobs.persistence_threshold,
                                 prefetch_bucket_size=knobs.prefetch_bucket_size,
                                 max_reuse_distance=knobs.max_reuse_distance)
    deepspeed.init_distributed(dist_backend=ctx.backend, dist_init_required=False)
    model = build_model(config.model_config(), seed=config.seed).to(ctx.device)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                      dist_init_required=False)
    return engine, EngineOptimizer(engine), ds_config


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts its storage once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure_zero_bytes(engine: nn.Module, grads: int) -> RankState:
    """What ``engine``'s ZeRO optimizer holds now, in the parts the model predicts: parameters
    (ZeRO-1/2's flat buffer; ZeRO-3's ``ds_tensor`` partitions plus the tensors kept whole), the
    fp32 master partition, the optimizer state tensors of more than one element (Adam's moments)
    and the one-element ones (its ``step``). ``grads`` is the gradient bytes measured after the
    last backward (:attr:`EngineOptimizer.grad_bytes`: ``engine.step()`` releases some)."""
    opt = engine.optimizer
    params = list(engine.module.parameters())
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3
        whole = [p.data for p in params if p.data.numel() == getattr(p, "ds_numel", -1)]
        param_bytes = _storage_bytes(getattr(p, "ds_tensor", None) for p in params) + _storage_bytes(whole)
        master = _storage_bytes(tensors_in(opt.fp32_partitioned_groups_flat))
    else:  # ZeRO-1/2
        param_bytes = _storage_bytes(p.data for p in params)
        master = _storage_bytes(tensors_in(opt.single_partition_of_fp32_groups))
    state = [v for s in opt.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return RankState(
        params=param_bytes, master=master, grads=grads,
        optimizer=_storage_bytes(t for t in state if t.numel() > 1),
        optimizer_step=sum(t.numel() * t.element_size() for t in state if t.numel() == 1),
    )


def measure_zero_grad_bytes(engine: nn.Module) -> int:
    """Gradient bytes ``engine``'s ZeRO optimizer holds now (call it between backward and step)."""
    opt = engine.optimizer
    if hasattr(opt, "grad_partitions_flat_buffer"):  # ZeRO-3: one flat partition buffer
        return _storage_bytes(tensors_in(opt.grad_partitions_flat_buffer))
    held = _storage_bytes(tensors_in(opt.averaged_gradients))
    return held + _storage_bytes(p.grad for p in opt.single_partition_of_fp32_groups)


def measure_zero_step(engine: nn.Module, optimizer: EngineOptimizer, inputs: torch.Tensor,
                      targets: torch.Tensor) -> dict[str, int]:
    """Train one more step on ``(inputs, targets)`` and measure what it allocates beyond what
    existed before it, bytes (:class:`~handbook_lib.runtime.measure.NewBytesPeak`, independent
    of the model that predicts it):

    - ``buckets_at_rest``: DeepSpeed's gradient buckets held as the step begins (ZeRO-3 keeps
      its bucket from the engine's start; ZeRO-1/2 allocate theirs in each backward);
    - ``backward``: the most bytes alive from the forward's start to the optimizer step;
    - ``optimizer_step``: the most bytes alive during ``engine.step()``, counted from the
      step's start as well (ZeRO-1/2's gradients, made in backward, are among them), read once
      gloo's worker thread has let go of the last reduction's buffer
      (:func:`~handbook_lib.runtime.measure.smallest_soon`).

    Only new storage counts: a tensor that existed before the step and is replaced during it
    (ZeRO-3's persistent tensors, gathered anew after the optimizer step) counts as new while
    its old storage's release is not seen.
    """
    buckets = getattr(engine.optimizer, "ipg_buckets", {}).values()
    at_rest = _storage_bytes(b.buffer for b in buckets if isinstance(b.buffer, torch.Tensor))
    readings: dict[str, int] = {"buckets_at_rest": at_rest}
    mode, step = NewBytesPeak(), optimizer.step

    def measured_step() -> None:
        readings["backward"] = mode.peak
        mode.peak = smallest_soon(lambda: mode.live)
        step()
        readings["optimizer_step"] = mode.peak

    optimizer.step = measured_step  # type: ignore[method-assign]
    try:
        with mode:
            train_step(engine, optimizer, inputs, targets)
    finally:
        optimizer.step = step  # type: ignore[method-assign]
    return readings


def deepspeed_estimates(model: ModelConfig, world_size: int) -> dict[str, int]:
    """DeepSpeed's own per-GPU model-state estimators for ``model`` on ``world_size`` GPUs of one
    node, without offload, in bytes (its printed "GB" are GiB):

    - ``zero2``: ``estimate_zero2_model_states_mem_needs`` — 2P + 18P/N;
    - ``zero3``: ``estimate_zero3_model_states_mem_needs`` — 4L + 18P/N, L the largest layer's
      parameters (here the largest module ZeRO-3 gathers, :func:`handbook_lib.models.zero.gather_units`).

    Both assume 16-bit parameters and gradients with fp32 master, gradients and Adam states.
    """
    import_deepspeed()
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs,
    )

    total = param_count(model)
    largest = max(sum(sizes) for _, sizes in gather_units(model))
    _, zero2 = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=world_size, cpu_offload=False)
    _, zero3, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=world_size,
                                                        cpu_offload=False)
    return {"num_params": total, "largest_layer_params": largest, "zero2": int(zero2), "zero3": int(zero3)}


def parse_deepspeed_config(config: dict[str, Any], world_size: int) -> Any:
    """``DeepSpeedConfig(config)`` as each of ``world_size`` processes would parse it: DeepSpeed's
    own parser (its keys, types and batch arithmetic), run here in one process. DeepSpeed takes
    the world size from ``deepspeed.comm``; it is set to ``world_size`` for the parse only.

    Raises:
        deepspeed.runtime.config.DeepSpeedConfigError: for what DeepSpeed refuses.
    """
    import_deepspeed()
    import deepspeed.runtime.config as ds_config

    comm = ds_config.dist
    saved = comm.get_world_size, comm.get_rank
    comm.get_world_size, comm.get_rank = (lambda group=None: world_size), (lambda group=None: 0)
    try:
        return ds_config.DeepSpeedConfig(config, mpu=None)
    finally:
        comm.get_world_size, comm.get_rank = saved
