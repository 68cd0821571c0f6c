"""What verifying a checkpoint costs, and how long an asynchronous save blocks (chapter 6).

Each rank builds the seeded model once — widened ``scale`` times in parameters
(:func:`~handbook_lib.models.checkpoint.scale_model_width`; 1: the config's own model) — shards it
with FSDP2 and trains one step, so that AdamW's state exists. Then, ``repeats`` times after one
untimed round, it does on the same state: a synchronous save with checksums (each rank hashes
the file it wrote, item by item) and one without (sizes only), in alternating order; a load of
each, verifying the items this rank reads and checking sizes only; and an asynchronous save
(staged to CPU memory, written in a background thread), waited for at once. Last, the middle of the largest item of
the last rank's file is overwritten, size unchanged, and every rank loads that checkpoint again.

``checks`` (all exact): per rank, the bytes it hashed equal the bytes of the files it wrote
(DCP names them ``__{rank}_*.distcp``; rank 0 also hashes ``.metadata``), and over the ranks
every file is hashed once; per rank, the bytes it verified at load equal, file by file, the
bytes its load read (DCP's reader records them), ``.metadata`` added; the asynchronous
checkpoint's shard files have the synchronous one's checksums, and both load, on every rank,
bit for bit the tensors the ranks trained; the damaged file is refused by exactly its own rank,
naming the file, and by :func:`~handbook_lib.runtime.checkpoint.validate_checkpoint` in one
process. Times are metrics, not checks: each rank's seconds per repeat and the fractions of their
medians (:func:`~handbook_lib.models.checkpoint.cost_fraction`); the job's, the slowest rank's
per repeat, are in ``extra["job"]`` (:func:`job_times`).

Launch::

    python -m handbook_lib run checkpoint_cost --nproc 2 --set scale=10
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

from handbook_lib.core.results import Check
from handbook_lib.models.checkpoint import CHECKSUM, MANIFEST, cost_fraction, scale_model_width
from handbook_lib.models.layout import model_layout
from handbook_lib.runs.entry import RankReport, main
from handbook_lib.runs.specs.checkpoint_cost import CONFIG as CONFIG, CheckpointCostConfig, job_of, validate
from handbook_lib.runtime.build import parallelize
from handbook_lib.runtime.checkpoint import PendingCheckpoint, load_checkpoint, save_checkpoint
from handbook_lib.runtime.checkpoint_verify import METADATA, CheckpointError, read_metadata, validate_checkpoint
from handbook_lib.runtime.data import local_batch
from handbook_lib.runtime.distributed import RankContext, shared_temp_dir
from handbook_lib.runtime.measure import local_tensor
from handbook_lib.runtime.training import build_optimizer, train_step

TIMES = ("save_s", "hash_s", "save_plain_s", "load_s", "verify_s", "load_plain_s", "async_blocked_s",
         "async_wait_s", "async_total_s")
"""The seconds each rank records per repeat (metrics, one list each)."""


def _root(config: CheckpointCostConfig, ctx: RankContext) -> Path:
    """``ckpt_dir``, or a temporary directory made by rank 0 and named to every rank."""
    if config.ckpt_dir:
        return Path(config.ckpt_dir)
    return Path(shared_temp_dir("handbook-ckcost-", ctx))


def _tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's shards of every model and optimizer tensor, copied, in a fixed order."""
    out: list[torch.Tensor] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            out.append(local_tensor(value).detach().clone())
        elif isinstance(value, Mapping):
            for key in sorted(value, key=str):
                walk(value[key])

    walk(get_state_dict(model, optimizer))
    return out


def _differing(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    """Tensors that differ in any bit (or in number), of two lists from :func:`_tensors`."""
    return abs(len(a) - len(b)) + sum(not torch.equal(x, y) for x, y in zip(a, b))


def _round(root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           job: Mapping[str, Any]) -> tuple[dict, dict]:
    """Every save and load once, on the same state: their seconds, and the last records. With
    and without checksums alternate in order from round to round (``step`` odd: with first)."""

    def save(checksums: bool):
        return save_checkpoint(root / ("verified" if checksums else "plain"), step, model, optimizer,
                               keep_last=1, checksums=checksums, job=job)

    def load(checksums: bool):
        return load_checkpoint(root / ("verified" if checksums else "plain"), model, optimizer,
                               verify_checksums=checksums)

    order = (True, False) if step % 2 else (False, True)
    saves = {checksums: save(checksums) for checksums in order}
    loads = {checksums: load(checksums) for checksums in order}
    saved, plain, loaded, load_plain = saves[True], saves[False], loads[True], loads[False]
    pending = save_checkpoint(root / "async", step, model, optimizer, keep_last=1, asynchronous=True, job=job)
    assert isinstance(pending, PendingCheckpoint)  # asynchronous=True
    waited = pending.wait()
    times = {"save_s": saved.seconds, "hash_s": saved.checksum_s, "save_plain_s": plain.seconds,
             "load_s": loaded.seconds, "verify_s": loaded.verify_s, "load_plain_s": load_plain.seconds,
             "async_blocked_s": waited.blocked_s, "async_wait_s": waited.wait_s, "async_total_s": waited.seconds}
    return times, {"saved": saved, "loaded": loaded, "async": waited}


def _own_bytes(path: Path, rank: int) -> int:
    """Bytes of the files DCP names as rank ``rank``'s (``__{rank}_*.distcp``), and ``.metadata``
    for rank 0: read from the directory, not from the save's records."""
    own = sum(p.stat().st_size for p in path.glob(f"__{rank}_*.distcp"))
    return own + ((path / METADATA).stat().st_size if rank == 0 else 0)


def _damage(path: Path, rank: int) -> tuple[str, int]:
    """Overwrite 4 KiB in the middle of the largest item of rank ``rank``'s first file, its size
    unchanged: ``(file, offset)``. At the saving world size only that rank reads the item."""
    name = f"__{rank}_0.distcp"
    items = [i for i in read_metadata(path).storage_data.values() if i.relative_path == name]
    largest = max(items, key=lambda i: i.length)
    offset = largest.offset + largest.length // 2 - 2048
    with open(path / name, "r+b") as f:
        f.seek(offset)
        f.write(bytes(4096))  # zeros where a float tensor's bytes were
    return name, offset


def _refusal_checks(path: Path, ctx: RankContext, model, optimizer) -> tuple[list[Check], dict]:
    """Damage the last rank's file, load it on every rank, and check who refuses it."""
    victim = ctx.world_size - 1
    name, offset = _damage(path, victim) if ctx.is_main else (f"__{victim}_0.distcp", -1)
    if ctx.world_size > 1:
        dist.barrier()
    try:
        load_checkpoint(path, model, optimizer)
        refused: tuple[int, ...] = ()
        message = ""
    except CheckpointError as err:
        refused, message = err.refused_by, str(err)
    checks = []
    if ctx.is_main:
        try:
            validate_checkpoint(path)  # one process, every item of every file
            single = ""
        except CheckpointError as err:
            single = str(err)
        checks = [Check("damaged_file_refused_by_its_rank", None, victim, refused[0] if len(refused) == 1 else -1,
                        "rank"),
                  Check("damaged_file_named", None, 1, int(f"{name} does not match" in message), "refusal"),
                  Check("damaged_file_named_in_one_process", None, 1, int(f"{name} does not match" in single),
                        "refusal")]
    return checks, {"damaged_file": name, "damaged_offset": offset, "refused_by": list(refused),
                    "message": message.replace(str(path), "<checkpoint>")}


def _checks(ctx: RankContext, records: dict, trained: list[torch.Tensor], loaded_async: list[torch.Tensor],
            loaded_sync: list[torch.Tensor]) -> list[Check]:
    """The exact checks of the last round (see the module's docstring)."""
    saved, loaded = records["saved"], records["loaded"]
    verified = dict(loaded.verified)
    expected = {**loaded.read, METADATA: verified.get(METADATA, 0)}
    outside = sum(abs(verified.get(f, 0) - expected.get(f, 0)) for f in set(verified) | set(expected))
    checks = [
        Check("hashed_bytes", ctx.rank, _own_bytes(saved.path, ctx.rank), sum(saved.hashed.values()), "bytes"),
        Check("verified_bytes", ctx.rank, sum(loaded.read.values()) + verified.get(METADATA, 0),
              sum(verified.values()), "bytes"),
        Check("verified_bytes_not_read", ctx.rank, 0, outside, "bytes"),
        Check("async_tensors_differing", ctx.rank, 0, _differing(trained, loaded_async), "tensors"),
        Check("sync_tensors_differing", ctx.rank, 0, _differing(trained, loaded_sync), "tensors"),
    ]
    hashed = [saved.hashed]
    if ctx.world_size > 1:
        hashed = [None] * ctx.world_size
        dist.all_gather_object(hashed, saved.hashed)
    if ctx.is_main:
        files = {k: v for k, v in saved.files.items() if k != MANIFEST}
        sync = _manifest(saved.path)[CHECKSUM]
        other = _manifest(records["async"].path)[CHECKSUM]
        shards = [f for f in files if f != METADATA]
        checks += [
            Check("files_hashed", None, len(files), sum(len(h) for h in hashed), "files"),
            Check("bytes_hashed", None, sum(files.values()), sum(sum(h.values()) for h in hashed), "bytes"),
            Check("async_shards_identical", None, len(shards), sum(sync[f] == other.get(f) for f in shards), "files"),
        ]
    return checks


def _manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def _metrics(times: dict[str, list[float]], records: dict) -> dict[str, Any]:
    """This rank's seconds per repeat, bytes, and the fractions of the medians."""
    saved, loaded = records["saved"], records["loaded"]
    hashed, verified = sum(saved.hashed.values()), sum(loaded.verified.values())
    return {
        **times,
        "hashed_bytes": hashed, "verified_bytes": verified, "read_bytes": sum(loaded.read.values()),
        "hash_fraction_of_save": cost_fraction(times["hash_s"], times["save_s"]),
        "verify_fraction_of_load": cost_fraction(times["verify_s"], times["load_s"]),
        "async_blocked_fraction_of_save": cost_fraction(times["async_blocked_s"], times["save_s"]),
        "hash_bytes_per_s": hashed / median(times["hash_s"]) if median(times["hash_s"]) > 0 else None,
    }


def job_times(ranks: Sequence[Mapping[str, list[float]]]) -> dict[str, float]:
    """The job's seconds from every rank's: per repeat the slowest rank's (a collective save or
    load lasts as long as its slowest rank), then the median over the repeats, for each key of
    :data:`TIMES`; with the fractions of the hashing in a save, of the verification in a load
    and of the time an asynchronous save blocks in a synchronous one."""
    slowest = {key: [max(times) for times in zip(*(rank[key] for rank in ranks))] for key in TIMES}
    out = {key: median(values) for key, values in slowest.items()}
    out["hash_fraction_of_save"] = cost_fraction(slowest["hash_s"], slowest["save_s"])
    out["verify_fraction_of_load"] = cost_fraction(slowest["verify_s"], slowest["load_s"])
    out["async_blocked_fraction_of_save"] = cost_fraction(slowest["async_blocked_s"], slowest["save_s"])
    return out


def run(config: CheckpointCostConfig, ctx: RankContext) -> RankReport:
    validate(config, ctx.world_size)
    shape = scale_model_width(config.model_config(), config.scale)
    wide = config.replace(d_model=shape.d_model, dim_feedforward=shape.dim_feedforward)
    model = parallelize(wide, ctx)
    optimizer = build_optimizer(model.parameters(), wide.optimizer, wide.lr, wide.optimizer_impl)
    train_step(model, optimizer, *local_batch(wide, 0, ctx))  # AdamW's state exists from here
    # Python's generator is saved pickled, its integers in as many bytes as their values need:
    # seeded, every file has the same size from run to run (NumPy's: its position, likewise)
    random.seed(config.seed + ctx.rank)
    np.random.seed(config.seed + ctx.rank)
    trained = _tensors(model, optimizer)
    root = _root(config, ctx)
    times: dict[str, list[float]] = {key: [] for key in TIMES}
    for repeat in range(config.repeats + 1):
        measured, records = _round(root, repeat + 1, model, optimizer, job_of(config))
        if repeat:  # the first round warms up DCP's planning and the async save's process group
            for key in TIMES:
                times[key].append(measured[key])
    loaded_sync = _tensors(model, optimizer)  # the last load was of a synchronous checkpoint
    load_checkpoint(records["async"].path, model, optimizer)
    checks = _checks(ctx, records, trained, _tensors(model, optimizer), loaded_sync)
    refusal, found = _refusal_checks(records["saved"].path, ctx, model, optimizer)
    files = dict(records["saved"].files)
    every: list[Any] = [times]
    if ctx.world_size > 1:
        every = [None] * ctx.world_size
        dist.all_gather_object(every, times)
    if ctx.is_main and not config.ckpt_dir:
        shutil.rmtree(root)
    params = model_layout(shape).num_params
    extra = {"model": {k: getattr(shape, k) for k in ("vocab_size", "d_model", "nhead", "dim_feedforward",
                                                       "num_layers")},
             "params": params, "param_bytes": 4 * params, "files": files,
             "checkpoint_bytes": sum(v for k, v in files.items() if k != MANIFEST), "job": job_times(every),
             **found}
    return RankReport(metrics=_metrics(times, records), checks=checks + refusal, extra=extra)


if __name__ == "__main__":
    main(sys.modules[__name__])
