"""handbook_lib.core.config: the run-config vocabulary rejects what it does not know."""

import pytest

from handbook_lib.core import (
    APIS,
    OPTIMIZERS,
    PRECISIONS,
    STRATEGIES,
    ModelConfig,
    RunConfig,
    parse_overrides,
)


def test_defaults_match_the_model_defaults():
    assert RunConfig().model_config() == ModelConfig()


def test_unknown_key_lists_accepted_keys():
    with pytest.raises(ValueError) as err:
        RunConfig.from_mapping({"stepz": 3})
    message = str(err.value)
    assert "'stepz'" in message
    for key in RunConfig.keys():
        assert key in message


@pytest.mark.parametrize("key, values", [
    ("strategy", STRATEGIES), ("api", APIS), ("precision", PRECISIONS), ("optimizer", OPTIMIZERS),
    ("optimizer_impl", ("default", "for-loop", "foreach", "fused")),
])
def test_bad_choice_lists_accepted_values(key, values):
    with pytest.raises(ValueError) as err:
        RunConfig.from_mapping({key: "nonsense"})
    assert all(v in str(err.value) for v in values)
    for value in values:  # and every accepted value is accepted
        assert getattr(RunConfig.from_mapping({key: value}), key) == value


def test_strings_are_converted_by_field_type():
    config = RunConfig.from_mapping(parse_overrides(
        ["steps=3", "lr=0.5", "activation_checkpointing=true", "cpu_offload=0", "strategy=SHARD_GRAD_OP"]
    ))
    assert (config.steps, config.lr, config.activation_checkpointing, config.cpu_offload) == (3, 0.5, "full", False)
    assert config.strategy == "SHARD_GRAD_OP"


@pytest.mark.parametrize("value, mode", [(True, "full"), (False, "none"), ("true", "full"), ("False", "none"),
                                         ("none", "none"), ("selective", "selective"), ("full", "full")])
def test_activation_checkpointing_takes_three_modes_and_the_old_booleans(value, mode):
    assert RunConfig.from_mapping({"activation_checkpointing": value}).activation_checkpointing == mode
    assert RunConfig(activation_checkpointing=value).activation_checkpointing == mode
    assert RunConfig.choices()["activation_checkpointing"] == ("none", "selective", "full")


def test_activation_checkpointing_refuses_other_values():
    with pytest.raises(ValueError, match="'activation_checkpointing' got 'some'; accepted values: none, selective"):
        RunConfig.from_mapping({"activation_checkpointing": "some"})


@pytest.mark.parametrize("mapping, match", [
    ({"steps": "three"}, "steps"),
    ({"steps": 0}, "steps"),
    ({"batch_size": 2.5}, "batch_size"),
    ({"cpu_offload": "maybe"}, "boolean"),
    ({"lr": -1.0}, "lr"),
    ({"nhead": 3}, "nhead=3 must divide"),
])
def test_bad_values_raise(mapping, match):
    with pytest.raises(ValueError, match=match):
        RunConfig.from_mapping(mapping)


def test_round_trip_and_replace():
    config = RunConfig(steps=7, precision="bf16-mixed")
    assert RunConfig.from_mapping(config.to_dict()) == config
    assert config.replace(steps=2).steps == 2
    with pytest.raises(ValueError):
        config.replace(unknown=1)


@pytest.mark.parametrize("item", ["noequals", "=3", ""])
def test_parse_overrides_rejects_malformed(item):
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides([item])


def test_chapter5_keys_are_validated():
    config = RunConfig.from_mapping({"strategy": "NONE", "wrap": "size", "wrap_min_params": "5000",
                                     "grad_scaler": "false", "grad_scale_init": "1024"})
    assert (config.wrap_min_params, config.grad_scaler, config.grad_scale_init) == (5000, False, 1024.0)
    with pytest.raises(ValueError, match="accepted values: layer, model, size"):
        RunConfig(wrap="blocks")
    with pytest.raises(ValueError, match="wrap_min_params"):
        RunConfig(wrap_min_params=0)
    with pytest.raises(ValueError, match="grad_scale_init"):
        RunConfig(grad_scale_init=0.0)


def test_lookup_returns_the_entry_and_lists_choices_on_error():
    """config.lookup: one lookup, one error message, for every preset and vocabulary table."""
    from handbook_lib.core import lookup

    table = {"a": 1, "b": 2}
    assert lookup(table, "b", "letter") == 2
    with pytest.raises(ValueError, match=r"^letter must be one of a, b, got 'c'$"):
        lookup(table, "c", "letter")
    with pytest.raises(ValueError, match="letter must be one of"):
        lookup(table, ["unhashable"], "letter")


def _documented(module, class_name):
    """The fields of ``class_name`` in ``module`` that have a docstring under them (read from the
    source)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(module))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name).body
    return {node.target.id for node, after in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)}


def test_every_run_config_key_is_documented_and_choices_are_literals():
    """A docstring under every section of RunConfig and every key of each section, and the
    accepted values of the choice keys come from their Literal annotations."""
    import handbook_lib.core.architecture as architecture
    import handbook_lib.core.config as config_module

    assert set(RunConfig.sections()) == {"model", "data", "layout", "numerics", "levers"}
    assert set(RunConfig.sections()) - _documented(config_module, "RunConfig") == set()
    documented = _documented(architecture, "ModelConfig")
    for name in ("DataConfig", "LayoutConfig", "NumericsConfig", "LeversConfig"):
        documented |= _documented(config_module, name)
    assert set(RunConfig.keys()) - documented == set()
    assert RunConfig.choices() == {"strategy": STRATEGIES, "api": APIS, "wrap": ("layer", "model", "size"),
                                   "precision": tuple(PRECISIONS), "optimizer": OPTIMIZERS,
                                   "optimizer_impl": ("default", "for-loop", "foreach", "fused"),
                                   "init": ("meta", "full"), "lr_schedule": ("constant", "cosine", "linear"),
                                   "activation_checkpointing": ("none", "selective", "full"),
                                   "ac_save": ("matmul+attention", "matmul", "attention")}


def _config_classes():
    from handbook_lib.runs.checkpoint_resume import CheckpointRunConfig
    from handbook_lib.runs.comm_bench import BenchConfig
    from handbook_lib.runs.deepspeed_zero import ZeroRunConfig
    from handbook_lib.runs.step_time import StepTimeConfig
    return [RunConfig, CheckpointRunConfig, ZeroRunConfig, StepTimeConfig, BenchConfig]


@pytest.mark.parametrize("cls", _config_classes(), ids=lambda c: c.__name__)
def test_every_minimum_is_enforced_with_the_key_named(cls):
    """Each int key in MINIMUMS: its minimum is accepted, one less is refused by a message that
    names the key and the minimum; a subclass keeps its base's minimums."""
    for base in cls.__mro__[1:]:
        assert set(getattr(base, "MINIMUMS", {})) <= set(cls.MINIMUMS)
    assert cls.MINIMUMS, cls.__name__
    for key, minimum in cls.MINIMUMS.items():
        assert getattr(cls.from_mapping({key: minimum}), key) == minimum
        with pytest.raises(ValueError, match=rf"^config key '{key}' must be an int >= {minimum}, "
                                             rf"got {minimum - 1}$"):
            cls.from_mapping({key: minimum - 1})


@pytest.mark.parametrize("batch, ranks, accum, message", [
    (8, 2, 1, None),
    (8, 2, 4, None),
    (9, 2, 1, "batch_size=9 must be divisible by the number of ranks 2"),
    (8, 2, 3, "batch_size=8 must be divisible by the number of ranks 2 times grad_accum_steps=3"),
])
def test_check_batch(batch, ranks, accum, message):
    config = RunConfig(batch_size=batch, grad_accum_steps=accum)
    if message is None:
        config.check_batch(ranks)
    else:
        with pytest.raises(ValueError, match=f"^{message}$"):
            config.check_batch(ranks)


@pytest.mark.parametrize("key, value, words", [
    ("reshard_after_forward_size", 1, "SHARD_GRAD_OP"),
    ("explicit_prefetch", -1, "explicit_prefetch"),
    ("sync_every_micro_step", True, "grad_accum_steps >= 2"),
    ("reshard_after_backward", False, "grad_accum_steps >= 2"),
])
def test_fsdp2_knobs_are_validated_with_the_key_named(key, value, words):
    with pytest.raises(ValueError) as err:
        RunConfig.from_mapping({key: value})
    assert key in str(err.value) and words in str(err.value)


def test_fsdp2_knobs_accepted_and_flag_the_probe():
    assert not RunConfig().tunes_fsdp2  # the book's other runs: no probe, no extra checks
    for change in ({"explicit_prefetch": 1}, {"reshard_after_forward_size": 2}, {"count_gathered": True},
                   {"grad_accum_steps": 2, "sync_every_micro_step": True},
                   {"grad_accum_steps": 2, "reshard_after_backward": "false"}):
        config = RunConfig.from_mapping(change)
        assert config.tunes_fsdp2
        assert all(getattr(config, k) == (v if not isinstance(v, str) else False) for k, v in change.items())



# --- numbers typed as text: one parser per type, the accepted range in the one-line message -------

@pytest.mark.parametrize("text, message", [
    ("3.0", "--set steps=3.0: steps takes a whole number >= 1"),
    ("1e1", "--set steps=1e1: steps takes a whole number >= 1"),
    ("", "--set steps=: steps takes a whole number >= 1"),
    ("1e-3x", "--set steps=1e-3x: steps takes a whole number >= 1"),
    ("0", "--set steps=0: steps takes a whole number >= 1"),
    ("three", "--set steps=three: steps takes a whole number >= 1"),
])
def test_an_int_key_typed_as_text_names_its_range(text, message):
    with pytest.raises(ValueError) as refused:
        RunConfig.from_mapping(parse_overrides([f"steps={text}"]))
    assert str(refused.value) == message


@pytest.mark.parametrize("item, message", [
    ("lr=1e-3x", "--set lr=1e-3x: lr takes a finite number > 0"),
    ("lr=", "--set lr=: lr takes a finite number > 0"),
    ("lr=nan", "--set lr=nan: lr takes a finite number > 0"),
    ("lr=0", "--set lr=0: lr takes a finite number > 0"),
    ("lr=1e400", "--set lr=1e400: lr takes a finite number > 0"),
    ("max_grad_norm=-1", "--set max_grad_norm=-1: max_grad_norm takes a finite number >= 0"),
    ("cpu_offload=maybe", "--set cpu_offload=maybe: cpu_offload takes a boolean, true or false (also 1/0, yes/no, on/off)"),
    ("cpu_offload=", "--set cpu_offload=: cpu_offload takes a boolean, true or false (also 1/0, yes/no, on/off)"),
    ("vocab_size=0", "--set vocab_size=0: vocab_size takes a whole number >= 1"),
    ("num_layers=2.5", "--set num_layers=2.5: num_layers takes a whole number >= 1"),
    ("seed=-1", "--set seed=-1: seed takes a whole number >= 0"),
])
def test_every_type_typed_as_text_names_its_range(item, message):
    with pytest.raises(ValueError) as refused:
        RunConfig.from_mapping(parse_overrides([item]))
    assert str(refused.value) == message


def test_text_that_is_a_value_of_its_type_is_read():
    config = RunConfig.from_mapping(parse_overrides(
        ["steps=7", "lr=2e-3", "cpu_offload=on", "max_grad_norm=0", "seed= 3 ", "batch_size=1_6"]))
    assert (config.steps, config.lr, config.cpu_offload, config.max_grad_norm, config.seed, config.batch_size) == \
        (7, 0.002, True, 0.0, 3, 16)
    from handbook_lib.runs.fault import FaultConfig  # a run's own config: a float key with no bound
    with pytest.raises(ValueError, match=r"^--set sleep_s=x: sleep_s takes a finite number$"):
        FaultConfig.from_mapping({"sleep_s": "x"})


def test_a_key_given_twice_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"^--set steps given twice \(steps=3, steps=4\): give each key once$"):
        parse_overrides(["steps=3", "steps=4"])
    with pytest.raises(ValueError, match=r"^--set lr given twice"):
        parse_overrides(["lr=0.1", "steps=2", " lr =0.2"])
    assert parse_overrides(["steps=3", "seed=3"]) == {"steps": "3", "seed": "3"}


def test_the_parsers_refuse_what_python_would_coerce():
    from handbook_lib.core.checks import BadText, parse_bool, parse_count, parse_float, parse_int

    assert parse_int(" 12 ", 1) == 12 and parse_int("-3") == -3 and parse_int("1_000", 0, 1001) == 1000
    for text in ("3.0", "1e1", "", " ", "1e-3x", "0x10", "١٢", "+"):
        with pytest.raises(BadText, match=r"^must be a whole number >= 1, got "):
            parse_int(text, 1)
    with pytest.raises(BadText, match=r"^must be a whole number in \[1, 65536\), got 70000$"):
        parse_int("70000", 1, 65536)
    assert parse_float("1e-3", above=0) == 0.001
    for text in ("nan", "inf", "-inf", "1e400", "", "0.1.2"):
        with pytest.raises(BadText, match=r"^must be a finite number > 0, got "):
            parse_float(text, above=0)
    with pytest.raises(BadText, match=r"^must be a number in \[0, 1\), got '1'$"):
        parse_float("1", 0, below=1)
    assert [parse_bool(t) for t in ("TRUE", "0", " yes ", "Off")] == [True, False, True, False]
    assert parse_count("7e9", 1, 10**15) == 7 * 10**9 and parse_count("1.5e3") == 1500
    for text in ("7.5", "1e30", "0", "inf", "nan", "", "7e9x"):
        with pytest.raises(BadText, match=r"^must be a whole number from 1 to 1e15 \(e.g. 7e9\), got "):
            parse_count(text, 1, 10**15)


def test_the_optimizer_implementation_resolves_per_device_and_refuses_fused_sgd_on_fsdp2():
    """torch's default: foreach where foreach kernels exist (CUDA), the for-loop on the CPU;
    fused SGD has no DTensor rule, so FSDP2 refuses it, while DDP's plain tensors take it."""
    from handbook_lib.core.config import optimizer_impl_on

    assert [optimizer_impl_on("default", d) for d in ("cuda", "cpu")] == ["foreach", "for-loop"]
    assert optimizer_impl_on("fused", "cpu") == "fused"
    with pytest.raises(ValueError, match="optimizer_impl must be one of default, for-loop, foreach, fused"):
        optimizer_impl_on("apex", "cuda")
    with pytest.raises(ValueError, match="'optimizer_impl'='fused' cannot step sgd over FSDP2"):
        RunConfig(optimizer="sgd", optimizer_impl="fused")
    assert RunConfig(optimizer="sgd", optimizer_impl="fused", strategy="DDP").optimizer_impl == "fused"
    assert RunConfig(optimizer="sgd", optimizer_impl="fused", api="fsdp1").optimizer_impl == "fused"


def test_pure_bf16_keeps_the_state_in_bf16_and_builds_on_the_meta_device():
    from handbook_lib.core.config import state_dtype

    assert [state_dtype(p) for p in ("fp32", "bf16-mixed", "fp16-mixed", "bf16")] == ["fp32", "fp32", "fp32", "bf16"]
    assert RunConfig(precision="bf16").precision == "bf16"
    for bad in ({"init": "full"}, {"api": "fsdp1"}):
        with pytest.raises(ValueError, match="'precision'='bf16' .* builds on the meta device"):
            RunConfig(precision="bf16", **bad)
    assert RunConfig(precision="bf16", strategy="ZERO3", init="full").precision == "bf16"  # DeepSpeed's bf16 master
