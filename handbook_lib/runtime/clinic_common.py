"""What every case of the FSDP clinic shares: its set-up, its two halves, small helpers.

Chapter 10 runs each case of :data:`handbook_lib.models.clinic_cases.CLINIC_CASES` twice in one
job, as users wrote it (the *broken* half) and fixed, through :mod:`handbook_lib.runs.clinic`. A
case is a function ``(setup) -> (broken, fixed)`` of the modules ``clinic_memory``,
``clinic_correctness``, ``clinic_hangs`` and ``clinic_checkpoints``; each half is a :class:`Half`:
whether the symptom showed (measured), one line saying what was seen, and its checks — the
measurement beside the book's model where one exists.

Every case runs on the CPU over a gloo group of its own (:class:`CaseSetup`), on any machine: the
symptoms are FSDP's logic, not the device's. The one exception, ``init_full_copy``, builds the
model as the book's runs do, on the rank's device.
"""

from __future__ import annotations

import datetime
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from handbook_lib.core.config import RunConfig
from handbook_lib.core.results import Check
from handbook_lib.models.layout import ModelLayout, model_layout
from handbook_lib.models.traffic import estimate_step_traffic
from handbook_lib.runtime.build import apply_fsdp2
from handbook_lib.runtime.collectives import CollectiveCall, CollectiveCounter
from handbook_lib.runtime.data import local_batch
from handbook_lib.runtime.distributed import RankContext
from handbook_lib.runtime.model import SimpleTransformer, build_model
from handbook_lib.runtime.training import next_token_loss

__all__ = ["Half", "CaseSetup", "CaseFn", "first_line", "raised", "counted", "shard_model",
           "units_of_class", "step_loss", "forward_all_gathers", "GROUP_TIMEOUT_S"]

GROUP_TIMEOUT_S = 120.0
"""Seconds a collective of a case's own gloo group may wait (the hang cases use a shorter one)."""


@dataclass
class Half:
    """What one half of a case measured on this rank."""

    rank: int
    symptom: bool = False
    """The symptom was seen (measured): the broken half must show it, the fixed half must not."""
    finding: str = ""
    """One line: what was seen, with the figures."""
    checks: list[Check] = field(default_factory=list)
    """Each measurement beside its prediction (the book's model, or what the symptom means)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Measurements kept for the chapter, JSON-ready."""

    def check(self, quantity: str, predicted: float, measured: float, unit: str,
              tolerance: float = 0.0) -> bool:
        """Add a check on this rank; return whether it holds (for the half's ``symptom``)."""
        item = Check(quantity, self.rank, predicted, measured, unit, tolerance)
        self.checks.append(item)
        return item.ok

    def flag(self, quantity: str, expected: bool, seen: bool) -> None:
        """A yes/no check (unit ``flag``: 1 yes, 0 no), e.g. ``raised``; also kept in metrics."""
        self.check(quantity, int(expected), int(seen), "flag")
        self.metrics[quantity] = bool(seen)


CaseFn = Callable[["CaseSetup"], tuple[Half, Half]]
"""A case: ``(setup) -> (broken, fixed)``, called on every rank."""


_SHARED: dict[str, Any] = {}
"""The job's own gloo group and its mesh, made by the first case and kept until the process
group is destroyed (cases come and go; FSDP and DTensor cache what they saw of a mesh)."""


@dataclass
class CaseSetup:
    """What a case is given: the run's config (model, batch, seed), this rank, and a gloo group
    over every rank for the clinic's collectives, on the CPU."""

    config: RunConfig
    ctx: RankContext
    hang_timeout_s: float = 1.0
    """Seconds a hang case's collective waits before it raises (its symptom)."""
    _groups: list[dist.ProcessGroup] = field(default_factory=list)

    @property
    def group(self) -> dist.ProcessGroup:
        """A gloo group of every rank (:data:`GROUP_TIMEOUT_S`), one per job, made on first use."""
        if _SHARED.get("world") is not dist.group.WORLD:  # a new job's process group: new ones
            _SHARED.clear()
            _SHARED["world"] = dist.group.WORLD
            _SHARED["group"] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        return _SHARED["group"]

    def hang_group(self) -> dist.ProcessGroup:
        """A new gloo group whose collectives raise after :attr:`hang_timeout_s`: a hang becomes
        an error (destroyed by :meth:`close`). It is made with the long timeout and its ranks
        meet once in it, then its timeout is cut: a rank that reaches it late (one that left the
        previous case early, or a busy machine) is not taken for a hang."""
        from torch.distributed.distributed_c10d import _set_pg_timeout

        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        self._groups.append(group)
        dist.barrier(group=group)
        _set_pg_timeout(datetime.timedelta(seconds=self.hang_timeout_s), group)
        return group

    def mesh(self, group: dist.ProcessGroup | None = None) -> DeviceMesh:
        """A 1-D CPU mesh over ``group`` (default: :attr:`group`), for ``fully_shard``. Each
        group's mesh has a dimension name of its own: meshes over the same ranks compare equal
        otherwise, and DTensor's caches would hand one's collectives to the other."""
        default = self.group  # the job's (made anew for a new job: _SHARED cleared)
        if group is None or group is default:
            if "mesh" not in _SHARED:
                _SHARED["mesh"] = DeviceMesh.from_group(self.group, "cpu", mesh_dim_names=("clinic",))
            return _SHARED["mesh"]
        return DeviceMesh.from_group(group, "cpu", mesh_dim_names=(f"clinic_{group.group_name}",))

    @property
    def layout(self) -> ModelLayout:
        """The book's layout of the config's model (:func:`handbook_lib.models.layout.model_layout`)."""
        return model_layout(self.config.model_config())

    @property
    def world(self) -> int:
        return self.ctx.world_size

    @property
    def rank(self) -> int:
        return self.ctx.rank

    def half(self) -> Half:
        """An empty :class:`Half` for this rank."""
        return Half(self.rank)

    def model(self, seed_offset: int = 0) -> SimpleTransformer:
        """The config's model, seeded (``seed + seed_offset``), on the CPU."""
        return build_model(self.config.model_config(), seed=self.config.seed + seed_offset)

    def batch(self, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of global batch ``step`` (:func:`handbook_lib.runtime.data.make_batch`), CPU."""
        cpu = RankContext(self.rank, self.world, self.ctx.local_rank, torch.device("cpu"), "gloo")
        return local_batch(self.config, step, cpu)

    def all_sum(self, value: float) -> float:
        """``value`` summed over the ranks (float64, over :attr:`group`)."""
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return float(t)

    def close(self) -> None:
        """Destroy the case's hang groups (the job's group stays)."""
        for group in self._groups:
            dist.destroy_process_group(group)
        self._groups.clear()


_GLOO_PREFIX = re.compile(r"^\[[^\]]*\]\s*")
"""gloo's ``[path/file.cc:line]`` at the start of its messages."""


def first_line(err: BaseException) -> str:
    """``"Type: message"`` of ``err``, its first line only, without gloo's ``[file.cc:N]`` prefix
    (which names a build path)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {_GLOO_PREFIX.sub('', text)}"


def raised(fn: Callable[[], Any]) -> BaseException | None:
    """Call ``fn``; return the exception it raised, or ``None``."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the symptom is the error, whatever its type
        return err
    return None


@contextmanager
def counted() -> Iterator[list[CollectiveCall]]:
    """Count the collectives issued inside the block (:class:`CollectiveCounter`, DTensor's
    functional collectives included): the list fills when the block ends, also if it raised."""
    calls: list[CollectiveCall] = []
    counter = CollectiveCounter(functional=True)
    try:
        with counter:
            yield calls
    finally:
        calls.extend(counter.calls)


def units_of_class(model: nn.Module, class_names: tuple[str, ...]) -> list[nn.Module]:
    """The modules of ``model`` whose class is named in ``class_names``: what a transformer wrap
    policy given class names (Accelerate's ``fsdp_transformer_layer_cls_to_wrap``) makes units of."""
    return [m for m in model.modules() if type(m).__name__ in class_names]


def shard_model(model: nn.Module, mesh: DeviceMesh, units: list[nn.Module] | None = None,
                **kwargs: Any) -> nn.Module:
    """``fully_shard`` each of ``units`` (default: each transformer layer), then the root, as
    the book's runs do (:func:`handbook_lib.runtime.build.apply_fsdp2`); returns ``model``."""
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    apply_fsdp2(model, mesh, units=units, **kwargs)
    return model


def forward_all_gathers(setup: CaseSetup) -> int:
    """All-gathers of one forward of the case's model, one unit per layer and the root, as
    :func:`shard_model` wraps it (:func:`~handbook_lib.models.traffic.estimate_step_traffic`)."""
    records = estimate_step_traffic(setup.layout.units("layer"), setup.world, "FULL_SHARD").records
    return sum(r.phase == "forward" for r in records)


def step_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
              optimizer: torch.optim.Optimizer | None = None) -> float:
    """One forward and backward of ``batch`` (:func:`next_token_loss`), then, with an
    ``optimizer``, its step and zeroed gradients; this rank's loss (nats per token)."""
    x, y = batch
    loss, _ = next_token_loss(model(x), y)
    loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad()
    return float(loss.detach())
