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
        forward_modules,
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
    from handbook_lib.core.parallel_config import AXES_LEVERS_REFUSED, PP_SCHEDULES, SP_METHODS, ParallelConfig
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


__getattr__, __dir__, __all__ = lazy_exports(__name__)
