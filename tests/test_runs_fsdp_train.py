"""handbook_lib.runs.fsdp_train: real runs whose every byte must match the memory model.

Model state (parameter shards, padding, gradients, optimizer states and step counters) must
match to the byte; activations and the peak within the run's stated tolerances. The configs
cover 1, 2 and 4 ranks, one plain process, DDP, every FSDP2 strategy and FSDP1, the three
wrapping policies, fp32, bf16 and fp16 (with its gradient scaler), Adam and SGD — on small
odd-shaped models that force padding, and different from the chapter notebooks' runs, so CI
does not run the same experiment twice.
"""

import pytest

from handbook_lib.core import SCHEMA, RunConfig, max_relative_difference, param_count
from handbook_lib.launch import torchrun_batch
from handbook_lib.models import (
    estimate_flat_shard_bytes,
    estimate_memory,
    estimate_shard_bytes,
    model_layout,
    wrap_units,
)

TINY = {"vocab_size": 1001, "d_model": 64, "nhead": 2, "dim_feedforward": 96, "num_layers": 2,
        "batch_size": 8, "seq_len": 16, "steps": 2}
BOOK_MODEL = {"vocab_size": 10000, "d_model": 256, "nhead": 4, "dim_feedforward": 1024, "num_layers": 6,
              "seq_len": 64}
"""The book's model (chapter 2's), for a case whose peak is compared to a few bytes: the tiny
model's peak can come at a moment between the phases (its two layers' backward)."""
CASES = {
    "2-SHARD_GRAD_OP-fp32-sgd-momentum": (2, {"strategy": "SHARD_GRAD_OP", "optimizer": "sgd-momentum", "lr": 0.1}),
    "4-FULL_SHARD-bf16-adam-foreach-AC": (4, {"strategy": "FULL_SHARD", "precision": "bf16-mixed", "optimizer": "adam",
                                              "optimizer_impl": "foreach", "activation_checkpointing": True}),
    "1-SHARD_GRAD_OP-fp32-sgd": (1, {"strategy": "SHARD_GRAD_OP", "optimizer": "sgd", "lr": 0.1}),
    "4-HYBRID_SHARD_ZERO2-fp32-adamw": (4, {"strategy": "HYBRID_SHARD_ZERO2", "shard_group_size": 2}),
    "2-FULL_SHARD-bf16-adamw-offload": (2, {"strategy": "FULL_SHARD", "precision": "bf16-mixed", "cpu_offload": True}),
    "2-DDP-fp32-adamw-foreach": (2, {"strategy": "DDP", "steps": 3, "optimizer_impl": "foreach"}),
    "2-FULL_SHARD-pure-bf16-adamw": (2, {"strategy": "FULL_SHARD", "precision": "bf16"}),
    "2-FULL_SHARD-fp32-adamw-AC-every-2": (2, {"strategy": "FULL_SHARD", "activation_checkpointing": "full",
                                               "ac_every": 2}),
    # chapter 5: the baseline, wrapping, recomputation, FSDP1, fp16
    "1-NONE-fp32-adamw": (1, {"strategy": "NONE"}),
    "2-FULL_SHARD-fp32-adamw": (2, {"strategy": "FULL_SHARD"}),
    "2-FULL_SHARD-fp32-adamw-one-unit": (2, {"strategy": "FULL_SHARD", "wrap": "model"}),
    "2-FULL_SHARD-fp32-adamw-AC": (2, {"strategy": "FULL_SHARD", "activation_checkpointing": True}),
    "2-FULL_SHARD-fp32-adamw-selective-AC": (2, {"strategy": "FULL_SHARD", "activation_checkpointing": "selective"}),
    "2-FULL_SHARD-fp32-adamw-selective-AC-every-2nd-product": (2, {"strategy": "FULL_SHARD", "ac_matmul_every": 2,
                                                                   "activation_checkpointing": "selective"}),
    "2-FULL_SHARD-fp32-adamw-selective-AC-keep-products": (2, {"strategy": "FULL_SHARD", "ac_save": "matmul",
                                                               "activation_checkpointing": "selective"}),
    "2-FSDP1-FULL_SHARD-fp32-adamw-size-wrap": (2, {"api": "fsdp1", "strategy": "FULL_SHARD", "wrap": "size",
                                                    "wrap_min_params": 20_000}),
    "4-FSDP1-HYBRID_SHARD-fp16-scaler": (4, {"api": "fsdp1", "strategy": "HYBRID_SHARD", "shard_group_size": 2,
                                             "precision": "fp16-mixed"}),
    "2-FULL_SHARD-fp16-scaler-too-large": (2, {"strategy": "FULL_SHARD", "precision": "fp16-mixed", "steps": 4,
                                               "grad_scale_init": 2.0**20}),
    # the table's other rows, run for real; one loop's accumulation and clipping
    "2-FSDP1-NO_SHARD-bf16-adamw": (2, {"api": "fsdp1", "strategy": "NO_SHARD", "precision": "bf16-mixed",
                                        "steps": 3}),
    "2-FULL_SHARD-fp32-adamw-fused-accum-clip": (2, {"strategy": "FULL_SHARD", "grad_accum_steps": 2,
                                                     "max_grad_norm": 0.5, "optimizer_impl": "fused"}),
    # a vocabulary large enough for the loss to be the peak, its cross-entropy in chunks
    "2-FULL_SHARD-fp32-adamw-loss-in-4-chunks": (2, {"strategy": "FULL_SHARD", "vocab_size": 32000, "seq_len": 64,
                                                     "loss_chunks": 4}),
    "2-FULL_SHARD-bf16-adamw-loss-in-2-chunks": (2, {"strategy": "FULL_SHARD", "vocab_size": 32000, "seq_len": 64,
                                                     "precision": "bf16-mixed", "loss_chunks": 2}),
    # gradients freed after each step, as PyTorch's zero_grad() does by default
    "2-FULL_SHARD-fp32-adamw-set-to-none": (2, {"strategy": "FULL_SHARD", "set_to_none": True, **BOOK_MODEL}),
    "1-NONE-pure-bf16-adamw-set-to-none": (1, {"strategy": "NONE", "precision": "bf16", "vocab_size": 32000,
                                               "seq_len": 64, "set_to_none": True}),
}
"""Cases whose measured peak has no prediction: FSDP1 sharding its flat parameters (the phase
model of the sharding strategies is FSDP2's; NO_SHARD's is the replicated one's)."""
UNPREDICTED_PEAK = {k for k, (_, o) in CASES.items() if o.get("api") == "fsdp1" and o["strategy"] != "NO_SHARD"}


_RESULTS: dict[str, tuple] = {}


def _run(name: str, tmp_path_factory) -> tuple:
    """Case ``name``'s ``(nproc, config, result)``. The first case asked for on a number of ranks
    runs every case of that number in one job (:func:`torchrun_batch`), once per session."""
    if name not in _RESULTS:
        nproc = CASES[name][0]
        batch = {label: {**TINY, **overrides} for label, (n, overrides) in CASES.items() if n == nproc}
        results = torchrun_batch("fsdp_train", nproc, batch, out=tmp_path_factory.mktemp("fsdp"), timeout_s=600,
                                 stream=False)
        _RESULTS.update({label: (nproc, batch[label], results[label]) for label in batch})
    return _RESULTS[name]


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory):
    return _run(request.param, tmp_path_factory)


def _units(config: dict) -> list:
    model = RunConfig.from_mapping(config).model_config()
    return [u for u in wrap_units(model, config.get("wrap", "layer"), config.get("wrap_min_params", 100_000))
            if u.numel]


def test_result_has_the_documented_shape(case):
    nproc, config, result = case
    assert result.schema == SCHEMA and result.run == "fsdp_train"
    assert result.world_size == nproc and [r["rank"] for r in result.ranks] == list(range(nproc))
    assert (result.backend, result.device) == ("gloo", "cpu")
    # the config it ran, as the run config spells it (activation_checkpointing=True reads "full")
    canonical = RunConfig.from_mapping(config).to_dict()
    assert {k: result.config[k] for k in config} == {k: canonical[k] for k in config}


def _fsdp1(config: dict) -> bool:
    return config.get("api") == "fsdp1" and config["strategy"] not in ("NONE", "DDP")


def _expected_kinds(nproc: int, config: dict) -> list[str]:
    """Collective kinds a step must issue, from the strategy alone."""
    strategy = config["strategy"]
    if strategy == "NONE" or (nproc == 1 and strategy != "DDP"):
        return []
    if strategy in ("DDP", "NO_SHARD"):  # replicas: every gradient all-reduced, nothing gathered
        return ["all_reduce"]
    kinds = ["all_gather", "reduce_scatter"]
    scaler = config.get("precision") == "fp16-mixed" and _fsdp1(config)  # ShardedGradScaler's inf check
    if strategy.startswith("HYBRID") or scaler:
        kinds.append("all_reduce")
    return kinds


def test_no_check_is_off_not_even_by_a_byte(case):
    nproc, config, result = case
    memory = {"param_shard_bytes", "param_padding_bytes", "grad_shard_bytes", "optimizer_state_bytes",
              "optimizer_step_bytes", "activation_bytes"}
    memory |= set() if _fsdp1(config) else {"init_bytes"}  # FSDP1 flattens as it materialises
    memory |= set() if _fsdp1(config) and config["strategy"] != "NO_SHARD" else {"peak_bytes"}
    memory |= {"held_between_micro_steps"} if config.get("grad_accum_steps", 1) > 1 else set()
    memory |= {"grad_norm"} if config.get("max_grad_norm") and not _fsdp1(config) else set()
    memory |= set() if _last_step_skipped(config, result) else {"optimizer_temporary_bytes"}
    kinds = _expected_kinds(nproc, config)
    comm = {f"{k}_buffer_bytes" for k in kinds}
    comm |= {f"{k}_count" for k in kinds} if config["strategy"] != "DDP" else set()
    comm |= {"sent_bytes"} if kinds else set()
    comm |= {"collective_count"} if config["strategy"] == "NONE" else set()
    units = set() if config["strategy"] in ("NONE", "DDP") else {"fsdp_unit_count"}
    assert {c.quantity for c in result.checks} == memory | comm | units
    assert len(result.checks) == nproc * len(memory | comm | units)
    tolerated = ({"activation_bytes", "peak_bytes", "grad_norm"} & memory) | (
        {"sent_bytes"} if config["strategy"] == "DDP" else set())
    assert {c.quantity for c in result.checks if c.tolerance > 0} == tolerated
    off = [(c.quantity, c.rank, c.predicted, c.measured) for c in result.checks if not c.ok]
    assert off == []


def _last_step_skipped(config: dict, result) -> bool:
    """The scaler skipped the measured (last) step: the optimizer did not step, nothing to check."""
    return config.get("steps", TINY["steps"]) in result.ranks[0]["skipped_steps"]


def test_the_optimizer_step_allocates_what_its_implementation_does(case):
    """Adam's temporaries, by hand: foreach, one fp32 copy of every local parameter (the rank's
    measured parameter bytes); the for-loop, two of one tensor with the one before still bound
    (each tensor's dim-0 shard of ceil(rows / N) rows); fused, none; SGD, none."""
    nproc, config, result = case
    if _last_step_skipped(config, result):
        assert all(r["optimizer_temporary_bytes"] is None for r in result.ranks)
        return
    impl = config.get("optimizer_impl", "for-loop")  # the CPU's default
    e = 2 if config.get("precision") == "bf16" else 4  # the moments' dtype: the state's
    tensors = RunConfig.from_mapping(config).model_config()
    shapes = [shape for _, shape in model_layout(tensors).tensors]
    for rank in result.ranks:
        if not config.get("optimizer", "adamw").startswith("adam") or impl == "fused":
            want = 0
        elif impl == "foreach":
            want = rank["param_shard_bytes"]
        elif _fsdp1(config):  # one flat parameter per unit, padded, the root's first
            group = rank["shard_group_size"]
            n = [u.flat_padded_numel(group) // group for u in _units(config)]
            want = e * max(a + 2 * b for a, b in zip([0, *n], n))
        else:
            group = rank["shard_group_size"] if config["strategy"] not in ("NONE", "DDP", "NO_SHARD") else 1
            n = []
            for shape in shapes:
                chunk = -(-shape[0] // group)
                rows = max(0, min(chunk, shape[0] - (rank["rank"] % group) * chunk))
                n.append(rows * (shape[1] if len(shape) > 1 else 1))
            want = e * max(a + 2 * b for a, b in zip([0, *n], n))
        assert rank["optimizer_temporary_bytes"] == want, (rank["rank"], impl)


def test_shards_sum_to_the_model_per_shard_group(case):
    nproc, config, result = case
    model = RunConfig.from_mapping(config).model_config()
    group = result.ranks[0]["shard_group_size"]
    assert group == {"DDP": 1, "NONE": 1, "NO_SHARD": 1}.get(config["strategy"],
                                                            config.get("shard_group_size") or nproc)
    shards = result.metric("param_shard_bytes")
    padding = result.metric("param_padding_bytes")
    dtype = "bf16" if config.get("precision") == "bf16" else "fp32"  # the state's dtype
    for start in range(0, nproc, group):  # each replica's shard group holds the whole model once
        assert sum(shards[start:start + group]) == {"bf16": 2, "fp32": 4}[dtype] * param_count(model)
    # independent of the run's own checks: the shard rule, applied to the shard index (FSDP1 pads
    # each unit's flat parameter once, FSDP2 each parameter)
    if _fsdp1(config):
        expected = [estimate_flat_shard_bytes(_units(config), group, r % group).padding_bytes for r in range(nproc)]
    else:
        expected = [estimate_shard_bytes(model, group, r % group, dtype).padding_bytes for r in range(nproc)]
    assert padding == expected
    assert len({s + p for s, p in zip(shards, padding)}) == 1  # equal storage on every rank


def test_units_are_what_the_wrapping_policy_makes(case):
    """FSDP's own wrapping (FSDP1's policies; our fully_shard calls) against the pure rule."""
    _, config, result = case
    if config["strategy"] in ("NONE", "DDP"):
        assert result.ranks[0]["measured_units"] == []
        return
    assert result.ranks[0]["measured_units"] == [u.name for u in _units(config)]


def test_ranks_agree_on_a_finite_loss(case):
    _, _, result = case
    config_steps_ = case[1]["steps"]
    losses = result.metric("losses")
    assert all(run == losses[0] for run in losses) and len(losses[0]) == config_steps_
    assert all(0 < x < 20 for x in losses[0])


def test_counted_collectives_follow_the_strategy(case):
    nproc, config, result = case
    calls = result.ranks[0]["collectives"]
    if not _expected_kinds(nproc, config):
        assert calls == []  # one plain process, or FSDP on a single rank: nothing communicated
    elif config["strategy"] in ("DDP", "NO_SHARD"):
        # DDP's buckets / NO_SHARD's flat gradient of each unit, summed: exactly the fp32 model
        assert {c["kind"] for c in calls} == {"all_reduce"}
        assert sum(c["buffer_bytes"] for c in calls) == result.extra["model_bytes"]
        if config["strategy"] == "NO_SHARD":
            assert len(calls) == len(_units(config))  # one all-reduce per unit
    else:
        units = _units(config)
        gathers = [c for c in calls if c["kind"] == "all_gather"]
        regathered = len(units) - (1 if units[0].root else 0)  # FSDP2 and FSDP1 keep the root gathered
        again = regathered if config["strategy"] in ("FULL_SHARD", "HYBRID_SHARD") else 0
        assert len(gathers) == (len(units) + again) * config.get("grad_accum_steps", 1)  # every micro-step
        dtype = {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16": "bf16"}.get(config.get("precision"), "fp32")
        assert {c["dtype"] for c in gathers} == {dtype}
        reduced = "bf16" if config.get("precision") == "bf16" else "fp32"  # pure bf16 reduces in bf16
        assert {c["dtype"] for c in calls if c["kind"] == "reduce_scatter"} == {reduced}
        group = result.ranks[0]["shard_group_size"]
        assert {c["group_size"] for c in calls if c["kind"] != "all_reduce"} == {group}
        scaler = [c for c in calls if c["kind"] == "all_reduce" and c["buffer_bytes"] == 4]
        if config.get("precision") == "fp16-mixed" and _fsdp1(config):
            assert [(c["dtype"], c["group_size"]) for c in scaler] == [("fp32", nproc)]  # one inf flag
        assert {c["group_size"] for c in calls if c["kind"] == "all_reduce" and c not in scaler} <= {nproc // group}


def test_peak_is_within_ten_percent_and_reported(case):
    """The peak is the one load-sensitive quantity: gloo runs FSDP2's reduce-scatters
    asynchronously, and one that finishes late keeps a layer unit's gradient buffer alive into
    the next phase (+3.2 % on 4 ranks in one chapter-2 execution under load; 0.00 % when idle;
    +10.7 % once for this file's accumulation case with two test workers on 2 cores). Hence the
    run's 10 % tolerance on ``peak_bytes``, plus, where gloo can free a sharded run's buffers
    late, the model's own late-free headroom (``MemoryEstimate.late_free_peak``); every
    model-state, unit and collective check stays exact
    (``test_no_check_is_off_not_even_by_a_byte``)."""
    nproc, overrides, result = case
    config = RunConfig.from_mapping({**TINY, **overrides})
    peaks = [c for c in result.checks if c.quantity == "peak_bytes"]
    for c in peaks:
        rank = result.ranks[c.rank]
        estimate = estimate_memory(
            config.model_config(), nproc, config.strategy, config.precision, config.optimizer,
            micro_batch=config.batch_size // (nproc * config.grad_accum_steps), seq_len=config.seq_len,
            shard_group_size=rank["shard_group_size"] if config.strategy.startswith("HYBRID") else None,
            rank=c.rank, cpu_offload=config.cpu_offload, activation_checkpointing=config.activation_checkpointing,
            units=wrap_units(config.model_config(), config.wrap, config.wrap_min_params),
            flat_params=_fsdp1(overrides), backend=result.backend, grad_accum_steps=config.grad_accum_steps,
            set_to_none=config.set_to_none)
        headroom = max(0, estimate.late_free_peak - estimate.peak) / c.predicted
        assert c.tolerance == pytest.approx(0.10 + headroom) and headroom < 0.05
        assert abs(c.relative_error) <= c.tolerance
    assert all(r["peak_breakdown"] for r in result.ranks)


def test_losses_equal_one_process_on_the_global_batch(case):
    """Sharding must not change the maths: in fp32, every run's losses equal those of one plain
    process training on the whole global batch (relative difference <= 1e-5), and with
    clipping, the total gradient norm over the shards equals the one process's (<= 1e-6)."""
    from handbook_lib.runtime import train_one_process

    _, config, result = case
    if config.get("precision", "fp32") != "fp32":
        pytest.skip("bf16 and fp16, mixed or pure, round differently from fp32 by design")
    run_config = RunConfig.from_mapping(config)
    log = train_one_process(run_config)
    worst = max_relative_difference(result.metric("losses")[0], log.losses)
    print(f"{result.world_size} ranks, {config['strategy']}: max relative loss difference {worst:.2e}")
    assert worst <= 1e-5, f"max relative loss difference {worst:.2e}"
    if run_config.max_grad_norm:
        assert len(log.grad_norm) == run_config.steps and min(log.grad_norm) > run_config.max_grad_norm  # clips
        for norms in result.metric("grad_norm"):
            assert max_relative_difference(norms, log.grad_norm) <= 1e-6


def test_one_unit_holds_the_whole_model_at_once(tmp_path_factory):
    """Wrapping only the root makes one unit of everything: FULL_SHARD then gathers every
    parameter at once, so the measured peak per rank rises above the per-layer wrapping's by
    at least one more unsharded copy of all the layers' parameters."""
    _, config, one = _run("2-FULL_SHARD-fp32-adamw-one-unit", tmp_path_factory)
    _, _, layered = _run("2-FULL_SHARD-fp32-adamw", tmp_path_factory)
    model = RunConfig.from_mapping(config).model_config()
    layers_bytes = 4 * sum(u.numel for u in _units({**config, "wrap": "layer"}) if not u.root)
    assert one.metric("param_shard_bytes") == layered.metric("param_shard_bytes")  # same state at rest
    assert min(one.metric("peak_bytes")) >= max(layered.metric("peak_bytes")) + layers_bytes // 2
    assert max(one.metric("peak_bytes")) >= 4 * param_count(model)  # the whole model, unsharded


def test_the_root_stays_gathered_into_backward(tmp_path_factory):
    """FSDP2's default for the root (``reshard_after_forward=None``): it is not resharded after
    forward, so backward does not gather it again. With one unit the step peaks as forward ends,
    the root's parameters and its all-gather's buffer (freed in the root's post-forward) both
    alive: ``2·4·R`` bytes, R its padded elements; the model's ``forward_end`` within 0.1 %."""
    nproc, config, result = _run("2-FULL_SHARD-fp32-adamw-one-unit", tmp_path_factory)
    (root,) = _units(config)
    gathered = 4 * root.padded_numel(nproc)
    run = RunConfig.from_mapping(config)
    predicted = estimate_memory(run.model_config(), nproc, "FULL_SHARD", micro_batch=run.batch_size // nproc,
                                seq_len=run.seq_len, backend="gloo", units=[root])
    assert predicted.peak_phase == "forward_end"
    for rank in result.ranks:
        assert [c["kind"] for c in rank["collectives"]].count("all_gather") == 1
        assert rank["peak_breakdown"]["Unsharded Param"] == rank["peak_breakdown"]["All Gather"] == gathered
        assert abs(rank["peak_bytes"] - predicted.peak) <= 1e-3 * predicted.peak


def test_activation_checkpointing_keeps_only_layer_inputs(tmp_path_factory):
    """With recomputation, forward keeps less: measured activations drop, to the byte, by what
    the layers would have saved beyond their inputs, less the boolean causal mask that every
    checkpointed layer keeps as an input; the losses stay identical."""
    from handbook_lib.models import estimate_activation_bytes

    _, config, ac = _run("2-FULL_SHARD-fp32-adamw-AC", tmp_path_factory)
    _, _, plain = _run("2-FULL_SHARD-fp32-adamw", tmp_path_factory)
    assert ac.metric("losses") == plain.metric("losses")
    saved = [p - a for p, a in zip(plain.metric("activation_bytes"), ac.metric("activation_bytes"))]
    model = RunConfig.from_mapping(config).model_config()
    micro = config["batch_size"] // 2
    full = estimate_activation_bytes(model, micro, config["seq_len"], "fp32")
    kept = estimate_activation_bytes(model, micro, config["seq_len"], "fp32", activation_checkpointing=True)
    assert all(s > 0 for s in saved)
    assert kept.head - full.head == config["seq_len"] ** 2
    assert saved == [full.total - kept.total] * len(saved)


def test_selective_checkpointing_keeps_what_its_policy_saves(tmp_path_factory):
    """Selective recomputation keeps, beyond the layers' inputs, the outputs of their matrix
    products and attention: measured against full recomputation, to the byte; same losses."""
    from handbook_lib.models import estimate_activation_bytes

    _, config, selective = _run("2-FULL_SHARD-fp32-adamw-selective-AC", tmp_path_factory)
    _, _, full = _run("2-FULL_SHARD-fp32-adamw-AC", tmp_path_factory)
    assert selective.config["activation_checkpointing"] == "selective" and full.config["activation_checkpointing"] == "full"
    assert selective.metric("losses") == full.metric("losses")
    model = RunConfig.from_mapping(config).model_config()
    micro, seq = config["batch_size"] // 2, config["seq_len"]
    d, f, h = model.d_model, model.dim_feedforward, model.nhead
    # per layer: Q/K/V, attention output and fp32 log-sum-exp, out projection, linear1, linear2
    kept = model.num_layers * (micro * seq * (3 * d + d + d + f + d) * 4 + 4 * h * micro * seq)
    assert kept == (estimate_activation_bytes(model, micro, seq, "fp32", activation_checkpointing="selective").total
                    - estimate_activation_bytes(model, micro, seq, "fp32", activation_checkpointing="full").total)
    measured = [s - a for s, a in zip(selective.metric("activation_bytes"), full.metric("activation_bytes"))]
    assert measured == [kept] * len(measured)


def test_every_second_product_keeps_q_k_v_and_linear1_as_torchtitan_s_policy_would(tmp_path_factory):
    """``ac_matmul_every=2``: of each layer's four products (Q/K/V, output projection, linear1,
    linear2) the 1st and 3rd outputs kept, the attention's output and log-sum-exp too; measured
    against full recomputation, to the byte; same losses."""
    _, config, thinned = _run("2-FULL_SHARD-fp32-adamw-selective-AC-every-2nd-product", tmp_path_factory)
    _, _, full = _run("2-FULL_SHARD-fp32-adamw-AC", tmp_path_factory)
    _, _, selective = _run("2-FULL_SHARD-fp32-adamw-selective-AC", tmp_path_factory)
    assert thinned.metric("losses") == full.metric("losses") and not thinned.failed_checks()
    model = RunConfig.from_mapping(config).model_config()
    tokens, d, f, h = config["batch_size"] // 2 * config["seq_len"], model.d_model, model.dim_feedforward, model.nhead
    kept = model.num_layers * (tokens * (3 * d + f + d) * 4 + 4 * h * tokens)
    measured = [t - a for t, a in zip(thinned.metric("activation_bytes"), full.metric("activation_bytes"))]
    assert measured == [kept] * len(measured)
    dropped = [s - t for s, t in zip(selective.metric("activation_bytes"), thinned.metric("activation_bytes"))]
    assert dropped == [model.num_layers * tokens * 2 * d * 4] * len(dropped)  # the output projection's, linear2's


def test_a_policy_keeping_the_products_only_recomputes_the_attention(tmp_path_factory):
    """``ac_save=matmul``: the attention's output and its fp32 log-sum-exp are recomputed, not
    kept (Korthikanti et al.'s split, at the operators' level): ``T·d·4 + 4·h·T`` bytes a layer
    fewer than the default policy, measured to the byte; same losses as full recomputation."""
    _, config, products = _run("2-FULL_SHARD-fp32-adamw-selective-AC-keep-products", tmp_path_factory)
    _, _, full = _run("2-FULL_SHARD-fp32-adamw-AC", tmp_path_factory)
    _, _, selective = _run("2-FULL_SHARD-fp32-adamw-selective-AC", tmp_path_factory)
    assert products.metric("losses") == full.metric("losses") and not products.failed_checks()
    model = RunConfig.from_mapping(config).model_config()
    tokens, d, h = config["batch_size"] // 2 * config["seq_len"], model.d_model, model.nhead
    dropped = [s - p for s, p in zip(selective.metric("activation_bytes"), products.metric("activation_bytes"))]
    assert dropped == [model.num_layers * (tokens * d * 4 + 4 * h * tokens)] * len(dropped)


def test_a_too_large_scale_skips_steps_and_halves(tmp_path_factory):
    """fp16's gradient scaler: a first factor of 2**20 overflows the fp16 gradients; the scaler
    skips those optimizer steps and halves itself each time, until the gradients fit."""
    _, config, result = _run("2-FULL_SHARD-fp16-scaler-too-large", tmp_path_factory)
    scales, skipped = result.ranks[0]["grad_scale"], result.ranks[0]["skipped_steps"]
    assert scales[0] == config["grad_scale_init"]
    assert skipped and skipped == list(range(1, len(skipped) + 1))  # the first steps (1-based), in a row
    assert len(skipped) < config["steps"]  # and then it trains
    for step in range(1, config["steps"]):  # scales[step - 1] is the factor step ``step`` used
        assert scales[step] == scales[step - 1] / (2 if step in skipped else 1)
    assert all(r["skipped_steps"] == skipped for r in result.ranks)  # every rank skips alike


# FSDP2's tuning knobs (explicit prefetch, reshard_after_forward as a group size, the three
# accumulation modes) run in chapter 5's "Tuning FSDP2", on the book's model, and each run there
# fails its cell unless every check holds: the order of issue, the units gathered at each
# compute and their bytes, the backward all-gathers in pairs, the bytes held between
# micro-steps and sent, and the losses against one process. CI executes that notebook, so the
# suite does not run the same experiments again; it keeps what needs no run: the refusals.
@pytest.mark.parametrize("overrides, world, words", [
    ({"strategy": "DDP", "explicit_prefetch": 1, "steps": 3}, 2, "explicit_prefetch"),
    ({"api": "fsdp1", "reshard_after_forward_size": 2}, 4, "reshard_after_forward_size"),
    ({"strategy": "SHARD_GRAD_OP", "reshard_after_forward_size": 2}, 4, "reshards after forward"),
    ({"reshard_after_forward_size": 3}, 4, "must divide the shard group of 4"),
    ({"reshard_after_forward_size": 4}, 4, "smaller"),
    ({"strategy": "NO_SHARD", "api": "fsdp1", "grad_accum_steps": 2, "reshard_after_backward": False}, 2,
     "reshard_after_backward"),
])
def test_tuning_knobs_refused_where_they_do_not_apply(overrides, world, words):
    from handbook_lib.runs.fsdp_train import validate

    with pytest.raises(ValueError, match=words):
        validate(RunConfig.from_mapping({**TINY, **overrides}), world)


def test_checkpointing_every_other_layer_keeps_the_plain_layers_activations(tmp_path_factory):
    """``ac_every=2`` on the 2-layer model: layer 0 checkpointed, layer 1 not. Against the run
    that checkpoints both, the forward keeps layer 1's whole share instead of its input, by
    hand ``T·(8d + 2f)·4 + T·(16 + 4h) + 4·s² - T·d·4`` bytes (T = 4 × 16 tokens a rank, d 64,
    f 96, h 2, s 16); each run's own prediction is off by the same 508 B."""
    _, _, every = _run("2-FULL_SHARD-fp32-adamw-AC-every-2", tmp_path_factory)
    _, _, both = _run("2-FULL_SHARD-fp32-adamw-AC", tmp_path_factory)
    t, d, f, h, s = 64, 64, 96, 2, 16
    layer = t * (8 * d + 2 * f) * 4 + t * (16 + 4 * h) + 4 * s * s
    measured = [r["activation_bytes"] for r in every.ranks]
    assert [m - r["activation_bytes"] for m, r in zip(measured, both.ranks)] == [layer - t * d * 4] * 2
    predicted = [c.predicted for c in every.checks if c.quantity == "activation_bytes"]
    assert [p - m for p, m in zip(predicted, measured)] == [508, 508]


@pytest.mark.parametrize("name", ["2-FULL_SHARD-fp32-adamw-loss-in-4-chunks", "2-FULL_SHARD-bf16-adamw-loss-in-2-chunks"])
def test_the_loss_in_chunks_lowers_the_peak_as_predicted(name, tmp_path_factory):
    """``loss_chunks``: the loss's backward holds one chunk's fp32 gradients; on a 32,000-token
    vocabulary its moment is the step's peak, measured within 0.01 % of the prediction, and the
    whole loss's prediction, ``2·4·T·V`` bytes of gradients, is far above what was measured."""
    nproc, config, result = _run(name, tmp_path_factory)
    assert not result.failed_checks()
    model = RunConfig.from_mapping(config).model_config()
    micro = config["batch_size"] // nproc
    kwargs = {"micro_batch": micro, "seq_len": config["seq_len"], "backend": "gloo"}
    chunked = estimate_memory(model, nproc, "FULL_SHARD", config.get("precision", "fp32"), **kwargs,
                              loss_chunks=config["loss_chunks"])
    whole = estimate_memory(model, nproc, "FULL_SHARD", config.get("precision", "fp32"), **kwargs)
    assert chunked.peak_phase == whole.peak_phase == "loss_backward"
    tv = micro * config["seq_len"] * config["vocab_size"]
    for rank in result.ranks:
        measured = rank["peak_bytes"]
        assert abs(measured - chunked.peak) <= 1e-4 * chunked.peak, (measured, chunked.peak)
        assert whole.peak - measured >= 2 * tv  # at least 2 bytes per logit element saved


@pytest.mark.parametrize("name", ["2-FULL_SHARD-fp32-adamw-set-to-none", "1-NONE-pure-bf16-adamw-set-to-none"])
def test_freed_gradients_lower_the_peak_as_predicted(name, tmp_path_factory):
    """``set_to_none``: no gradient at rest; the step's peak measured within 0.05 % of the model
    with the gradients freed (none before backward makes them, then those of the units already
    reduced), and below the model that keeps them. One process in pure bf16 on a 32,000-token
    vocabulary peaks in the loss's backward, before any gradient exists: freeing them saves all
    of them, ``2·P`` bytes."""
    nproc, config, result = _run(name, tmp_path_factory)
    assert not result.failed_checks()
    model = RunConfig.from_mapping(config).model_config()
    kwargs = {"micro_batch": config["batch_size"] // nproc, "seq_len": config["seq_len"], "backend": "gloo",
              "precision": config.get("precision", "fp32")}
    freed = estimate_memory(model, nproc, config["strategy"], **kwargs, set_to_none=True)
    kept = estimate_memory(model, nproc, config["strategy"], **kwargs)
    for rank in result.ranks:
        assert rank["grad_shard_bytes"] == 0
        assert abs(rank["peak_bytes"] - freed.peak) <= 5e-4 * freed.peak, (rank["peak_bytes"], freed.peak)
        assert rank["peak_bytes"] < kept.peak
    assert freed.peak_reserved == kept.peak_reserved  # the allocator keeps the freed blocks reserved
    if nproc == 1:
        assert freed.peak_phase == kept.peak_phase == "loss_backward"
        assert kept.peak - freed.peak == kept.components["grads"] == 2 * param_count(model)
