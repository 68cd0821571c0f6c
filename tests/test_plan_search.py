"""handbook_lib.models.plan_search: what the planner searches by default, each layout priced as
plan() and compare_axes() price it alone, and the verdict read against the model's error band."""

import time

import pytest

from handbook_lib.models import CheckpointPolicy, compare_axes, get_shape, plan
from handbook_lib.models.bands import StepTimeBand, step_time_band
from handbook_lib.models.plan_search import SEARCH_POLICIES, Candidate, PlanSearch, batch_splits, search_plan

LLAMA70 = get_shape("llama2-70b")


@pytest.fixture(scope="module")
def big():
    start = time.process_time()
    found = search_plan(LLAMA70, "h100-80gb", 512, seq_len=4096)
    return found, time.process_time() - start


def test_512_gpus_search_groups_tp_and_policies_in_under_a_second(big):
    found, cpu_s = big
    assert cpu_s < 1.0
    names = {c.name for c in found.candidates}
    groups = {n.split(" ")[0] for n in names if n.startswith("HYBRID_SHARD/")}
    assert groups == {f"HYBRID_SHARD/{g}" for g in (8, 16, 32, 64, 128, 256)}
    assert {"TP 2 x FSDP 256", "TP 4 x FSDP 128 + AC", "TP 8 x FSDP 64"} <= names
    assert {c.checkpointing for c in found.candidates} == {"none", *(p.label for p in SEARCH_POLICIES)}
    assert "FULL_SHARD + AC + offload" in names
    # every candidate once: 9 strategies and groups (DDP, SGO, FS, 6 HSDP) x (none + 4 policies), offload,
    # 3 TP degrees x (plain, async) x (none, full)
    assert len(found.candidates) == len(names) == 9 * 5 + 1 + 12
    assert {"TP 8 (async) x FSDP 64", "TP 2 (async) x FSDP 256 + AC"} <= names
    verdict = found.verdict()
    assert verdict.startswith(f"Fastest of the {len(found.fitting)} that fit: {found.winner.name}")
    assert f"Next: {found.runner_up.name}, {100 * found.lead:.1f} % slower" in verdict
    band = step_time_band("h100-80gb")
    assert f"±{100 * band.median:.0f} %" in verdict and f"{100 * band.p80:.1f} %" in verdict


def test_each_candidate_is_priced_as_plan_and_compare_axes_price_it_alone(big):
    found, _ = big
    by = {c.name: c for c in found.candidates}
    for policy in SEARCH_POLICIES:
        alone = plan(LLAMA70, "h100-80gb", 512, seq_len=4096, checkpointing=policy, shard_group_size=0)
        for o in alone.options:
            if not o.activation_checkpointing or o.cpu_offload:
                continue
            name = o.name if policy.label == "full" else o.name.replace(" + AC", f" + AC ({policy.label})")
            c = by[name]
            assert (c.step_s, c.peak_reserved_bytes, c.fits) == (o.step_s, o.peak_reserved_bytes, o.fits)
            assert c.tokens_per_s_per_gpu == pytest.approx(4096 / o.step_s)
    for row in compare_axes(LLAMA70, "h100-80gb", 512, seq_len=4096, tp_size=4):
        if row.tp_size == 4:
            c = by[row.name]
            assert (c.step_s, c.peak_reserved_bytes) == (row.step_s, row.peak_reserved_bytes)
            assert c.tokens_per_s_per_gpu == pytest.approx(row.tokens_per_s_per_gpu)


def test_fitting_layouts_come_first_fastest_first(big):
    found, _ = big
    fits = list(found.fitting)
    assert fits and all(c.fits for c in fits) and not any(c.fits for c in found.candidates[len(fits):])
    rates = [c.tokens_per_s_per_gpu for c in fits]
    assert all(b <= a * 1.01 for a, b in zip(rates, rates[1:]))  # within a 1 % tie, by fewer levers
    assert max(rates) <= found.winner.tokens_per_s_per_gpu * 1.01
    # torchtitan's policy (every 2nd product kept) recomputes less than full: it leads here
    assert found.winner.checkpointing == "selective, every 2nd product"


def _c(name, rate, tp=1, checkpointing="none", fits=True, comm=1.0, margin=float("nan"), bound="compute"):
    return Candidate(name, checkpointing, tp, fits, 10, 20, 1 / rate, rate, bound, comm, False, margin)


@pytest.mark.parametrize("margin, bound, words", [
    (1.05, "compute", "compute-bound unless utilization exceeds 42 % (priced at 40 %: inside the model's error)"),
    (1.5, "compute", "compute-bound unless utilization exceeds 60 % (priced at 40 %)."),
    (3.0, "compute", "compute-bound at any utilization"),
    (0.8, "communication", "communication-bound unless utilization falls below 32 % (priced at 40 %)."),
    (float("nan"), "compute", "s a step ±10 %, compute-bound. Next")])
def test_the_winners_bound_says_where_it_flips_and_whether_inside_the_band(margin, bound, words):
    found = PlanSearch((_c("A", 100.0, margin=margin, bound=bound), _c("B", 50.0)), "2 layouts", BAND, 0.40)
    assert words in found.verdict()


BAND = StepTimeBand("GPU", 50, 0.10, 0.20)


@pytest.mark.parametrize("runner, words", [
    (99.5, "Tied within 1 %"), (95.0, "a tie within the model's median error on this GPU (10.0 %, 50 published"),
    (87.0, "beyond the model's median error on this GPU (10.0 %), within what 4 runs in 5 stay within (20.0 %)"),
    (70.0, "beyond the model's error for 4 runs in 5 on this GPU (20.0 %)")])
def test_the_lead_is_read_against_the_band(runner, words):
    found = PlanSearch((_c("A", 100.0), _c("B", runner), _c("C", 10.0, fits=False)), "3 layouts", BAND)
    assert words in found.verdict()
    assert "±10 %" in found.verdict()


def test_a_tie_goes_to_fewer_levers_then_less_communication():
    from handbook_lib.models.plan_search import _order

    ordered = _order([_c("TP", 100.0, tp=2), _c("SAC", 99.8, checkpointing="selective"),
                      _c("AC", 99.5, checkpointing="full"), _c("plain-busy", 99.3, comm=2.0),
                      _c("plain", 99.2, comm=1.0), _c("slow", 80.0)])
    assert [c.name for c in ordered] == ["plain", "plain-busy", "AC", "SAC", "TP", "slow"]


def test_nothing_fits_says_what_comes_closest():
    found = PlanSearch((_c("small", 1.0, fits=False),), "1 layout", None)
    assert found.winner is None and found.lead is None
    assert found.verdict().startswith("None of the 1 layouts searched fits: the smallest peak is small's")
    alone = PlanSearch((_c("A", 100.0), _c("B", 50.0)), "2", None)
    assert "no published run on this GPU tests the model's step times" in alone.verdict()


def test_one_node_searches_no_hybrid_groups_and_the_handbook_model_no_tp():
    found = search_plan(get_shape("llama2-7b"), "h100-80gb", 8, seq_len=4096)
    assert not any(c.name.startswith("HYBRID") for c in found.candidates)
    assert {c.tp_size for c in found.candidates} == {1, 2, 4, 8}
    from handbook_lib.core import ModelConfig

    tiny = search_plan(ModelConfig(), "h100-80gb", 8, seq_len=256)
    assert {c.tp_size for c in tiny.candidates} == {1}
    selective = plan(ModelConfig(), "h100-80gb", 8, seq_len=256, checkpointing=CheckpointPolicy("selective"))
    assert any(c.step_s == o.step_s for c in tiny.candidates for o in selective.options)


def test_an_accumulated_batch_is_also_searched_in_fewer_larger_micro_batches():
    """The same 4 sequences a step on each GPU: 4 micro-steps of 1 (gradients held unsharded
    between them: nothing fits 64 H100s), or 2 of 2, or 1 of 4, priced as plan() prices each."""
    found = search_plan(LLAMA70, "h100-80gb", 64, seq_len=4096, grad_accum_steps=4)
    assert found.searched.endswith("the batch also as micro-batch x micro-steps 2 x 2, 4 x 1, 1 x 4 reduced each")
    names = {c.name for c in found.candidates}
    assert {"FULL_SHARD + AC (2 x 2)", "FULL_SHARD + AC (4 x 1)",
            "FULL_SHARD + AC (1 x 4, reduced each)"} <= names
    assert not any(c.fits for c in found.candidates if " x " not in c.name)
    assert found.winner.name == "FULL_SHARD + AC (4 x 1)"
    alone = next(o for o in plan(LLAMA70, "h100-80gb", 64, seq_len=4096, micro_batch=4).options
                 if o.name == "FULL_SHARD + AC")
    assert (found.winner.step_s, found.winner.peak_reserved_bytes) == (alone.step_s, alone.peak_reserved_bytes)
    assert found.winner.tokens_per_s_per_gpu == pytest.approx(4 * 4096 / alone.step_s)
    assert not any(" x " in c.name and "TP" not in c.name
                   for c in search_plan(LLAMA70, "h100-80gb", 64, seq_len=4096).candidates)


def test_the_batch_cuts_keep_the_sequences_a_step_and_reduce_each_micro_step_when_smaller():
    assert batch_splits(1, 1, False) == []
    assert batch_splits(1, 4, False) == [(2, 2, False), (4, 1, False), (1, 4, True)]
    assert batch_splits(1, 4, True) == [(2, 2, True), (4, 1, False)]
    assert batch_splits(8, 1, False) == [(4, 2, True), (2, 4, True), (1, 8, True)]
    assert batch_splits(6, 2, True) == [(12, 1, False), (3, 4, True)]
    for m, a, sync in batch_splits(4, 8, False):
        assert m * a == 32 and (a > 1 or not sync)
    with pytest.raises(ValueError, match="micro_batch"):
        batch_splits(0, 1, False)


def test_a_micro_batch_that_does_not_fit_is_searched_as_smaller_ones_reduced_each_micro_step():
    """Eight 4,096-token sequences a step on each of 64 H100s: as one micro-batch only offload
    (or tensor parallelism) fits; as 4 x 2, 2 x 4 or 1 x 8 with gradients reduce-scattered every micro-step (they stay
    sharded), FULL_SHARD + AC fits, priced as plan() prices that cut."""
    found = search_plan(LLAMA70, "h100-80gb", 64, seq_len=4096, micro_batch=8)
    whole = [c for c in found.candidates if c.fits and c.tp_size == 1 and " x " not in c.name]
    assert whole and all(c.cpu_offload for c in whole)
    assert found.winner.name.startswith("FULL_SHARD + AC (")
    assert found.winner.name.endswith(", reduced each)") and not found.winner.cpu_offload
    m, a = (int(x) for x in found.winner.name.split("(")[1].split(",")[0].split(" x "))
    assert m * a == 8 and a > 1
    cut = next(o for o in plan(LLAMA70, "h100-80gb", 64, seq_len=4096, micro_batch=m, grad_accum_steps=a,
                               sync_every_micro_step=True).options if o.name == "FULL_SHARD + AC")
    assert (found.winner.step_s, found.winner.peak_reserved_bytes) == (cut.step_s, cut.peak_reserved_bytes)
    assert found.winner.tokens_per_s_per_gpu == pytest.approx(8 * 4096 / cut.step_s)
