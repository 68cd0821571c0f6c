"""The clinic run (chapter 10): every case in one real 2-rank job, broken then fixed.

One torchrun job (module fixture) runs all cases through ``torchrun_batch`` with a config the
chapter does not use (another seed, d_model 48, a 1 s hang timeout); each case's broken half
must show its symptom in a check, its fixed half must pass every check, and the figures are
recomputed here from the shapes, independently of the library's models.
"""

from __future__ import annotations

import math

import pytest

from handbook_lib.core.architecture import ModelConfig, param_shapes
from handbook_lib.launch import torchrun_batch
from handbook_lib.models.clinic_cases import CLINIC_CASES

CONFIG = {"seed": 1, "d_model": 48, "hang_timeout_s": 0.5}
MODEL = ModelConfig(vocab_size=96, d_model=48, nhead=2, dim_feedforward=64, num_layers=2)
SHAPES = [shape for _, shape in param_shapes(MODEL)]
P = sum(math.prod(s) for s in SHAPES)
ORDER = list(CLINIC_CASES)  # every case, in the registry's order


def _rows(n: int, rank: int, world: int = 2) -> int:
    chunk = -(-n // world)
    return max(0, min(chunk, n - rank * chunk))


def _padded(shapes) -> int:
    """Elements of the unsharded buffers, every dim 0 padded to a multiple of 2."""
    return sum(-(-s[0] // 2) * 2 * math.prod(s[1:]) for s in shapes)


@pytest.fixture(scope="module")
def results():
    return torchrun_batch("clinic", 2, {name: {**CONFIG, "case": name} for name in ORDER},
                          stream=False, timeout_s=300)


def _by_rank(result, quantity: str) -> list[float]:
    found = sorted((c.rank, c.measured) for c in result.checks if c.quantity == quantity)
    assert found, quantity
    return [m for _, m in found]


def _half(result, half: str, rank: int = 0) -> dict:
    return result.ranks[rank][half]


def test_every_case_shows_its_symptom_broken_and_passes_fixed(results):
    assert list(results) == ORDER and set(ORDER) == set(CLINIC_CASES)
    for name, result in results.items():
        assert not result.failed_checks(), name
        job = {c.quantity: (c.predicted, c.measured) for c in result.checks if c.rank is None}
        assert job == {"broken.symptom": (1, 1), "fixed.symptom": (0, 0)}, name
        for half in ("broken", "fixed"):
            assert any(c.quantity.startswith(half + ".") and c.rank is not None for c in result.checks), name
        assert result.extra["case"] == name and result.extra["threads"] == list(CLINIC_CASES[name].urls)
        assert result.config["d_model"] == 48 and result.config["seed"] == 1


def test_memory_symptoms_measured(results):
    wrap = results["wrap_class_missing"]
    assert _by_rank(wrap, "broken.units") == [1, 1] and _by_rank(wrap, "fixed.units") == [3, 3]
    assert _by_rank(wrap, "broken.largest_all_gather_bytes") == [4 * _padded(SHAPES)] * 2
    layer = SHAPES[1:13]
    assert _by_rank(wrap, "fixed.largest_all_gather_bytes") == [4 * max(_padded(layer), _padded(
        [SHAPES[0], *SHAPES[-2:]]))] * 2
    assert "wrap each TransformerLayer (2 of them)" in _half(wrap, "broken")["diagnosis"]
    assert _half(wrap, "fixed")["diagnosis"] is None

    init = results["init_full_copy"]
    assert all(b >= 4 * P for b in _by_rank(init, "broken.init_bytes"))
    assert all(b < 4 * P for b in _by_rank(init, "fixed.init_bytes"))

    frozen = results["frozen_params"]
    assert "uniform `requires_grad`" in _half(frozen, "broken")["error"]
    trainable = [s for (n, s) in param_shapes(MODEL) if "embedding" not in n and "self_attn" not in n]
    shards = [4 * sum(_rows(s[0], r) * math.prod(s[1:]) for s in trainable) for r in (0, 1)]
    assert _by_rank(frozen, "fixed.grad_shard_bytes") == shards
    assert _by_rank(frozen, "fixed.optimizer_state_bytes") == [2 * s for s in shards]

    acc = results["accumulation_unsharded_grads"]
    assert _by_rank(acc, "broken.held_after_micro1_bytes") == [4 * P] * 2
    assert _by_rank(acc, "fixed.held_after_micro1_bytes") == [0, 0]
    assert _by_rank(acc, "broken.reduce_scatters") == [3, 3]  # one per unit, last micro-step
    assert _by_rank(acc, "fixed.reduce_scatters") == [6, 6]
    assert f"{4 * P:,} bytes of unsharded gradients" in _half(acc, "broken")["diagnosis"]


def test_correctness_symptoms_measured(results):
    tied = results["tied_weights_split"]
    assert _by_rank(tied, "broken.parameter_tensors") == [len(SHAPES)] * 2
    assert _by_rank(tied, "fixed.parameter_tensors") == [len(SHAPES) - 1] * 2
    assert "shared with a parameter already managed" in _half(tied, "broken")["error"]
    assert "fully_shard([embedding, output])" in _half(tied, "broken")["diagnosis"]

    norm = results["local_grad_norm"]
    assert _by_rank(norm, "broken.clipped_norm") == pytest.approx([0.01 * math.sqrt(2)] * 2, rel=1e-5)
    assert _by_rank(norm, "fixed.clipped_norm") == pytest.approx([0.01] * 2, rel=1e-5)
    logged = [_half(norm, "broken", r)["logged_norm"] for r in (0, 1)]
    whole = _half(norm, "broken")["whole_norm"]
    assert logged[0] != logged[1] and max(logged) < whole
    assert math.hypot(*logged) == pytest.approx(whole, rel=1e-5)
    assert "this rank's shards' only" in _half(norm, "broken")["diagnosis"]
    assert _half(norm, "fixed")["diagnosis"] is None and _half(norm, "fixed")["logged_norm"] == pytest.approx(
        _half(norm, "fixed")["whole_norm"], rel=1e-5)

    meta = results["meta_buffer_uninit"]
    assert _by_rank(meta, "broken.buffer_nonfinite") == [16 * 48] * 2
    assert _by_rank(meta, "broken.loss_finite") == [0, 0] and _by_rank(meta, "fixed.loss_finite") == [1, 1]

    before = results["optimizer_before_wrap"]
    assert _by_rank(before, "broken.weights_updated") == [0, 0]
    assert _by_rank(before, "broken.optimizer_params_bytes") == [4 * P] * 2
    flat = [4 * (-(-P_unit // 2)) for P_unit in _unit_numels()]
    assert _by_rank(before, "fixed.optimizer_state_bytes") == [2 * sum(flat)] * 2

    ac = results["ac_nondeterministic"]
    assert _half(ac, "broken")["relative_grad_difference"] > 1e-3
    assert _half(ac, "fixed")["relative_grad_difference"] <= 1e-6

    mixed = results["mixed_dtype"]
    assert "uniform original parameter dtype" in _half(mixed, "broken")["error"]
    assert _half(mixed, "broken")["parameter_dtypes"] == ["bfloat16", "float32"]
    layers = [s for n, s in param_shapes(MODEL) if n.startswith("layers.")]
    root = [s for n, s in param_shapes(MODEL) if not n.startswith("layers.")]
    # bf16: the layers gathered in forward and again in backward, the root once (kept gathered)
    assert _by_rank(mixed, "fixed.all_gather_bytes") == [2 * (2 * _padded(layers) + _padded(root))] * 2


def _unit_numels() -> list[int]:
    """The layer policy's units: the root (embedding, head) and each layer, in elements."""
    sizes = [math.prod(s) for s in SHAPES]
    return [sizes[0] + sum(sizes[-2:]), sum(sizes[1:13]), sum(sizes[13:25])]


def test_a_forward_that_skips_the_hooks_meets_sharded_parameters(results):
    skips = results["forward_skips_hooks"]
    assert _by_rank(skips, "broken.all_gathers") == [0, 0]  # the root's hook never ran
    assert "mixed torch.Tensor and DTensor" in _half(skips, "broken")["error"]
    assert _by_rank(skips, "fixed.all_gathers") == [3, 3]  # 2 layers and the root


def test_hangs_are_cut_by_the_timeout_on_the_waiting_rank(results):
    for name in ("rank0_only_forward", "rank0_only_state_dict"):
        result = results[name]
        assert _by_rank(result, "broken.collectives") == [1, 0]
        assert _by_rank(result, "broken.timed_out") == [1, 0]
        waiting = _half(result, "broken")
        assert waiting["error"].startswith("RuntimeError: Timed out waiting 500ms")
        assert 0.5 <= waiting["waited_s"] < 30
    assert _by_rank(results["rank0_only_forward"], "fixed.all_gathers") == [3, 3]
    uneven = results["uneven_batches"]  # 5 batches sliced [rank::2]; padded to 3 each when fixed
    assert _by_rank(uneven, "broken.batches") == [3, 2]
    assert _by_rank(uneven, "broken.forwards_done") == [2, 2]
    assert _by_rank(uneven, "broken.timed_out") == [1, 0]
    assert _half(uneven, "broken")["error"].startswith("RuntimeError: Timed out waiting 500ms")
    assert _by_rank(uneven, "fixed.batches") == _by_rank(uneven, "fixed.forwards_done") == [3, 3]
    # 3 forwards of 2 layers each, and the root once: kept gathered after forward, nothing reshards it
    assert _by_rank(uneven, "fixed.all_gathers") == [3 * 2 + 1, 3 * 2 + 1]
    sd = results["rank0_only_state_dict"]
    assert _by_rank(sd, "fixed.all_gathers") == [len(SHAPES)] * 2
    assert _by_rank(sd, "fixed.state_dict_bytes") == [4 * P, 0]


def test_checkpoint_symptoms_measured(results):
    full = results["full_state_dict_every_rank"]
    whole = 4 * P * 3 + 4 * len(SHAPES)  # parameters, Adam's two moments, a step per tensor
    assert _by_rank(full, "broken.state_dict_bytes") == [whole, whole]
    assert _by_rank(full, "fixed.state_dict_bytes") == [whole, 0]
    resume = results["resume_other_world_size"]
    assert _by_rank(resume, "broken.wrong_shapes") == [len(SHAPES)]  # every tensor has 2+ rows
    assert "size mismatch for embedding.weight" in _half(resume, "broken")["error"]
    assert _by_rank(resume, "fixed.max_difference") == [0.0]
    compiled = results["compiled_key_prefix"]  # every tensor named '_orig_mod.<name>': none loads
    assert _by_rank(compiled, "broken.prefixed_keys") == [len(SHAPES)]
    assert _by_rank(compiled, "broken.tensors_loaded") == [0]
    assert _by_rank(compiled, "fixed.tensors_loaded") == [len(SHAPES)]
    assert _half(compiled, "broken", rank=1)["finding"] == "gathered; the load runs on rank 0"


def test_the_config_refuses_what_the_cases_set_themselves():
    from handbook_lib.runs.clinic import CONFIG, case_function, validate

    ok = CONFIG.from_mapping({"case": "mixed_dtype", "seed": 3})
    validate(ok, 2)
    for config, world, match in (
            (ok, 1, "clinic needs >= 2 ranks"),
            (ok.replace(precision="bf16-mixed"), 2, "'precision'='bf16-mixed' is set by each clinic case"),
            (ok.replace(hang_timeout_s=0.1), 2, r"'hang_timeout_s' must be in \[0.5, 60\]"),
            (ok.replace(batch_size=6), 2, "'batch_size'=6 must be divisible by 2 x 2 ranks")):
        with pytest.raises(ValueError, match=match):
            validate(config, world)
    with pytest.raises(ValueError, match="config key 'case' got 'oom'; accepted values: wrap_class_missing"):
        CONFIG.from_mapping({"case": "oom"})
    with pytest.raises(ValueError, match="case must be one of"):
        case_function("oom")
    assert all(callable(case_function(name)) for name in CLINIC_CASES)


def test_a_gloo_timeout_reads_without_its_build_path():
    from handbook_lib.runtime.clinic_common import first_line, units_of_class
    from handbook_lib.runtime.model import build_model

    err = RuntimeError("[/__w/pytorch/third_party/gloo/pair.cc:534] Timed out waiting 2000ms for recv\nmore")
    assert first_line(err) == "RuntimeError: Timed out waiting 2000ms for recv"
    assert first_line(ValueError("")) == "ValueError: "
    model = build_model(MODEL)
    assert units_of_class(model, ("TransformerLayer",)) == list(model.layers)
    assert units_of_class(model, ("LlamaDecoderLayer",)) == []
