"""handbook_lib.core.strategies: one table of strategies, and nobody else deciding by name."""

import re
from pathlib import Path
from typing import get_args

import pytest

from handbook_lib.core import (
    STRATEGIES,
    STRATEGY_TABLE,
    WRAPPERS,
    Strategy,
    StrategyName,
    get_strategy,
    strategies_where,
)

LIBRARY = Path(__file__).resolve().parents[1] / "handbook_lib"


def test_the_literal_and_the_table_list_the_same_strategies():
    assert STRATEGIES == get_args(StrategyName) == tuple(STRATEGY_TABLE)
    assert all(row.name == name for name, row in STRATEGY_TABLE.items())
    assert all(row.wrapper in WRAPPERS for row in STRATEGY_TABLE.values())


def test_rows_are_consistent():
    for row in STRATEGY_TABLE.values():
        if row.shards_params:  # what is sharded at rest implies the rest is sharded too
            assert row.shards_grads and row.shards_optimizer, row.name
        if row.hybrid:
            assert row.shards_params, row.name
        if row.reshard_after_forward:
            assert row.shards_params, row.name
        if row.wrapper != "fsdp":
            assert row.fsdp1 is None and not row.fsdp2, row.name
        if row.zero_stage is not None and not row.hybrid:
            # ZeRO's stage counts what it shards: 1 optimizer, 2 + gradients, 3 + parameters
            assert row.zero_stage == row.shards_optimizer + row.shards_grads + row.reshard_after_forward


def test_fsdp1_names_are_members_of_torchs_sharding_strategy():
    from torch.distributed.fsdp import ShardingStrategy

    for row in STRATEGY_TABLE.values():
        if row.fsdp1 is not None:
            assert ShardingStrategy[row.fsdp1].name == row.fsdp1


@pytest.mark.parametrize("name, world, size, group", [
    ("DDP", 8, None, 1), ("NO_SHARD", 8, None, 1), ("NONE", 1, None, 1),
    ("SHARD_GRAD_OP", 8, None, 8), ("FULL_SHARD", 8, None, 8),
    ("HYBRID_SHARD", 8, 4, 4), ("HYBRID_SHARD_ZERO2", 8, 2, 2), ("HYBRID_SHARD", 8, None, 8),
])
def test_one_shard_group_rule(name, world, size, group):
    assert get_strategy(name).shard_group(world, size) == group


@pytest.mark.parametrize("name, world, size, match", [
    ("HYBRID_SHARD", 8, 3, "must divide world_size=8"),
    ("FULL_SHARD", 8, 4, "applies only to the hybrid strategies"),
    ("DDP", 0, None, "world_size must be an int >= 1"),
])
def test_shard_group_refuses(name, world, size, match):
    with pytest.raises(ValueError, match=match):
        get_strategy(name).shard_group(world, size)


def test_lookup_and_filters():
    assert get_strategy("FULL_SHARD") is STRATEGY_TABLE["FULL_SHARD"]
    assert get_strategy(STRATEGY_TABLE["DDP"]) is STRATEGY_TABLE["DDP"]
    with pytest.raises(ValueError, match=r"strategy must be one of NONE, DDP, .*ZERO3, got 'ZERO4'"):
        get_strategy("ZERO4")
    assert strategies_where(wrapper="deepspeed") == ("ZERO1", "ZERO2", "ZERO3")
    assert strategies_where(hybrid=True) == ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
    assert strategies_where(wrapper="ddp") == ("DDP",)


def test_cpu_offload_needs_fsdp():
    get_strategy("NO_SHARD").check_cpu_offload(True)
    get_strategy("DDP").check_cpu_offload(False)
    get_strategy("ZERO2").check_cpu_offload(True)
    with pytest.raises(ValueError, match=r"^--cpu-offload needs an FSDP or ZeRO strategy .*ZERO3\): DDP keeps"):
        get_strategy("DDP").check_cpu_offload(True, flag="--cpu-offload")


def test_spellings_and_deepspeed_sections():
    assert get_strategy("SHARD_GRAD_OP").fsdp2_spelling == "fully_shard(m, reshard_after_forward=False)"
    assert "mesh=<2-D (replicate, shard) mesh>" in get_strategy("HYBRID_SHARD").fsdp2_spelling
    assert get_strategy("NO_SHARD").fsdp2_spelling.startswith("none: FSDP2 has no NO_SHARD")
    assert get_strategy("FULL_SHARD").deepspeed_config() == {"stage": 3}
    assert get_strategy("HYBRID_SHARD").deepspeed_config() is None  # MiCS left DeepSpeed in 0.19
    assert get_strategy("HYBRID_SHARD_ZERO2").deepspeed_config() is None
    assert [get_strategy(f"ZERO{k}").deepspeed_config() for k in (1, 2, 3)] == [{"stage": k} for k in (1, 2, 3)]
    assert not any(get_strategy(f"ZERO{k}").runs_with(api) for k in (1, 2, 3) for api in ("fsdp1", "fsdp2"))


def test_a_new_row_needs_no_other_module():
    """A ZeRO-1-like row (optimizer state sharded only) flows through the pure models unchanged:
    the memory model shards exactly the optimizer state, the comm model all-reduces gradients."""
    from handbook_lib.core import ModelConfig
    from handbook_lib.models import estimate_memory

    zero1 = Strategy("ZERO1", "fsdp", False, False, True, False, False, None, False, 1, "", False, "")
    model = ModelConfig(num_layers=2, d_model=64, nhead=2, dim_feedforward=128, vocab_size=1000)
    ddp = estimate_memory(model, 4, "DDP")
    one = estimate_memory(model, 4, zero1)
    assert one.components["params"] == ddp.components["params"]
    assert one.components["grads"] == ddp.components["grads"]
    assert one.components["optimizer"] < ddp.components["optimizer"] / 3


_NAMES = "|".join(STRATEGIES)
_COMPARED = re.compile(r"""(==|!=|\bin\s*\(|\bin\s*\[)[^\n]*["'](%s)["']|["'](%s)["']\s*(==|!=)"""
                       r"""|startswith\(["'](HYBRID|SHARD|FULL|NO_)""" % (_NAMES, _NAMES))


def test_no_module_decides_by_a_strategy_name():
    """Outside the table, no library module compares a strategy's name (read the row instead)."""
    offenders = []
    for path in sorted(LIBRARY.rglob("*.py")):
        if path.name == "strategies.py":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = re.sub(r"\bfor\s+[\w, ]+\s+in\b", "", line)  # iterating over names decides nothing
            if _COMPARED.search(code) and not line.lstrip().startswith("#"):
                offenders.append(f"{path.relative_to(LIBRARY)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_which_api_runs_which_row():
    assert get_strategy("NO_SHARD").runs_with("fsdp1") and not get_strategy("NO_SHARD").runs_with("fsdp2")
    assert get_strategy("DDP").runs_with("fsdp2") and get_strategy("NONE").runs_with("fsdp1")
    assert all(get_strategy(s).runs_with(api) for s in ("SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD",
                                                          "HYBRID_SHARD_ZERO2") for api in ("fsdp1", "fsdp2"))


def test_only_full_shard_is_fully_sharded_over_one_group():
    """Chapter 9's runs compose tensor and sequence parallelism with this row alone: everything
    sharded, freed after forward, one group (HSDP's replicas and ZeRO-3's engine are not it)."""
    assert [s for s in STRATEGIES if get_strategy(s).fully_sharded] == ["FULL_SHARD"]
