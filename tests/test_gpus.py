"""handbook_lib.launch.gpus: where and on how many ranks a lesson runs, on 0 (CPU), 1, 2, 4 or 8
GPUs (faked), for each HANDBOOK_DEVICE setting; and the launcher running a CPU plan's ranks on
the CPU with gloo on a machine that reports a GPU."""

import pytest
import torch

from handbook_lib.launch import RankPlan, ranks_for, torchrun, visible_gpus
from handbook_lib.launch.gpus import (
    DEVICE_CHOICES,
    DEVICE_ENV,
    device_setting,
    gpus_hidden,
    rank_env,
)
from handbook_lib.launch.planned import torchrun_planned

HIDE = {"CUDA_VISIBLE_DEVICES": ""}


def _expected(wanted, minimum, gpus, setting):
    """The policy, from its statement: (device, nproc), or None for a refusal.

    cpu: the CPU, as asked. Enough GPUs: as asked. Fewer but >= minimum: the GPUs there are.
    Fewer than minimum: refused under 'gpu', else the CPU with every rank asked for."""
    if setting == "cpu":
        return "cpu", wanted
    if gpus >= wanted:
        return "cuda", wanted
    if gpus >= minimum:
        return "cuda", gpus
    return None if setting == "gpu" else ("cpu", wanted)


CASES = [(wanted, minimum, gpus, setting) for setting in DEVICE_CHOICES for gpus in (0, 1, 2, 4, 8)
         for wanted in (1, 2, 4, 8) for minimum in (1, 2, 4, 8) if minimum <= wanted]


@pytest.fixture
def fake_cuda(monkeypatch):
    """Make torch report ``n`` GPUs (0: CUDA unavailable)."""
    def fake(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return fake


@pytest.fixture(autouse=True)
def no_setting(monkeypatch):
    """Every test starts from the default (``auto``), whatever the shell running pytest says."""
    monkeypatch.delenv(DEVICE_ENV, raising=False)


@pytest.mark.parametrize("wanted, minimum, gpus, setting", CASES)
def test_ranks_for_follows_the_policy(wanted, minimum, gpus, setting):
    expected = _expected(wanted, minimum, gpus, setting)
    if expected is None:
        with pytest.raises(ValueError) as err:
            ranks_for(wanted, lesson="the test lesson", minimum=minimum, gpus=gpus, device=setting)
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith(f"the test lesson needs {minimum} GPU")
        assert f"{gpus} {'is' if gpus == 1 else 'are'} visible and device='gpu' refuses the CPU" in message
        assert message.endswith(f"run it on a node with {minimum} GPUs, or with device='auto' on the CPU")
        return
    device, nproc = expected
    plan = ranks_for(wanted, lesson="the test lesson", minimum=minimum, gpus=gpus, device=setting)
    assert (plan.device, plan.nproc, plan.wanted, plan.gpus) == (device, nproc, wanted, gpus)
    # the ranks see no GPU exactly when they run on the CPU of a machine that has some
    assert plan.env == (HIDE if device == "cpu" and gpus else {})
    assert gpus_hidden(plan.env) == (device == "cpu" and gpus > 0)
    # a note whenever the plan is not what a CPU-only machine or enough GPUs would give
    assert bool(plan.note) == (gpus > 0 and (device == "cpu" or nproc < wanted))
    assert "\n" not in plan.note
    for n in range(1, wanted + 1):  # a run written for n ranks: n on the CPU, at most one per GPU
        assert plan.ranks(n) == (n if device == "cpu" else min(n, gpus))


@pytest.mark.parametrize("wanted, minimum, gpus, setting", [c for c in CASES if c[3] != "gpu" or c[2] >= c[1]])
def test_the_setting_comes_from_the_environment(monkeypatch, fake_cuda, wanted, minimum, gpus, setting):
    fake_cuda(gpus)
    monkeypatch.setenv(DEVICE_ENV, setting)
    assert visible_gpus() == gpus
    plan = ranks_for(wanted, lesson="a lesson", minimum=minimum)
    assert (plan.device, plan.nproc) == _expected(wanted, minimum, gpus, setting)
    if plan.note and setting == "cpu":
        assert "as HANDBOOK_DEVICE=cpu asks" in plan.note


def test_the_argument_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert ranks_for(4, lesson="L", gpus=4).device == "cpu"
    assert ranks_for(4, lesson="L", gpus=4, device="auto").device == "cuda"
    monkeypatch.setenv(DEVICE_ENV, "gpu")
    with pytest.raises(ValueError, match="HANDBOOK_DEVICE=gpu refuses the CPU: .* or with HANDBOOK_DEVICE=auto on"):
        ranks_for(4, lesson="L", minimum=2, gpus=1)
    assert ranks_for(4, lesson="L", minimum=2, gpus=1, device="auto").device == "cpu"


def test_cuda_unavailable_means_cpu_even_if_a_count_is_reported(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert visible_gpus() == 0
    plan = ranks_for(8, lesson="x", minimum=8)
    assert (plan.nproc, plan.device, plan.env, plan.note) == (8, "cpu", {}, "")


def test_the_notes_and_the_refusal_read_as_one_line_each():
    assert ranks_for(4, lesson="this lesson", gpus=2).note == (
        "this lesson asks for 4 ranks; 2 GPUs are visible, so it runs on 2 (the byte checks scale with N)")
    assert ranks_for(4, lesson="the HSDP lesson", minimum=4, gpus=2, needs="a 2x2 mesh").note == (
        "the HSDP lesson needs 4 GPUs (a 2x2 mesh); 2 are visible, so its 4 ranks run on the CPU "
        "with gloo (HANDBOOK_DEVICE=gpu refuses instead)")
    assert ranks_for(2, lesson="chapter 1", minimum=2, gpus=8, device="cpu").note == (
        "chapter 1 runs its 2 ranks on the CPU with gloo, as device='cpu' asks (8 are visible)")
    with pytest.raises(ValueError) as err:
        ranks_for(4, lesson="the HSDP lesson", minimum=4, gpus=2, needs="a 2x2 mesh", device="gpu")
    assert str(err.value) == ("the HSDP lesson needs 4 GPUs (a 2x2 mesh); 2 are visible and device='gpu' "
                              "refuses the CPU: run it on a node with 4 GPUs, or with device='auto' on the CPU")


def test_one_gpu_reads_in_the_singular():
    assert ranks_for(2, lesson="L", gpus=1).note == \
        "L asks for 2 ranks; 1 GPU is visible, so it runs on 1 (the byte checks scale with N)"
    assert ranks_for(2, lesson="L", minimum=2, gpus=1).note == \
        "L needs 2 GPUs; 1 is visible, so its 2 ranks run on the CPU with gloo (HANDBOOK_DEVICE=gpu refuses instead)"
    with pytest.raises(ValueError, match=r"^L needs 2 GPUs; 1 is visible and device='gpu' refuses"):
        ranks_for(2, lesson="L", minimum=2, gpus=1, device="gpu")


def test_a_cpu_only_machine_says_nothing_whatever_the_setting_but_gpu():
    for setting in ("auto", "cpu"):
        assert ranks_for(4, lesson="L", minimum=4, gpus=0, device=setting) == RankPlan(4, 4, 0)
    with pytest.raises(ValueError, match="0 are visible and device='gpu' refuses the CPU"):
        ranks_for(1, lesson="L", gpus=0, device="gpu")


@pytest.mark.parametrize("kwargs, names", [
    ({"wanted": 0}, "wanted"), ({"wanted": True}, "wanted"), ({"wanted": 2.0}, "wanted"),
    ({"minimum": 0}, "minimum"), ({"minimum": 3}, "minimum"), ({"gpus": -1}, "gpus"),
    ({"gpus": 1.5}, "gpus"), ({"lesson": ""}, "lesson"), ({"lesson": None}, "lesson"),
    ({"device": "cuda"}, "device must be one of auto, cpu, gpu, got 'cuda'"), ({"device": ""}, "device"),
])
def test_bad_arguments_are_named(kwargs, names):
    args = {"wanted": 2, "lesson": "L", "minimum": 1, "gpus": 2, **kwargs}
    with pytest.raises(ValueError, match=names):
        ranks_for(args.pop("wanted"), **args)


def test_a_bad_setting_is_named(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, "GPU")
    with pytest.raises(ValueError, match="^HANDBOOK_DEVICE must be one of auto, cpu, gpu, got 'GPU'$"):
        ranks_for(2, lesson="L", gpus=2)
    with pytest.raises(ValueError, match="^HANDBOOK_DEVICE must be one of"):
        rank_env()
    with pytest.raises(ValueError, match="^HANDBOOK_DEVICE must be one of"):
        rank_env({DEVICE_ENV: "nope"})
    monkeypatch.setenv(DEVICE_ENV, "")  # set but empty: the default
    assert device_setting() == "auto"
    with pytest.raises(ValueError, match="n must be an int >= 1, got 0"):
        ranks_for(2, lesson="L", gpus=2).ranks(0)


def test_rank_env_hides_the_gpus_only_for_cpu(monkeypatch):
    assert rank_env() == {} and rank_env(None) == {}
    assert rank_env({"A": "1"}) == {"A": "1"}
    assert rank_env({DEVICE_ENV: "cpu"}) == {DEVICE_ENV: "cpu", **HIDE}
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert rank_env({"A": "1"}) == {"A": "1", **HIDE}
    assert rank_env({DEVICE_ENV: "auto"}) == {DEVICE_ENV: "auto"}  # the caller's env wins
    assert not gpus_hidden({"CUDA_VISIBLE_DEVICES": "0"}) and not gpus_hidden(None)


# --- the launcher, on a machine that reports one GPU (faked in this process) ----------------------

GPU_REFUSAL = "NCCL needs one rank per GPU"


def test_the_launcher_refuses_more_ranks_than_gpus_unless_they_run_on_the_cpu(fake_cuda, monkeypatch, tmp_path):
    """Checked before any process starts: an ``out`` that is a file fails only after the GPU check,
    so the error says which check stopped the call."""
    fake_cuda(1)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=GPU_REFUSAL):
        torchrun("fault", 2, {"mode": "none"}, out=a_file)
    plan = ranks_for(2, lesson="L", minimum=2)
    with pytest.raises(ValueError, match="is a file, not a folder"):
        torchrun("fault", plan.nproc, {"mode": "none"}, out=a_file, env=plan.env)
    monkeypatch.setenv(DEVICE_ENV, "cpu")  # the one setting, read by the launcher too
    with pytest.raises(ValueError, match="is a file, not a folder"):
        torchrun("fault", 2, {"mode": "none"}, out=a_file)


@pytest.fixture(scope="module")
def planned_runs():
    """A chapter on a machine reporting 1 GPU: its 2-rank run shrinks to 1 GPU rank, its pair
    lesson (minimum 2) runs its 2 ranks on the CPU. Two real jobs, one per placement (the
    chapters' 4 ranks on 2 GPUs place the same way; the smallest case costs the fewest processes)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(DEVICE_ENV, raising=False)
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "device_count", lambda: 1)
        plan = ranks_for(2, lesson="the chapter", minimum=1)
        mesh = ranks_for(2, lesson="its pair lesson", minimum=2, needs="a pair of ranks")
        none = {"mode": "none", "fail_rank": 0}  # rank 0 exists on 1 rank and on 2
        results = torchrun_planned("fault", {"mesh": (2, none), "shrunk": (2, none)}, plan,
                                   needs={"mesh": mesh}, stream=False)
    return plan, mesh, results


def test_each_run_goes_where_its_plan_says(planned_runs):
    plan, mesh, results = planned_runs
    assert (plan.device, plan.nproc, plan.env) == ("cuda", 1, {})
    assert plan.note == "the chapter asks for 2 ranks; 1 GPU is visible, so it runs on 1 (the byte checks scale with N)"
    assert (mesh.device, mesh.nproc, mesh.env) == ("cpu", 2, HIDE)
    assert mesh.note == ("its pair lesson needs 2 GPUs (a pair of ranks); 1 is visible, so its 2 ranks run on the "
                         "CPU with gloo (HANDBOOK_DEVICE=gpu refuses instead)")
    assert list(results) == ["mesh", "shrunk"]  # the order asked, whatever the order run
    assert (results["shrunk"].world_size, results["mesh"].world_size) == (1, 2)
    assert results["mesh"].backend == "gloo" and results["mesh"].device == "cpu"
    assert sorted(r["rank"] for r in results["mesh"].ranks) == [0, 1]


def test_torchrun_planned_refuses_what_it_cannot_place():
    plan = ranks_for(2, lesson="L", gpus=0)
    with pytest.raises(ValueError, match="needs names runs that runs does not hold: 'b'"):
        torchrun_planned("fault", {"a": (2, None)}, plan, needs={"b": plan})
    with pytest.raises(ValueError, match=r"runs\['a'\] must be \(n, config\)"):
        torchrun_planned("fault", {"a": 2}, plan)
    with pytest.raises(ValueError, match="env comes from the plans"):
        torchrun_planned("fault", {"a": (2, None)}, plan, env={})


# --- the rank's side: a rank that sees no GPU takes the CPU and gloo --------------------------------

def test_pick_device_one_gpu_per_local_rank_else_the_cpu(fake_cuda):
    from handbook_lib.runtime.distributed import pick_device

    fake_cuda(2)
    assert pick_device(1) == (torch.device("cuda", 1), "nccl")
    with pytest.raises(RuntimeError, match=r"^local rank 2 has no GPU: 2 visible; start at most 2 processes "
                                           r"per node, or run the ranks on the CPU \(CUDA_VISIBLE_DEVICES=''\)$"):
        pick_device(2)
    fake_cuda(0)  # what CUDA_VISIBLE_DEVICES="" makes torch report
    assert pick_device(3) == (torch.device("cpu"), "gloo")


def test_gpu_only_refuses_a_machine_without_a_gpu_in_one_line(fake_cuda, monkeypatch):
    """``HANDBOOK_DEVICE=gpu`` means GPUs only: the launcher refuses where none is visible (or the
    caller hides them), where it used to train on the CPU and succeed."""
    fake_cuda(0)
    monkeypatch.setenv(DEVICE_ENV, "gpu")
    message = (r"^HANDBOOK_DEVICE=gpu runs on GPUs only, and no GPU is visible here: run on a machine with a "
               r"GPU, or set HANDBOOK_DEVICE=auto \(or cpu\) to run on the CPU$")
    with pytest.raises(ValueError, match=message):
        rank_env()
    with pytest.raises(ValueError, match=message):
        torchrun("fault", 2, {"mode": "none"}, stream=False)
    monkeypatch.delenv(DEVICE_ENV)
    with pytest.raises(ValueError, match=message):
        rank_env({DEVICE_ENV: "gpu"})
    fake_cuda(1)
    assert rank_env({DEVICE_ENV: "gpu"}) == {DEVICE_ENV: "gpu"}
    with pytest.raises(ValueError, match=message):  # GPUs there, but hidden from the ranks
        rank_env({DEVICE_ENV: "gpu", **HIDE})
