"""Where a lesson's ranks run, and how many: the GPU hub's policy. Pure, apart from counting GPUs
and :func:`torchrun_planned`, which starts the runs so placed.

Chapter 8 introduces it (section "On a GPU hub"). Every chapter runs on the CPU (ranks are
processes) and on a hub with 1, 2, 4 or 8 GPUs. A notebook cell asks for the ranks it is
written for, and gets the ranks it can have here::

    from handbook_lib.launch import ranks_for, torchrun
    plan = ranks_for(4, lesson="chapter 2", minimum=2)
    if plan.note:
        print(plan.note)
    result = torchrun("fsdp_train", nproc=plan.ranks(4), config={...}, env=plan.env)

A run that truly needs its ranks (HSDP on a 2x2 mesh) has a plan of its own, with its own
minimum, and :func:`torchrun_planned` starts a chapter's runs, each placed by its plan.

The policy, for a lesson written for ``wanted`` ranks that needs at least ``minimum``:

- **No GPU** (no CUDA): ranks are processes talking over gloo; any number fits, so the lesson
  gets what it asked for, and nothing is said.
- **Enough GPUs** (``wanted <= gpus``): one rank per GPU, NCCL, as asked.
- **Fewer GPUs, at least** ``minimum``: it runs on the GPUs there are, and its cells say so in
  one line (:attr:`RankPlan.note`); a run written for ``n`` ranks gets ``min(n, gpus)``
  (:meth:`RankPlan.ranks`).
- **Fewer GPUs than** ``minimum`` (a one-GPU hub, for a lesson that shards over 2): its ranks
  run on the CPU with gloo, as on a laptop, saying so in one line. :attr:`RankPlan.env` hides
  the GPUs from the ranks (``CUDA_VISIBLE_DEVICES=""``), so every part of a rank (PyTorch,
  DeepSpeed, the Trainer) sees a CPU-only machine.

One setting, ``HANDBOOK_DEVICE`` (:data:`DEVICE_ENV`; or the ``device`` argument, which wins),
changes where the ranks run:

- ``auto`` (the default): as above;
- ``cpu``: the ranks run on the CPU with gloo even where there are GPUs (a learner on a GPU hub
  who wants the CPU path, e.g. to compare with the book's stored outputs);
- ``gpu``: never fall back to the CPU: with fewer GPUs than ``minimum`` (none included),
  :func:`ranks_for` raises a ``ValueError`` whose one line names the lesson and what it needs.

Set it for a notebook's kernel with ``%env HANDBOOK_DEVICE=cpu`` before the chapter's first
cell, or in the hub's environment for every learner. The launcher honours ``cpu`` too
(:func:`rank_env`), so ``HANDBOOK_DEVICE=cpu python -m handbook_lib run ...`` runs on the CPU.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from handbook_lib.core.checks import check_int


__all__ = ["DEVICE_CHOICES", "DEVICE_ENV", "RankPlan", "device_setting", "gpus_hidden", "rank_env",
           "ranks_for", "visible_gpus"]

DEVICE_ENV = "HANDBOOK_DEVICE"
"""The environment variable a learner sets to choose where the ranks run."""

DEVICE_CHOICES = {
    "auto": "GPUs where there are enough, else the CPU with gloo",
    "cpu": "the CPU with gloo, even where there are GPUs",
    "gpu": "GPUs only: a lesson with too few refuses instead of running on the CPU",
}
"""Accepted values of ``HANDBOOK_DEVICE`` (and of ``ranks_for(device=...)``), with their meaning."""

_HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}
"""The ranks' environment on the CPU path: CUDA then reports no device to any library."""


@dataclass(frozen=True)
class RankPlan:
    """The ranks a lesson runs on, where, and why."""

    nproc: int
    """Processes to launch for a run written for ``wanted`` ranks (``torchrun(..., nproc=...)``)."""
    wanted: int
    """Ranks the lesson asked for."""
    gpus: int
    """GPUs visible (0: no CUDA)."""
    note: str = ""
    """One line for the notebook to print when the plan differs from what the lesson asked for
    (fewer ranks, or the CPU on a machine with GPUs); ``""`` otherwise."""
    device: str = "cpu"
    """Where the ranks run: ``"cuda"`` (NCCL, one rank per GPU) or ``"cpu"`` (gloo)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the ranks (``torchrun(..., env=plan.env)``): ``{"CUDA_VISIBLE_DEVICES":
    ""}`` on the CPU path of a machine with GPUs, else empty."""

    def ranks(self, n: int) -> int:
        """Ranks for a run the lesson wrote for ``n``: ``n`` on the CPU, ``min(n, gpus)`` on GPUs.

        Raises:
            ValueError: if ``n`` is not an int >= 1.
        """
        check_int("n", n, 1)
        return n if self.device == "cpu" else min(n, self.gpus)


def visible_gpus() -> int:
    """GPUs this process can use: ``torch.cuda.device_count()``, or 0 without CUDA."""
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def device_setting(device: str | None = None) -> str:
    """Where the ranks should run: ``device`` if given, else ``$HANDBOOK_DEVICE``, else ``"auto"``.

    Raises:
        ValueError: for a value not in :data:`DEVICE_CHOICES`, naming where it came from.
    """
    if device is not None:
        name, value = "device", device
    else:
        name, value = DEVICE_ENV, os.environ.get(DEVICE_ENV) or "auto"
    if value not in DEVICE_CHOICES:
        raise ValueError(f"{name} must be one of {', '.join(DEVICE_CHOICES)}, got {value!r}")
    return value


def gpus_hidden(env: Mapping[str, str] | None) -> bool:
    """True when ``env`` (the ranks' extra environment) hides every GPU from them."""
    return (env or {}).get("CUDA_VISIBLE_DEVICES") == ""


def rank_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ranks' extra environment as the launcher passes it: ``env``, plus
    ``CUDA_VISIBLE_DEVICES=""`` when ``HANDBOOK_DEVICE`` is ``cpu`` (in ``env``, else in this
    process's environment). A rank that sees no GPU runs on the CPU with gloo
    (:func:`handbook_lib.runtime.distributed.pick_device`), whatever the machine has.

    Raises:
        ValueError: for a ``HANDBOOK_DEVICE`` not in :data:`DEVICE_CHOICES`, or ``gpu`` where
            no GPU is visible (``gpu`` never falls back to the CPU).
    """
    out = dict(env or {})
    setting = out.get(DEVICE_ENV)
    if setting is not None and setting not in DEVICE_CHOICES:
        raise ValueError(f"{DEVICE_ENV} must be one of {', '.join(DEVICE_CHOICES)}, got {setting!r}")
    setting = setting or device_setting()
    if setting == "cpu":
        out.update(_HIDE_GPUS)
    if setting == "gpu" and (gpus_hidden(out) or visible_gpus() == 0):
        raise ValueError(f"{DEVICE_ENV}=gpu runs on GPUs only, and no GPU is visible here: run on a machine "
                         f"with a GPU, or set {DEVICE_ENV}=auto (or cpu) to run on the CPU")
    return out


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def ranks_for(wanted: int, *, lesson: str, minimum: int = 1, gpus: int | None = None,
              needs: str = "", device: str | None = None) -> RankPlan:
    """The ranks ``lesson`` runs on here, and where (the policy in the module's docstring).

    Args:
        wanted: Ranks the lesson is written for.
        lesson: How the lesson is named in messages, e.g. ``"the HSDP lesson"``.
        minimum: Fewest GPUs the lesson can run on (``1 <= minimum <= wanted``).
        gpus: GPUs visible; ``None`` counts them (:func:`visible_gpus`; 0 without CUDA).
        needs: Why it needs ``minimum``, said in its messages, e.g. ``"a 2x2 mesh"``.
        device: ``"auto"``, ``"cpu"`` or ``"gpu"`` (:data:`DEVICE_CHOICES`); ``None`` reads
            ``HANDBOOK_DEVICE`` (default ``auto``).

    Returns:
        A :class:`RankPlan`: on GPUs ``nproc = min(wanted, gpus)``; on the CPU ``nproc ==
        wanted``, with :attr:`RankPlan.env` hiding the GPUs where there are some. Its
        :attr:`RankPlan.note` is one line whenever the plan is not what the lesson asked for.

    Raises:
        ValueError: for a bad argument (naming it), or with ``device="gpu"`` when fewer than
            ``minimum`` GPUs are visible: one line, e.g. ``the HSDP lesson needs 4 GPUs (a 2x2
            mesh); 2 are visible and HANDBOOK_DEVICE=gpu refuses the CPU: run it on a node with 4
            GPUs, or with HANDBOOK_DEVICE=auto on the CPU`` (``device='auto'`` when the argument
            asked for ``gpu``).
    """
    check_int("wanted", wanted, 1)
    check_int("minimum", minimum, 1)
    if minimum > wanted:
        raise ValueError(f"minimum must be <= wanted ({wanted}), got {minimum}")
    if not isinstance(lesson, str) or not lesson.strip():
        raise ValueError(f"lesson must be a non-empty string naming the lesson, got {lesson!r}")
    setting = device_setting(device)
    said = f"device={setting!r}" if device is not None else f"{DEVICE_ENV}={setting}"
    if gpus is None:
        gpus = visible_gpus()
    check_int("gpus", gpus, 0)
    visible = f"{gpus} is visible" if gpus == 1 else f"{gpus} are visible"
    why = f" ({needs})" if needs else ""
    on_cpu = RankPlan(nproc=wanted, wanted=wanted, gpus=gpus, device="cpu",
                      env=dict(_HIDE_GPUS) if gpus else {})
    if setting == "cpu":
        note = (f"{lesson} runs its {_count(wanted, 'rank')} on the CPU with gloo, as {said} asks "
                f"({visible})") if gpus else ""
        return replace(on_cpu, note=note)
    if gpus >= wanted:
        return RankPlan(nproc=wanted, wanted=wanted, gpus=gpus, device="cuda")
    if gpus >= minimum:
        note = (f"{lesson} asks for {_count(wanted, 'rank')}; {_count(gpus, 'GPU')} "
                f"{'is' if gpus == 1 else 'are'} visible, so it runs on {gpus} "
                "(the byte checks scale with N)")
        return RankPlan(nproc=gpus, wanted=wanted, gpus=gpus, note=note, device="cuda")
    if setting == "gpu":
        instead = "device='auto'" if device is not None else f"{DEVICE_ENV}=auto"
        raise ValueError(f"{lesson} needs {_count(minimum, 'GPU')}{why}; {visible} and {said} refuses the "
                         f"CPU: run it on a node with {minimum} GPUs, or with {instead} on the CPU")
    if gpus == 0:  # no CUDA at all: the CPU is the machine, nothing to say
        return on_cpu
    note = (f"{lesson} needs {_count(minimum, 'GPU')}{why}; {visible}, so its "
            f"{_count(wanted, 'rank')} run on the CPU with gloo ({DEVICE_ENV}=gpu refuses instead)")
    return replace(on_cpu, note=note)
