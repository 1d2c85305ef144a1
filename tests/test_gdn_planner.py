"""The planner's context-parallel bytes per layer type: a Gated DeltaNet layer's headwise all-to-alls
(``gdn_communication_bytes``) against the bytes the real layer exchanges, and a hybrid model's plan (3 GDN : 1
attention) against an all-attention model of the same shape."""

from __future__ import annotations

import pytest
import torch
from helpers.distributed import run_distributed

from lightning_mm.model import linear_attention as la
from lightning_mm.plan.cp_comm import cp_communication_bytes, gdn_communication_bytes
from lightning_mm.planner import AttentionShape, LayerCost, ModuleSpec, evaluate_plan

LM = "language_model"
BLOCK = 8


@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 8, 6), (16, 32, 128, 128), (4, 8, 16, 32)])
def test_gdn_bytes_equal_the_layers_channel_table(hk, hv, dk, dv):
    """Per cp (2, 4, 8 where it divides the value heads): what the layer's channel table (``_channels``: the q, k,
    v, b, a channels each rank is sent, key heads repeated where cp does not divide them) and its output
    (``Hv / cp`` heads of ``dv``) put through the two all-to-alls, from the other cp - 1 ranks' S / cp tokens."""
    seq, dtype_bytes = 4096, 2
    for cp in (c for c in (2, 4, 8) if hv % c == 0):
        chan, _, nv = la._channels(hk, hv, dk, dv, cp)
        received = (cp - 1) * (seq // cp) * (chan.shape[1] + nv * dv) * dtype_bytes
        got = gdn_communication_bytes(seq, cp, hk, hv, dk, dv, dtype_bytes)
        assert got["forward"] == got["backward"] == got["all_to_all"] == received, (cp, got, received)
        assert got["all_gather"] == 0 and got["collectives_per_layer"] == 4
    assert gdn_communication_bytes(seq, 1, hk, hv, dk, dv)["forward"] == 0


def _counted_rank(rank, world, heads, seq):
    """The real GDN layer (``tests/test_gdn_context_parallel.py``'s) on a zigzag plan of 2 unpadded rows, forward
    and backward, with every all-to-all's received bytes (the parts from the other ranks) counted."""
    import torch.distributed as dist

    from lightning_mm.parallel.context import distribute, token_index
    from test_gdn_context_parallel import _gdn

    received, real = [], la._all_to_all

    def counted(x, group):
        out = real(x, group)
        received.append(sum(out[i].numel() for i in range(out.shape[0]) if i != rank) * out.element_size())
        return out

    la._all_to_all = counted
    gdn = _gdn(*heads).to(torch.bfloat16)
    bam = torch.ones(2, seq, dtype=torch.int64)
    index = token_index(distribute(bam, world, "zigzag", BLOCK)[rank], BLOCK, seq)
    hidden = torch.randn(2, seq, 32, generator=torch.Generator().manual_seed(1), dtype=torch.bfloat16)
    local = hidden.index_select(1, index).requires_grad_(True)
    out = gdn(local, bam=bam.index_select(1, index), token_index=index.expand(2, -1), cp_group=dist.group.WORLD,
              attn_cache={})
    out.float().sum().backward()
    return received


@pytest.mark.slow
@pytest.mark.parametrize("heads,cp", [((2, 4), 2), ((2, 4), 4)])
def test_gdn_bytes_equal_what_the_real_layer_exchanges(heads, cp):
    """bf16, 2 rows of 128 tokens on cp ranks (cp 4 repeats the 2 key heads): the four all-to-alls of one forward
    and backward receive exactly ``gdn_communication_bytes`` for the microbatch's 256 tokens on every rank."""
    seq = 128
    expected = gdn_communication_bytes(2 * seq, cp, *heads, 8, 6, dtype_bytes=2)
    for received in run_distributed(_counted_rank, cp, heads, seq, timeout=800):
        assert len(received) == 4
        assert sum(received[:2]) == expected["forward"] and sum(received[2:]) == expected["backward"], received


def _llm(linear_ids, layers=8, seq_len=1 << 20):
    """An LLM of ``layers`` equal layers with a Qwen3.5-9B-like shape: attention 16 query / 4 KV heads of 256,
    GDN 16 key heads of 128 and 32 value heads of 128; ``linear_ids``: which layers are GDN."""
    costs = [LayerCost(1.0, 2.0, True, True) for _ in range(layers)]
    shape = AttentionShape(seq_len, 16, 4, 256, 2, linear_value_heads=32, linear_key_heads=16, linear_key_dim=128,
                           linear_value_dim=128, linear_ids=linear_ids)
    return {LM: ModuleSpec(costs, attention=shape)}


@pytest.mark.parametrize("mode,ulysses", [("allgather", None), ("ulysses", None), ("hybrid", 2)])
def test_hybrid_models_cp_time_charges_each_layer_its_own_exchange(mode, ulysses):
    """LLM stages of 3 and 5 layers, GDN at 0-2 and 4-6 (attention at 3 and 7), cp 4: each stage's CP seconds are
    its attention layers' ``cp_communication_bytes`` for the mode plus its GDN layers' headwise bytes (the same in
    every mode), forward and backward, over the bandwidth; the all-attention model of the same shape charges
    ``cp_communication_bytes`` to all 8."""
    bw, seq = 100e9, 1 << 20
    hybrid = evaluate_plan(_llm((0, 1, 2, 4, 5, 6)), {LM: [3, 5]}, "parallel", 4, cp=4, cp_mode=mode,
                           ulysses=ulysses, cp_bandwidth=bw)
    dense = evaluate_plan(_llm(()), {LM: [3, 5]}, "parallel", 4, cp=4, cp_mode=mode, ulysses=ulysses, cp_bandwidth=bw)
    attn = cp_communication_bytes(mode, seq, 4, 16, 4, 256, ulysses)["forward"]
    gdn = gdn_communication_bytes(seq, 4, 16, 32, 128, 128)["forward"]
    assert gdn == 3 / 4 * seq / 4 * (2 * 16 * 128 + 2 * 32 * 128 + 2 * 32) * 2  # hand count: q, k, v, b, a in; out
    assert hybrid.cp_comm == pytest.approx({f"{LM}.0": 2 * 3 * gdn / bw, f"{LM}.1": 2 * (3 * gdn + 2 * attn) / bw})
    assert dense.cp_comm == pytest.approx({f"{LM}.0": 2 * 3 * attn / bw, f"{LM}.1": 2 * 5 * attn / bw})
    # the direction at cp 4: a GDN layer's 12352 channels a token (q, k, v, b, a in; the output back) outweigh
    # what an attention layer moves in every mode (4 KV heads gathered; or 16 + 8 heads in, 16 back): dearer
    assert gdn > attn and hybrid.iteration_time > dense.iteration_time


def test_hybrid_model_moves_fewer_bytes_than_attention_at_high_cp():
    """Allgather's K/V bytes per rank grow as (cp - 1) / cp of the sequence, a GDN layer's all-to-all as
    (cp - 1) / cp^2: at cp 8 the hybrid model's CP time (and step) falls below the all-attention model's (2702 vs
    3584 bytes a token per layer), at cp 2 it is the other way round (6176 vs 2048)."""
    for cp, hybrid_less in ((8, True), (2, False)):
        times = {name: evaluate_plan(_llm(ids), {LM: [8]}, "parallel", 4, cp=cp, cp_bandwidth=10e9)
                 for name, ids in (("hybrid", (0, 1, 2, 4, 5, 6)), ("dense", ()))}
        assert (times["hybrid"].cp_comm[f"{LM}.0"] < times["dense"].cp_comm[f"{LM}.0"]) == hybrid_less, cp
        assert (times["hybrid"].iteration_time < times["dense"].iteration_time) == hybrid_less, cp


def test_attention_shape_needs_the_gdn_layers_shape():
    """GDN layers without their ids or head shape would be charged nothing: refused, naming what is missing."""
    with pytest.raises(ValueError, match="need linear_ids .* and positive linear_value_heads"):
        AttentionShape(1024, 16, 4, 256, 2, linear_layers=6, linear_value_heads=32)
    shape = AttentionShape(1024, 16, 4, 256, 2, linear_value_heads=32, linear_key_heads=16, linear_key_dim=128,
                           linear_value_dim=128, linear_ids=[4, 0, 1])
    assert shape.linear_layers == 3 and shape.linear_ids == (0, 1, 4)
