"""handbook_lib.integrations.frameworks: each config it writes is read by the library that owns it.

Nothing is compared as text. The Accelerate file goes through ``accelerate launch``'s own path
(its config loader, ``_validate_launch_command``, ``prepare_multi_gpu_env``) into the environment
``FullyShardedDataParallelPlugin()`` reads; the Trainer keywords build ``TrainingArguments`` and
then the plugin the Trainer builds from them; the DeepSpeed dict builds ``DeepSpeedConfig``. What
each library understood is compared with what the run config asked for (round trips), and every
refusal is pinned with its message.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys

import pytest
import torch

from handbook_lib.core import DTYPES, PRECISIONS, STRATEGIES, RunConfig, get_strategy
from handbook_lib.integrations import (
    LAYER_CLASS,
    accelerate_config,
    deepspeed_config,
    trainer_fsdp_args,
)
from handbook_lib.runtime import build_optimizer

yaml = pytest.importorskip("yaml")
if not torch.cuda.is_available():  # DeepSpeed's CPU accelerator, as handbook_lib.integrations.zero_engine picks it
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file  # noqa: E402
from accelerate.commands.launch import _validate_launch_command, launch_command_parser  # noqa: E402
from accelerate.utils import (  # noqa: E402
    DistributedType,
    FullyShardedDataParallelPlugin,
    prepare_multi_gpu_env,
)
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError  # noqa: E402
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum  # noqa: E402
from torch.distributed.fsdp import (  # noqa: E402
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    OffloadPolicy,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import (  # noqa: E402
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers.trainer_utils import SchedulerType  # noqa: E402


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, DTYPES[name].torch_name)


@pytest.fixture
def clean_env(monkeypatch):
    """No FSDP_* / ACCELERATE_* variable from outside, and every one the libraries set undone.

    ``TrainingArguments`` and the plugin write ``FSDP_CPU_RAM_EFFICIENT_LOADING`` into
    ``os.environ`` themselves; setting it through monkeypatch first makes the undo remove it.
    """
    for key in list(os.environ):
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "")
    monkeypatch.delenv("FSDP_CPU_RAM_EFFICIENT_LOADING")
    return monkeypatch


def fake_cuda(patch, available: bool) -> None:
    """A machine with one CUDA device (or none), faked at torch's level: the accelerator torch
    reports and CUDA's availability, device count and current device. What Accelerate and the
    Trainer decide from it is their own code, whichever release is installed."""
    patch.setattr(torch.accelerator, "current_accelerator",
                  lambda check_available=False: torch.device("cuda") if available else None)
    patch.setattr(torch.accelerator, "is_available", lambda: available)
    patch.setattr(torch.cuda, "is_available", lambda: available)
    patch.setattr(torch.cuda, "device_count", lambda: int(available))
    patch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.fixture
def one_cuda_device(monkeypatch):
    """The plugin as on a GPU node: with ``sync_module_states`` (FSDP1 with the efficient loading)
    it asks for the current device and refuses a machine with none."""
    fake_cuda(monkeypatch, True)




def unused_port() -> int:
    """A TCP port nothing on this machine listens on now: ``accelerate launch`` checks the
    rendezvous port of machine 0 and, when it is taken, launches differently (one machine: a
    standalone rendezvous; several: an error), which says nothing about the file."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, env_patch, file: dict):
    """What ``accelerate launch --main_process_port <free> --config_file <file> train.py`` hands
    the training processes: the loaded file, the parsed launch arguments and the plugin
    ``Accelerator`` builds from the environment (``FullyShardedDataParallelPlugin()``), with the
    mixed precision applied as ``AcceleratorState`` applies it (``fsdp_plugin.set_mixed_precision``)."""
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(file))
    loaded = load_config_from_file(str(path))
    args = launch_command_parser().parse_args(["--main_process_port", str(unused_port()),
                                               "--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            env_patch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    if env["ACCELERATE_MIXED_PRECISION"] != "no":
        plugin.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])
    return loaded, args, plugin


def check_plugin(plugin: FullyShardedDataParallelPlugin, config: RunConfig) -> None:
    """The plugin runs what ``config`` asks for (mixed precision apart: see :func:`check_mixed`)."""
    row = get_strategy(config.strategy)
    fsdp2 = config.api == "fsdp2"
    assert plugin.fsdp_version == (2 if fsdp2 else 1)
    if fsdp2:
        assert plugin.reshard_after_forward is row.reshard_after_forward
        assert type(plugin.cpu_offload) is (CPUOffloadPolicy if config.cpu_offload else OffloadPolicy)
    else:  # what Accelerator passes to FullyShardedDataParallel (accelerate/accelerator.py)
        assert (plugin.sharding_strategy or plugin.reshard_after_forward) == ShardingStrategy[row.fsdp1]
        assert plugin.cpu_offload == CPUOffload(offload_params=config.cpu_offload)
        assert plugin.sync_module_states is (config.init == "meta")
        assert plugin.use_orig_params is False
        assert plugin.backward_prefetch == BackwardPrefetch.BACKWARD_PRE
        assert plugin.forward_prefetch is False
    if config.wrap == "layer":
        assert plugin.auto_wrap_policy is transformer_auto_wrap_policy
        assert plugin.transformer_cls_names_to_wrap == [LAYER_CLASS]
    elif config.wrap == "size":
        assert plugin.auto_wrap_policy is size_based_auto_wrap_policy
        assert plugin.min_num_params == config.wrap_min_params
    else:
        assert plugin.auto_wrap_policy is None  # NO_WRAP: the root, one unit
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert plugin.activation_checkpointing is (config.activation_checkpointing == "full")
    assert plugin.cpu_ram_efficient_loading is (config.init == "meta")


def check_mixed(plugin: FullyShardedDataParallelPlugin, config: RunConfig) -> None:
    """fp32: no policy. A mixed precision (written with ``reduce_in_compute_dtype=True``):
    parameters in the compute dtype, and gradients reduced in it too, which is why the writers
    refuse a mixed precision unless told to accept that."""
    compute, reduce = PRECISIONS[config.precision]
    if compute == "fp32":
        assert plugin.mixed_precision_policy is None
        return
    assert plugin.mixed_precision_policy.param_dtype == torch_dtype(compute)
    assert plugin.mixed_precision_policy.reduce_dtype == torch_dtype(compute) != torch_dtype(reduce)


# ---- Accelerate ---------------------------------------------------------------------------

ACCELERATE_CASES = [
    dict(api=api, strategy=strategy, precision=precision, cpu_offload=offload)
    for api, strategy, precision, offload in itertools.product(
        ("fsdp2", "fsdp1"), ("FULL_SHARD", "SHARD_GRAD_OP"), ("fp32", "bf16-mixed"), (False, True))
] + [
    dict(api="fsdp1", strategy="NO_SHARD"),
    dict(api="fsdp1", strategy="FULL_SHARD", wrap="size", wrap_min_params=50_000),
    dict(api="fsdp2", wrap="model"),
    dict(api="fsdp1", wrap="model", init="full"),
    dict(api="fsdp2", activation_checkpointing=True, init="full"),
    dict(api="fsdp1", activation_checkpointing=True, strategy="SHARD_GRAD_OP", init="full"),
    dict(api="fsdp2", precision="fp16-mixed"),
]


@pytest.mark.parametrize("keys", ACCELERATE_CASES, ids=lambda keys: "-".join(f"{v}" for v in keys.values()))
def test_accelerate_launch_reads_the_file_as_the_run(keys, tmp_path, clean_env, one_cuda_device):
    config = RunConfig(**keys)
    file = accelerate_config(config, num_processes=4, reduce_in_compute_dtype=True)
    loaded, args, plugin = launch(tmp_path, clean_env, file)
    assert isinstance(loaded, ClusterConfig)
    assert loaded.distributed_type == DistributedType.FSDP
    assert args.use_fsdp and (args.num_processes, args.num_machines) == (4, 1)
    check_plugin(plugin, config)
    check_mixed(plugin, config)


def test_accelerate_processes_and_machines(tmp_path, clean_env):
    port = unused_port()
    file = accelerate_config(RunConfig(), num_processes=8, num_machines=2, main_process_ip="10.0.0.1",
                             main_process_port=port)
    args, _ = launch_env_of(tmp_path, clean_env, file)
    assert (args.nproc_per_node, args.nnodes, args.node_rank) == ("4", "2", 0)
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("static", f"10.0.0.1:{port}")


def launch_env_of(tmp_path, env_patch, file: dict, *flags: str) -> tuple:
    """The launcher's arguments and torchrun's environment for ``accelerate launch <flags>
    --config_file <file> train.py`` on one node (``prepare_multi_gpu_env``, as launch does)."""
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(file))
    args = launch_command_parser().parse_args([*flags, "--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    return args, prepare_multi_gpu_env(args)


@pytest.mark.parametrize("node", [0, 1, 2])
def test_accelerate_one_file_for_every_node(node, tmp_path, clean_env):
    """Three nodes of 8 GPUs, one file: each node's ``--machine_rank`` (the documented
    ``$SLURM_NODEID``) wins over the file's 0, and every node meets at machine 0's address."""
    from handbook_lib.integrations import MACHINE_RANK_FLAG
    port = unused_port()  # node 0 checks that it can listen on it
    file = accelerate_config(RunConfig(), num_processes=24, num_machines=3, main_process_ip="node-a",
                             main_process_port=port)
    assert file["machine_rank"] == 0 and MACHINE_RANK_FLAG.split()[0] == "--machine_rank"
    args, env = launch_env_of(tmp_path, clean_env, file, "--machine_rank", str(node))
    assert (args.nproc_per_node, args.nnodes, args.node_rank) == ("8", "3", node)
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("static", f"node-a:{port}")
    assert env["ACCELERATE_USE_FSDP"] == "true"


def test_accelerate_machine_rank_in_the_file(tmp_path, clean_env):
    """A per-node file: its ``machine_rank`` is the node's rank when no flag overrides it."""
    file = accelerate_config(RunConfig(), num_processes=16, num_machines=2, main_process_ip="10.1.2.3",
                             machine_rank=1)
    args, _ = launch_env_of(tmp_path, clean_env, file)
    assert (args.node_rank, args.rdzv_endpoint) == (1, "10.1.2.3:29500")


def test_accelerate_one_machine_writes_no_rendezvous():
    file = accelerate_config(RunConfig(), num_processes=8, main_process_ip="ignored")
    assert "main_process_ip" not in file and "main_process_port" not in file


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_machines": 2}, r"num_machines=2 needs main_process_ip"),
    ({"num_machines": 2, "main_process_ip": "h", "main_process_port": 70000}, r"not a TCP port"),
    ({"num_machines": 2, "main_process_ip": "h", "main_process_port": 0}, r"main_process_port must be"),
    ({"num_machines": 2, "main_process_ip": "h", "machine_rank": 2}, r"machine_rank=2 must be below"),
    ({"machine_rank": -1}, r"machine_rank must be an int >= 0"),
])
def test_accelerate_refuses_a_rendezvous_it_cannot_meet(kwargs, message):
    with pytest.raises(ValueError, match=message):
        accelerate_config(RunConfig(), num_processes=8, **kwargs)


def test_accelerate_fsdp1_strategy_needs_the_sharding_strategy_key(tmp_path, clean_env):
    """Why the FSDP1 file also says ``fsdp_sharding_strategy``: ``accelerate launch`` exports it
    (default FULL_SHARD), and the plugin then ignores ``fsdp_reshard_after_forward``."""
    config = RunConfig(api="fsdp1", strategy="SHARD_GRAD_OP", init="full")
    file = accelerate_config(config, num_processes=2)
    assert file["fsdp_config"]["fsdp_sharding_strategy"] == "SHARD_GRAD_OP"
    del file["fsdp_config"]["fsdp_sharding_strategy"]
    _, _, plugin = launch(tmp_path, clean_env, file)
    assert (plugin.sharding_strategy or plugin.reshard_after_forward) == ShardingStrategy.FULL_SHARD


def test_accelerate_fsdp1_meta_init_on_a_cpu_only_machine(tmp_path, clean_env):
    """The file is for GPU nodes: FSDP1 with the efficient loading syncs module states, and the
    plugin asks for the current accelerator (the tests above pretend one CUDA device). The
    refusal's words are Accelerate's: 1.16 names the CPU, earlier releases found no device."""
    fake_cuda(clean_env, False)  # also on a GPU machine
    file = accelerate_config(RunConfig(api="fsdp1", init="meta"), num_processes=2)
    with pytest.raises(RuntimeError, match="not supported on cpu|no available devices"):
        launch(tmp_path, clean_env, file)


# ---- Transformers Trainer -------------------------------------------------------------------

def training_args(tmp_path, keywords: dict) -> TrainingArguments:
    # TrainingArguments refuses bf16 on a machine without a bf16-capable GPU unless use_cpu=True
    # (transformers/training_args.py, "Your setup doesn't support bf16/gpu. You need to assign
    # use_cpu ..."); FSDP itself is not refused without a GPU. use_cpu changes no key compared
    # here (it turns off pinned data-loader memory and picks the CPU device).
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **keywords)


TRAINER_CASES = [
    dict(api="fsdp2", strategy=strategy, precision=precision, cpu_offload=offload, grad_accum_steps=accum,
         max_grad_norm=clip)
    for strategy, precision, offload, (accum, clip) in itertools.product(
        ("FULL_SHARD", "SHARD_GRAD_OP"), ("fp32", "bf16-mixed"), (False, True), ((1, 0.0), (4, 0.5)))
] + [
    dict(api="fsdp1", strategy="FULL_SHARD", init="full"),
    dict(api="fsdp1", strategy="FULL_SHARD", cpu_offload=True, precision="bf16-mixed"),
    dict(api="fsdp1", wrap="size", wrap_min_params=50_000, init="full"),
    dict(api="fsdp2", wrap="model", init="full"),
    dict(api="fsdp2", activation_checkpointing=True),
    dict(api="fsdp2", precision="fp16-mixed"),
]


@pytest.mark.parametrize("keys", TRAINER_CASES, ids=lambda keys: "-".join(f"{v}" for v in keys.values()))
def test_training_arguments_read_the_keywords_as_the_run(keys, tmp_path, clean_env, one_cuda_device):
    config = RunConfig(**keys)
    args = training_args(tmp_path, trainer_fsdp_args(config, reduce_in_compute_dtype=True))
    compute = PRECISIONS[config.precision].compute
    assert args.fsdp is True
    assert args.mixed_precision == {"fp32": "no"}.get(compute, compute)
    assert (args.bf16, args.fp16) == (compute == "bf16", compute == "fp16")
    assert args.gradient_accumulation_steps == config.grad_accum_steps
    assert args.max_grad_norm == config.max_grad_norm
    assert args.learning_rate == config.lr
    assert args.lr_scheduler_type == SchedulerType.CONSTANT
    assert args.fsdp_plugin_args["fsdp_version"] == (2 if config.api == "fsdp2" else 1)
    # the plugin as Trainer.create_accelerator_and_postprocess builds it, and the mixed
    # precision as AcceleratorState applies it
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    if args.mixed_precision != "no":
        plugin.set_mixed_precision(args.mixed_precision)
    check_plugin(plugin, config)
    check_mixed(plugin, config)


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd", "sgd-momentum"])
def test_trainer_builds_the_books_optimizer(optimizer, tmp_path, clean_env):
    """The Trainer's optimizer (``Trainer.get_optimizer_cls_and_kwargs``, with its
    ``weight_decay``) has the hyperparameters of :func:`handbook_lib.runtime.training.build_optimizer`'s;
    Adam is AdamW without weight decay, the same update."""
    config = RunConfig(optimizer=optimizer, lr=3e-4)
    args = training_args(tmp_path, trainer_fsdp_args(config))
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    params = [torch.nn.Parameter(torch.zeros(2))]
    theirs = cls(params, **kwargs, weight_decay=args.weight_decay).param_groups[0]
    ours = build_optimizer(params, optimizer, config.lr).param_groups[0]
    for key in ("lr", "weight_decay", "betas", "eps", "momentum", "dampening", "nesterov", "amsgrad"):
        assert theirs.get(key) == ours.get(key), key
    assert cls is (torch.optim.SGD if optimizer.startswith("sgd") else torch.optim.AdamW)


# ---- DeepSpeed ------------------------------------------------------------------------------

@pytest.fixture
def ds_world():
    """Give DeepSpeedConfig a world of ``size`` processes to read. With ``mpu=None`` and no mesh
    it asks ``deepspeed.comm.get_world_size()``, and counts 1 when no process group exists. For
    ``size`` > 1: a process group of that size in this process, on torch's ``fake`` backend (rank
    0; its collectives do nothing), which ``deepspeed.comm.init_distributed`` takes as a group the
    user made. Size 1: no group. Torn down after the test."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from handbook_lib.integrations.zero_engine import import_deepspeed

    deepspeed = import_deepspeed()  # its CPU accelerator here, and no compiled shared-memory op

    def set_world(size: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        if size > 1:
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
            deepspeed.comm.init_distributed(dist_backend="gloo", verbose=False)
            assert deepspeed.comm.get_world_size() == size

    yield set_world
    if dist.is_initialized():
        dist.destroy_process_group()


DS_CASES = list(itertools.product(
    ("ZERO1", "ZERO2", "ZERO3", "FULL_SHARD", "SHARD_GRAD_OP"), ("fp32", "bf16-mixed"), (False, True),
    (1, 2), (0.0, 1.0)))


@pytest.mark.parametrize("strategy, precision, offload, accum, clip", DS_CASES)
def test_deepspeed_reads_the_config_as_the_run(strategy, precision, offload, accum, clip, ds_world):
    world = 2
    ds_world(world)
    config = RunConfig(strategy=strategy, precision=precision, cpu_offload=offload, grad_accum_steps=accum,
                       max_grad_norm=clip, batch_size=16)
    ds = DeepSpeedConfig(deepspeed_config(config, world), mpu=None)
    stage = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2}.get(strategy) or int(strategy[-1])
    assert stage == get_strategy(strategy).zero_stage
    compute, reduce = PRECISIONS[precision]
    assert ds.world_size == world
    assert ds.zero_optimization_stage == stage
    assert ds.train_batch_size == config.batch_size
    assert ds.gradient_accumulation_steps == accum
    assert ds.train_micro_batch_size_per_gpu * world * accum == config.batch_size
    assert ds.gradient_clipping == clip
    assert ds.bfloat16_config.enabled is (compute == "bf16")
    assert ds.float16_config.enabled is False
    assert ds.communication_data_type == torch_dtype(reduce)
    zero = ds.zero_config
    assert (zero.offload_optimizer.device if offload else zero.offload_optimizer) == (
        OffloadDeviceEnum.cpu if offload else None)
    assert (zero.offload_param.device if offload and stage == 3 else zero.offload_param) == (
        OffloadDeviceEnum.cpu if offload and stage == 3 else None)
    assert ds.zero_force_ds_cpu_optimizer is (not offload)  # PyTorch's optimizer on offloaded state
    assert ds.optimizer_name == "adamw" and ds.optimizer_params["torch_adam"] is True
    if stage == 3:
        assert (zero.param_persistence_threshold, zero.prefetch_bucket_size, zero.max_reuse_distance) == (0, 0, 0)


def test_deepspeed_persistence_threshold_and_world_size(ds_world):
    ds_world(4)
    config = RunConfig(strategy="ZERO3", batch_size=16, grad_accum_steps=2)
    ds = DeepSpeedConfig(deepspeed_config(config, 4, persistence_threshold=4096), mpu=None)
    assert ds.zero_config.param_persistence_threshold == 4096
    assert (ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (2, 2)


def test_deepspeed_no_clipping_is_written_as_zero(ds_world):
    """DeepSpeed clips at 1.0 when the key is absent, so ``max_grad_norm=0`` must be written."""
    ds_world(2)
    written = deepspeed_config(RunConfig(strategy="ZERO2", max_grad_norm=0.0), 2)
    assert "gradient_clipping" in written and written["gradient_clipping"] == 0
    assert DeepSpeedConfig(written, mpu=None).gradient_clipping == 0
    without = {key: value for key, value in written.items() if key != "gradient_clipping"}
    assert DeepSpeedConfig(without, mpu=None).gradient_clipping == 1.0


def test_deepspeed_adam_is_not_adamw(ds_world):
    """DeepSpeed runs its "Adam" as AdamW unless ``adam_w_mode`` is false (ADAM_W_MODE_DEFAULT)."""
    ds_world(2)
    from deepspeed.runtime.config import ADAM_W_MODE_DEFAULT

    assert ADAM_W_MODE_DEFAULT is True
    adam = DeepSpeedConfig(deepspeed_config(RunConfig(strategy="ZERO1", optimizer="adam"), 2), mpu=None)
    assert adam.optimizer_name == "adam"
    assert adam.optimizer_params["adam_w_mode"] is False
    adamw = DeepSpeedConfig(deepspeed_config(RunConfig(strategy="ZERO1", optimizer="adamw"), 2), mpu=None)
    assert adamw.optimizer_name == "adamw" and "adam_w_mode" not in adamw.optimizer_params


def test_deepspeed_fp16_loss_scale(ds_world):
    ds_world(2)
    fp16 = DeepSpeedConfig(deepspeed_config(RunConfig(strategy="ZERO2", precision="fp16-mixed"), 2), mpu=None)
    assert fp16.float16_config.enabled and not fp16.bfloat16_config.enabled
    assert (fp16.float16_config.loss_scale, fp16.float16_config.initial_scale_power) == (0, 16)  # dynamic, 2**16
    static = deepspeed_config(RunConfig(strategy="ZERO2", precision="fp16-mixed", grad_scaler=False), 2)
    assert DeepSpeedConfig(static, mpu=None).float16_config.loss_scale == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_deepspeed_accepts_every_config_written(strategy, ds_world):
    """deepspeed_config either refuses a strategy (no ZeRO stage) or writes a config DeepSpeed
    accepts, with the stage of the strategy table."""
    ds_world(2)
    config = RunConfig(strategy=strategy, shard_group_size=0)
    if get_strategy(strategy).zero_stage is None:
        with pytest.raises(ValueError, match="has no DeepSpeed ZeRO counterpart"):
            deepspeed_config(config, 2)
        return
    ds = DeepSpeedConfig(deepspeed_config(config, 2), mpu=None)
    assert ds.zero_optimization_stage == get_strategy(strategy).zero_stage


def test_mics_is_gone_from_deepspeed(ds_world):
    """Why HYBRID_SHARD has no ZeRO row: DeepSpeed 0.19 refuses MiCS's key."""
    ds_world(2)
    with pytest.raises(DeepSpeedConfigError):
        DeepSpeedConfig({"train_batch_size": 8, "zero_optimization": {"stage": 3, "mics_shard_size": 2}}, mpu=None)


# ---- refusals -------------------------------------------------------------------------------

def accelerate(config):
    return accelerate_config(config, num_processes=2)


REFUSALS = [
    (accelerate, dict(strategy="ZERO1"),
     r"^accelerate_config: config key 'strategy' got 'ZERO1': a DeepSpeed ZeRO stage, not FSDP \(write it with "
     r"deepspeed_config\); accepted: SHARD_GRAD_OP, FULL_SHARD \(with api='fsdp2'\)$"),
    (accelerate, dict(strategy="DDP"), r"'strategy' got 'DDP': not an FSDP strategy; accepted: SHARD_GRAD_OP"),
    (accelerate, dict(strategy="NONE"), r"'strategy' got 'NONE': not an FSDP strategy"),
    (accelerate, dict(strategy="HYBRID_SHARD"), r"'strategy' got 'HYBRID_SHARD': a hybrid strategy needs a 2-D"),
    (accelerate, dict(strategy="HYBRID_SHARD_ZERO2", api="fsdp1"),
     r"'HYBRID_SHARD_ZERO2': a hybrid .*accepted: NO_SHARD, SHARD_GRAD_OP, FULL_SHARD \(with api='fsdp1'\)$"),
    (accelerate, dict(strategy="NO_SHARD"), r"'strategy' got 'NO_SHARD': fsdp2 has no NO_SHARD \(use api='fsdp1'\)"),
    (accelerate, dict(shard_group_size=2), r"'shard_group_size' got 2: only the hybrid .*; accepted: 0$"),
    (accelerate, dict(wrap="size"), r"'wrap' got 'size': Accelerate's FSDP2 size policy .*; accepted: 'layer', "
                                    r"'model'; 'size' with api='fsdp1'$"),
    (accelerate, dict(wrap="model", activation_checkpointing=True),
     r"'wrap' got 'model': Accelerate checkpoints the modules its wrap policy selects; the book checkpoints "
     r"each transformer layer; accepted: 'layer' with activation_checkpointing$"),
    (accelerate, dict(wrap="size", api="fsdp1", activation_checkpointing=True), r"'wrap' got 'size': Accelerate "
                                                                                r"checkpoints"),
    (accelerate, dict(activation_checkpointing="selective"),
     r"'activation_checkpointing' got 'selective': Accelerate's fsdp_activation_checkpointing recomputes "
     r"whole layers; the selective policy is fsdp_train's; accepted: 'none', 'full'$"),
    (accelerate, dict(precision="bf16-mixed"),
     r"'precision' got 'bf16-mixed': it reduces gradients in fp32, but Accelerate's mixed_precision='bf16' makes "
     r"FSDP reduce them in bf16 .*; accepted: 'fp32'; 'bf16-mixed' with reduce_in_compute_dtype=True$"),
    (accelerate, dict(precision="fp16-mixed"), r"'precision' got 'fp16-mixed'"),
    (lambda c: accelerate_config(c, num_processes=2, reduce_in_compute_dtype=True),
     dict(precision="fp16-mixed", grad_scaler=False), r"'grad_scaler' got False: .*; accepted: True$"),
    (lambda c: accelerate_config(c, num_processes=2, reduce_in_compute_dtype=True),
     dict(precision="fp16-mixed", grad_scale_init=1024.0), r"'grad_scale_init' got 1024.0: .*; accepted: 65536.0$"),
    (lambda c: accelerate_config(c, num_processes=0), {}, r"num_processes must be an int >= 1, got 0"),
    (lambda c: accelerate_config(c, num_processes=True), {}, r"num_processes must be an int >= 1, got True"),
    (lambda c: accelerate_config(c, num_processes=4, num_machines=0), {}, r"num_machines must be an int >= 1"),
    (lambda c: accelerate_config(c, num_processes=3, num_machines=2), {},
     r"num_processes=3 \(processes in all\) must be a multiple of num_machines=2"),
    (trainer_fsdp_args, dict(strategy="ZERO3"), r"^trainer_fsdp_args: config key 'strategy' got 'ZERO3': a DeepSpeed"),
    (trainer_fsdp_args, dict(strategy="SHARD_GRAD_OP", api="fsdp1"),
     r"'strategy' got 'SHARD_GRAD_OP': with FSDP1, .*FSDP_SHARDING_STRATEGY .*; accepted: FULL_SHARD with "
     r"api='fsdp1'; SHARD_GRAD_OP, FULL_SHARD with api='fsdp2'$"),
    (trainer_fsdp_args, dict(strategy="NO_SHARD", api="fsdp1"), r"'strategy' got 'NO_SHARD': with FSDP1"),
    (trainer_fsdp_args, dict(strategy="HYBRID_SHARD"), r"'strategy' got 'HYBRID_SHARD': a hybrid"),
    (trainer_fsdp_args, dict(precision="bf16-mixed"), r"^trainer_fsdp_args: config key 'precision' got"),
    (trainer_fsdp_args, dict(wrap="size"), r"^trainer_fsdp_args: config key 'wrap' got 'size'"),
    (lambda c: deepspeed_config(c, 2), dict(strategy="NONE"),
     r"^strategy 'NONE' has no DeepSpeed ZeRO counterpart \(none\)$"),
    (lambda c: deepspeed_config(c, 2), dict(strategy="HYBRID_SHARD_ZERO2"),
     r"^strategy 'HYBRID_SHARD_ZERO2' has no DeepSpeed ZeRO counterpart \(DeepSpeed has no hybrid ZeRO-2\)$"),
    (lambda c: deepspeed_config(c, 3), dict(strategy="ZERO2", batch_size=8),
     r"^batch_size=8 must be divisible by the number of ranks 3$"),
    (lambda c: deepspeed_config(c, 0), dict(strategy="ZERO2"), r"^world_size must be an int >= 1, got 0$"),
    (lambda c: deepspeed_config(c, 2, persistence_threshold=-1), dict(strategy="ZERO3"),
     r"^persistence_threshold must be a whole number of elements >= 0, got -1$"),
]


@pytest.mark.parametrize("write, keys, message", REFUSALS)
def test_refusals(write, keys, message):
    with pytest.raises(ValueError, match=message):
        write(RunConfig(**keys))


def test_torch_grad_scaler_default_is_what_the_writers_accept():
    import inspect

    assert inspect.signature(torch.amp.GradScaler).parameters["init_scale"].default == RunConfig().grad_scale_init


def test_module_is_pure():
    code = "import sys, handbook_lib.integrations.frameworks; print(sorted({'torch', 'accelerate', 'transformers', " \
           "'deepspeed', 'yaml'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_trainer_deepspeed_args_agree_with_what_the_trainer_checks(tmp_path, ds_world):
    """The Trainer refuses a DeepSpeed config whose batch, clipping or learning rate disagree with
    its own arguments (``trainer_config_finalize``): build both and let it compare them."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    from handbook_lib.integrations import trainer_deepspeed_args

    config = RunConfig.from_mapping({"strategy": "ZERO3", "batch_size": 8, "grad_accum_steps": 2,
                                     "max_grad_norm": 0.5, "lr": 3e-4, "steps": 5})
    ds_world(1)  # TrainingArguments in this (non-distributed) process counts one process too
    kwargs = trainer_deepspeed_args(config, 1)
    assert kwargs["deepspeed"]["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert kwargs["lr_scheduler_type"] == "constant" and kwargs["max_steps"] == 5
    args = TrainingArguments(output_dir=str(tmp_path), **{k: v for k, v in kwargs.items() if k != "deepspeed"})
    hf = HfTrainerDeepSpeedConfig(kwargs["deepspeed"])
    hf.trainer_config_process(args)  # fills "auto" values and records mismatches
    assert not hf.mismatches, hf.mismatches


# ---- production configs (chapter 7's "what you would write") ---------------------------------

def test_deepspeed_stage3_defaults_are_deepspeeds(ds_world):
    """The production config writes DeepSpeed's own ZeRO-3 defaults, read from its config class."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from handbook_lib.integrations import DEEPSPEED_STAGE3_DEFAULTS

    fields = {f.alias: f.default for f in DeepSpeedZeroConfig.model_fields.values() if f.alias}
    assert {key: fields[key] for key in DEEPSPEED_STAGE3_DEFAULTS} == DEEPSPEED_STAGE3_DEFAULTS
    ds_world(8)
    written = deepspeed_config(RunConfig(strategy="ZERO3", precision="bf16-mixed"), 8, production=True,
                               reduce_in_compute_dtype=True)
    zero = DeepSpeedConfig(written, mpu=None).zero_config
    assert (zero.prefetch_bucket_size, zero.max_reuse_distance, zero.param_persistence_threshold) == (
        5e7, 1e9, 1e5)
    assert zero.overlap_comm is True
    assert DeepSpeedConfig(written, mpu=None).communication_data_type is None  # bf16 reduces in bf16
    measured = deepspeed_config(RunConfig(strategy="ZERO3", precision="bf16-mixed"), 8)
    assert DeepSpeedConfig(measured, mpu=None).communication_data_type == torch.float32


@pytest.mark.parametrize("strategy", ["ZERO1", "ZERO2", "SHARD_GRAD_OP"])
def test_deepspeed_production_overlaps_below_stage_3(strategy, ds_world):
    ds_world(2)
    zero = DeepSpeedConfig(deepspeed_config(RunConfig(strategy=strategy), 2, production=True), mpu=None).zero_config
    assert zero.overlap_comm is True and zero.use_multi_rank_bucket_allreduce is True


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd", "sgd-momentum"])
def test_deepspeed_weight_decay_is_the_books(optimizer, ds_world):
    ds_world(2)
    ds = DeepSpeedConfig(deepspeed_config(RunConfig(strategy="ZERO2", optimizer=optimizer), 2), mpu=None)
    ours = build_optimizer([torch.nn.Parameter(torch.zeros(2))], optimizer, 1e-3).param_groups[0]
    assert ds.optimizer_params["weight_decay"] == ours["weight_decay"]


def test_trainer_checks_the_written_weight_decay(tmp_path, ds_world):
    """Why ``trainer_deepspeed_args`` passes ``weight_decay``: the JSON now says 0.01, and the
    Trainer's default (0.0) would be a mismatch it refuses."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    from handbook_lib.integrations import trainer_deepspeed_args

    ds_world(1)
    kwargs = trainer_deepspeed_args(RunConfig(strategy="ZERO3"), 1)
    assert kwargs["weight_decay"] == 0.01
    del kwargs["weight_decay"]
    args = TrainingArguments(output_dir=str(tmp_path), **{k: v for k, v in kwargs.items() if k != "deepspeed"})
    hf = HfTrainerDeepSpeedConfig(kwargs["deepspeed"])
    hf.trainer_config_process(args)
    assert any("weight_decay" in m for m in hf.mismatches)


def test_production_configs_are_read_by_their_libraries(tmp_path, clean_env, ds_world):
    """The bf16 trio of chapter 7, each handed to its library: Accelerate's launcher, the
    plugin it builds, ``TrainingArguments`` and the plugin the Trainer builds, DeepSpeed."""
    from handbook_lib.integrations import accelerate_launch_env, production_configs

    config = RunConfig(strategy="FULL_SHARD", precision="bf16-mixed", activation_checkpointing=True,
                       batch_size=64, max_grad_norm=1.0)
    trio = production_configs(config, num_processes=16, num_machines=2, main_process_ip="10.0.0.1")
    env = accelerate_launch_env(trio["accelerate"], "--machine_rank", "1")
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16" and env["FSDP_VERSION"] == "2"
    for key, value in env.items():
        clean_env.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    plugin.set_mixed_precision("bf16")
    assert plugin.mixed_precision_policy.reduce_dtype == torch.bfloat16  # the file's bf16 reduces in bf16
    args = training_args(tmp_path, trio["trainer"])
    assert args.bf16 and args.fsdp_plugin_args["fsdp_version"] == 2
    ds_world(16)
    ds = DeepSpeedConfig(trio["deepspeed"], mpu=None)
    assert ds.zero_optimization_stage == 3 and ds.bfloat16_config.enabled and ds.gradient_clipping == 1.0
    assert ds.train_micro_batch_size_per_gpu == 4


def test_fsdp_plugin_keeps_an_fp32_reduce(clean_env):
    """The escape hatch: a policy given in code survives ``mixed_precision="bf16"``."""
    from handbook_lib.integrations import fsdp_plugin

    plugin = fsdp_plugin(RunConfig(strategy="FULL_SHARD", precision="bf16-mixed"))
    plugin.set_mixed_precision("bf16")  # what AcceleratorState does with the Accelerator's precision
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (
        torch.bfloat16, torch.float32, torch.bfloat16)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    with pytest.raises(ValueError, match="api='fsdp2'"):
        fsdp_plugin(RunConfig(api="fsdp1", init="full"))


def test_parse_deepspeed_config_sees_the_world_size_it_is_given():
    from handbook_lib.integrations import parse_deepspeed_config

    config = deepspeed_config(RunConfig(strategy="ZERO3", batch_size=32), 8)
    assert parse_deepspeed_config(config, 8).train_micro_batch_size_per_gpu == 4
    with pytest.raises(Exception, match="train_batch_size"):  # 32 != 4 x 1 x 2: DeepSpeed's check
        parse_deepspeed_config(config, 2)
    import deepspeed.comm

    assert deepspeed.comm.get_world_size.__name__ == "get_world_size"  # restored


def test_training_arguments_leave_the_environment_as_they_found_it(tmp_path, clean_env):
    from handbook_lib.integrations import training_arguments

    before = {k: v for k, v in os.environ.items() if k.startswith(("FSDP_", "ACCELERATE_"))}
    args = training_arguments(trainer_fsdp_args(RunConfig(), reduce_in_compute_dtype=True), str(tmp_path))
    assert args.fsdp_plugin_args["fsdp_version"] == 2 and args.fsdp_plugin_args["cpu_ram_efficient_loading"]
    assert {k: v for k, v in os.environ.items() if k.startswith(("FSDP_", "ACCELERATE_"))} == before
