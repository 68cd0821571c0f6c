"""handbook_lib.models.published: other people's GPU measurements beside the models'."""

from __future__ import annotations

import pytest

from handbook_lib.models import (
    FOUNDRY_SOURCE,
    PUBLISHED_BUS_BANDWIDTH,
    PUBLISHED_MEMORY_CHANGE,
    PUBLISHED_SOURCES,
    PUBLISHED_THROUGHPUT,
    UTILIZATION_HALF_WIDTH,
    UTILIZATION_MAX,
    bus_bandwidth_rows,
    fit_utilizations,
    memory_change_rows,
    throughput_rows,
    utilization_points,
)
from handbook_lib.models.published_memory import PUBLISHED_AXIS_MEMORY, axis_memory_rows


def test_every_independent_bus_bandwidth_is_within_15_percent_or_says_why_not():
    rows = [r for r in bus_bandwidth_rows() if not r.published.calibration]
    assert len(rows) >= 7 and len({r.published.source.split(":")[0] for r in rows}) >= 4
    for r in rows:
        if r.published.why:  # an explained miss is a miss: the reason is not a way to hide a hit
            assert abs(r.error) >= 0.15, r.published.label
        else:
            assert abs(r.error) < 0.15, (r.published.label, r.published.kind, r.error)
    assert sum(bool(r.published.why) for r in rows) == 1  # NVLink SHARP, on one node of H100


def test_the_model_figure_is_the_ring_bytes_over_the_routed_time():
    row = next(r for r in bus_bandwidth_rows() if r.published.kind == "all_gather" and r.published.gpus == 32)
    b, n = row.published.buffer_bytes, 32
    sent = (n - 1) * (b // n)
    # 4 machines of 8 H100, 8 NDR ports each: min(8 x 47, 369) GB/s; each ring step waits for its
    # slower hop, NVLink's 7.7 us against the port's 5
    assert row.model_bytes_per_s == pytest.approx(sent / (31 * 7.7e-6 + sent / 369e9))
    assert row.algorithm == "ring"
    assert row.error == pytest.approx(row.model_bytes_per_s / 323.53e9 - 1)


def test_nvlinks_step_latency_is_the_fit_of_the_ramps_ends_and_the_sizes_between_follow():
    """NCCL's ring reduce-scatter on 8 H100 (NVIDIA/nccl#1047): fitting alpha and beta to its 128
    MiB and 8 GiB points gives NVLink's latency per ring step; the five sizes between, not fitted
    on, climb from 331 to 358 GB/s and the model follows them within 4 %."""
    from handbook_lib.models import LINKS, NVLINK_RING_STEP_S, fit_alpha_beta

    ends = [p for p in PUBLISHED_BUS_BANDWIDTH if "nccl#1047" in p.source and p.calibration]
    seconds = [p.buffer_bytes * 7 / 8 / p.busbw_bytes_per_s for p in ends]  # busbw = sent / time
    fit = fit_alpha_beta("reduce_scatter", 8, [p.buffer_bytes for p in ends], seconds)
    assert fit.alpha_s == pytest.approx(NVLINK_RING_STEP_S, abs=0.05e-6)
    assert all(LINKS[k].latency_s == NVLINK_RING_STEP_S for k in ("nvlink3", "nvlink4", "nvlink5"))
    ramp = [r for r in bus_bandwidth_rows() if "nccl#1047" in r.published.source]
    assert len(ramp) == 7 and [r.published.busbw_bytes_per_s for r in ramp] == sorted(
        r.published.busbw_bytes_per_s for r in ramp)
    assert [r.model_bytes_per_s for r in ramp] == sorted(r.model_bytes_per_s for r in ramp)  # a ramp too
    assert all(abs(r.error) < 0.04 for r in ramp)
    # with the datasheet's latency of a hop (2 us) the smallest would be 13 % fast, not 1 %
    small = ramp[0].published.buffer_bytes * 7 / 8
    assert small / (7 * 2e-6 + small / 369e9) / 311.34e9 - 1 > 0.13


def test_links_priced_at_their_line_rate_say_so():
    from handbook_lib.models import LINKS

    bounds = {k for k, link in LINKS.items() if link.upper_bound}
    assert bounds == {"infinity-fabric", "100gbe", "25gbe"}
    assert all("upper bound" in LINKS[k].source and LINKS[k].efficiency == 1.0 for k in bounds)
    assert LINKS["pcie5"].achievable_bytes_per_s == 52e9 and "nvbandwidth" in LINKS["pcie5"].source


def test_a_ring_over_more_nodes_loses_bus_bandwidth_to_its_steps_latency():
    """NVIDIA/nccl#1229: reduce-scatter on 4 to 128 nodes of H100 falls from 360 to 260 GB/s; the
    route's 8M - 1 ring steps at NVLink's fitted 7.7 us each give 365 to 276, within 14 %."""
    rows = [r for r in bus_bandwidth_rows() if "nccl#1229" in r.published.source]
    assert [r.published.gpus for r in rows] == [32, 64, 128, 256, 512, 1024]
    model = [r.model_bytes_per_s for r in rows]
    assert model == sorted(model, reverse=True) and all(abs(r.error) < 0.14 for r in rows)
    assert model[-1] / model[0] == pytest.approx(0.755, abs=0.005)  # published: 260 / 360 = 0.72


def test_fewer_ports_than_gpus_are_priced_on_the_ports():
    row = next(r for r in bus_bandwidth_rows() if r.published.label == "2 x 8 A100, 4 x HDR")
    # 4 ports of HDR 200 (23.5 GB/s achievable) for 8 GPUs: 94 GB/s per GPU, a ring of 16
    b = row.published.buffer_bytes
    sent = 2 * 15 * -(-b // 16)
    assert row.model_bytes_per_s == pytest.approx(sent / (30 * 7.7e-6 + sent / 94e9))  # NVLink's step: slower


def test_a_row_the_parameters_came_from_is_marked_as_calibration():
    calibration = [p for p in PUBLISHED_BUS_BANDWIDTH if p.calibration]
    assert [p.label for p in calibration] == ["1 x 8 H100, ring", "1 x 8 H100, 128 MiB", "1 x 8 H100, 8,192 MiB"]
    assert "nccl-tests#212" in calibration[0].source and all("nccl#1047" in p.source for p in calibration[1:])
    assert all(p.source for p in PUBLISHED_BUS_BANDWIDTH)
    # the utilization's constants: MosaicML's one-node, 2,048-token runs without checkpointing
    fitted = [p for p in PUBLISHED_THROUGHPUT if p.calibration]
    assert len(fitted) == 17 and all(p.source == FOUNDRY_SOURCE for p in fitted)
    assert all((p.gpus, p.seq_len, p.activation_checkpointing) == (8, 2048, False) for p in fitted)


def test_the_utilization_constants_are_the_fit_of_the_calibration_rows():
    """UTILIZATION_MAX and UTILIZATION_HALF_WIDTH are what fit_utilizations makes of the
    calibration rows' utilizations, each of those computed here from its published tokens/s."""
    points = utilization_points()
    u_max, d0 = fit_utilizations(points)
    assert d0 == UTILIZATION_HALF_WIDTH == 386
    for gpu, u in u_max.items():
        assert UTILIZATION_MAX[gpu][0] == round(u, 3)
    # one point by hand: MPT 7B on 8 A100 80GB, 4,641 tokens/s: (6P + 12·L·d·s) FLOPs a token
    p, layers, d, s = 6_658_859_008, 32, 4096, 2048
    assert (d, pytest.approx((6 * p + 12 * layers * d * s) * 4641 / 312e12)) in points["NVIDIA A100 80GB"]


def test_throughput_is_tokens_over_the_compute_model():
    """Each row's model: the hardware FLOPs (6PT, attention's 12·L·w·s per token, the forward
    again with checkpointing) at the GPU's utilization for the model's width, by hand."""
    rows = {r.published.label: r for r in throughput_rows()}
    u_a100 = 0.692 * 4096 / (4096 + 386)
    p7, l7, w7 = 6_738_415_616, 32, 4096   # Llama 2 7B
    seven = rows["Llama 2 7B, 128 A100"]  # 2 x 4,096 tokens per GPU
    assert seven.utilization == pytest.approx(u_a100)
    assert seven.model_tokens_per_s == pytest.approx(u_a100 * 312e12 / (6 * p7 + 12 * l7 * w7 * 4096))
    ac = rows["Llama 2 70B, 128 A100, AC"]  # recomputation: the forward again, 8P + 16·L·w·s
    p70, l70, w70 = 68_976_648_192, 80, 8192
    u70 = 0.692 * w70 / (w70 + 386)
    assert ac.model_tokens_per_s == pytest.approx(u70 * 312e12 / (8 * p70 + 16 * l70 * w70 * 4096))
    mpt = rows["MPT 7B, 2,048 tok x 6, 8 H100"]  # a bare count: its layers and width from its yaml
    assert mpt.model_tokens_per_s == pytest.approx(
        0.468 * 4096 / (4096 + 386) * 989e12 / (6 * 6_658_859_008 + 12 * 32 * 4096 * 2048))
    assert mpt.published.tokens_per_s_per_gpu == 10643 and mpt.published.published_mfu == 0.4644


def test_the_throughput_table_meets_its_goals():
    """At least 100 rows not calibrated on, from at least 4 independent sources, across A100s
    and H100s, sequences from 2k to 32k tokens and more, with and without checkpointing; median
    |error| at most 15 % overall and per GPU, no source worse than 25 %."""
    import statistics

    rows = [r for r in throughput_rows() if not r.published.calibration]
    assert len(rows) >= 100 and len({r.published.source for r in rows}) >= 4
    assert {r.published.gpu for r in rows} == {"a100-40gb", "a100-80gb", "h100-80gb"}
    assert min(r.published.seq_len for r in rows) <= 2048 and max(r.published.seq_len for r in rows) >= 32768
    assert {r.published.activation_checkpointing for r in rows} == {True, False}
    assert statistics.median(abs(r.error) for r in rows) <= 0.15
    for key in ("gpu", "source"):
        for value in {getattr(r.published, key) for r in rows}:
            errors = [abs(r.error) for r in rows if getattr(r.published, key) == value]
            assert statistics.median(errors) <= (0.15 if key == "gpu" else 0.25), (value, statistics.median(errors))


def test_the_throughput_model_beats_the_6pt_rule_at_one_utilization():
    """Against the same published rows, the compute model (attention counted, utilization per
    GPU and width) errs less than the rule it replaced (6PT, 8PT with checkpointing, 41 % on every
    GPU): the median |error| of the rows not calibrated on."""
    import statistics

    from handbook_lib.models.published import _params

    rows = [r for r in throughput_rows() if not r.published.calibration]
    now = statistics.median(abs(r.error) for r in rows)
    before = []
    for r in rows:
        p = r.published
        flops = (8 if p.activation_checkpointing else 6) * _params(p.model)
        rate = 0.41 * {"a100-40gb": 312e12, "a100-80gb": 312e12, "h100-80gb": 989e12}[p.gpu] / flops
        before.append(abs(rate / p.tokens_per_s_per_gpu - 1))
    assert now < 0.10 < 0.20 < statistics.median(before) and now < statistics.median(before) / 2


def test_the_memory_change_is_the_sharded_state_and_the_reserve():
    rows = memory_change_rows()
    assert len(rows) == 3
    p = 8_030_261_248  # Llama 3.1 8B, from its config.json
    by_hand = 1.10 * 16 * p * (1 / 8 - 1 / 128)  # fp32 params, grads, Adam's 2: 16 B, sharded
    for r in rows:
        assert r.model_change_bytes == pytest.approx(by_hand, rel=0.005)
        assert abs(r.error) < 0.10, (r.published.label, r.error)


def test_the_sources_are_independent_groups():
    assert len(PUBLISHED_SOURCES) >= 3
    from handbook_lib.models import PUBLISHED_ZERO_STATE

    from handbook_lib.models import PUBLISHED_PEAKS

    cited = " ".join(p.source for rows in (PUBLISHED_BUS_BANDWIDTH, PUBLISHED_THROUGHPUT, PUBLISHED_MEMORY_CHANGE,
                                           PUBLISHED_ZERO_STATE, PUBLISHED_PEAKS) for p in rows)
    for refs in PUBLISHED_SOURCES.values():
        assert any(ref.split("#")[0].split("/")[-1] in cited or ref in cited for ref in refs), refs


def test_the_published_absolute_peaks_fall_between_full_and_selective_recomputation():
    for r in memory_change_rows():
        for gpus, published in zip(r.published.gpus, r.published.peaks_gib):
            assert r.model_peaks_gib(gpus, "full") < published < r.model_peaks_gib(gpus, "selective")


def test_context_parallel_peaks_are_flat_and_within_10_percent():
    """torchtitan's Table 2: FSDP x CP on 8 H100, the sequence doubling with CP. Each GPU keeps
    32,768 tokens and 1/8 of the state on every row, so the model predicts the same peak for all
    four; the published ones differ by 0.6 GiB. Bound: 10 % (Float8, compile and NCCL buffers
    are not in the model; it predicts 8 % low)."""
    rows = [r for r in axis_memory_rows() if r.published.tp_size == 1]
    assert [r.published.cp_size for r in rows] == [1, 2, 4, 8]
    assert all(r.published.seq_len // r.published.cp_size == 32768 for r in rows)
    assert len({r.model_bytes for r in rows}) == 1  # one peak: the tokens per GPU do not change
    published = [r.published.peak_gib for r in rows]
    assert max(published) - min(published) < 0.01 * min(published)  # and theirs is flat within 1 %
    for r in rows:
        assert abs(r.error) < 0.10, (r.published.label, r.error)
    assert all("llama3_h100_202412_torchtitan.md" in p.source for p in PUBLISHED_AXIS_MEMORY)


def test_the_2d_peak_is_predicted_within_30_percent_and_says_what_it_leaves_out():
    """torchtitan's Table 4: Llama 3.1 70B, FSDP 32 x TP 8, 16 sequences of 8,192 per TP group,
    full checkpointing. The model's peak: TP's shard of the state plus 1/8 of FULL_SHARD's
    activations and logits (sequence and loss parallel), 52.6 GiB reserved; measured 71.9 GiB
    (67.6 with AsyncTP). Bound: 30 %, a known miss (the model predicts low), not a fit."""
    rows = [r for r in axis_memory_rows() if r.published.tp_size == 8]
    assert len(rows) == 2 and all(r.published.gpus == 256 for r in rows)
    for r in rows:
        assert -0.30 < r.error < 0, (r.published.label, r.error)
        assert "Float8" in r.published.why and "in-flight" in r.published.why
    # by hand: 70.6e9 parameters x 16 B / 256 GPUs = 4.4 GB of state; layer inputs under SP
    # 2 B x 16 x 8,192 x 8,192 x 80 / 8 = 21.5 GB: the bulk of the rest is activations and logits
    assert rows[0].model_bytes > (4.4e9 + 21.4e9) * 1.10


def test_the_eager_torchtitan_peaks_are_compared_in_absolute_terms_with_its_own_policy():
    """torchtitan's 8B runs keep every second matrix product (its op policy): the model's reserved
    peak with that policy is within 10 % of the published reserved peak on 8 and on 128 GPUs;
    the compiled runs are shown, not counted, each with its reason."""
    from handbook_lib.models import TORCHTITAN_OP_POLICY, estimate_memory, peak_rows
    from handbook_lib.models.published import published_model

    rows = peak_rows()
    assert TORCHTITAN_OP_POLICY == 2 and len(rows) == 6
    counted = [r for r in rows if r.counted]
    assert [(r.gpus, r.published_gib) for r in counted] == [(8, 82.4), (128, 67.0)]
    assert all(-0.06 < r.error < -0.03 for r in counted)  # 3.9 % and 4.9 % low
    assert all("torch.compile" in r.why for r in rows if not r.counted)
    shape = published_model("llama3.1-8b")
    whole = estimate_memory(shape, 8, "FULL_SHARD", "bf16-mixed", micro_batch=2, seq_len=8192,
                            activation_checkpointing="selective").peak_reserved / 2**30
    assert counted[0].model_gib < counted[0].published_gib < whole  # keeping every product: 97.5 GiB


def test_deepspeeds_zero3_state_with_and_without_its_bf16_master():
    """DeepSpeed's example: ZeRO-3's allocated memory after the last step. Its model has
    32·(12d² + 13d) + 2·50,000·d + 512·d + 50,000 parameters at d = 4,096 (6.86B); the state is
    2 + 4 + 2 + 8 bytes a parameter with the fp32 master, 2 + 2 + 2 + 4 with the bf16 one, over 4
    GPUs, plus the script's last bf16 logits, ids and labels, 512·(2·50,000 + 16) bytes."""
    from handbook_lib.models import PUBLISHED_ZERO_STATE, zero_state_rows

    rows = {r.label: r for r in zero_state_rows()}
    big = next(r for r in PUBLISHED_ZERO_STATE if r.label == "6.86B, 4 GPUs, bf16 master")
    d, n = 4096, 4
    p = 32 * (12 * d * d + 13 * d) + 2 * 50_000 * d + 512 * d + 50_000
    assert big.params == p == 6_855_902_032
    part, logits = -(-p // n), 512 * (2 * 50_000 + 16)
    assert rows[big.label].model_gib * 2**30 == pytest.approx(10 * part + 4 + logits)
    assert rows["6.86B, 4 GPUs, fp32 master"].model_gib * 2**30 == pytest.approx(16 * part + 4 + logits)
    assert all(r.counted for r in rows.values())
    within = [r for r in rows.values() if abs(r.error) < 0.10]
    assert len(within) == 4 and all(r.why for r in rows.values() if r not in within)


def test_published_peaks_are_compared_counter_with_counter():
    """torchtitan's pull request 165 (percentages of a 95.0396 GiB H100) and torchtune's README:
    an active peak against the model's allocated peak, a reserved one against its reserved peak."""
    from handbook_lib.models import PUBLISHED_PEAKS, estimate_memory, published_peak_rows

    rows = {r.label: r for r in published_peak_rows()}
    assert rows["7B, FSDP2, full AC (active)"].published_gib == pytest.approx(23.92 / 100 * 95.0396)
    assert rows["7B, FSDP1, SAC (reserved)"].published_gib == pytest.approx(67.23 / 100 * 95.0396)
    fsdp2 = estimate_memory("llama2-7b", 8, "FULL_SHARD", "bf16-mixed", micro_batch=8, seq_len=2048,
                            activation_checkpointing="selective", ac_matmul_every=2, backend="nccl",
                            optimizer_impl="foreach", set_to_none=True)  # torchtitan's zero_grad() frees them
    assert rows["7B, FSDP2, SAC (active)"].model_gib == fsdp2.peak / 2**30
    assert rows["7B, FSDP2, SAC (reserved)"].model_gib == fsdp2.peak_reserved / 2**30
    counted = [r for r in rows.values() if r.counted]
    assert len(counted) == 21 and sum(abs(r.error) < 0.10 for r in counted) == 12
    # torchtitan's active peaks hold the gradients its loop frees: kept, the model is within 3 %
    titan = [r for r in counted if r.label.endswith("(active)") and r.gpus == 8 and abs(r.error) >= 0.10]
    assert len(titan) == 2 and all("with them kept the model is" in r.why for r in titan)
    # IBM's rows, the Trainer freeing its gradients after each step: Mistral's and PowerLM's within
    # 1.2 %; SantaCoder's misses say its loss is taken on the bf16 logits
    ibm = [r for r in counted if r.label.startswith(("Mistral", "PowerLM"))]
    assert sum(abs(r.error) < 0.012 for r in ibm) == 8 and all(abs(r.error) < 0.10 for r in ibm)
    santacoder = [r for r in counted if r.label.startswith("SantaCoder")]
    assert all("bf16 logits" in r.why for r in santacoder if abs(r.error) >= 0.10)
    assert all(r.error > 0 for r in santacoder)
    assert [r.label for r in rows.values() if not r.counted] == ["7B, FSDP2, full AC, compile (reserved)",
                                                                 "7B, FSDP2, SAC, compile (reserved)"]
    # a reserved miss says how far the run's reserved peak stood above its active one
    assert rows["7B, FSDP2, full AC (reserved)"].why.startswith(f"the run reserved {32.64 / 23.92:.2f}x")
    assert {p.counter for p in PUBLISHED_PEAKS} == {"active", "allocated", "reserved"}
