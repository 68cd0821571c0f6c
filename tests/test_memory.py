"""handbook_lib.models.memory: FSDP's shard rule and the 16-bytes-per-parameter model state."""

import math

import pytest

from handbook_lib.core import ModelConfig, param_count, param_shapes
from handbook_lib.models import (
    estimate_model_state_bytes,
    estimate_shard_bytes,
    optimizer_states,
    shard_rows,
)


@pytest.mark.parametrize("dim0, world, expected", [
    (10, 4, [(3, 3), (3, 3), (3, 3), (1, 3)]),   # ceil(10/4) = 3 rows a chunk, last one short
    (2, 4, [(1, 1), (1, 1), (0, 1), (0, 1)]),    # fewer rows than ranks: two ranks hold nothing
    (8, 2, [(4, 4), (4, 4)]),
    (5, 1, [(5, 5)]),
])
def test_shard_rows_hand_cases(dim0, world, expected):
    assert [shard_rows(dim0, world, r) for r in range(world)] == expected


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8])
def test_shards_add_up_to_the_model_and_padding_equalises(world):
    config = ModelConfig(vocab_size=1001, d_model=24, nhead=3, dim_feedforward=50, num_layers=2)
    shards = [estimate_shard_bytes(config, world, r) for r in range(world)]
    assert sum(s.shard_bytes for s in shards) == 4 * param_count(config)
    assert len({s.padded_bytes for s in shards}) == 1  # every rank allocates the same
    # padded storage per rank is ceil(dim0 / world) rows of every tensor
    expected = sum(math.ceil(s[0] / world) * math.prod(s[1:]) for _, s in param_shapes(config))
    assert shards[0].padded_bytes == 4 * expected


def test_padding_of_an_odd_vocabulary_by_hand():
    # vocab 1001 on 2 ranks: chunks of 501 rows; rank 1 holds 500 rows of the embedding (d=256),
    # of the head's weight (d=256) and of its bias (1): padding = 256*4 + 256*4 + 4 bytes.
    config = ModelConfig(vocab_size=1001)
    assert estimate_shard_bytes(config, 2, 0).padding_bytes == 0
    assert estimate_shard_bytes(config, 2, 1).padding_bytes == 256 * 4 + 256 * 4 + 4


def test_bf16_shards_are_half_of_fp32():
    config = ModelConfig()
    assert 2 * estimate_shard_bytes(config, 4, 1, "bf16").shard_bytes == estimate_shard_bytes(config, 4, 1).shard_bytes


def test_sixteen_bytes_per_parameter():
    state = estimate_model_state_bytes(ModelConfig())
    n = param_count(ModelConfig())
    assert (state.params, state.grads, state.optimizer) == (4 * n, 4 * n, 8 * n)
    assert state.total == 16 * n
    # the seed's figures: 39.5 MB of weights, 157.9 MB of model state (decimal MB)
    assert round(state.params / 1e6, 1) == 39.5 and round(state.total / 1e6, 1) == 157.9


def test_optimizer_states():
    assert [optimizer_states(o) for o in ("adamw", "adam", "sgd-momentum", "sgd")] == [2, 2, 1, 0]
    with pytest.raises(ValueError, match="adamw"):
        optimizer_states("lion")


@pytest.mark.parametrize("call, match", [
    (lambda: shard_rows(10, 0, 0), "world_size"),
    (lambda: shard_rows(10, 2, 2), "rank"),
    (lambda: shard_rows(-1, 2, 0), "dim0"),
    (lambda: estimate_shard_bytes(ModelConfig(), 2, 0, "fp8"), "fp32, bf16, fp16"),
    (lambda: estimate_model_state_bytes(-5), "model must be a ModelConfig, a DecoderShape, a preset name or an int >= 0"),
    (lambda: estimate_model_state_bytes(10, grad_bytes=-1), "grad_bytes"),
])
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- estimate_memory and the ZeRO accounting (chapter 2) -------------------------------------

from handbook_lib.core import FSDP2_SPELLING, STRATEGIES  # noqa: E402 - each section imports what it tests
from handbook_lib.models import (  # noqa: E402
    COMPONENTS,
    DECODER_SHAPES,
    ZERO_STAGES,
    estimate_activation_bytes,
    estimate_memory,
    estimate_zero_memory,
    optimizer_step_bytes,
)


@pytest.mark.parametrize("stage, gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage, gb):
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters, 64 GPUs, K = 12.
    assert round(estimate_zero_memory(7_500_000_000, 64, stage).total / 1e9, 1) == gb


def test_sixteen_bytes_two_ways():
    fp32 = estimate_model_state_bytes(1000)
    zero = estimate_zero_memory(1000, 1, 0)
    assert fp32.total == zero.total == 16_000
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4000, 4000, 8000)
    assert (zero.params, zero.grads, zero.optimizer) == (2000, 2000, 12000)


def test_model_state_shards_exactly_by_strategy():
    config = ModelConfig(vocab_size=1001)
    n = param_count(config)
    steps = optimizer_step_bytes(config, "adamw")
    assert steps == 4 * len(param_shapes(config))
    for strategy, group in [("DDP", 1), ("NO_SHARD", 1), ("SHARD_GRAD_OP", 4), ("FULL_SHARD", 4),
                            ("HYBRID_SHARD", 2), ("HYBRID_SHARD_ZERO2", 2)]:
        est = estimate_memory(config, 4, strategy, shard_group_size=2 if "HYBRID" in strategy else None, rank=1)
        shard = estimate_shard_bytes(config, group, 1 % group).shard_bytes
        assert (est.params, est.grads, est.optimizer) == (shard, shard, 2 * shard + steps), strategy
    assert estimate_memory(config, 1, "DDP").params == 4 * n


def test_precision_changes_transients_not_the_sharded_state():
    config = ModelConfig()
    fp32 = estimate_memory(config, 2, "FULL_SHARD", "fp32", micro_batch=4, seq_len=64)
    bf16 = estimate_memory(config, 2, "FULL_SHARD", "bf16-mixed", micro_batch=4, seq_len=64)
    assert fp32.model_state == bf16.model_state
    assert bf16.forward_activations < fp32.forward_activations
    root = 2 * 256 * 10_000 + 10_000  # embedding + head, even split at 2 ranks: no padding
    parts = fp32.phases["loss_backward"] - fp32.model_state - fp32.components["activations"] \
        - fp32.components["loss_buffers"]
    assert fp32.peak_phase == "loss_backward" and parts == 4 * root  # the root kept gathered from forward
    # backward starts with the root still gathered; FSDP2 freed its all-gather buffer in forward
    logits = 4 * 4 * 64 * 10_000  # the logits' gradient, fp32
    acts = fp32.forward_activations - 4 * 4 * 64 * 10_000  # A - L: the log-softmax freed
    assert fp32.phases["backward_start"] - fp32.model_state == 4 * root + acts + logits
    again = estimate_memory(config, 2, "FULL_SHARD", "fp32", micro_batch=4, seq_len=64,
                            root_reshard_after_forward=True)
    assert again.phases["backward_start"] - fp32.phases["backward_start"] == 4 * root  # gathered again: + buffer
    # forward ends with the last layer's all-gather buffer still held (freed in the root's post-forward)
    layer = 3 * 256 * 256 + 3 * 256 + 256 * 256 + 256 + 2 * 1024 * 256 + 1024 + 256 + 4 * 256
    assert fp32.phases["forward_end"] - fp32.phases["backward_start"] == 4 * layer


def test_shard_grad_op_keeps_every_parameter_unsharded_after_forward():
    config = ModelConfig()
    est = estimate_memory(config, 4, "SHARD_GRAD_OP", "fp32", micro_batch=8, seq_len=64)
    assert est.peak_phase == "loss_backward"
    assert est.components["unsharded_params"] == 4 * param_count(config)  # 10,000 and 256 split by 4


def test_activations_come_from_the_activation_model():
    config = ModelConfig()
    est = estimate_memory(config, 2, micro_batch=4, seq_len=64, activation_checkpointing=True)
    assert est.forward_activations == estimate_activation_bytes(config, 4, 64, activation_checkpointing=True).total
    assert "layer_recompute" in est.phases


def test_peak_never_grows_with_more_gpus_under_full_shard():
    shape = DECODER_SHAPES["13b"]
    peaks = [estimate_memory(shape, n, "FULL_SHARD", "bf16-mixed", micro_batch=1, seq_len=2048).peak
             for n in (1, 2, 4, 8, 16, 64)]
    assert peaks == sorted(peaks, reverse=True)


def test_cpu_offload_moves_the_state_to_the_host():
    config = ModelConfig()
    on = estimate_memory(config, 2, cpu_offload=True, micro_batch=4, seq_len=64)
    off = estimate_memory(config, 2, micro_batch=4, seq_len=64)
    assert on.model_state == 0 and on.host == off.model_state
    assert on.peak < off.peak


def test_parameter_count_alone_gives_model_state_and_says_what_is_missing():
    est = estimate_memory(7_000_000_000, 8, "FULL_SHARD", "bf16-mixed", backend="gloo")
    assert est.peak == 16 * 7_000_000_000 // 8
    assert any("activations not included" in n for n in est.notes)
    assert set(est.components) == set(COMPONENTS)


def test_vocabulary_tables_cover_every_strategy():
    assert set(FSDP2_SPELLING) == {s for s in STRATEGIES if not s.startswith("ZERO")}
    assert ZERO_STAGES[1] is None and ZERO_STAGES[3] == "FULL_SHARD"


@pytest.mark.parametrize("kwargs, match", [
    ({"strategy": "ZERO4"}, "strategy must be one of"),
    ({"strategy": "ZERO3"}, "estimate_memory models PyTorch's strategies .*ZERO3 is DeepSpeed's: see handbook_lib.models.zero"),
    ({"precision": "fp8"}, "precision must be one of"),
    ({"optimizer": "lion"}, "optimizer must be one of"),
    ({"strategy": "HYBRID_SHARD", "shard_group_size": 3}, "must divide world_size"),
    ({"micro_batch": 2}, "together"),
    ({"micro_batch": -1, "seq_len": 4}, "micro_batch"),
    ({"world_size": 0}, "world_size"),
    ({"strategy": "DDP", "cpu_offload": True}, "cpu_offload needs an FSDP or ZeRO strategy.*DDP keeps the whole model state"),
    ({"strategy": "NONE", "cpu_offload": True}, "cpu_offload needs an FSDP or ZeRO strategy"),
])
def test_estimate_memory_rejects_bad_input(kwargs, match):
    args = {"world_size": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        estimate_memory(ModelConfig(), **args)


def test_zero_rejects_bad_input():
    with pytest.raises(ValueError, match="stage must be one of 0, 1, 2, 3"):
        estimate_zero_memory(10, 2, 4)


# --- issue 13: the table's rows in one model; init, accumulation, the corrected phases ----------

from handbook_lib.models import (  # noqa: E402
    estimate_accumulation_bytes,
    estimate_init_bytes,
    estimate_seed_model_state,
    model_part_numels,
)

TINY = ModelConfig(vocab_size=1001, d_model=64, nhead=2, dim_feedforward=96, num_layers=2)
# by hand: a layer is attention 4·64·64 + 4·64, feed-forward 2·64·96 + 96 + 64, norms 4·64
TINY_LAYER = 4 * 64 * 64 + 4 * 64 + 2 * 64 * 96 + 96 + 64 + 4 * 64
TINY_EMBEDDING, TINY_OUTPUT = 1001 * 64, 1001 * 64 + 1001


def test_parts_are_the_construction_order_with_their_sizes():
    assert model_part_numels(TINY) == {"embedding": TINY_EMBEDDING, "layers.0": TINY_LAYER,
                                       "layers.1": TINY_LAYER, "output": TINY_OUTPUT}
    assert sum(model_part_numels(TINY).values()) == param_count(TINY)


def test_init_bytes_by_hand():
    n = param_count(TINY)
    # one process, nothing sharded: the model, plus the largest part (the head) being copied in
    assert estimate_init_bytes(TINY, 1, "NONE", "meta") == 4 * n + 4 * TINY_OUTPUT
    assert estimate_init_bytes(TINY, 1, "NONE", "full") == 4 * n
    # DDP: its buckets (a second copy of every gradient) outweigh the part
    assert estimate_init_bytes(TINY, 2, "DDP", "meta") == 4 * n + 4 * n
    # FSDP on 2 ranks: the padded shards (vocab 1001: 501 rows each), the head, 2 mesh ids
    shards = 4 * (501 * 64 + TINY_LAYER * 2 // 2 + 501 * 64 + 501)
    assert shards == estimate_shard_bytes(TINY, 2, 0).padded_bytes  # no odd first dims in a layer
    assert estimate_init_bytes(TINY, 2, "FULL_SHARD", "meta") == shards + 4 * TINY_OUTPUT + 8
    # the full build: fully_shard unit by unit, a unit's originals freed once its shards exist.
    # The first layer's moment is the whole model plus its shards; the root's (last) is its own
    # originals, both layers' shards and its shards: larger here, with a 1001-word vocabulary
    # (a 2-rank gloo run of TINY measures 892,416 B)
    first = 4 * n + 4 * TINY_LAYER // 2 + 8
    root = 4 * (TINY_EMBEDDING + TINY_OUTPUT) + 2 * 4 * TINY_LAYER // 2 + 4 * (501 * 64 + 501 * 64 + 501) + 8
    assert root > first and root == 892_416
    assert estimate_init_bytes(TINY, 2, "FULL_SHARD", "full") == root


def test_accumulation_keeps_unsharded_gradients_only_when_they_are_sharded():
    n = param_count(TINY)
    assert estimate_accumulation_bytes(TINY, "FULL_SHARD", "fp32") == 4 * n
    assert estimate_accumulation_bytes(TINY, "SHARD_GRAD_OP", "bf16-mixed") == 4 * n  # fp32 reduce
    assert estimate_accumulation_bytes(TINY, "DDP") == estimate_accumulation_bytes(TINY, "NO_SHARD") == 0
    one = estimate_memory(TINY, 2, "FULL_SHARD", micro_batch=2, seq_len=16)
    two = estimate_memory(TINY, 2, "FULL_SHARD", micro_batch=2, seq_len=16, grad_accum_steps=2)
    # reduced in every micro-step, the gradients stay sharded: one micro-step's memory
    synced = estimate_memory(TINY, 2, "FULL_SHARD", micro_batch=2, seq_len=16, grad_accum_steps=2,
                             sync_every_micro_step=True)
    assert synced == one and two.peak > one.peak
    for phase, total in one.phases.items():
        if phase not in ("layer_backward", "layer_reduce"):
            # the end of backward and the optimizer step come after the last reduce-scatter
            assert two.phases[phase] - total == (0 if phase in ("root_reduce", "optimizer_step") else 4 * n), phase
    # in backward each unit's accumulated gradients go with its reduce-scatter, and the new
    # gradients are added in place, one parameter at a time: no head gradients apart, and one
    # layer's largest gradient (in_proj, 3·64·64) instead of the whole layer's
    L, R = TINY_LAYER, 1002 * 64 * 2 + 1002  # the root, 1001 rows padded to 1002
    acts = estimate_activation_bytes(TINY, 2, 16)
    left = acts.total - 4 * 32 * 1001  # the log-softmax output freed
    # the first layer in backward (layers.1): the root, layers.1 and layers.0 (prefetched) gathered
    assert two.phases["layer_backward"] - two.model_state == 4 * R + 2 * 4 * L + 4 * 3 * 64 * 64 + 4 * n + left
    # its reduce-scatter: its accumulated gradients taken into the input; the larger moment is
    # the copy-in (gradients + input)
    assert two.phases["layer_reduce"] - two.model_state == (
        4 * R + 4 * L + (4 * L + 4 * L) + 4 * n - 4 * L + left - acts.per_layer)


def test_bare_count_shard_grad_op_keeps_the_gathered_model():
    """7B on 8 GPUs, bf16: FULL_SHARD's state at rest, 16P/8 (and on a GPU foreach Adam's 4P/8
    in the optimizer step); SHARD_GRAD_OP adds the model kept gathered in bf16 from forward to
    backward, 2P — not silently equal to FULL_SHARD."""
    p = 7_000_000_000
    full = estimate_memory(p, 8, "FULL_SHARD", "bf16-mixed")
    sgo = estimate_memory(p, 8, "SHARD_GRAD_OP", "bf16-mixed")
    assert full.phases["loss_backward"] == 16 * p // 8 and full.peak == 20 * p // 8
    assert sgo.peak == 16 * p // 8 + 2 * p
    assert any("keeps every unit gathered" in n for n in sgo.notes)


def test_ddp_and_no_shard_differ_by_the_buckets_alone_in_fp32():
    """One model for the replicas: DDP's buckets (r·n) are the whole difference, phase by phase."""
    n = param_count(TINY)
    ddp = estimate_memory(TINY, 2, "DDP", micro_batch=2, seq_len=16)
    ns = estimate_memory(TINY, 2, "NO_SHARD", micro_batch=2, seq_len=16)
    assert ddp.model_state == ns.model_state == 16 * n + optimizer_step_bytes(TINY, "adamw")
    for phase in ("loss_backward", "backward_start", "head_backward", "optimizer_step"):
        assert ddp.phases[phase] - ns.phases[phase] == 4 * n, phase
    assert "root_reduce" in ns.phases and "root_reduce" not in ddp.phases  # the flat gradient's cat


def test_end_of_backward_by_backend():
    """The root's gradients copied into the reduce-scatter input and cast there (c·R + r·R), or
    the input, its 1/N output and — on gloo — gloo's flattened copy."""
    R = 1004 * 64 * 2 + 1004  # the root unit, padded for 4 ranks: 1001 rows -> 4 x 251 = 1004
    est = {b: estimate_memory(TINY, 4, "FULL_SHARD", "bf16-mixed", micro_batch=2, seq_len=16, backend=b)
           for b in ("nccl", "gloo")}
    rest = est["nccl"].model_state
    assert est["nccl"].phases["root_reduce"] - rest == max(2 * R + 4 * R, 4 * R + 4 * R // 4)
    # + the head's bias gradient (bf16, 1001 elements), which FSDP2's foreach_reduce keeps in a
    # loop variable through the collective
    assert est["gloo"].phases["root_reduce"] - rest == 4 * R + 4 * R // 4 + 4 * R + 2 * 1001
    with pytest.raises(ValueError, match="backend must be one of nccl, gloo, got 'mpi'"):
        estimate_memory(TINY, 4, backend="mpi")


def test_seed_rule_by_hand():
    assert estimate_seed_model_state(1000, 4, "NO_SHARD") == 16_000
    assert estimate_seed_model_state(1000, 4, "SHARD_GRAD_OP") == 4000 + 12_000 // 4
    assert estimate_seed_model_state(1000, 4, "FULL_SHARD") == 16_000 // 4
    with pytest.raises(ValueError, match="the seed's three"):
        estimate_seed_model_state(1000, 4, "DDP")


def test_backward_keeps_the_previous_reduce_scatter_input_and_the_hsdp_all_reduce_buffers():
    """FSDP2 keeps a unit's reduce-scatter input (reduce dtype) until the next unit's
    post-backward, and with HSDP every unit's all-reduce buffer (its reduce-scatter output)
    until the end of backward; gloo adds its flattened copy of each reduce-scatter input."""
    L = TINY_LAYER  # first dims all even: no padding in shard groups of 2
    R = 1002 * 64 * 2 + 1002  # the root, 1001 rows padded to 1002
    c, r = 2, 4  # bf16-mixed: bf16 compute, fp32 reduce
    acts = estimate_activation_bytes(TINY, 1, 16, "bf16")
    left = acts.total - 4 * 16 * 1001  # the log-softmax output freed
    est = {b: estimate_memory(TINY, 4, "HYBRID_SHARD", "bf16-mixed", micro_batch=1, seq_len=16,
                              shard_group_size=2, backend=b) for b in ("nccl", "gloo")}
    rest = est["nccl"].model_state
    # the second layer in backward (layers.0): root + the layer, the head's and the layer's
    # gradients, layers.1's reduce-scatter input and its all-reduce buffer; layers.1's
    # activations freed
    assert est["nccl"].phases["layer_backward"] - rest == (
        c * R + c * L + c * TINY_OUTPUT + c * L + r * L + r * L // 2 + left - acts.per_layer)
    # end of backward: both layers' all-reduce buffers, the root's input and output, and the
    # head's bias gradient (FSDP2's foreach_reduce keeps the last gradient in a loop variable)
    assert est["nccl"].phases["root_reduce"] - rest == 2 * r * L // 2 + r * R + r * R // 2 + c * 1001
    assert est["gloo"].phases["root_reduce"] - est["nccl"].phases["root_reduce"] == r * R
    assert est["gloo"].phases["layer_reduce"] - est["nccl"].phases["layer_reduce"] == r * L


def test_rank_state_puts_fsdp_and_zero_rows_in_the_same_parts():
    from handbook_lib.models import estimate_rank_state, estimate_zero_rank_bytes

    shape = ModelConfig(vocab_size=1001, d_model=64, nhead=2, dim_feedforward=96, num_layers=2)
    total = 4 * param_count(shape)
    for world in (2, 4):
        shards = [estimate_shard_bytes(shape, world, r) for r in range(world)]
        for rank in range(world):
            full = estimate_rank_state(shape, world, "FULL_SHARD", rank=rank)
            assert (full.params, full.grads, full.optimizer) == (
                shards[rank].padded_bytes, shards[rank].shard_bytes, 2 * shards[rank].shard_bytes)
            assert full.master == 0 and full.optimizer_step == 4 * len(param_shapes(shape))
            zero = estimate_rank_state(shape, world, "ZERO3", "bf16-mixed", rank=rank)
            assert vars(zero) == vars(estimate_zero_rank_bytes(shape, world, "ZERO3", "bf16-mixed", rank=rank))
        # over the ranks, FSDP's grads and moments add up to the model (one copy, two copies)
        assert sum(estimate_rank_state(shape, world, "FULL_SHARD", rank=r).grads for r in range(world)) == total
    ddp = estimate_rank_state(shape, 4, "DDP", "bf16-mixed")
    assert (ddp.params, ddp.grads, ddp.optimizer, ddp.master) == (total, total, 2 * total, 0)
    with pytest.raises(ValueError, match="cpu_offload needs an FSDP or ZeRO strategy"):
        estimate_rank_state(shape, 2, "DDP", cpu_offload=True)


def test_estimate_memory_and_the_memory_command_say_which_precision_they_use(capsys):
    """estimate_memory defaults to fp32 (the runs' precision), the memory command to bf16-mixed;
    the command prints its precision in its assumptions and says the function's default."""
    import inspect

    from handbook_lib.face.cli import main

    assert inspect.signature(estimate_memory).parameters["precision"].default == "fp32"
    assert "The default is ``fp32``" in estimate_memory.__doc__ and "defaults to ``bf16-mixed``" in estimate_memory.__doc__
    assert main(["memory", "--model", "7b", "--world-size", "8"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "FULL_SHARD on 8 ranks, bf16-mixed, optimizer adamw" in out
    assert "add --precision fp32 to compare with estimate_memory(), whose default it is too" in out
    bf16 = estimate_memory("llama2-7b", 8, precision="bf16-mixed").peak
    assert f"{bf16:,}" in out and estimate_memory("llama2-7b", 8).peak != bf16
    assert main(["memory", "--model", "7b", "--world-size", "8", "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    assert f"{estimate_memory('llama2-7b', 8).peak:,}" in out and "whose default" not in out


def test_the_estimators_take_every_model_form():
    """A preset's name, its DecoderShape, its layout and the Transformers config of the same
    model give the same figures; the handbook's ModelConfig too, against its own count."""
    from pathlib import Path

    from handbook_lib.core import param_count as count
    from handbook_lib.models import get_shape, model_layout, read_hf_config

    config = Path(__file__).parent / "data" / "hf_configs" / "llama2-7b.json"
    forms = ["llama2-7b", get_shape("llama2-7b"), model_layout("llama2-7b"), read_hf_config(config)]
    states = {estimate_model_state_bytes(m).total for m in forms}
    peaks = {estimate_memory(m, 8, micro_batch=1, seq_len=512).peak for m in forms}
    assert states == {16 * 6_738_415_616} and len(peaks) == 1
    assert {count(m) for m in forms[1:]} == {6_738_415_616}
    assert estimate_model_state_bytes(ModelConfig()).total == 16 * count(ModelConfig())
    with pytest.raises(ValueError) as err:
        estimate_memory({"model_type": "llama"}, 8)
    assert "\n" not in str(err.value) and str(err.value).startswith("model must be a ModelConfig")


def test_the_optimizer_step_temporaries_by_implementation_by_hand():
    """Adam over tensors of 10, 30 and 20 elements: foreach 4·60; the for-loop's worst moment is
    the 30-element tensor's two temporaries with the 10-element one's denominator still bound,
    4·(10 + 60); fused none; SGD none under any implementation."""
    from handbook_lib.models.model_state import optimizer_temporary_bytes

    numels = (10, 30, 20)
    assert optimizer_temporary_bytes(numels, "adamw", "foreach") == 240
    assert optimizer_temporary_bytes(numels, "adam", "for-loop") == 280
    assert optimizer_temporary_bytes(numels, "adamw", "fused") == 0
    assert {optimizer_temporary_bytes(numels, "sgd-momentum", i) for i in ("for-loop", "foreach", "fused")} == {0}
    with pytest.raises(ValueError, match="optimizer_impl"):
        optimizer_temporary_bytes(numels, "adamw", "default")  # resolve it for a device first


def test_pure_bf16_keeps_the_state_in_two_bytes():
    """``precision="bf16"``: parameters, gradients and Adam's two moments all in bf16, 8 bytes a
    parameter over N (fp32 Adam: 16), and foreach's temporary one bf16 copy, 2P/N; the gathered
    units and the reduce-scatter are bf16 too (no fp32 reduction)."""
    p = 7_000_000_000
    est = estimate_memory(p, 8, "FULL_SHARD", "bf16", backend="nccl")
    assert est.model_state == 8 * p // 8
    assert (est.peak_phase, est.peak) == ("optimizer_step", 10 * p // 8)
    tiny = ModelConfig(vocab_size=1001, d_model=64, nhead=2, dim_feedforward=96, num_layers=2)
    pure = estimate_memory(tiny, 2, "FULL_SHARD", "bf16", micro_batch=2, seq_len=16, backend="gloo")
    mixed = estimate_memory(tiny, 2, "FULL_SHARD", "bf16-mixed", micro_batch=2, seq_len=16, backend="gloo")
    steps = 4 * len(param_shapes(tiny))  # Adam's step counters stay fp32 scalars
    assert (2 * pure.params, 2 * pure.grads) == (mixed.params, mixed.grads)
    assert 2 * (pure.optimizer - steps) == mixed.optimizer - steps
    assert pure.forward_activations == mixed.forward_activations  # both compute in bf16


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_loss_in_chunks_holds_one_chunk_s_fp32_gradients(precision):
    """loss_backward, by hand: the loss's two fp32 (T x V) gradients, 2L with L = 4·T·V, whole;
    in k chunks the largest of one chunk's two (2L/k), the chunks' gradients joined into the
    logits' (2c·T·V - L), and the forward's end, logits and the last chunk's fp32 copy (c·T·V + L/k)."""
    config = ModelConfig(vocab_size=32000, d_model=64, nhead=2, dim_feedforward=96, num_layers=2)
    b, s = 4, 64
    tv, c = b * s * 32000, 4 if precision == "fp32" else 2
    whole = estimate_memory(config, 2, "FULL_SHARD", precision, micro_batch=b, seq_len=s, backend="gloo")
    L = 4 * tv
    assert whole.peak_phase == "loss_backward"
    base = whole.phases["loss_backward"] - 2 * L
    for k in (2, 4, 8):
        chunked = estimate_memory(config, 2, "FULL_SHARD", precision, micro_batch=b, seq_len=s, backend="gloo",
                                  loss_chunks=k)
        assert chunked.phases["loss_backward"] - base == max(2 * L // k, 2 * c * tv - L, c * tv + L // k)
        assert {n: v for n, v in chunked.phases.items() if n != "loss_backward"} == \
            {n: v for n, v in whole.phases.items() if n != "loss_backward"}
    # in fp32 the join (L) and the forward's end (L + L/k) decide; in bf16 2L/k, or 2·T·V + L/k
    four = estimate_memory(config, 2, "FULL_SHARD", precision, micro_batch=b, seq_len=s, backend="gloo",
                           loss_chunks=4).phases["loss_backward"] - base
    assert four == (L + L // 4 if precision == "fp32" else 2 * tv + L // 4)
    with pytest.raises(ValueError, match="loss_chunks=3 must divide seq_len=64"):
        estimate_memory(config, 2, "FULL_SHARD", precision, micro_batch=b, seq_len=s, loss_chunks=3)


def test_float8_all_gather_gathers_each_layer_in_one_byte_an_element():
    """torchao's Float8 all-gather: SHARD_GRAD_OP keeps every unit gathered from forward to
    backward, so at the loss's backward the gathered bytes are the layers in 1 B an element plus
    the root (embedding and head) in bf16; without it every element is 2 B."""
    from handbook_lib.models.layout import model_layout

    layout = model_layout("llama2-70b")
    units = layout.units()
    layers = sum(u.padded_numel(64) for u in units[1:])
    root = units[0].padded_numel(64)
    kwargs = {"micro_batch": 1, "seq_len": 4096, "activation_checkpointing": "full"}
    plain = estimate_memory("llama2-70b", 64, "SHARD_GRAD_OP", "bf16-mixed", **kwargs)
    float8 = estimate_memory("llama2-70b", 64, "SHARD_GRAD_OP", "bf16-mixed", **kwargs, float8_all_gather=True)
    # the loss's backward: every unit still gathered, the layers at 1 B instead of 2, the root at 2
    assert plain.phases["loss_backward"] - float8.phases["loss_backward"] == (2 - 1) * layers
    assert plain.peak_phase == float8.peak_phase == "layer_backward"
    assert float8.unsharded_params < plain.unsharded_params and root > 0
    for bad in ({"strategy": "DDP"}, {"precision": "fp32"}, {"cpu_offload": True}):
        args = {"strategy": "FULL_SHARD", "precision": "bf16-mixed", **bad}
        with pytest.raises(ValueError, match="float8_all_gather gathers float8 weights"):
            estimate_memory("llama2-7b", 8, args.pop("strategy"), args.pop("precision"), **kwargs, **args,
                            float8_all_gather=True)


def test_freed_gradients_leave_the_early_phases_and_come_back_layer_by_layer():
    """``set_to_none``: the forward and the loss's backward hold no gradient of the state; a
    layer's backward holds those of the layers reduced before it; the optimizer step all of them.
    The reserved peak keeps them (the allocator does not reuse their blocks)."""
    kwargs = {"micro_batch": 2, "seq_len": 64, "backend": "gloo"}
    kept = estimate_memory(ModelConfig(), 2, "FULL_SHARD", **kwargs)
    freed = estimate_memory(ModelConfig(), 2, "FULL_SHARD", **kwargs, set_to_none=True)
    grads = kept.components["grads"]
    assert grads > 0
    for phase in ("forward_start", "layer_forward", "loss_backward", "backward_start", "head_backward"):
        assert kept.phases[phase] - freed.phases[phase] == grads, phase
    assert kept.phases["optimizer_step"] == freed.phases["optimizer_step"]
    assert 0 < kept.phases["layer_backward"] - freed.phases["layer_backward"] < grads
    assert freed.peak < kept.peak and freed.peak_reserved == kept.peak_reserved
    accumulating = estimate_memory(ModelConfig(), 2, "FULL_SHARD", micro_batch=1, seq_len=64, backend="gloo",
                                   grad_accum_steps=2, set_to_none=True)
    assert accumulating.phases == estimate_memory(ModelConfig(), 2, "FULL_SHARD", micro_batch=1, seq_len=64,
                                                  backend="gloo", grad_accum_steps=2).phases


def test_each_phase_keeps_its_components():
    """``by_phase``: every phase's components, summing to its total; the peak's are ``components``."""
    est = estimate_memory(ModelConfig(), 2, "FULL_SHARD", "bf16-mixed", micro_batch=4, seq_len=64, backend="gloo")
    assert set(est.by_phase) == set(est.phases)
    assert all(sum(parts.values()) == est.phases[name] for name, parts in est.by_phase.items())
    assert est.by_phase[est.peak_phase] == est.components
    assert est.by_phase["layer_backward"]["grad_buffers"] > est.by_phase["loss_backward"]["grad_buffers"] == 0
