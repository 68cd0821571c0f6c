"""Every prediction of the pure models, pinned: 4,313 configurations, 4,593 predictions.

The file ``tests/data/predictions.json.gz`` was first written by the flat package (commit
53daa75, SHA-256 b3a882bc...dad11) before its models were rebuilt over one layout and one
function per memory phase; the layered package gave every number, phase name, note and planner
reason of it, byte for byte. It was written again once, on purpose, when the planner began to
price a collective over a machine's every network rail with the links' published efficiencies
(:mod:`handbook_lib.models.topology`): that changed 5 plans' ``comm_s`` (34 options),
``step_s`` (26), ``routes`` (new, 40) and 6 reasons, and no memory figure. And once more when
``estimate_init_bytes`` with ``init="full"`` under a sharding strategy learned that the peak may
come when the root unit is sharded, last, not with the first unit: 28 ``init|...|full``
entries changed, each checked against a real gloo run (e.g. 2 ranks, vocab 1001, d 64: 892,416 B
measured and now predicted, where 809,964 B was), no other figure. And once more when the
memory model learned what CUDA ranks (``backend="nccl"``) add: foreach AdamW's fp32 temporary
of every local parameter in the optimizer step (now a phase of the sharding strategies too) and,
with CPU offload, the shards copied to the device at each all-gather (``offload_gather``). 1,464
nccl memory entries and 5 plans changed (598 peaks: the optimizer step or the offload copy
became the peak, e.g. 7B-count FULL_SHARD on 8: 16P/8 -> 20P/8), no gloo entry; and the
planner's ``cpu`` preset prices gloo ranks (its peaks lose the GPU's temporary: 1 plan) while a
reason whose peak is the optimizer step says so (4 plans' DDP reasons), no other figure.
And once more when a GPU's usable memory became the memory CUDA reports (published per card,
measured on an H200) less a training process's context as ``make gpu-check`` measured it
(1,457,521,152 B, not the bare context's 287,047,680): 4 plans' budgets, margins and reasons
changed (e.g. GPT-3 175B on 64 A100 80GB: 85.61 -> 83.64 GB usable, FULL_SHARD + AC's margin
5.0 -> 2.7 %), no fit verdict and no recommendation, no other figure.
And once more when compute began to count attention's FLOPs (12·L·w·s per token) at a
utilization per GPU and width (``expected_utilization``, fitted on 17 published runs: A100 80GB
0.692·d/(d + 386), H100 0.468·...), and a checkpointed handbook model began to keep its boolean
causal mask (s² bytes, measured on CPU and on an H200): 5 plans' ``compute_s``, ``step_s`` and
the step times their reasons quote (e.g. GPT-3 175B on 64 A100: FULL_SHARD + AC 44.7 -> 28.9 s;
Llama-2 7B on 8 H100: 0.410 -> 0.455 s) and 504 checkpointed memory entries of the
handbook-model layouts (+s² bytes, e.g. +4,096 B at 64 tokens), no fit verdict and no
recommendation.
And once more when the optimizer step's temporaries became a function of its implementation
(``optimizer_temporary_bytes``: foreach 4·Σn, for-loop 4·max(n_{i-1} + 2·n_i) with the previous
tensor's denominator still bound, fused 0), measured to the byte by every ``fsdp_train`` run:
1,849 entries changed, all of them on gloo but 84 NO_SHARD + offload entries on nccl that lost
an empty optimizer phase. On gloo the sharding strategies gained an optimizer phase (their
for-loop temporaries, never the peak); the replicating ones' grew by the previous tensor (e.g.
+256 B on the handbook's tiny model); for decoders known by their blocks the for-loop's
temporaries are no longer counted as a whole layer's (a note says so), which moved 312 gloo
peaks from the optimizer step to the head's backward. One plan changed (the ``cpu`` preset's,
+1,024 B); no nccl peak, no fit verdict and no recommendation.
And once more when the budget began to take off NCCL's buffers for each option's process groups
(:mod:`handbook_lib.models.nccl_buffers`: 12 MiB a ring channel inside a node, 20 MiB across,
a tree and NVLS for the groups that all-reduce): the 5 plans' options gained ``nccl_bytes``
and 4 plans' budgets, margins and reasons changed (e.g. GPT-3 175B on 64 A100 80GB: 83.64 ->
83.30 GB usable for FULL_SHARD + AC, its margin 2.7 -> 2.3 %; DDP 82.97 GB), no fit verdict,
no recommendation, no other figure.
And once more when a Llama-family decoder's activations began to be counted operator by operator
(:func:`~handbook_lib.models.activations.gated_decoder_tensors`: the RMSNorms' fp32 copies, Q, K
and V after RoPE, the SwiGLU's four tensors; exact against Transformers' own Llama on CPU) where
Korthikanti's GPT count of ``34·s·b·h`` stood: 792 memory entries of the Llama presets and 3
plans' reasons changed (e.g. Llama-2 7B on 8 H100, SHARD_GRAD_OP: 51.5 -> 58.4 GB reserved, its
margin 38.1 -> 29.8 %; Llama-2 70B on 32 A100, FULL_SHARD + AC: 55.0 -> 55.2 GB), no fit verdict
and no recommendation.
And once more when a step's time began to be priced phase by phase and link by link
(:func:`~handbook_lib.models.timing.estimate_step_time`: forward's collectives behind forward's
compute, backward's behind backward's, the first all-gather and the last reduction exposed,
collectives on different links at once, DDP's last 25 MiB bucket exposed), NVLink's latency per
ring step became the 7.7 us fitted on NCCL's own rings (NVIDIA/nccl#1047; a ring across machines
waits for its slower hop) and PCIe 5 the 52 GB/s Azure measured: the 5 plans' ``comm_s`` and
``step_s`` (39 options), one ``offload`` and 10 reasons changed (e.g. Llama-2 7B on 8 H100:
SHARD_GRAD_OP 0.455 -> 0.458 s), and one recommendation, the handbook's model on 2 gloo ranks:
DDP's last bucket now waits, DDP and SHARD_GRAD_OP tie within 1 %, and the tie goes to the
one that communicates less (DDP -> SHARD_GRAD_OP); every option gained its ``compute_margin`` (how far compute may shrink
before a phase waits on its links); no memory figure and no fit verdict.
And once more when the CPU optimizer of offload was capped by the host's memory bandwidth
(:data:`~handbook_lib.models.offload.ADAM_BYTES_PER_PARAM`, 28 B a parameter; the DGX hosts' DRAM
channels at their peak): the 3 A100 plans' offload options stepped slower (e.g. Llama-2 70B on 32
A100: 12.726 -> 13.007 s), their "next best" reasons with them, and every offload cost gained
``optimizer_limit``; no fit verdict and no recommendation.
And once more when GPUs behind one PCIe switch began to share its uplink to the host
(``Host.gpus_per_uplink``, 2 on a DGX A100): the 3 A100 plans' offload copies doubled (e.g.
Llama-2 13B on 8 A100 40GB: 0.774 -> 1.549 s, its ``comm_s`` with it and its compute margin
3.23 -> 1.61); no step time, fit verdict or recommendation.
``tests/prediction_grid.py`` says what the grid covers and how to regenerate the file after a
deliberate change.
"""

from __future__ import annotations

import gzip
import hashlib
import json

from tests.prediction_grid import GOLDEN, canonical, predictions

GOLDEN_SHA256 = "e34dd198269e333822dfa3024c90439bf6b0ca920dd32b43b9d754a5e0d08d09"
"""SHA-256 of the golden file's canonical text (a change to it must be deliberate)."""


def test_the_golden_file_is_the_pinned_one():
    text = gzip.decompress(GOLDEN.read_bytes()).decode()
    assert hashlib.sha256(text.encode()).hexdigest() == GOLDEN_SHA256


def test_every_prediction_is_unchanged():
    golden = json.loads(gzip.decompress(GOLDEN.read_bytes()))
    count, out = predictions()
    now = json.loads(canonical(out))
    assert count >= 400 and len(now) == len(golden) == 4593
    differ = [key for key in golden if now.get(key) != golden[key]]
    assert not differ, f"{len(differ)} predictions changed, e.g. {differ[:5]}"
    assert set(now) == set(golden)
