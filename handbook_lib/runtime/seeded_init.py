"""The seeded weights of the handbook's model, filled into a model built on the meta device, one
top-level part at a time: the *materialise* step of :func:`handbook_lib.runtime.build.parallelize`.

Chapter 5 measures what it saves (``init="meta"`` against ``init="full"``). Each rank
materialises only what it holds (its shards, with FSDP) and copies in the values that
``build_model(config, seed)`` would have drawn, so every rank ends with the very weights of one
process, and none ever holds the whole model.
"""

from __future__ import annotations

from collections.abc import Generator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from handbook_lib.core.config import RunConfig
from handbook_lib.runtime.model import model_parts

__all__ = ["seeded_parts", "SeededInit"]

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module")

def _plain_name(name: str) -> str:
    """A parameter's or module's name as in the unwrapped model (wrappers' prefixes removed)."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PREFIXES)

def seeded_parts(config: RunConfig) -> Generator[tuple[str, nn.Module], None, None]:
    """Build the model's top-level parts one by one on the CPU, in construction order, each
    with the weights ``build_model(config.model_config(), seed=config.seed)`` gives it.

    The random stream is replayed in a forked generator (``torch.random.fork_rng``), so nothing
    else that draws random numbers in between changes the weights, and the caller's generator
    is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        state = torch.get_rng_state()
    for name, make in model_parts(config.model_config()):
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(state)
            part = make()
            state = torch.get_rng_state()
        yield name, part
        del part  # not held while the next part is built

def _local_view(full: torch.Tensor, target: DTensor) -> torch.Tensor:
    """This rank's part of ``full`` as ``target`` places it, as a view (no copy): ``Shard(d)``
    cuts dim ``d`` as ``torch.chunk`` does (FSDP's rule: ceil-sized chunks, trailing ranks
    possibly empty), ``Replicate`` keeps it whole."""
    coordinate = target.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(target.placements):
        if isinstance(placement, Shard):
            chunks = full.chunk(target.device_mesh.size(mesh_dim), dim=placement.dim)
            index = coordinate[mesh_dim]
            full = chunks[index] if index < len(chunks) else full.narrow(placement.dim, 0, 0)
    return full

def _copy_full(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full value ``full`` into ``target``: its local shard if it is a DTensor."""
    if isinstance(target, DTensor):
        target.to_local().copy_(_local_view(full, target))
    else:
        target.copy_(full)

class SeededInit:
    """Fill a materialised model with the seeded weights, one top-level part at a time.

    Parts are built in construction order (:func:`seeded_parts`) as they are asked for; a part
    is dropped once all its tensors are copied, so at most the parts asked for out of order are
    held (FSDP1 materialises each layer's unit before the root's embedding and head: the
    embedding waits, one layer at a time passes).
    """

    def __init__(self, config: RunConfig) -> None:
        self._parts = seeded_parts(config)
        self._names = [name for name, _ in model_parts(config.model_config())]
        self._built: dict[str, dict[str, torch.Tensor]] = {}

    def _part_of(self, name: str) -> str:
        part = next((p for p in self._names if name.startswith(p + ".")), None)
        if part is None:
            raise KeyError(f"{name!r} belongs to no part of the model ({', '.join(self._names)})")
        return part

    def _take(self, name: str) -> torch.Tensor:
        part = self._part_of(name)
        while part not in self._built:
            built, module = next(self._parts)
            self._built[built] = {f"{built}.{k}": v.detach() for k, v in
                                  [*module.named_parameters(), *module.named_buffers()]}
        value = self._built[part].pop(name)
        if not self._built[part]:
            del self._built[part]
        return value

    @torch.no_grad()
    def fill_module(self, name: str, module: nn.Module) -> None:
        """Fill ``module``'s own parameters and buffers (not its children's); ``name`` is its
        qualified name in the model (wrapper prefixes are ignored)."""
        prefix = _plain_name(name)
        for key, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            _copy_full(tensor, self._take(f"{prefix}.{key}" if prefix else key))

    def fill(self, model: nn.Module) -> None:
        """Fill every parameter and buffer of ``model`` (after ``to_empty``), then :meth:`close`."""
        for name, module in model.named_modules():
            self.fill_module(name, module)
        self.close()

    def close(self) -> None:
        """Drop the last part built (the part generator holds it until closed).

        Raises:
            RuntimeError: if some built tensor was never copied into the model.
        """
        self._parts.close()
        if self._built:
            raise RuntimeError(f"seeded init left tensors unfilled: {sorted(self._built)}")
