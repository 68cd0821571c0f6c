"""handbook_lib.core.parallel_layout: the degrees of a job's axes and every rule about them, checked
against a brute-force statement of each rule, and the package searched for a rule stated elsewhere."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from handbook_lib.core.parallel_layout import INTRA_NODE_AXES, MESH_DIMS, ParallelLayout
from handbook_lib.core.strategies import STRATEGY_TABLE, get_strategy

PACKAGE = Path(__file__).resolve().parent.parent / "handbook_lib"


def _brute(world, tp, sp, method, group, per_node, nhead, kv, ffn, vocab, seq, seq_par):
    """Each rule written out plainly: True when every one holds."""
    if world % (tp * sp):
        return False
    if group is not None and (world // (tp * sp)) % group:
        return False
    if tp > 1 and any(n % tp for n in (per_node, nhead, kv, ffn, vocab) if n is not None):
        return False
    if tp > 1 and seq_par and seq % tp:
        return False
    if sp > 1 and seq % sp:
        return False
    return not (sp > 1 and method == "ulysses" and (nhead % sp or kv % sp))


@pytest.mark.parametrize("world", range(1, 13))
def test_allows_agrees_with_each_rule_written_out(world):
    shapes = [(4, 2, 8, 6, 12), (6, 6, 12, 10, 9), (8, 1, 16, 16, 16)]
    for tp, sp in itertools.product(range(1, 7), repeat=2):
        if tp > 1 and sp > 1 and world % (tp * sp) == 0:
            continue  # both axes together: checked in test_both_model_parallel_axes
        for method, group, per_node, (nhead, kv, ffn, vocab, seq), seq_par in itertools.product(
                ("ulysses", "ring"), (None, 1, 2, 3), (None, 4, 8), shapes, (False, True)):
            got = ParallelLayout.allows(world, tp=tp, sp=sp, sp_method=method, shard_group=group,
                                        gpus_per_node=per_node, nhead=nhead, kv_heads=kv, ffn=ffn, vocab=vocab,
                                        seq_len=seq, sequence_parallel=seq_par)
            want = _brute(world, tp, sp, method, group, per_node, nhead, kv, ffn, vocab, seq, seq_par)
            assert got == want, (world, tp, sp, method, group, per_node, nhead, kv, ffn, vocab, seq, seq_par)


def test_both_model_parallel_axes():
    assert ParallelLayout.allows(8, tp=2, sp=2, sp_method="ring")
    assert ParallelLayout.refusal(6, tp=2, sp=2) == "tp_size=2 x sp_size=2 must divide world_size=6"


@pytest.mark.parametrize("world", range(1, 17))
def test_the_product_of_the_degrees_is_the_world(world):
    for tp, sp, group in itertools.product((1, 2, 4), (1, 2), (None, 1, 2)):
        if not ParallelLayout.allows(world, tp=tp, sp=sp, shard_group=group):
            continue
        layout = ParallelLayout.for_world(world, tp=tp, sp=sp, shard_group=group, sp_method="ring")
        assert layout.world_size == world == layout.dp * tp * sp
        assert layout.dp_shard == (group or world // (tp * sp))
        names, sizes = layout.mesh_dims()
        assert list(names) == [n for n in MESH_DIMS if n in names] and all(s > 1 for s in sizes)
        product = 1
        for size in sizes:
            product *= size
        assert product == world


def test_mesh_dims_in_torchtitans_order():
    layout = ParallelLayout(dp_replicate=2, dp_shard=4, tp=2, sp=3, sp_method="ring")
    assert layout.mesh_dims() == (("dp_replicate", "dp_shard", "sp", "tp"), (2, 4, 3, 2))
    assert layout.fsdp_size == 12 and layout.hybrid and layout.world_size == 48
    assert ParallelLayout().mesh_dims() == ((), ())
    assert MESH_DIMS == ("pp", "dp_replicate", "dp_shard", "sp", "tp") and INTRA_NODE_AXES == ("tp",)


def test_strategies_map_onto_the_data_parallel_degrees():
    for name, row in STRATEGY_TABLE.items():
        world = 1 if not row.distributed else 8
        layout = get_strategy(name).layout(world, 2 if row.hybrid else None)
        if not row.sharded:
            assert (layout.dp_replicate, layout.dp_shard) == (world, 1), name
        elif row.hybrid:
            assert (layout.dp_replicate, layout.dp_shard) == (4, 2), name
        else:
            assert (layout.dp_replicate, layout.dp_shard) == (1, world), name
        assert get_strategy(name).shard_group(world, 2 if row.hybrid else None) == layout.dp_shard
    assert get_strategy("FULL_SHARD").layout(8, tp=2).mesh_dims() == (("dp_shard", "tp"), (4, 2))


@pytest.mark.parametrize("kwargs, message", [
    ({"pp": 3}, "pp_size=3 must divide world_size=8"),
    ({"pp": 4, "layers": 2}, "pp_size=4 must be at most num_layers=2 (a stage holds whole layers)"),
    ({"pp": 2, "tp": 8}, "tp_size=8 must divide the 4 ranks of a pipeline stage"),
    ({"tp": 3}, "tp_size=3 must divide world_size=8"),
    ({"tp": 2, "gpus_per_node": 1, "nhead": 3}, "tp_size=2 must divide gpus_per_node=1 and nhead=3"),
    ({"shard_group": 3}, "shard_group_size=3 must divide world_size=8"),
    ({"tp": 2, "shard_group": 3}, "shard_group_size=3 must divide the 4 data-parallel ranks"),
    ({"sp": 4, "seq_len": 10}, "sp_size=4 must divide seq_len=10"),
    ({"sp": 4, "nhead": 2, "kv_heads": 4, "seq_len": 8},
     "sp_size=4 with sp_method=ulysses must divide nhead=2 (its all-to-all splits the heads); "
     "sp_method=ring needs neither"),
    ({"tp": 2, "seq_len": 9, "sequence_parallel": True},
     "tp_size=2 with sequence_parallel=True must divide seq_len=9"),
    ({"tp": 2, "names": {"tp": "--tp-size {}", "world": "--gpus ({})"}, "vocab": 7}, "--tp-size 2 must divide vocab_size=7"),
])
def test_a_refusal_is_one_line_naming_the_degree_and_what_it_must_divide(kwargs, message):
    with pytest.raises(ValueError) as err:
        ParallelLayout.for_world(8, **kwargs)
    assert str(err.value) == message


def test_a_layout_refuses_a_bad_degree():
    with pytest.raises(ValueError, match="tp must be an int >= 1"):
        ParallelLayout(tp=0)
    with pytest.raises(ValueError, match="sp_method must be one of ulysses, ring"):
        ParallelLayout(sp=2, sp_method="rings")


# --- the rules live here only ------------------------------------------------------------------
DEGREES = {"tp", "sp", "tp_size", "sp_size", "group", "shard_group", "shard_group_size", "inner", "inner_size"}
"""Names a degree goes by in the package: a ``% <degree>`` in a condition is a divisibility rule."""
PHRASES = ("must divide", "must be divisible", "divisible by", "must divide by")
AXIS_WORDS = ("tp_size", "sp_size", "shard_group", "shard group", "--tp-size", "--sp-size", "tp=", "sp=")
HOME = "core/parallel_layout.py"
ELSEWHERE = {
    ("models/tensor_parallel.py", "local_shape"): "one tensor's split along its TP dim (the layout's nhead/ffn/vocab "
                                                  "rule, checked again where a tensor is cut)",
    ("models/tensor_parallel.py", "estimate_tp_layer_traffic"): "a (T, d) buffer's reduce-scatter under SP",
    ("models/traffic.py", "estimate_step_traffic"): "FSDP2's reshard_after_forward=int subgroup (not a mesh axis)",
    ("runs/specs/fsdp_train.py", "_validate_knobs"): "FSDP2's reshard_after_forward=int subgroup (not a mesh axis)",
}
"""Statements of a divisibility that are not the layout's rules, with why."""


def _degree(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _conditions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            yield node.test
        elif isinstance(node, ast.comprehension):
            yield from node.ifs
        elif isinstance(node, ast.Call) and _degree(node.func) in ("all", "any"):
            yield from node.args


def _statements() -> list[tuple[str, str, int, str]]:
    """``(module, function, line, what)`` of every divisibility rule stated in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for test in _conditions(func):
                for node in ast.walk(test):
                    if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod)
                            and _degree(node.right) in DEGREES):
                        found.append((rel, func.name, node.lineno, f"% {_degree(node.right)}"))
            for node in ast.walk(func):
                if isinstance(node, ast.Raise) and node.exc is not None:
                    text = " ".join(c.value for c in ast.walk(node.exc)
                                    if isinstance(c, ast.Constant) and isinstance(c.value, str))
                    if any(p in text for p in PHRASES) and any(w in text for w in AXIS_WORDS):
                        found.append((rel, func.name, node.lineno, "message"))
    return found


def test_each_divisibility_rule_lives_in_the_layout_only():
    stray = [s for s in _statements() if s[0] != HOME and s[:2] not in ELSEWHERE]
    assert stray == [], "a divisibility rule stated outside core/parallel_layout.py: " + repr(stray)
    assert {s[:2] for s in _statements()} == set(ELSEWHERE)  # the scan is live: it sees each of these


def test_the_scan_finds_a_restated_rule(tmp_path):
    """The checker's own proof: a planted rule is reported."""
    planted = ("def price(world_size, tp_size):\n    if world_size % tp_size:\n"
               "        raise ValueError(f'tp_size={tp_size} must divide the GPUs')\n")
    tree = ast.parse(planted)
    func = tree.body[0]
    assert any(isinstance(n, ast.BinOp) and _degree(n.right) in DEGREES for t in _conditions(func)
               for n in ast.walk(t))


def test_the_pipeline_is_the_outermost_axis_and_the_other_axes_split_a_stage():
    layout = ParallelLayout.for_world(8, pp=2, tp=2, layers=4)
    assert (layout.pp, layout.dp, layout.tp, layout.world_size) == (2, 2, 2, 8)
    assert layout.mesh_dims() == (("pp", "dp_shard", "tp"), (2, 2, 2))
