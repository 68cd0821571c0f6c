"""How many ranks a lesson runs on: the GPU hub policy. Pure, apart from counting the GPUs.

Chapter 8 introduces it (section "On a GPU hub"). Every chapter runs on the CPU (ranks are
processes) and on a hub with at least its minimum of GPUs: 2 for chapters 1, 4 and 7, 4 for
chapters 2, 3, 5, 6 and 8 (its ``ranks_for`` call at the top). A notebook cell asks for the
ranks it needs, and gets the ranks it can have::

    from handbook_lib.launch.gpus import ranks_for
    plan = ranks_for(4, lesson="the sharding lesson")
    if plan.note:
        print(plan.note)
    result = torchrun("fsdp_train", nproc=plan.nproc, config={...})

- On the CPU (no CUDA), ranks are processes talking over gloo: any number fits, so the lesson
  gets what it asked for.
- On GPUs (NCCL: one rank per GPU), a lesson gets what it asked for if there are enough GPUs;
  else, if there are at least ``minimum``, it runs on the GPUs there are and says so in one
  line (:attr:`RankPlan.note`); else it cannot run here, and :func:`ranks_for` raises a
  ``ValueError`` whose one line names the lesson and what it needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from handbook_lib.core.checks import check_int

__all__ = ["RankPlan", "ranks_for", "visible_gpus"]


@dataclass(frozen=True)
class RankPlan:
    """The ranks a lesson runs on, and why."""

    nproc: int
    """Processes to launch (``torchrun(..., nproc=plan.nproc)``)."""
    wanted: int
    """Ranks the lesson asked for."""
    gpus: int
    """GPUs visible (0: no CUDA, the ranks run on the CPU)."""
    note: str = ""
    """One line for the notebook to print when ``nproc < wanted`` (``""`` otherwise)."""


def visible_gpus() -> int:
    """GPUs this process can use: ``torch.cuda.device_count()``, or 0 without CUDA."""
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def ranks_for(wanted: int, *, lesson: str, minimum: int = 1, gpus: int | None = None,
              needs: str = "") -> RankPlan:
    """The ranks ``lesson`` runs on, here: ``wanted`` or, on too few GPUs, as many as there are.

    Args:
        wanted: Ranks the lesson is written for.
        lesson: How the lesson is named in messages, e.g. ``"the HSDP lesson"``.
        minimum: Fewest ranks the lesson can run on (``1 <= minimum <= wanted``).
        gpus: GPUs visible; ``None`` counts them (:func:`visible_gpus`; 0 without CUDA).
        needs: Why it needs ``minimum``, said in the error, e.g. ``"a 2x2 mesh"``.

    Returns:
        A :class:`RankPlan`. On the CPU (``gpus == 0``) ``nproc == wanted``; on GPUs
        ``nproc = min(wanted, gpus)``, with a one-line :attr:`RankPlan.note` when it is fewer.

    Raises:
        ValueError: for a bad argument (naming it), or when fewer than ``minimum`` GPUs are
            visible: one line, e.g. ``the HSDP lesson needs 4 GPUs (a 2x2 mesh); 2 are visible:
            run it on a node with 4, or on the CPU``.
    """
    check_int("wanted", wanted, 1)
    check_int("minimum", minimum, 1)
    if minimum > wanted:
        raise ValueError(f"minimum must be <= wanted ({wanted}), got {minimum}")
    if not isinstance(lesson, str) or not lesson.strip():
        raise ValueError(f"lesson must be a non-empty string naming the lesson, got {lesson!r}")
    if gpus is None:
        gpus = visible_gpus()
    check_int("gpus", gpus, 0)
    if gpus == 0 or wanted <= gpus:  # CPU: gloo ranks are processes, any number fits
        return RankPlan(nproc=wanted, wanted=wanted, gpus=gpus)
    visible = f"{gpus} is visible" if gpus == 1 else f"{gpus} are visible"
    if gpus < minimum:
        why = f" ({needs})" if needs else ""
        raise ValueError(f"{lesson} needs {_count(minimum, 'GPU')}{why}; {visible}: "
                         f"run it on a node with {minimum}, or on the CPU")
    note = (f"{lesson} asks for {_count(wanted, 'rank')}; {_count(gpus, 'GPU')} "
            f"{'is' if gpus == 1 else 'are'} visible, so it runs on {gpus} (the byte checks scale with N)")
    return RankPlan(nproc=gpus, wanted=wanted, gpus=gpus, note=note)
