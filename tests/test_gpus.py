"""handbook_lib.launch.gpus: the ranks a lesson runs on, on 0 (CPU), 1, 2, 4 or 8 GPUs (faked)."""

import pytest
import torch

from handbook_lib.launch import RankPlan, ranks_for, visible_gpus


def _expected(wanted, minimum, gpus):
    """The policy, from its statement: CPU any number; enough GPUs; fewer but >= minimum; else error."""
    if gpus == 0 or wanted <= gpus:
        return wanted
    if gpus >= minimum:
        return gpus
    return None


CASES = [(wanted, minimum, gpus) for gpus in (0, 1, 2, 4, 8) for wanted in (2, 4) for minimum in (1, 2, 4)
         if minimum <= wanted]


@pytest.fixture
def fake_cuda(monkeypatch):
    """Make torch report ``n`` GPUs (0: CUDA unavailable)."""
    def fake(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return fake


@pytest.mark.parametrize("wanted, minimum, gpus", CASES)
def test_ranks_for_follows_the_policy(wanted, minimum, gpus):
    expected = _expected(wanted, minimum, gpus)
    if expected is None:
        with pytest.raises(ValueError) as err:
            ranks_for(wanted, lesson="the test lesson", minimum=minimum, gpus=gpus)
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith(f"the test lesson needs {minimum} GPU")
        assert f"{gpus} {'is' if gpus == 1 else 'are'} visible" in message
        assert f"run it on a node with {minimum}, or on the CPU" in message
        return
    plan = ranks_for(wanted, lesson="the test lesson", minimum=minimum, gpus=gpus)
    assert plan == RankPlan(nproc=expected, wanted=wanted, gpus=gpus, note=plan.note)
    if expected < wanted:
        assert plan.note == (f"the test lesson asks for {wanted} ranks; {gpus} GPU{'s' if gpus > 1 else ''} "
                             f"{'are' if gpus > 1 else 'is'} visible, so it runs on {gpus} "
                             "(the byte checks scale with N)")
    else:
        assert plan.note == ""


@pytest.mark.parametrize("wanted, minimum, gpus", CASES)
def test_default_counts_the_gpus_torch_sees(fake_cuda, wanted, minimum, gpus):
    fake_cuda(gpus)
    assert visible_gpus() == gpus
    expected = _expected(wanted, minimum, gpus)
    if expected is None:
        with pytest.raises(ValueError, match="needs"):
            ranks_for(wanted, lesson="a lesson", minimum=minimum)
    else:
        plan = ranks_for(wanted, lesson="a lesson", minimum=minimum)
        assert (plan.nproc, plan.gpus) == (expected, gpus)


def test_cuda_unavailable_means_cpu_even_if_a_count_is_reported(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert visible_gpus() == 0
    assert ranks_for(8, lesson="x", minimum=8).nproc == 8


def test_the_brief_examples():
    note = ranks_for(4, lesson="this lesson", gpus=2).note
    assert note == "this lesson asks for 4 ranks; 2 GPUs are visible, so it runs on 2 (the byte checks scale with N)"
    with pytest.raises(ValueError) as err:
        ranks_for(4, lesson="the HSDP lesson", minimum=4, gpus=2, needs="a 2x2 mesh")
    assert str(err.value) == ("the HSDP lesson needs 4 GPUs (a 2x2 mesh); 2 are visible: "
                              "run it on a node with 4, or on the CPU")


def test_one_gpu_reads_in_the_singular():
    assert ranks_for(2, lesson="L", gpus=1).note == \
        "L asks for 2 ranks; 1 GPU is visible, so it runs on 1 (the byte checks scale with N)"
    with pytest.raises(ValueError, match=r"^L needs 2 GPUs; 1 is visible: run it on a node with 2, or on the CPU$"):
        ranks_for(2, lesson="L", minimum=2, gpus=1)


@pytest.mark.parametrize("kwargs, names", [
    ({"wanted": 0}, "wanted"), ({"wanted": True}, "wanted"), ({"wanted": 2.0}, "wanted"),
    ({"minimum": 0}, "minimum"), ({"minimum": 3}, "minimum"), ({"gpus": -1}, "gpus"),
    ({"gpus": 1.5}, "gpus"), ({"lesson": ""}, "lesson"), ({"lesson": None}, "lesson"),
])
def test_bad_arguments_are_named(kwargs, names):
    args = {"wanted": 2, "lesson": "L", "minimum": 1, "gpus": 2, **kwargs}
    with pytest.raises(ValueError, match=names):
        ranks_for(args.pop("wanted"), **args)
