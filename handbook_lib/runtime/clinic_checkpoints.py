"""The FSDP clinic's checkpoint cases: saving that holds too much, resuming that cannot load.

Chapter 10, "Checkpoints" (chapter 6 teaches the right way). Each case is
``(setup) -> (broken, fixed)`` (:data:`handbook_lib.runtime.clinic_common.CaseFn`); the bytes a
state dict holds are checked against the book's model state
(:mod:`handbook_lib.models.model_state`), and what a rank saved against FSDP's shard rule
(:func:`~handbook_lib.models.sharding.shard_rows`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from handbook_lib.models.model_state import optimizer_states, optimizer_step_bytes
from handbook_lib.models.sharding import shard_rows
from handbook_lib.runtime.clinic_common import (
    CaseFn,
    CaseSetup,
    Half,
    first_line,
    raised,
    shard_model,
    step_loss,
)
from handbook_lib.runtime.collectives import tensors_in
from handbook_lib.runtime.distributed import shared_temp_dir
from handbook_lib.runtime.measure import local_tensor, nbytes

__all__ = ["full_state_dict_every_rank", "resume_other_world_size", "compiled_key_prefix", "CHECKPOINT_CASES"]


def _trained(setup: CaseSetup) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The config's model under FSDP2, after one AdamW step (so the optimizer has its state)."""
    model = shard_model(setup.model(), setup.mesh())
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.config.lr)
    step_loss(model, setup.batch(0), optimizer)
    return model, optimizer


def full_state_dict_every_rank(setup: CaseSetup) -> tuple[Half, Half]:
    """The model's and the optimizer's full state dicts, to save them as one file, with
    ``full_state_dict=True`` but no ``cpu_offload``: every rank gathers and keeps the whole
    model and optimizer state (4P + 8P bytes with AdamW in fp32), however many ranks there are.
    Fixed: ``cpu_offload=True``, which keeps the copy on rank 0 only (or DCP, chapter 6, which
    saves the shards). Checked: the bytes of the state dicts on each rank against
    :func:`~handbook_lib.models.model_state.optimizer_states` and
    :func:`~handbook_lib.models.model_state.optimizer_step_bytes`, exact."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    layout = setup.layout
    whole = 4 * layout.num_params * (1 + optimizer_states("adamw")) + optimizer_step_bytes(layout, "adamw")
    halves = []
    for broken in (True, False):
        half = setup.half()
        model, optimizer = _trained(setup)
        options = StateDictOptions(full_state_dict=True, cpu_offload=not broken)  # clinic: both
        state = get_state_dict(model, optimizer, options=options)  # clinic: both
        held = sum(nbytes(t) for t in tensors_in(state))
        keeps = broken or setup.rank == 0
        half.check("state_dict_bytes", whole if keeps else 0, held, "bytes")
        half.symptom = broken and held >= whole
        half.metrics.update(state_dict_bytes=held, whole_bytes=whole)
        half.finding = (f"cpu_offload={not broken}: rank {setup.rank} holds {held:,} B of state dicts "
                        f"({held / whole:.0%} of the model and optimizer)")
        halves.append(half)
    return halves[0], halves[1]


def _size_mismatch(err: BaseException | None) -> str:
    """The first ``size mismatch for ...`` line of ``load_state_dict``'s error (its first line
    only names the model), or ``"loaded"``."""
    if err is None:
        return "loaded"
    lines = [line.strip() for line in str(err).splitlines() if "size mismatch" in line]
    return f"{type(err).__name__}: {lines[0]}" if lines else first_line(err)


def _folder(setup: CaseSetup) -> Path:
    """A temporary folder made by rank 0 and named to every rank (one machine: ``/tmp``)."""
    return Path(shared_temp_dir("handbook-clinic-", setup.ctx, setup.group))


def resume_other_world_size(setup: CaseSetup) -> tuple[Half, Half]:
    """Each rank saves its own shards (``torch.save`` of the local tensors, FSDP1's
    ``LOCAL_STATE_DICT`` in spirit); the job resumes on another number of ranks, here 1 (rank 0,
    the model unsharded). Rank 0's file holds 1/N of each tensor's rows: ``load_state_dict``
    refuses it, ``size mismatch``. Fixed: save with DCP (every tensor's global shape and where
    its shards lie are recorded), load on 1 rank without a process group: the very weights.
    Checked on rank 0: the tensors whose saved shape is not the model's (every tensor with more
    than one row, by :func:`~handbook_lib.models.sharding.shard_rows`), and the fixed load's
    largest difference from the weights of the job that saved (0), exact."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    folder = _folder(setup)
    model, _ = _trained(setup)
    truth = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    local = {k: local_tensor(v).clone() for k, v in model.state_dict().items()}  # clinic: broken
    torch.save(local, folder / f"rank{setup.rank}.pt")  # clinic: broken
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=folder / "dcp",  # clinic: fixed
             process_group=setup.group)
    dist.barrier(group=setup.group)
    broken, fixed = setup.half(), setup.half()
    if setup.rank == 0:
        one = setup.model(seed_offset=1)  # a fresh model, on 1 rank
        saved = torch.load(folder / "rank0.pt")  # clinic: broken
        wrong = sum(saved[k].shape != t.shape for k, t in one.state_dict().items())
        rows = sum(shard_rows(shape[0], setup.world, 0)[0] != shape[0] for _, shape in setup.layout.tensors)
        err = raised(lambda: one.load_state_dict(saved))  # clinic: broken
        broken.check("wrong_shapes", rows, wrong, "tensors")
        broken.flag("raised", True, err is not None)
        broken.symptom = err is not None
        mismatch = _size_mismatch(err)
        broken.metrics.update(error=mismatch)
        broken.finding = f"rank 0's own shards into 1 rank: {wrong} tensors of another shape; {mismatch}"
        one = setup.model(seed_offset=1)
        state = {"model": one.state_dict()}
        dcp.load(state, checkpoint_id=folder / "dcp", no_dist=True)  # clinic: fixed
        one.load_state_dict(state["model"])  # clinic: fixed
        diff = max(float((one.state_dict()[k] - v).abs().max()) for k, v in truth.items())
        fixed.check("tensors_loaded", len(setup.layout.tensors), len(state["model"]), "tensors")
        fixed.check("max_difference", 0.0, diff, "weight")
        fixed.symptom = diff != 0.0
        fixed.finding = f"DCP, saved on {setup.world} ranks, loaded on 1: largest difference {diff}"
    else:
        broken.finding = fixed.finding = "saved its shards; the resume runs on rank 0 alone"
    dist.barrier(group=setup.group)
    if setup.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return broken, fixed


def compiled_key_prefix(setup: CaseSetup) -> tuple[Half, Half]:
    """A compiled FSDP2 model's state dict gathered whole, then loaded into the plain model with
    ``strict=False``, as resume and export scripts often do: ``torch.compile`` wraps the model in
    an ``OptimizedModule`` whose keys all begin ``_orig_mod.``, so no tensor matches and nothing
    is raised (the model is not run, so nothing is compiled). Fixed: ``get_model_state_dict``,
    which names each tensor without its wrappers' prefixes (compile's, DDP's, activation
    checkpointing's). Checked on rank 0: the keys with the prefix (every tensor broken, none
    fixed), the tensors loaded, whether the weights are the ones saved."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = torch.compile(shard_model(setup.model(), setup.mesh()))
    truth = _full(model)
    tensors = len(setup.layout.tensors)
    halves = []
    for broken in (True, False):
        half = setup.half()
        if broken:  # clinic: both
            state = {k: v.full_tensor() for k, v in model.state_dict().items()}
        else:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = get_model_state_dict(model, options=options)
        if setup.rank == 0:
            plain = setup.model(seed_offset=1)  # a fresh model, another seed
            missing = plain.load_state_dict(state, strict=False).missing_keys  # clinic: both
            same = all(torch.equal(plain.state_dict()[k], v) for k, v in truth.items())
            prefixed = sum(k.startswith("_orig_mod.") for k in state)
            half.check("prefixed_keys", tensors if broken else 0, prefixed, "tensors")
            half.check("tensors_loaded", 0 if broken else tensors, tensors - len(missing), "tensors")
            half.flag("weights_as_saved", not broken, same)
            half.symptom = bool(missing)
            half.finding = f"{prefixed} keys begin '_orig_mod.'; {tensors - len(missing)} of {tensors} tensors loaded"
        else:
            half.finding = "gathered; the load runs on rank 0"
        halves.append(half)
    return halves[0], halves[1]


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights, whole, by their plain names (every rank joins the all-gathers)."""
    inner = getattr(model, "_orig_mod", model)
    return {k: v.full_tensor() for k, v in inner.state_dict().items()}


CHECKPOINT_CASES: dict[str, CaseFn] = {
    "full_state_dict_every_rank": full_state_dict_every_rank,
    "resume_other_world_size": resume_other_world_size,
    "compiled_key_prefix": compiled_key_prefix,
}
"""The checkpoint cases of this module, by name."""
