"""Layer 0, the vocabulary every other layer reads: the run config, the dtype and precision
tables, the model's shape keys, the strategy table, the result shape, the launcher<->rank
contract, and the one way arguments are checked. Pure: no ``torch``, and no import of any other
layer of ``handbook_lib``.

Every name below is imported from its module on first use, so importing one module of
this layer (a rank's harness importing its process-group set-up) loads no other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from handbook_lib.core.lazy import lazy_exports

if TYPE_CHECKING:  # what a type checker sees; at run time each name is imported on first use
    from handbook_lib.core.architecture import (
        MODEL_KEYS,
        ModelConfig,
        param_count,
        param_count_breakdown,
        param_shapes,
    )
    from handbook_lib.core.checks import check_int, check_world, is_int, lookup
    from handbook_lib.core.config import (
        LR_SCHEDULES,
        APIS,
        CHECKPOINTING_MODES,
        DTYPES,
        INITS,
        OPTIMIZERS,
        PRECISIONS,
        WRAPS,
        CheckpointingMode,
        Dtype,
        FlatConfig,
        Precision,
        RunConfig,
        checkpointing_mode,
        dtype_bytes,
        get_precision,
        parse_overrides,
    )
    from handbook_lib.core.parallel_config import PLAIN_KEYS, SP_METHODS, ParallelConfig
    from handbook_lib.core.parallel_layout import MESH_DIMS, ParallelLayout
    from handbook_lib.core.files import fsync_dir, write_json_atomic, write_text_atomic
    from handbook_lib.core.protocol import (
        PREEMPT_SIGNALS,
        PREEMPTED_EXIT,
        BATCH_KEY,
        COLLECTIVE_TIMEOUT_ENV,
        CONFIG_FILE,
        DEADLINE_ENV,
        LOGS_DIR,
        RANKS_DIR,
        RESULT_FILE,
        RESULTS_DIR,
        RESULTS_LOG_ENV,
        RUN_FILES,
        RUN_MARKER,
        RankStatus,
        batch_result_path,
        collective_timeout_s,
        rank_stacks_path,
        rank_status_path,
    )
    from handbook_lib.core.results import (
        SCHEMA,
        Check,
        RunResult,
        load_result,
        max_relative_difference,
        model_state_bytes,
    )
    from handbook_lib.core.strategies import (
        FSDP2_SPELLING,
        STRATEGIES,
        STRATEGY_TABLE,
        WRAPPERS,
        Strategy,
        StrategyName,
        Wrapper,
        get_strategy,
        strategies_where,
    )
    from handbook_lib.core.text import BOOK_WIDTH, TERMINAL_WIDTH, wrap
    from handbook_lib.core.files import (
        check_writable_dir,
    )
    from handbook_lib.core.protocol import (
        node_marker,
        node_config_file,
        node_files,
    )

_HOMES = {
    "ModelConfig": "architecture",
    "MODEL_KEYS": "architecture",
    "param_shapes": "architecture",
    "param_count": "architecture",
    "param_count_breakdown": "architecture",
    "is_int": "checks",
    "check_int": "checks",
    "lookup": "checks",
    "check_world": "checks",
    "FlatConfig": "config",
    "RunConfig": "config",
    "ParallelConfig": "parallel_config",
    "SP_METHODS": "parallel_config",
    "ParallelLayout": "parallel_layout",
    "MESH_DIMS": "parallel_layout",
    "CheckpointingMode": "config",
    "CHECKPOINTING_MODES": "config",
    "checkpointing_mode": "config",
    "APIS": "config",
    "Dtype": "config",
    "DTYPES": "config",
    "dtype_bytes": "config",
    "Precision": "config",
    "PRECISIONS": "config",
    "get_precision": "config",
    "OPTIMIZERS": "config",
    "WRAPS": "config",
    "INITS": "config",
    "parse_overrides": "config",
    "write_text_atomic": "files",
    "write_json_atomic": "files",
    "fsync_dir": "files",
    "DEADLINE_ENV": "protocol",
    "COLLECTIVE_TIMEOUT_ENV": "protocol",
    "RESULTS_LOG_ENV": "protocol",
    "collective_timeout_s": "protocol",
    "RUN_MARKER": "protocol",
    "CONFIG_FILE": "protocol",
    "RESULT_FILE": "protocol",
    "RESULTS_DIR": "protocol",
    "BATCH_KEY": "protocol",
    "RANKS_DIR": "protocol",
    "LOGS_DIR": "protocol",
    "RUN_FILES": "protocol",
    "rank_status_path": "protocol",
    "rank_stacks_path": "protocol",
    "batch_result_path": "protocol",
    "RankStatus": "protocol",
    "SCHEMA": "results",
    "Check": "results",
    "RunResult": "results",
    "load_result": "results",
    "max_relative_difference": "results",
    "model_state_bytes": "results",
    "StrategyName": "strategies",
    "Wrapper": "strategies",
    "WRAPPERS": "strategies",
    "Strategy": "strategies",
    "STRATEGY_TABLE": "strategies",
    "STRATEGIES": "strategies",
    "FSDP2_SPELLING": "strategies",
    "get_strategy": "strategies",
    "strategies_where": "strategies",
    "BOOK_WIDTH": "text",
    "TERMINAL_WIDTH": "text",
    "wrap": "text",
    "check_writable_dir": "files",
    "node_marker": "protocol",
    "node_config_file": "protocol",
    "node_files": "protocol",
    "PLAIN_KEYS": "parallel_config",
    "LR_SCHEDULES": "config",
    "PREEMPT_SIGNALS": "protocol",
    "PREEMPTED_EXIT": "protocol",
}
"""Each exported name and the module of this package it is defined in."""

__all__ = [
    "ModelConfig", "MODEL_KEYS", "param_shapes", "param_count", "param_count_breakdown", "is_int",
    "check_int", "lookup", "check_world", "FlatConfig", "RunConfig", "ParallelConfig", "SP_METHODS",
    "ParallelLayout", "MESH_DIMS", "CheckpointingMode",
    "CHECKPOINTING_MODES", "checkpointing_mode", "APIS", "Dtype", "DTYPES", "dtype_bytes",
    "Precision", "PRECISIONS", "get_precision", "OPTIMIZERS", "WRAPS", "INITS", "parse_overrides",
    "write_text_atomic", "write_json_atomic", "fsync_dir", "DEADLINE_ENV", "COLLECTIVE_TIMEOUT_ENV",
    "RESULTS_LOG_ENV", "collective_timeout_s", "RUN_MARKER", "CONFIG_FILE", "RESULT_FILE",
    "RESULTS_DIR", "BATCH_KEY", "RANKS_DIR", "LOGS_DIR", "RUN_FILES", "rank_status_path",
    "rank_stacks_path", "batch_result_path", "RankStatus", "SCHEMA", "Check", "RunResult",
    "load_result", "max_relative_difference", "model_state_bytes", "StrategyName", "Wrapper",
    "WRAPPERS", "Strategy", "STRATEGY_TABLE", "STRATEGIES", "FSDP2_SPELLING", "get_strategy",
    "strategies_where", "BOOK_WIDTH", "TERMINAL_WIDTH", "wrap",
    "check_writable_dir",
    "node_marker", "node_config_file", "node_files",
    "PLAIN_KEYS",
    "LR_SCHEDULES",
    "PREEMPT_SIGNALS", "PREEMPTED_EXIT",
]

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
