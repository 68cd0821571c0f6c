"""handbook_lib.core.flat_config and the sections of core.config.RunConfig: every key keeps its flat
name, every stored notebook's configs still build, and a key lives in one section."""

import ast
import json
from pathlib import Path

import pytest

from handbook_lib.core import ModelConfig, RunConfig
from handbook_lib.core.config import DataConfig, LayoutConfig, LeversConfig, NumericsConfig
from handbook_lib.core.parallel_config import AxesLayoutConfig, ParallelConfig
from handbook_lib.runs.specs import SPECS

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
CONFIG_CLASSES = list(dict.fromkeys(spec.config for spec in SPECS.values()))


def test_run_config_composes_five_sections():
    config = RunConfig(num_layers=2, steps=3, strategy="SHARD_GRAD_OP", lr=0.01, cpu_offload=True)
    assert config.model == ModelConfig(num_layers=2) and config.model_config() is config.model
    assert config.data == DataConfig(steps=3)
    assert config.layout == LayoutConfig(strategy="SHARD_GRAD_OP")
    assert config.numerics == NumericsConfig(lr=0.01)
    assert config.levers == LeversConfig(cpu_offload=True)
    assert (config.num_layers, config.steps, config.strategy, config.lr, config.cpu_offload) == (
        2, 3, "SHARD_GRAD_OP", 0.01, True)
    # each key once: the sections' keys, in order, are the flat keys
    flat = [key for keys in RunConfig.sections().values() for key in keys]
    assert flat == list(RunConfig.keys()) and len(set(flat)) == len(flat) == 37


def test_a_key_by_its_section_name_is_the_same_key():
    dotted = RunConfig.from_mapping({"model.num_layers": "2", "numerics.lr": "0.01", "data.steps": 3})
    assert dotted == RunConfig.from_mapping({"num_layers": "2", "lr": "0.01", "steps": 3})
    assert RunConfig(**{"levers.init": "full"}).init == "full"
    with pytest.raises(ValueError, match="unknown config key"):
        RunConfig.from_mapping({"data.lr": 0.01})  # lr lives in numerics
    with pytest.raises(ValueError, match=r"^config key 'steps' given twice, by its name and its section's \('data.steps'\)$"):
        RunConfig.from_mapping({"steps": 3, "data.steps": 4})


def test_a_section_keeps_the_class_defaults_of_its_other_keys():
    """A run that changes a default through its section (the clinic's tiny model, ZeRO's
    strategy) keeps it when another key of that section is set."""
    clinic = SPECS["clinic"].config
    assert clinic(num_layers=3).model == ModelConfig(96, 32, 2, 64, 3)
    zero = SPECS["deepspeed_zero"].config.from_mapping({"shard_group_size": "0", "wrap": "model"})
    assert (zero.strategy, zero.init, zero.wrap) == ("ZERO3", "full", "model")


def test_an_axes_run_extends_the_layout_section():
    config = ParallelConfig(tp_size=2, strategy="FULL_SHARD")
    assert isinstance(config.layout, AxesLayoutConfig) and config.layout.tp_size == 2
    assert config.parallel_layout(4).tp == 2
    assert list(ParallelConfig.keys())[:37] == list(RunConfig.keys())  # the shared keys first, in order


def test_config_round_trips_and_pickles():
    import pickle

    config = ParallelConfig(tp_size=2, precision="bf16-mixed", steps=4)
    assert ParallelConfig.from_mapping(config.to_dict()) == config
    assert pickle.loads(pickle.dumps(config)) == config
    assert config.to_sections()["layout"]["tp_size"] == 2
    with pytest.raises(AttributeError):
        config.no_such_key  # noqa: B018 - the attribute access is the test


def test_a_key_declared_again_outside_its_section_is_refused():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Twice(RunConfig):
        steps: int = 3

    with pytest.raises(TypeError, match="declares steps again, outside its section"):
        Twice()


def _literal(node, names):
    """``node``'s value if it is a literal, or a name bound to one; ``KeyError`` otherwise."""
    if isinstance(node, ast.Name):
        return names[node.id]
    if isinstance(node, ast.Dict):
        return _dict(node, names)
    return ast.literal_eval(node)


def _dict(node, names):
    """A dict display's known entries: ``**NAME`` of a dict bound earlier in the notebook, and
    literal keys with literal (or known) values; what a loop or a call makes is left out."""
    out = {}
    for key, value in zip(node.keys, node.values):
        try:
            if key is None:
                out.update(_literal(value, names))
            elif isinstance(key, ast.Constant) and isinstance(key.value, str):
                out[key.value] = _literal(value, names)
        except (KeyError, ValueError, TypeError, SyntaxError):
            continue
    return out


def _notebook_configs(path):
    """Every dict display in the notebook's code cells that names a run-config key, evaluated
    as far as its literals go."""
    keys = {key for cls in CONFIG_CLASSES for key in cls.keys()}
    names, found = {}, []
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        lines = "".join(cell["source"]).splitlines()
        tree = ast.parse("\n".join(line for line in lines if not line.lstrip().startswith(("%", "!"))))
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                try:
                    names[node.targets[0].id] = _literal(node.value, names)
                except (KeyError, ValueError, TypeError, SyntaxError):
                    pass
            if isinstance(node, ast.Dict):
                values = _dict(node, names)
                if values and set(values) <= keys:
                    found.append(values)
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_stored_notebook_config_builds_by_flat_and_by_section_names(path):
    """Each config a chapter writes is accepted by a run's config class, keeps every value, and
    spelled by its sections' names (``data.steps``) builds the same config."""
    configs = _notebook_configs(path)
    for values in configs:
        accepted = []
        for cls in CONFIG_CLASSES:
            try:
                accepted.append((cls, cls.from_mapping(values)))
            except ValueError:
                continue
        assert accepted, values
        for cls, config in accepted:
            assert {key: config.to_dict()[key] for key in values} == {
                key: (config.to_dict()[key] if key == "activation_checkpointing" else value)
                for key, value in values.items()}
            homes = {key: name for name, keys in cls.sections().items() for key in keys}
            dotted = {(f"{homes[key]}.{key}" if key in homes else key): value for key, value in values.items()}
            assert cls.from_mapping(dotted) == config


def test_the_notebooks_hold_many_configs():
    """The scan above reads the chapters' configs, not nothing."""
    counts = {path.stem: len(_notebook_configs(path)) for path in NOTEBOOKS}
    assert sum(counts.values()) >= 40, counts
    assert sum(1 for n in counts.values() if n) >= 9, counts
