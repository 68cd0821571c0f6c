"""models.sequence_parallel: the Q/K/V-split layout, activations per rank, the transfers of
Ulysses and of the ring, and the formulas at scale, each against a count by hand or a
measurement (the saved tensors of the book's model on the CPU)."""

import math

import pytest
import torch
from torch.nn import functional as F

from handbook_lib.core.architecture import ModelConfig
from handbook_lib.models.hardware import Link, get_accelerator
from handbook_lib.models.layout import model_layout
from handbook_lib.models.presets import DecoderShape, get_shape
from handbook_lib.models.sequence_parallel import (
    estimate_sp_activation_bytes,
    estimate_sp_collectives,
    estimate_sp_step_traffic,
    megatron_sp_layer_bytes,
    parallel_layout,
    ring_layer_bytes,
    ring_overlap,
    sequence_activation_bytes,
    ulysses_layer_bytes,
)
from handbook_lib.models.traffic import estimate_step_traffic
from handbook_lib.runtime.model import build_model
from handbook_lib.runtime.parallel_model import from_simple

CFG = ModelConfig(vocab_size=96, d_model=64, nhead=4, dim_feedforward=128, num_layers=2)
LLAMA3_8B = DecoderShape("Llama-3 8B", 32, 4096, 32, 128_256, dim_feedforward=14_336, num_kv_heads=8,
                         gated_mlp=True, tied_embeddings=False)


def test_parallel_layout_is_the_parallel_models_tensors():
    model = from_simple(build_model(CFG, seed=0))
    layout = parallel_layout(CFG)
    assert list(layout.tensors) == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert layout.num_params == model_layout(CFG).num_params == sum(p.numel() for p in model.parameters())
    # 3 ranks: a (64, 64) weight pads to 66 rows, a (64,) bias to 66; (192, 64) would not pad
    assert parallel_layout(CFG).shard_bytes(3, 2).padding_bytes > model_layout(CFG).shard_bytes(3, 2).padding_bytes


def _saved_bytes(config: ModelConfig, batch: int, seq: int) -> int:
    """Bytes of the distinct storages autograd saves in one forward of the parallel model (the
    parameters left out), with the loss."""
    model = from_simple(build_model(config, seed=0))
    x = torch.randint(0, config.vocab_size, (batch, seq))
    y = torch.randint(0, config.vocab_size, (batch, seq))
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


@pytest.mark.parametrize(("batch", "seq"), [(2, 8), (1, 16), (3, 4)])
def test_activations_are_what_autograd_saves(batch, seq):
    assert estimate_sp_activation_bytes(CFG, batch, seq, 1).total == _saved_bytes(CFG, batch, seq)


def test_activations_split_by_sp_and_ulysses_keeps_one_more_tensor_per_layer():
    # by hand, T = 2 x 16 / 4 = 8 tokens: per layer 8·(8·64 + 2·128)·4 + 8·(16 + 16) = 24,832
    ring = estimate_sp_activation_bytes(CFG, 2, 16, 4, "ring")
    assert ring.per_layer == 24_832
    assert ring.head == 2 * 8 * 8 + 8 * 64 * 4 + 8 * 96 * 4 + 4
    assert ring == estimate_sp_activation_bytes(CFG, 2, 4, 1)  # what one rank of 4 tokens keeps
    ulysses = estimate_sp_activation_bytes(CFG, 2, 16, 4, "ulysses")
    assert ulysses.per_layer - ring.per_layer == 8 * 64 * 4  # the output all-to-all's result


def test_ulysses_collectives_four_each_way_per_layer():
    ops = estimate_sp_collectives(CFG, 2, 16, 2, "ulysses")
    # T = 2 x 8 = 16 tokens x 64 wide x 4 bytes = 4,096 B; 2 layers x 4
    assert [(o.kind, o.phase, o.buffer_bytes, o.group_size, o.count) for o in ops] == [
        ("all_to_all", "forward", 4096, 2, 8), ("all_to_all", "backward", 4096, 2, 8)]
    assert sum(o.sent_bytes for o in ops) == 16 * 4096 // 2  # half of each stays home


def test_ring_collectives_per_layer():
    p = 4
    ops = {(o.kind, o.phase): o for o in estimate_sp_collectives(CFG, 1, 16, p, "ring")}
    assert ops[("send", "forward")].count == 2 * 3 * 2  # K and V, P-1 steps, 2 layers
    assert ops[("send", "backward")].count == (2 * 3 + 2 * 4) * 2  # K, V for P-1 steps; dK, dV for P
    assert ops[("recv", "backward")].count == ops[("send", "backward")].count
    assert {o.buffer_bytes for o in ops.values()} == {4 * 64 * 4}
    assert ops[("recv", "forward")].sent_bytes == 0
    assert estimate_sp_collectives(CFG, 1, 16, 1, "ring") == ()


def test_step_traffic_is_fsdp_over_the_world_beside_sp():
    traffic = estimate_sp_step_traffic(CFG, 4, 2, 16, 2, "ulysses")
    units = parallel_layout(CFG).units("layer")
    fsdp = estimate_step_traffic(units, 4, "FULL_SHARD")
    assert traffic.fsdp == fsdp
    counts = traffic.counts()
    assert counts[("all_gather", "forward", 4)][0] == 3 and counts[("reduce_scatter", "backward", 4)][0] == 3
    assert counts[("all_to_all", "forward", 2)] == (8, 8 * 2 * 8 * 64 * 4)
    assert traffic.sent_bytes == fsdp.sent_bytes + 16 * 4096 // 2


def test_refusals():
    with pytest.raises(ValueError, match="sp_size=2 must divide seq_len=15$"):
        estimate_sp_activation_bytes(CFG, 1, 15, 2)
    with pytest.raises(ValueError, match="sp_method must be one of ulysses, ring"):
        estimate_sp_collectives(CFG, 1, 16, 2, "allgather")
    with pytest.raises(ValueError, match="sp_size=8 with sp_method=ulysses must divide nhead=4 "):
        estimate_sp_collectives(CFG, 1, 16, 8, "ulysses")


def test_one_long_sequence_divides_by_sp():
    s = 131_072
    one = sequence_activation_bytes(LLAMA3_8B, s)
    # by hand, per token in bf16: a layer's two RMSNorms 2·(4·4096 + 4 + 2·2·4096), Q and the output
    # 2·2·4096, K and V 2·2·1024, the log-sum-exp 4·32, the SwiGLU's 4·2·14,336; outside the layers
    # the final norm, RoPE's cos and sin (2·128·2), the fp32 log-softmax, the ids and targets, and
    # the loss's 4-byte weight total
    layer = 2 * (4 * 4096 + 4 + 4 * 4096) + 4 * 4096 + 4 * 1024 + 4 * 32 + 8 * 14_336
    assert one == 32 * s * layer + s * (4 * 4096 + 4 + 4 * 4096 + 2 * 128 * 2 + 128_256 * 4 + 16) + 4
    for sp in (2, 8):  # every term is per token but the loss's weight total, one per rank
        assert sequence_activation_bytes(LLAMA3_8B, s, sp) * sp == one + 4 * (sp - 1)
    assert one / 2**30 > 800 > sequence_activation_bytes(LLAMA3_8B, s, 8) / 2**30 * 7


def test_ulysses_sends_4m_over_p_and_megatron_p_times_more():
    shape, s, p = get_shape("llama2-7b"), 32_768, 8  # multi-head attention: q = k = d
    m = s * 4096 * 2  # the whole sequence's activation, bf16
    ulysses = ulysses_layer_bytes(shape, s, p)
    assert ulysses.forward_sent == 4 * m * (p - 1) // p**2 and ulysses.forward_transfers == 4
    assert megatron_sp_layer_bytes(shape, s, p).forward_sent == p * ulysses.forward_sent


def test_ring_layer_bytes_by_hand():
    s, p = 131_072, 8
    block = s // p * 1024 * 2  # one K (or V) block: 8 KV heads x 128, bf16
    ring = ring_layer_bytes(LLAMA3_8B, s, p)
    assert ring.forward_sent == 2 * (p - 1) * block and ring.forward_transfers == 14
    assert ring.backward_sent == 2 * (p - 1) * block + 2 * p * block
    assert ring_layer_bytes(LLAMA3_8B, s, p, grad_dtype="fp32").backward_sent == 2 * (p - 1) * block + 4 * p * block
    # multi-head attention: the ring sends P/2 times Ulysses' bytes; with K, V a quarter of Q
    # (8 of 32 heads) the ring sends less only while P < 1 + q/k = 5
    mha = get_shape("llama2-7b")
    assert ring_layer_bytes(mha, s, p).forward_sent == p // 2 * ulysses_layer_bytes(mha, s, p).forward_sent
    assert ring_layer_bytes(LLAMA3_8B, s, 4).forward_sent < ulysses_layer_bytes(LLAMA3_8B, s, 4).forward_sent
    assert ring_layer_bytes(LLAMA3_8B, s, 8).forward_sent > ulysses_layer_bytes(LLAMA3_8B, s, 8).forward_sent


def test_ring_hides_when_a_block_reaches_flops_per_byte():
    # Liu et al.: with multi-head attention in bf16 and no latency, c >= F / B
    link = Link("test", 50e9, 0.0, "a test link")
    acc = get_accelerator("h100-80gb")
    shape = get_shape("llama2-7b")
    need = math.ceil(acc.peak_flops_bf16 * 0.5 / 50e9)
    assert abs(ring_overlap(shape, 8 * 65_536, 8, link, acc).min_block_tokens - need) <= 1
    assert ring_overlap(shape, 8 * (need + 64), 8, link, acc).hides
    assert not ring_overlap(shape, 8 * (need - 64), 8, link, acc).hides
    # across nodes (NDR400) it takes far longer blocks than inside one (NVLink)
    assert ring_overlap(shape, 131_072, 8, "ib-ndr400", acc).min_block_tokens > \
        ring_overlap(shape, 131_072, 8, "nvlink4", acc).min_block_tokens
