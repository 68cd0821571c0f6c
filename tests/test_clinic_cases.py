"""handbook_lib.models.clinic_cases: the clinic's table of cases, pure."""

import pytest

from handbook_lib.models.clinic_cases import (
    CLINIC_CASES,
    CLINIC_GROUPS,
    FIELD_NOTES,
    cases_in,
    get_case,
    notes_left_out,
    thread_url,
)


def test_threads_are_github_issues_and_pull_requests():
    assert thread_url("pytorch/pytorch#80581") == "https://github.com/pytorch/pytorch/issues/80581"
    assert thread_url("meta-pytorch/tnt!1057") == "https://github.com/meta-pytorch/tnt/pull/1057"
    for bad in ("pytorch#1", "pytorch/pytorch#x", "a/b/c#1", "pytorch/pytorch 1"):
        with pytest.raises(ValueError, match=r"'owner/repo#N' \(issue\) or 'owner/repo!N'"):
            thread_url(bad)


def test_every_case_is_grouped_sourced_and_told():
    assert len(CLINIC_CASES) >= 12 and set(FIELD_NOTES) == set(range(1, 16))
    for name, case in CLINIC_CASES.items():
        assert case.name == name and case.group in CLINIC_GROUPS
        assert case.note is None or case.note in FIELD_NOTES
        assert case.threads and all(url.startswith("https://github.com/") for url in case.urls)
        assert all(text and "\n" not in text for text in (case.title, case.symptom, case.cause, case.fix))
    # the table is in the chapter's order: grouped, groups in order
    order = [CLINIC_GROUPS.index(c.group) for c in CLINIC_CASES.values()]
    assert order == sorted(order)
    assert [c.name for g in CLINIC_GROUPS for c in cases_in(g)] == list(CLINIC_CASES)


def test_the_notes_left_out_are_the_trainer_and_zero3():
    assert notes_left_out() == [8, 15]  # 15, ZeRO-3's threshold, is chapter 7's trap 1
    assert len({c.note for c in CLINIC_CASES.values()} - {None}) == 13
    assert CLINIC_CASES["compiled_key_prefix"].note == 14  # torch.compile: its key prefix


def test_unknown_names_are_refused_with_the_accepted_ones():
    assert get_case("local_grad_norm").note == 11
    with pytest.raises(ValueError, match="case must be one of wrap_class_missing, .*, got 'oom'"):
        get_case("oom")
    with pytest.raises(ValueError, match="group must be one of memory, correctness, hangs, checkpoints"):
        cases_in("speed")
