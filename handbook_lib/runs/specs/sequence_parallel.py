"""Split each sequence over ``sp_size`` ranks (DeepSpeed Ulysses or the book's ring attention), FSDP2 over every rank.

The torch-free half of :mod:`handbook_lib.runs.sequence_parallel`: its config (the vocabulary's
:class:`~handbook_lib.core.parallel_config.ParallelConfig`) and the checks the launcher makes
before any process starts (:class:`~handbook_lib.core.run_spec.RunSpec`).
"""

from __future__ import annotations

from handbook_lib.core.parallel_config import ParallelConfig
from handbook_lib.core.run_spec import RunSpec

CONFIG = ParallelConfig


def validate(config: ParallelConfig, world_size: int) -> None:
    """Reject, before any process starts, a config this run cannot execute.

    Raises:
        ValueError: naming the key and the values this run accepts.
    """
    if config.tp_size != 1:
        raise ValueError(f"config key 'tp_size'={config.tp_size}: sequence_parallel splits sequences only; "
                         "tensor_parallel runs tp_size with sp_size together")
    if config.sp_size == 1:
        raise ValueError("config key 'sp_size'=1 splits no sequence: sequence_parallel needs sp_size >= 2 "
                         "(plain FSDP is fsdp_train)")
    if config.pp_size != 1:
        raise ValueError(f"config key 'pp_size'={config.pp_size}: sequence_parallel cuts no pipeline; the pipeline run "
                         "does (with tp_size too)")
    config.check_runnable("sequence_parallel", world_size)


SPEC = RunSpec("sequence_parallel", __doc__, CONFIG, validate)
