"""runtime.ring_attention: the book's ring against full causal attention, on 4 gloo processes.

One start of 4 ranks runs two rings: all 4 ranks as one sp group (2 heads), and two sp groups
of 2 ranks ([0, 1] and [2, 3]). Each rank computes full causal attention
(``parallel_model.causal_attention``, SDPA) on the whole sequence and compares its chunk of the
output and of the q, k, v gradients with the ring's (largest difference relative to the
reference's largest magnitude, 1e-6 in fp32: measured 1e-7), and counts its sends and receives.
"""

from __future__ import annotations

import json
import multiprocessing.forkserver

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from handbook_lib.runtime.collectives import CollectiveCounter
from handbook_lib.runtime.parallel_model import causal_attention
from handbook_lib.runtime.ring_attention import causal_ring_attention

WORLD = 4
BATCH, SEQ, HEAD_DIM = 2, 16, 8


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference, relative to the reference's largest magnitude."""
    return ((got - want).abs().max() / want.abs().max()).item()


def _case(rank: int, group: dist.ProcessGroup, size: int, heads: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(BATCH, SEQ, heads, HEAD_DIM, generator=gen, requires_grad=True) for _ in range(3))
    weight = torch.randn(BATCH, SEQ, heads, HEAD_DIM, generator=gen)
    full = causal_attention(q, k, v)
    (full * weight).sum().backward()
    me, chunk = dist.get_rank(group), SEQ // size
    part = slice(me * chunk, (me + 1) * chunk)
    mine = [t.detach()[:, part].clone().requires_grad_() for t in (q, k, v)]
    with CollectiveCounter() as counter:
        out = causal_ring_attention(*mine, group)
        (out * weight[:, part]).sum().backward()
    calls = counter.calls
    return {
        "out": _relative(out.detach(), full.detach()[:, part]),
        "grads": max(_relative(m.grad, t.grad[:, part]) for m, t in zip(mine, (q, k, v))),
        "contiguous": out.is_contiguous(),
        "counts": {f"{c.kind}/{c.phase}": sum((d.kind, d.phase) == (c.kind, c.phase) for d in calls) for c in calls},
        "bytes": sorted({c.buffer_bytes for c in calls}),
        "groups": sorted({c.group_size for c in calls}),
    }


def _worker(rank: int, store: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        whole = dist.new_group(list(range(WORLD)))
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        result = {"ring4": _case(rank, whole, 4, heads=2, seed=7),
                  "ring2": _case(rank, pairs[rank // 2], 2, heads=4, seed=11 + rank // 2)}
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """The 4 ranks, forked from one fork server that imported torch and this module once (each of
    4 spawned processes would import torch itself: most of this file's time on 2 cores); a fresh
    process, not this one (which may have run torch's thread pool), is what they are forked from.
    The server is stopped afterwards, so nothing is left running."""
    tmp = tmp_path_factory.mktemp("ring")
    server = multiprocessing.forkserver._forkserver  # the module's own, as set_forkserver_preload uses
    server.set_forkserver_preload([__name__])
    try:
        mp.start_processes(_worker, args=(str(tmp / "store"), str(tmp)), nprocs=WORLD, join=True,
                           start_method="forkserver")
    finally:
        server._stop()  # closes its "alive" pipe and waits for it to exit
        server.set_forkserver_preload(["__main__"])  # the default, for whoever starts one next
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("case", ["ring4", "ring2"])
def test_ring_output_and_gradients_equal_full_causal_attention(results, case):
    for rank in results:
        assert rank[case]["out"] <= 1e-6
        assert rank[case]["grads"] <= 1e-6
        assert rank[case]["contiguous"]


@pytest.mark.parametrize(("case", "p", "heads"), [("ring4", 4, 2), ("ring2", 2, 4)])
def test_ring_sends_what_the_model_counts(results, case, p, heads):
    # by hand, one layer: forward P-1 steps x (K, V) = 2(P-1) sends and receives; backward
    # K, V for P-1 steps and dK, dV for P steps = 4P-2; each a (2, 16/P, heads, 8) fp32 block
    block = BATCH * (SEQ // p) * heads * HEAD_DIM * 4
    for rank in results:
        assert rank[case]["counts"] == {"send/forward": 2 * (p - 1), "recv/forward": 2 * (p - 1),
                                        "send/backward": 4 * p - 2, "recv/backward": 4 * p - 2}
        assert rank[case]["bytes"] == [block]
        assert rank[case]["groups"] == [p]
