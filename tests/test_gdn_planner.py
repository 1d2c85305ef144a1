"""The planner's context-parallel bytes per layer type: a Gated DeltaNet layer's headwise all-to-alls
(``gdn_communication_bytes``) against the bytes the real layer exchanges, and a hybrid model's plan (3 GDN : 1
attention) against an all-attention model of the same shape."""

from __future__ import annotations

import pytest
import torch
from helpers.distributed import run_distributed

from lightning_mm.model import linear_attention as la
from lightning_mm.plan.cp_comm import cp_communication_bytes, gdn_communication_bytes, rank_token_counts
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


def _counted_rank(rank, world, heads, seq, lengths=None):
    """The real GDN layer (``tests/test_gdn_context_parallel.py``'s) forward and backward in bf16, with every
    all-to-all's received bytes (the parts from the other ranks) counted; returns them and the CP plan. Without
    ``lengths``: 2 unpadded rows on a zigzag plan (an even split); with them: row 0 those samples packed, row 1 one
    sample of 70 tokens, both padded to ``seq``, on the LPT plan the CP planner makes from their mask words and
    segments (blocks of uneven work: uneven token counts)."""
    import torch.distributed as dist

    from lightning_mm.parallel.context import distribute, token_index
    from test_gdn_context_parallel import _gdn, _inputs

    received, real = [], la._all_to_all

    def counted(x, group):
        out = real(x, group)
        received.append(sum(out[i].numel() for i in range(out.shape[0]) if i != rank) * out.element_size())
        return out

    la._all_to_all = counted
    gdn = _gdn(*heads).to(torch.bfloat16)
    if lengths is None:
        bam, segments = torch.ones(2, seq, dtype=torch.int64), None
        hidden = torch.randn(2, seq, 32, generator=torch.Generator().manual_seed(1), dtype=torch.bfloat16)
        plan = distribute(bam, world, "zigzag", BLOCK)
    else:
        hidden, bam, segments, _ = _inputs(lengths, seq)
        hidden = hidden.to(torch.bfloat16)
        plan = distribute(bam, world, "lpt", BLOCK, segments)
    index = token_index(plan[rank], BLOCK, seq)
    local = hidden.index_select(1, index).requires_grad_(True)
    out = gdn(local, bam=bam.index_select(1, index), token_index=index.expand(2, -1), cp_group=dist.group.WORLD,
              segment_ids=None if segments is None else segments.index_select(1, index), attn_cache={})
    out.float().sum().backward()
    return received, [p.tolist() for p in plan]


@pytest.mark.slow
@pytest.mark.parametrize("heads,cp,seq,lengths", [
    ((2, 4), 2, 128, None), ((2, 4), 4, 128, None),
    ((2, 4), 2, 136, [13, 40, 3, 20]), ((2, 4), 4, 136, [70, 1, 30])], ids=["cp2-even", "cp4-even", "cp2-lpt-packed",
                                                                          "cp4-lpt-packed"])
def test_gdn_bytes_equal_what_the_real_layer_exchanges(heads, cp, seq, lengths):
    """bf16, 2 rows on cp ranks (cp 4 repeats the 2 key heads): the four all-to-alls of one forward and backward
    receive exactly ``gdn_communication_bytes`` on every rank. Even: 2 x 128 tokens on a zigzag plan, the model's
    even split. Uneven: packed and padded rows of 136 tokens (17 blocks of 8) on the LPT plan, whose per-rank token
    counts (``rank_token_counts``) differ; every rank's tokens travel padded to the largest count, more than the
    even split's share (which would undercount)."""
    results = run_distributed(_counted_rank, cp, heads, seq, lengths, timeout=800)
    plan = results[0][1]
    counts = rank_token_counts(plan, BLOCK, seq, rows=2)
    assert sum(counts) == 2 * seq
    expected = gdn_communication_bytes(2 * seq, cp, *heads, 8, 6, dtype_bytes=2,
                                       rank_tokens=None if lengths is None else counts)
    even = gdn_communication_bytes(2 * seq, cp, *heads, 8, 6, dtype_bytes=2)
    if lengths is None:
        assert len(set(counts)) == 1 and expected["padded_tokens"] == 0
    else:  # the split is uneven, and the model charges its padding
        assert len(set(counts)) > 1 and expected["padded_tokens"] == cp * max(counts) - 2 * seq > 0, counts
        assert expected["forward"] > even["forward"]
    for received, _ in results:
        assert len(received) == 4
        assert sum(received[:2]) == expected["forward"] and sum(received[2:]) == expected["backward"], received


def test_gdn_bytes_take_the_plans_token_counts():
    """``rank_token_counts`` counts each rank's blocks (the last one short) times the rows; the bytes follow the
    largest count, equal the even split's when the counts are equal, and counts that do not fit the microbatch or
    the CP degree are refused, naming the fix."""
    assert rank_token_counts([[0, 3], [1, 2, 4]], 8, 36, rows=2) == [2 * (8 + 8), 2 * (8 + 8 + 4)]
    args = (2, 2, 4, 8, 6)  # cp 2; 2 key heads, 4 value heads of 8 and 6
    even = gdn_communication_bytes(96, *args)
    assert gdn_communication_bytes(96, *args, rank_tokens=[48, 48]) == {**even, "padded_tokens": 0}
    uneven = gdn_communication_bytes(96, *args, rank_tokens=[40, 56])
    assert uneven["forward"] == pytest.approx(even["forward"] * 56 / 48) and uneven["padded_tokens"] == 16
    for bad in ([48, 40], [32, 32, 32], [-8, 104]):
        with pytest.raises(ValueError, match="rank_tokens .* rank_token_counts"):
            gdn_communication_bytes(96, *args, rank_tokens=bad)


def _llm(linear_ids, layers=8, seq_len=1 << 20, rank_tokens=()):
    """An LLM of ``layers`` equal layers with a Qwen3.5-9B-like shape: attention 16 query / 4 KV heads of 256,
    GDN 16 key heads of 128 and 32 value heads of 128; ``linear_ids``: which layers are GDN; ``rank_tokens``: the
    CP splits of the microbatch."""
    costs = [LayerCost(1.0, 2.0, True, True) for _ in range(layers)]
    shape = AttentionShape(seq_len, 16, 4, 256, 2, linear_value_heads=32, linear_key_heads=16, linear_key_dim=128,
                           linear_value_dim=128, linear_ids=linear_ids, rank_tokens=rank_tokens)
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


def test_planner_charges_gdn_layers_the_cp_planners_uneven_split():
    """With the microbatch's split at cp 4 given (one rank 3072 tokens over a quarter), the GDN layers' CP seconds
    grow by the fullest rank's share over the even one (the exchange pads to it) and the attention layers' stay;
    the split at cp 2 is not used at cp 4; a split that does not sum to the microbatch is refused."""
    seq, bw, quarter = 1 << 20, 100e9, (1 << 20) // 4
    split4 = (quarter + 3072, quarter - 1024, quarter - 1024, quarter - 1024)
    plans = {name: evaluate_plan(_llm((0, 1, 2, 4, 5, 6), rank_tokens=splits), {LM: [3, 5]}, "parallel", 4, cp=4,
                                 cp_bandwidth=bw)
             for name, splits in (("even", ()), ("uneven", (split4, (seq // 2 + 8, seq // 2 - 8))))}
    gdn = gdn_communication_bytes(seq, 4, 16, 32, 128, 128)["forward"]
    attn = cp_communication_bytes("allgather", seq, 4, 16, 4, 256)["forward"]
    scale = (quarter + 3072) / quarter
    assert plans["even"].cp_comm == pytest.approx({f"{LM}.0": 2 * 3 * gdn / bw,
                                                  f"{LM}.1": 2 * (3 * gdn + 2 * attn) / bw})
    assert plans["uneven"].cp_comm == pytest.approx({f"{LM}.0": 2 * 3 * gdn * scale / bw,
                                                    f"{LM}.1": 2 * (3 * gdn * scale + 2 * attn) / bw})
    with pytest.raises(ValueError, match="rank_tokens .* must each sum to seq_len=1048576"):
        _llm((0,), rank_tokens=((quarter,) * 3 + (quarter - 8,),))


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
