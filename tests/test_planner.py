"""handbook_lib.models.planner: the planner, against the seed's rule and the memory model."""

import json
import re

import pytest

from handbook_lib.models import (
    ACCELERATORS,
    DECODER_SHAPES,
    SEED_SCENARIOS,
    STEP_TIE,
    DecoderShape,
    Option,
    decoder_shape_from_hf,
    estimate_memory,
    estimate_seed_model_state,
    get_shape,
    model_layout,
    plan,
    recommend,
    seed_recommendation,
)

SCENARIOS = [("llama2-7b", "h100-80gb", 8), ("llama2-13b", "a100-40gb", 8), ("llama2-70b", "a100-80gb", 16),
             ("llama2-70b", "h100-80gb", 64), ("gpt3-175b", "a100-80gb", 64)]


def test_seed_rule_by_hand():
    # 1e9 params: NO_SHARD needs 16 GB, SHARD_GRAD_OP on 8 GPUs 4 + 12/8 = 5.5 GB, FULL_SHARD 2 GB
    assert seed_recommendation(10**9, 20 * 10**9, 8) == "NO_SHARD"
    assert seed_recommendation(10**9, 10 * 10**9, 8) == "SHARD_GRAD_OP"
    assert seed_recommendation(10**9, 3 * 10**9, 8) == "FULL_SHARD"
    assert seed_recommendation(10**9, 1 * 10**9, 8) == "does not fit"


@pytest.mark.parametrize("model, gpu, gpus", SCENARIOS)
def test_every_option_is_priced_by_the_memory_model(model, gpu, gpus):
    result = plan(model, gpu, gpus, seq_len=4096)
    shape = get_shape(model)
    acc = ACCELERATORS[gpu]
    usable = acc.memory_bytes - 287_047_680  # the CUDA context, pytorch/pytorch#86509
    two_mib = 2 * 2**20
    for option in result.options:
        expected = estimate_memory(shape, option.gpus, option.strategy, "bf16-mixed", micro_batch=1, seq_len=4096,
                                   shard_group_size=option.shard_group_size,
                                   activation_checkpointing=option.activation_checkpointing,
                                   cpu_offload=option.cpu_offload)
        reserved = -(-round(1.1 * expected.peak) // two_mib) * two_mib  # +10 %, to the allocator's 2 MiB
        host_ok = not option.cpu_offload or 8 * expected.host <= acc.host.memory_bytes
        assert option.peak_bytes == expected.peak and option.peak_reserved_bytes == reserved
        assert option.fits == (reserved <= usable and host_ok)
        assert option.step_s >= max(option.compute_s, 0) > 0
    assert result.recommended is not None and result.recommended.fits
    assert result.reasons and result.reasons[0]
    # the seed's rule in the seed's own units: the datasheet's GB, decimal
    assert result.seed_answer == seed_recommendation(shape.num_params, acc.datasheet_gb * 10**9, gpus)


def test_a_cpu_plan_prices_cpu_ranks_and_a_gpu_plan_gpu_ranks():
    """The cpu preset's ranks are gloo processes: no foreach Adam temporary (a GPU's), so its
    options are priced with backend="gloo"; every GPU preset with "nccl"."""
    from handbook_lib.core import ModelConfig

    assert ACCELERATORS["cpu"].backend == "gloo"
    assert {a.backend for k, a in ACCELERATORS.items() if k != "cpu"} == {"nccl"}
    small = ModelConfig(num_layers=1, vocab_size=5000)  # little activation memory, a large head
    for gpu, backend in (("cpu", "gloo"), ("h100-80gb", "nccl")):
        for option in plan(small, gpu, 2, micro_batch=1, seq_len=8, precision="fp32").options:
            expected = estimate_memory(small, 2, option.strategy, "fp32", micro_batch=1, seq_len=8,
                                       activation_checkpointing=option.activation_checkpointing,
                                       cpu_offload=option.cpu_offload, backend=backend)
            assert option.peak_bytes == expected.peak, (gpu, option.name)
    gloo, nccl = (plan(small, g, 2, micro_batch=1, seq_len=8, precision="fp32").options[0]
                  for g in ("cpu", "h100-80gb"))
    assert nccl.peak_phase == "optimizer_step" and nccl.peak_bytes > gloo.peak_bytes


def test_agrees_with_the_seed_where_model_state_decides():
    # short sequences: activations are small, so the seed's fp32 answer and the planner agree
    # that FULL_SHARD is needed for 13B on 8 x 40 GB (the seed: SHARD_GRAD_OP needs 4P = 52 GB)
    result = plan("llama2-13b", "a100-40gb", 8, seq_len=128)
    assert result.seed_answer == "FULL_SHARD" and result.recommended.strategy == "FULL_SHARD"
    assert not result.recommended.activation_checkpointing


def test_differs_from_the_seed_when_activations_decide():
    result = plan("llama2-13b", "a100-40gb", 8, seq_len=4096)
    assert result.seed_answer == "FULL_SHARD"
    assert result.recommended.name == "FULL_SHARD + AC"
    assert any("activations decide" in r for r in result.reasons)


def test_more_gpus_never_need_more_memory_under_full_shard():
    for name in ("llama2-7b", "llama2-70b", "gpt3-175b"):
        peaks = [estimate_memory(DECODER_SHAPES[name], n, "FULL_SHARD", "bf16-mixed", micro_batch=1,
                                 seq_len=2048, activation_checkpointing=True).peak for n in (8, 16, 32, 64, 128)]
        assert peaks == sorted(peaks, reverse=True)


def test_suggests_more_gpus_when_nothing_fits():
    result = plan("gpt3-175b", "a100-40gb", 8, seq_len=2048)
    more = [o for o in result.options if o.gpus > 8]
    assert more and more[0].fits
    assert estimate_seed_model_state(DECODER_SHAPES["gpt3-175b"].num_params, 8, "FULL_SHARD") > 40e9


@pytest.mark.parametrize("kwargs, match", [
    ({"model": "gpt5"}, "model must be one of"),
    ({"gpu": "tpu"}, "accelerator name must be one of|must be one of"),
    ({"gpus": 0}, "gpus"),
    ({"seq_len": 0}, "seq_len"),
    ({"headroom": 1.5}, "headroom"),
])
def test_bad_input(kwargs, match):
    args = {"model": "llama2-7b", "gpu": "h100-80gb", "gpus": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        plan(args.pop("model"), args.pop("gpu"), args.pop("gpus"), **args)


@pytest.mark.parametrize("kwargs, match", [
    ({"gpus": 16, "gpus_per_node": 0}, "gpus_per_node must be an int >= 1, got 0"),
    ({"micro_batch": 0}, r"^micro_batch must be an int >= 1, got 0$"),
    ({"seq_len": 2.5}, r"^seq_len must be an int >= 1, got 2.5$"),
    ({"gpus": 16, "gpus_per_node": 3}, "gpus=16 is not a whole number of nodes of gpus_per_node=3"),
    ({"precision": "fp8"}, "precision must be one of fp32, bf16-mixed, fp16-mixed, bf16, got 'fp8'"),
])
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan("llama2-7b", "h100-80gb", **{"gpus": 8, **kwargs})


def test_offload_states_the_host_memory_it_needs():
    result = plan("llama2-70b", "h100-80gb", 16, seq_len=4096)
    offload = next(o for o in result.options if o.cpu_offload)
    shape = get_shape("llama2-70b")
    assert offload.host_bytes == estimate_memory(shape, 16, "FULL_SHARD", "bf16-mixed", micro_batch=1, seq_len=4096,
                                                 activation_checkpointing=True, cpu_offload=True).host > 0
    assert all(o.host_bytes == 0 for o in result.options if not o.cpu_offload)
    # 175B on one GPU: 16 B per parameter is 2.79 TB of host RAM, more than a DGX H100's 2 TiB
    one = plan("gpt3-175b", "h100-80gb", 1)
    offload = next(o for o in one.options if o.cpu_offload)
    assert offload.host_node_bytes == 16 * 174_604_259_328 > 2 * 2**40 and not offload.fits
    assert not one.recommended.cpu_offload and one.recommended.gpus > 1
    assert any(r.startswith("FULL_SHARD + AC + offload fits the GPU") and "not the host: 2793.7 GB" in r
               for r in one.reasons)
    sixteen = plan("gpt3-175b", "h100-80gb", 16)  # per node: 8 GPUs' worth of host memory, 1.40 TB
    chosen = sixteen.recommended
    assert chosen.cpu_offload and chosen.host_node_bytes == 8 * chosen.host_bytes < 2 * 2**40
    assert (f"CPU offload needs {chosen.host_bytes / 1e9:.1f} GB of host RAM per GPU, "
            f"{8 * chosen.host_bytes / 1e9:.1f} GB per node of 8 GPUs against 2199.0 GB"
            in " ".join(sixteen.reasons))  # a DGX H100's 2 TB (2**41 bytes)


def test_offload_is_priced_as_fsdp2_runs_it():
    """Llama 2 70B on 8 A100 80GB (one DGX A100, 128 cores, PCIe 4 with two GPUs behind each
    switch's uplink), FULL_SHARD + AC + offload: every all-gather copies its fp32 shard up, every
    reduce-scatter copies its fp32 gradient shard down, and AdamW steps the rank's shard on
    128 / 8 = 16 cores."""
    result = plan("llama2-70b", "a100-80gb", 8, seq_len=4096)
    o = next(o for o in result.options if o.cpu_offload)
    plain = next(o for o in result.options if o.name == "FULL_SHARD + AC")
    p = get_shape("llama2-70b").num_params
    units = model_layout("llama2-70b").units()
    shards = {u.name: -(-u.numel // 8) for u in units}  # P / 8 per rank, dim-0 padding aside
    gathers = {u.name: 1 if u.root else 2 for u in units}  # forward and backward; the root kept
    up = 4 * sum(shards[n] * gathers[n] for n in shards)  # the fp32 shard before each all-gather
    down = 4 * sum(shards.values())  # each reduced fp32 gradient shard
    copy_s = (up + down) / (25e9 / 2)  # PCIe 4 achieves 25 GB/s, shared by 2 GPUs behind one switch
    assert o.offload.copy_s == pytest.approx(copy_s, rel=1e-3)
    # on the host link, beside NVLink's collectives: in each phase the busier of the two, the host's
    assert o.comm_s == pytest.approx(copy_s, rel=1e-3) and plain.comm_s < copy_s / 2
    # 16 cores would step 2.4e9 parameters/s; the machine's two EPYC 7742 stream 409.6 GB/s, 28 B
    # a parameter over 8 ranks: 1.83e9 a second, the lower of the two
    assert o.cpu_step_s == pytest.approx(-(-p // 8) / (409.6e9 / 8 / 28))
    assert o.offload.optimizer_limit == "memory bandwidth" and 409.6e9 / 8 / 28 < 16 * 1.5e8
    h100 = next(x for x in plan("llama2-70b", "h100-80gb", 8, seq_len=4096).options if x.cpu_offload)
    assert h100.offload.optimizer_limit == "cores"  # 614.4 GB/s: 2.74e9 a second per rank, above 14 x 1.5e8
    assert o.step_s > o.compute_s + o.cpu_step_s  # the CPU step is never hidden
    assert o.host_node_bytes == 8 * o.host_bytes < 2 * 2**40  # fits a 2 TB DGX A100 80GB


def test_a_platform_without_a_host_gets_no_offload_option():
    result = plan("llama2-70b", "mi300x-192gb", 8, seq_len=4096)
    assert not any(o.cpu_offload for o in result.options)
    assert any("CPU offload not priced" in r for r in result.reasons)


def test_margins_are_budget_less_reserved_peak():
    result = plan("gpt3-175b", "a100-80gb", 64, seq_len=4096)
    mib = 2**20  # NCCL's rings over 8 nodes of 8 NICs: 16 channels of 20 MiB; DDP's tree as many again
    nccl = {"DDP": 2 * 16 * 20 * mib, "SHARD_GRAD_OP": 16 * 20 * mib, "FULL_SHARD": 16 * 20 * mib,
            "HYBRID_SHARD": 24 * 12 * mib + 2 * 2 * 20 * mib + 16 * 20 * mib}  # shards, replicas of 8, world
    for o in result.options:
        usable = round(79.25 * 2**30) - 1_457_521_152 - nccl[o.strategy]  # CUDA's total less the context
        assert o.budget_bytes == usable and o.nccl_bytes == nccl[o.strategy]
        assert o.peak_reserved_bytes >= 1.1 * o.peak_bytes  # the allocator's 10 % reserve
        assert o.peak_reserved_bytes - 1.1 * o.peak_bytes < 2 * 2**20  # rounded up to 2 MiB
        assert o.margin_bytes == usable - o.peak_reserved_bytes and o.fits == (o.margin_bytes >= 0)
    assert result.recommended.name == "FULL_SHARD + AC" and 0 < result.recommended.margin < 0.06
    tight = plan("gpt3-175b", "a100-80gb", 64, seq_len=4096, headroom=0.10)
    assert tight.recommended.cpu_offload  # 10 % more kept free: the margin is gone


def test_the_intra_node_link_comes_from_the_accelerator_preset():
    """A new accelerator is priced on its own link, never a silent PCIe 4 (the old name match)."""
    from handbook_lib.models import Accelerator, get_accelerator, get_link

    for gpu, link in (("b200-180gb", "nvlink5"), ("mi300x-192gb", "infinity-fabric"), ("h100-80gb", "nvlink4")):
        acc = get_accelerator(gpu)
        assert acc.intra_link == link
        priced = plan("7b", gpu, 8, seq_len=4096)
        pinned = plan("7b", gpu, 8, seq_len=4096, intra_link=get_link(link))
        assert [o.comm_s for o in priced.options] == [o.comm_s for o in pinned.options]
        assert priced.gpus_per_node == acc.gpus_per_node
    nameless = Accelerator("A new GPU", 96 * 10**9, 1e15, 5e13, "a test")
    with pytest.raises(ValueError, match="states no intra-node link: pass intra_link"):
        plan("7b", nameless, 8, gpus_per_node=8)
    assert plan("7b", nameless, 8, gpus_per_node=8, intra_link="pcie5").recommended is not None


def test_equal_step_time_goes_to_less_communication():
    # Llama-2 7B on 8 H100s is compute-bound for both SHARD_GRAD_OP and FULL_SHARD: the rule
    # (fastest, then fewer levers, then less communication) must pick the one that sends less.
    result = plan("llama2-7b", "h100-80gb", 8, seq_len=4096)
    by_name = {o.name: o for o in result.options}
    sgo, full = by_name["SHARD_GRAD_OP"], by_name["FULL_SHARD"]
    assert sgo.fits and full.fits and sgo.bound == full.bound == "compute"
    assert round(sgo.step_s, 6) == round(full.step_s, 6)
    assert sgo.comm_s < full.comm_s
    assert result.recommended is sgo
    assert any("wins the tie" in r and "FULL_SHARD takes the same step time" in r for r in result.reasons)
    # and the rule picks it among every fitting option
    fitting = [o for o in result.options if o.fits and o.gpus == 8]
    assert recommend(fitting) is sgo


def test_steps_within_one_percent_tie_and_the_tie_goes_to_fewer_levers_then_less_traffic():
    fast = Option("FULL_SHARD", "FULL_SHARD", 16, peak_bytes=30, fits=True, comm_s=0.20, step_s=1.000)
    near = Option("SHARD_GRAD_OP", "SHARD_GRAD_OP", 16, peak_bytes=40, fits=True, comm_s=0.10, step_s=1.009)
    far = Option("DDP", "DDP", 16, peak_bytes=50, fits=True, comm_s=0.05, step_s=1.011)
    lever = Option("FULL_SHARD + AC", "FULL_SHARD", 16, activation_checkpointing=True, peak_bytes=10,
                   fits=True, comm_s=0.01, step_s=1.000)
    assert STEP_TIE == 0.01
    assert recommend([fast, near, far]) is near  # 0.9 % slower ties, and sends half
    assert recommend([fast, far]) is fast  # 1.1 % slower does not tie
    assert recommend([lever, fast]) is fast  # at a tie, no recomputation beats less traffic
    assert recommend([]) is None


# What the seed printed for its five scenarios (GB per GPU for NO_SHARD, SHARD_GRAD_OP,
# FULL_SHARD, and its recommendation), copied from its output: an independent source.
SEED_PRINTED = [
    ((112.0, 38.5, 14.0), "SHARD_GRAD_OP"),
    ((208.0, 71.5, 26.0), "FULL_SHARD"),
    ((1120.0, 385.0, 140.0), "does not fit"),
    ((1120.0, 306.2, 35.0), "FULL_SHARD"),
    ((2800.0, 732.8, 43.8), "FULL_SHARD"),
]


@pytest.mark.parametrize("scenario,printed", list(zip(SEED_SCENARIOS, SEED_PRINTED)))
def test_seed_scenarios_reproduce_the_seed(scenario, printed):
    gb, answer = printed
    got = [estimate_seed_model_state(scenario.nominal_params, scenario.gpus, s) / 1e9
           for s in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")]
    assert [round(g, 1) for g in got] == list(gb)
    gpu_bytes = {"a100-80gb": 80e9, "a100-40gb": 40e9}[scenario.gpu]
    assert seed_recommendation(scenario.nominal_params, gpu_bytes, scenario.gpus) == answer


def test_global_batch_grows_with_the_gpus_of_pure_fsdp():
    from handbook_lib.models import global_batch_tokens, max_data_parallel

    assert global_batch_tokens(64, 1, 4096) == 64 * 4096
    assert global_batch_tokens(64, 2, 4096, grad_accum_steps=4) == 64 * 2 * 4096 * 4
    assert global_batch_tokens(64, 1, 4096, model_parallel=8) == 8 * 4096
    assert max_data_parallel(4 * 2**20, 1, 4096) == 1024
    assert max_data_parallel(4096, 2, 4096) == 0
    with pytest.raises(ValueError, match="multiple"):
        global_batch_tokens(12, 1, 4096, model_parallel=8)


# --- more GPUs: the counts searched are priced as the options are -----------------------------

QWEN25_14B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120,
              "intermediate_size": 13824, "num_hidden_layers": 48, "num_attention_heads": 40,
              "num_key_value_heads": 8, "vocab_size": 152064, "max_position_embeddings": 32768,
              "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "hidden_act": "silu"}
"""Qwen/Qwen2.5-14B's published config.json (its shape keys and a few it does not need)."""


def test_qwen25_14b_on_8_cpu_ranks_gets_the_fewest_counts_that_fit():
    """CPU ranks (gloo) are priced on gloo when the planner looks for more GPUs too: FULL_SHARD
    with checkpointing fits 128 of them, not 64 (the count an nccl-priced search gave, which then
    did not fit and left the plan saying that nothing fits)."""
    shape = decoder_shape_from_hf(QWEN25_14B)
    result = plan(shape, "cpu", 8)
    assert result.recommended is not None and result.recommended.gpus == 128
    assert result.recommended.name == "FULL_SHARD + AC on 128 GPUs" and result.recommended.fits
    at_128 = {o.name: o for o in plan(shape, "cpu", 128).options}["FULL_SHARD + AC"]
    assert at_128.fits and at_128.peak_reserved_bytes == result.recommended.peak_reserved_bytes
    for fewer in (8, 16, 32, 64):  # each count below, planned for itself: FULL_SHARD + AC does not fit
        assert not {o.name: o for o in plan(shape, "cpu", fewer).options}["FULL_SHARD + AC"].fits
    assert "Nothing fits on 8 GPUs; 128 are the fewest on which FULL_SHARD + AC fits" in " ".join(result.reasons)
    assert not any("exceed a GPU" in r for r in result.reasons)
    # and what CPU offload would do, as the plan on that many GPUs prices it
    assert "With CPU offload, FULL_SHARD + AC would fit 32 GPUs" in result.reasons[-1]
    assert {o.name: o for o in plan(shape, "cpu", 32).options}["FULL_SHARD + AC + offload"].fits
    assert not {o.name: o for o in plan(shape, "cpu", 16).options}["FULL_SHARD + AC + offload"].fits


def test_the_plan_command_agrees(tmp_path, capsys):
    from handbook_lib.face.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN25_14B))
    assert main(["plan", "--hf-config", str(path), "--gpu", "cpu", "--gpus", "8"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Recommended: FULL_SHARD + AC on 128 GPUs — peak" in out and "No option fits" not in out


@pytest.mark.parametrize("model, gpu, seq_len", [
    ("llama2-70b", "cpu", 2**16), ("llama2-7b", "a100-40gb", 2**20),
    (DecoderShape("wide", 4, 65536, 64, 32000, gated_mlp=True, tied_embeddings=False), "cpu", 2048),
], ids=["70b-cpu", "7b-a100", "wide-cpu"])
def test_nothing_fits_says_what_would_and_it_does(model, gpu, seq_len):
    result = plan(model, gpu, 8, seq_len=seq_len)
    assert result.recommended is None
    last = result.reasons[-1]
    assert last.startswith("No option fits: even FULL_SHARD + AC on 4,096 GPUs reserves ")
    widest = plan(model, gpu, 4096, seq_len=seq_len)
    reserved = {o.name: o for o in widest.options}["FULL_SHARD + AC"].peak_reserved_bytes
    assert f"reserves {reserved / 1e9:.1f} GB per GPU" in last  # the option priced on 4,096 GPUs
    found = re.search(r"There it fits with a micro-batch of (\d+) x ([\d,]+) tokens", last)
    if found:  # the suggestion, planned, fits; twice as many tokens would not
        tokens = int(found[2].replace(",", ""))
        fits = {o.name: o for o in plan(model, gpu, 4096, seq_len=tokens).options}["FULL_SHARD + AC"]
        assert fits.fits and tokens < seq_len
        assert not {o.name: o for o in plan(model, gpu, 4096, seq_len=2 * tokens).options}["FULL_SHARD + AC"].fits
    else:
        assert "Not even one token fits" in last


def test_accumulation_multiplies_compute_and_prices_what_each_micro_step_reduces():
    """``grad_accum_steps`` K: K micro-batches' compute; reducing in every micro-step repeats the
    whole step's collectives K times; reducing in the last one only, DDP all-reduces once (as
    many bytes as one micro-step) while FULL_SHARD gathers K times and holds every parameter's
    fp32 gradient unsharded in between (4 bytes a parameter, less the layer being computed)."""
    from handbook_lib.models import model_layout, plan

    base = plan("llama2-7b", "h100-80gb", 8, seq_len=4096)
    held = plan("llama2-7b", "h100-80gb", 8, seq_len=4096, grad_accum_steps=4)
    synced = plan("llama2-7b", "h100-80gb", 8, seq_len=4096, grad_accum_steps=4, sync_every_micro_step=True)
    one, kept, each = ({o.name: o for o in p.options} for p in (base, held, synced))
    p = model_layout("llama2-7b").num_params
    for name, o in one.items():
        assert kept[name].compute_s == pytest.approx(4 * o.compute_s, rel=1e-12)
        assert each[name].comm_s == pytest.approx(4 * o.comm_s, rel=1e-9)
        assert each[name].peak_bytes == o.peak_bytes  # reduced each time: one micro-step's memory
    assert kept["DDP"].comm_s == one["DDP"].comm_s
    assert one["FULL_SHARD"].comm_s < kept["FULL_SHARD"].comm_s < 4 * one["FULL_SHARD"].comm_s
    # the fp32 gradients held, less the one step's buffers that in-place accumulation makes
    # unnecessary, plus at most one more layer's activations as the peak moves a layer
    extra = kept["FULL_SHARD"].peak_bytes - one["FULL_SHARD"].peak_bytes
    alone = estimate_memory("llama2-7b", 8, "FULL_SHARD", "bf16-mixed", micro_batch=1, seq_len=4096)
    assert 4 * p - alone.grad_buffers <= extra <= 4 * p + 34 * 4096 * 4096
    with pytest.raises(ValueError, match="sync_every_micro_step needs grad_accum_steps >= 2"):
        plan("llama2-7b", "h100-80gb", 8, sync_every_micro_step=True)
    with pytest.raises(ValueError, match="grad_accum_steps"):
        plan("llama2-7b", "h100-80gb", 8, grad_accum_steps=0)


def test_pure_bf16_halves_the_state_and_changes_the_70b_verdict():
    """Llama-2 70B on 16 A100 80GB at 4,096 tokens: with bf16-mixed's fp32 state (16 bytes a
    parameter) only offload fits; with the whole state in bf16 (8 bytes a parameter, no fp32
    copy) FULL_SHARD + AC does, on the GPUs alone."""
    from handbook_lib.models import plan

    mixed = plan("llama2-70b", "a100-80gb", 16, seq_len=4096)
    pure = plan("llama2-70b", "a100-80gb", 16, seq_len=4096, precision="bf16")
    assert mixed.recommended.name == "FULL_SHARD + AC + offload"
    assert pure.recommended.name == "FULL_SHARD + AC"
    state = {o.name: o.model_state_bytes for o in pure.options}
    assert state["FULL_SHARD + AC"] * 2 == {o.name: o.model_state_bytes for o in mixed.options}["FULL_SHARD + AC"]


def test_shard_groups_are_whole_nodes_or_a_node_s_divisors():
    from handbook_lib.models import shard_groups

    assert shard_groups(64, 8) == [8] and shard_groups(8, 8) == [] and shard_groups(4, 8) == []
    assert shard_groups(64, 8, 0) == [8, 16, 32]
    assert shard_groups(48, 8, 0) == [8, 16, 24]
    assert shard_groups(64, 8, 4) == [4] and shard_groups(64, 8, 16) == [16]
    for bad in (12, 64, 3, 128, -8, 1):
        with pytest.raises(ValueError, match=f"shard_group_size={bad}"):
            shard_groups(64, 8, bad)
    with pytest.raises(ValueError, match="more than one node"):
        shard_groups(8, 8, 4)


def test_hybrid_shard_at_every_group_size_is_priced_as_the_memory_model_and_nccl_say():
    from handbook_lib.models import node_preset, reserved_bytes, strategy_nccl

    usual = plan("llama2-70b", "h100-80gb", 64, seq_len=4096)
    every = plan("llama2-70b", "h100-80gb", 64, seq_len=4096, shard_group_size=0)
    names = [o.name for o in every.options]
    assert [n for n in names if n.startswith("HYBRID")] == [
        "HYBRID_SHARD/8", "HYBRID_SHARD/8 + AC", "HYBRID_SHARD/16", "HYBRID_SHARD/16 + AC",
        "HYBRID_SHARD/32", "HYBRID_SHARD/32 + AC"]
    by_name = {o.name: o for o in every.options}
    for o in usual.options:  # a node's group is the usual HYBRID_SHARD, every figure the same
        twin = by_name[o.name.replace("HYBRID_SHARD", "HYBRID_SHARD/8")]
        assert (twin.peak_bytes, twin.comm_s, twin.step_s, twin.budget_bytes) == (o.peak_bytes, o.comm_s, o.step_s,
                                                                                 o.budget_bytes)
    node = node_preset("h100-80gb")
    for group in (16, 32):
        o = by_name[f"HYBRID_SHARD/{group} + AC"]
        mem = estimate_memory("llama2-70b", 64, "HYBRID_SHARD", "bf16-mixed", micro_batch=1, seq_len=4096,
                              shard_group_size=group, activation_checkpointing=True, backend="nccl")
        assert o.shard_group_size == group and o.peak_bytes == mem.peak
        assert o.peak_reserved_bytes == reserved_bytes(mem.peak)
        assert o.nccl_bytes == strategy_nccl(node, "HYBRID_SHARD", 64, group).total
    # a larger shard group holds less of the model state. A node's group keeps its all-gathers and
    # reduce-scatters on NVLink while the replicas' all-reduce crosses the network at the same
    # time; groups of several nodes put both on the network, one after the other
    sizes = [by_name[f"HYBRID_SHARD/{g}"] for g in (8, 16, 32)]
    assert sizes[0].model_state_bytes > sizes[1].model_state_bytes > sizes[2].model_state_bytes
    assert by_name["FULL_SHARD"].comm_s < sizes[0].comm_s < sizes[2].comm_s < sizes[1].comm_s
    # on 4 nodes the replicas' all-reduce is shorter (4 machines, not 8): a node's group keeps the
    # links busy for less than FULL_SHARD, whose every collective crosses the network
    four = {o.name: o for o in plan("llama2-70b", "h100-80gb", 32, seq_len=4096).options}
    assert four["HYBRID_SHARD"].comm_s < four["FULL_SHARD"].comm_s


def test_a_checkpointing_policy_prices_its_options_memory_and_recomputation():
    from handbook_lib.models import CheckpointPolicy, estimate_step_flops, model_layout, recompute_flops

    policy = CheckpointPolicy("selective", matmul_every=2)
    result = plan("llama2-70b", "h100-80gb", 64, seq_len=4096, checkpointing=policy)
    assert result.checkpointing == "selective, every 2nd product"
    lay, acc = model_layout("llama2-70b"), ACCELERATORS["h100-80gb"]
    step = estimate_step_flops(lay.num_params, 4096, seq_len=4096, num_layers=lay.num_layers,
                               attention_width=lay.attention_width)
    by_name = {o.name: o for o in result.options}
    for strategy in ("SHARD_GRAD_OP", "FULL_SHARD"):
        o = by_name[strategy + " + AC"]
        mem = estimate_memory("llama2-70b", 64, strategy, "bf16-mixed", micro_batch=1, seq_len=4096,
                              activation_checkpointing="selective", ac_matmul_every=2, backend="nccl")
        assert o.peak_bytes == mem.peak
        flops = step.model + recompute_flops(lay, 4096, 4096, policy)
        assert o.compute_s == pytest.approx(flops / (acc.peak_flops("bf16-mixed") * result.utilization), rel=1e-12)
        assert o.compute_s < by_name[strategy].compute_s * 4 / 3  # less than a forward again
    assert result.recommended.name == "FULL_SHARD + AC"
    assert "recomputes 11.1 % of the model's FLOPs" in " ".join(result.reasons)
    # full, every layer: the plan as it always was
    assert plan("llama2-70b", "h100-80gb", 64, seq_len=4096, checkpointing=CheckpointPolicy()) == \
        plan("llama2-70b", "h100-80gb", 64, seq_len=4096)


def test_selective_checkpointing_that_recomputes_no_product_says_so():
    from handbook_lib.models import CheckpointPolicy

    result = plan("llama2-13b", "h100-80gb", 16, seq_len=8192, checkpointing=CheckpointPolicy("selective"))
    chosen = result.recommended
    assert chosen is not None and chosen.activation_checkpointing
    by_name = {o.name: o for o in result.options}
    assert chosen.compute_s == by_name[chosen.strategy].compute_s  # no FLOPs again
    assert "recomputes pointwise operators only" in " ".join(result.reasons)
