"""Context parallelism: plans, sharding, and CP attention against single-process dense attention."""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_distributed

from lightning_mm.attention import mask as masks
from lightning_mm.parallel import context as cp

# ----------------------------------------------------------------------------------------------------------
# helpers (independent references)
# ----------------------------------------------------------------------------------------------------------


def dense_block_pairs(bam, seg, block):
    """Block pairs straight from the dense token mask."""
    dense = masks.to_dense(bam, seg)
    b, s, _ = dense.shape
    nb = -(-s // block)
    pad = nb * block - s
    dense = torch.nn.functional.pad(dense, (0, pad, 0, pad))
    return dense.view(b, nb, block, nb, block).any(4).any(2)


def dense_attention(q, k, v, bam, seg, scale):
    """Softmax attention under the dense mask; rows without allowed keys give zeros."""
    mask = masks.to_dense(bam, seg)[:, None]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, -1e30)
    return (torch.softmax(s, -1) * mask) @ v


def brute_force_makespan(work, g):
    return min(max(sum(w for w, r in zip(work, assign) if r == rank) for rank in range(g))
               for assign in itertools.product(range(g), repeat=len(work)))


def word_soup(gen, b, s, runs=False):
    """Random words from a pool covering padding, text, bidirectional, causal-only, partial-overlap and span
    words."""
    pool = torch.tensor([0, masks.text_word(2), 2, 4, 6, masks.CAUSAL, masks.CAUSAL | 2, masks.CAUSAL | 5, 1,
                         masks.span_word(1, 2, 1), masks.span_word(2, 2, 2)])
    if runs:
        return pool[torch.randint(0, len(pool), (b, s // 3 + 1), generator=gen)].repeat_interleave(3, 1)[:, :s]
    return pool[torch.randint(0, len(pool), (b, s), generator=gen)]


# ----------------------------------------------------------------------------------------------------------
# block workload
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spans", [False, True])
@pytest.mark.parametrize("layout", masks.LAYOUTS)
def test_block_workload_equals_dense_on_layouts(layout, spans):
    for seed, (s, block) in enumerate([(64, 8), (70, 8), (33, 4), (50, 7), (16, 16), (5, 8)]):
        bam, seg = masks.random_bam(layout, s, 2, 2, seed, mean_item_tokens=max(1, s // 5), spans=spans)
        ref = dense_block_pairs(bam, seg, block)
        assert torch.equal(masks.block_pairs(bam, block, seg), ref)
        assert torch.equal(masks.block_workload(bam, block, seg), ref.sum(-1))


def test_block_workload_equals_dense_on_arbitrary_words():
    gen = torch.Generator().manual_seed(1)
    for trial in range(120):
        b, s, block = trial % 3 + 1, int(torch.randint(1, 60, (1,), generator=gen)), trial % 7 + 1
        bam = word_soup(gen, b, s, runs=trial % 2 == 0)
        seg = None if trial % 3 == 0 else torch.randint(0, 3, (b, s), generator=gen)
        if seg is not None and trial % 3 == 1:
            seg = seg.sort(1).values  # contiguous segments (packing); otherwise interleaved
        ref = dense_block_pairs(bam, seg, block)
        assert torch.equal(masks.block_pairs(bam, block, seg), ref), trial
        assert torch.equal(masks.block_workload(bam, block, seg), ref.sum(-1)), trial


def test_block_workload_equals_dense_with_more_words_than_a_mask_holds():
    """Over 63 distinct words the workload scans runs instead of using word masks: still exact."""
    gen = torch.Generator().manual_seed(5)
    bits = torch.randint(1, 1 << 6, (150,), generator=gen)  # partial overlaps between modality sets
    pool = torch.unique(torch.where(torch.arange(150) % 2 == 0, bits | masks.CAUSAL, bits))
    for trial in range(6):
        b, s, block = 1 + trial % 2, 800, 3 + trial
        lengths = torch.randint(1, 5, (b, s), generator=gen)
        bam = torch.stack([pool[torch.randint(0, len(pool), (s,), generator=gen)].repeat_interleave(row)[:s]
                           for row in lengths])
        assert torch.unique(bam).numel() > 63
        seg = None if trial % 3 == 0 else torch.randint(0, 3, (b, s), generator=gen).sort(1).values
        ref = dense_block_pairs(bam, seg, block)
        assert torch.equal(masks.block_workload(bam, block, seg), ref.sum(-1)), trial
        assert torch.equal(masks.block_pairs(bam, block, seg), ref), trial


@pytest.mark.slow
def test_block_workload_equals_dense_with_many_runs():
    """Hundreds of items per row (images interleaved with text, packed samples): the per-group coverage counts."""
    for layout, seed in itertools.product(masks.LAYOUTS, range(2)):
        bam, seg = masks.random_bam(layout, 6000, 2, 2, seed, mean_item_tokens=12)
        for block in (4, 16):
            assert torch.equal(masks.block_workload(bam, block, seg), dense_block_pairs(bam, seg, block).sum(-1))


@pytest.mark.parametrize("layout", masks.LAYOUTS)
def test_block_workload_and_lpt_equal_the_previous_implementation_on_long_rows(layout):
    """The run-length workload and the LPT that deals equal-work runs in one step give exactly the numbers and
    plans of the per-block-summary workload and the Python-heap LPT they replaced."""
    from tests.helpers import block_workload_reference as ref

    for seed, (s, block, batch) in enumerate([(65536, 128, 1), (40000, 100, 2), (30001, 64, 3), (9000, 7, 1)]):
        bam, seg = masks.random_bam(layout, s, 3, batch, seed)
        if seed % 2:  # padding inside rows and at their ends
            bam[:, s // 3:s // 3 + 200] = 0
            bam[-1, -(s // 5):] = 0
        work = masks.block_workload(bam, block, seg)
        assert torch.equal(work, ref.block_workload(bam, block, seg))
        for size in (2, 5, 8, 16):
            plan = cp.distribute(bam, size, "lpt", block, seg)
            expected = ref.lpt_assign(work.sum(0), size)
            assert [p.tolist() for p in plan] == [p.tolist() for p in expected]


def test_lpt_equals_one_heap_operation_per_block():
    from tests.helpers import block_workload_reference as ref

    gen = torch.Generator().manual_seed(3)
    for trial in range(400):
        n, size = int(torch.randint(1, 300, (1,), generator=gen)), int(torch.randint(1, 17, (1,), generator=gen))
        if n < size:
            continue
        kind = trial % 4
        if kind == 0:  # few distinct values: long equal runs
            work = torch.randint(0, 4, (n,), generator=gen)
        elif kind == 1:
            work = torch.randint(0, 1000, (n,), generator=gen)
        elif kind == 2:  # an image's blocks after large text blocks: keys spread more than the equal step
            work = torch.cat([torch.randint(500, 1000, (n // 3,), generator=gen),
                              torch.full((n - n // 3,), int(torch.randint(0, 10, (1,), generator=gen)))])
        else:
            work = torch.randint(0, 50, (max(1, n // 30),), generator=gen).repeat_interleave(30)[:n]
        assert [p.tolist() for p in cp.lpt_assign(work, size)] == [p.tolist() for p in ref.lpt_assign(work, size)]
    for n, size in [(512, 8), (500, 16), (333, 3), (1000, 2)]:  # causal text: dealt as a snake, exactly
        text = torch.arange(1, n + 1)
        text[n // 3:] += 40  # a jump in the works: the snake may hold on, or break where LPT leaves it
        assert [p.tolist() for p in cp.lpt_assign(text, size)] == [p.tolist() for p in ref.lpt_assign(text, size)]
    huge = torch.cat([torch.randint(0, 1 << 40, (60,), generator=gen), torch.full((40,), 1 << 39)])  # integer keys
    assert [p.tolist() for p in cp.lpt_assign(huge, 8)] == [p.tolist() for p in ref.lpt_assign(huge, 8)]


def test_block_workload_1d_and_hand_case():
    t, a = masks.text_word(1), masks.modality_word(1, 1)
    # blocks of 2: [a a][t t][a t][t t] -> block 0 sees itself; 1 sees 0,1; 2 sees 0,1,2 (a sees a of 0);
    # block 3 sees 0..3
    bam = torch.tensor([a, a, t, t, a, t, t, t])
    assert masks.block_workload(bam, 2).tolist() == [2, 2, 3, 4]
    # the image in block 2 also sees block 0's image, so block 0 is seen from block 2: pairs not symmetric
    assert masks.block_pairs(bam, 2)[0].tolist() == [True, False, True, False]


def test_block_workload_reads_segment_ids_of_any_integer_type():
    bam, seg = masks.random_bam("mp", 5000, 2, 2, 4)
    work = masks.block_workload(bam, 64, seg)
    for dtype in (torch.int32, torch.int16, torch.uint8):
        assert torch.equal(masks.block_workload(bam, 64, seg.to(dtype)), work)
        assert [p.tolist() for p in cp.distribute(bam, 4, "lpt", 64, seg.to(dtype))] == \
            [p.tolist() for p in cp.distribute(bam, 4, "lpt", 64, seg)]


# ----------------------------------------------------------------------------------------------------------
# distribute
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", cp.METHODS)
def test_distribute_returns_a_partition(method):
    for layout, s, block, size, batch in [("ep", 256, 16, 4, 1), ("ee", 250, 16, 3, 2), ("mp", 130, 8, 2, 2),
                                          ("mp", 64, 16, 4, 1)]:
        bam, seg = masks.random_bam(layout, s, 2, batch, 3)
        plan = cp.distribute(bam, size, method, block, seg, seed=5)
        nb = -(-s // block)
        cp.validate_plan(plan, nb, size)
        assert all(p.numel() > 0 and p.dtype == torch.int64 for p in plan)
        assert torch.equal(torch.sort(torch.cat(plan)).values, torch.arange(nb))


def test_lpt_hand_case_seed_example():
    plan = cp.lpt_assign(torch.tensor([1, 2, 2, 4, 5, 2, 2, 8]), 2)
    assert [p.tolist() for p in plan] == [[0, 1, 5, 7], [2, 3, 4, 6]]
    assert cp.plan_workload(plan, torch.tensor([1, 2, 2, 4, 5, 2, 2, 8])).tolist() == [13, 13]


def test_lpt_spreads_zero_work_blocks():
    assert [p.tolist() for p in cp.lpt_assign(torch.zeros(5, dtype=torch.long), 3)] == [[0, 3], [1, 4], [2]]


def test_lpt_within_seed_bound_of_brute_force_optimum():
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        g, n = 2 + trial % 2, int(torch.randint(3, 8, (1,), generator=gen))
        work = torch.randint(0, 20, (n,), generator=gen)
        lpt = int(cp.plan_workload(cp.lpt_assign(work, g), work).max())
        opt = brute_force_makespan(work.tolist(), g)
        assert opt <= lpt <= work.sum().item() / g + work.max().item()  # the seeds' bound
        assert lpt <= (4 / 3 - 1 / (3 * g)) * opt + 1e-9  # Graham's LPT bound


def test_lpt_balances_causal_text_and_distribute_uses_summed_rows():
    bam = torch.full((2, 64), masks.text_word(0))
    bam[1, 32:] = 0  # the second row pads half: its blocks weigh less
    work = masks.block_workload(bam, 8).sum(0)
    plan = cp.distribute(bam, 2, "lpt", 8)
    assert [p.tolist() for p in plan] == [p.tolist() for p in cp.lpt_assign(work, 2)]
    loads = cp.plan_workload(plan, work)
    assert int(loads.max() - loads.min()) <= int(work.max())


def test_zigzag_and_contiguous_hand_cases():
    assert [p.tolist() for p in cp.zigzag_plan(8, 2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [p.tolist() for p in cp.zigzag_plan(10, 2)] == [[0, 1, 2, 8, 9], [3, 4, 5, 6, 7]]
    assert [p.tolist() for p in cp.zigzag_plan(5, 4)] == [[0], [1], [2], [3, 4]]
    assert [p.tolist() for p in cp.contiguous_plan(5, 2)] == [[0, 1, 2], [3, 4]]
    # zigzag balances a causal mask exactly: block i does i+1 work
    bam = torch.full((64,), masks.text_word(0))
    assert cp.plan_workload(cp.distribute(bam, 2, "zigzag", 8), masks.block_workload(bam, 8)).tolist() == [18, 18]


def test_random_is_seeded_and_balanced_in_count():
    a, b, c = (cp.random_plan(11, 3, s) for s in (1, 1, 2))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert any(not torch.equal(x, y) for x, y in zip(a, c))
    assert sorted(p.numel() for p in a) == [3, 4, 4]


def test_distribute_errors():
    bam = torch.full((1, 300), masks.text_word(0))
    with pytest.raises(ValueError, match="sequence shorter than cp_size blocks"):
        cp.distribute(bam, 4, "lpt", 128)
    with pytest.raises(ValueError, match="unknown CP distribution method 'ring'"):
        cp.distribute(bam, 2, "ring", 128)
    with pytest.raises(ValueError, match="block_size"):
        cp.distribute(bam, 2, "lpt", 0)
    with pytest.raises(ValueError, match="too large for LPT's int64 rank keys"):
        cp.lpt_assign(torch.full((8,), 1 << 56), 2)


def test_validate_plan_errors():
    good = [torch.tensor([0, 2]), torch.tensor([1, 3])]
    cp.validate_plan(good, 4, 2)
    cases = [
        ([torch.tensor([0, 1, 2, 3])], "one block list per rank"),
        ([torch.tensor([0, 2]), torch.tensor([1, 2])], "not a partition"),
        ([torch.tensor([0, 2]), torch.tensor([1])], "missing \\[3\\]"),
        ([torch.tensor([2, 0]), torch.tensor([1, 3])], "ascending"),
        ([torch.tensor([0, 2]), torch.tensor([1, 4])], "outside 0..3"),
        ([torch.tensor([0.0, 2.0]), torch.tensor([1, 3])], "integer tensor"),
    ]
    for plan, msg in cases:
        with pytest.raises(ValueError, match=msg):
            cp.validate_plan(plan, 4, 2)


# ----------------------------------------------------------------------------------------------------------
# sharding
# ----------------------------------------------------------------------------------------------------------


def test_token_index_shard_unshard_round_trip():
    s, block = 23, 4  # 6 blocks, the last one 3 tokens long
    plan = cp.distribute(masks.random_bam("ee", s, 2, 2, 0)[0], 3, "lpt", block)
    assert cp.token_index(torch.tensor([1, 5]), block, s).tolist() == [4, 5, 6, 7, 20, 21, 22]
    x = torch.randn(2, s, 5)
    shards = [cp.shard(x, p, block) for p in plan]
    assert sum(t.shape[1] for t in shards) == s
    for p, t in zip(plan, shards):
        assert torch.equal(t, x[:, cp.token_index(p, block, s)])
    assert torch.equal(cp.unshard(shards, plan, block, s), x)
    y = torch.arange(s * 3).view(3, s)  # dim 1 of a 2-D tensor, and dim 0
    assert torch.equal(cp.unshard([cp.shard(y, p, block) for p in plan], plan, block, s), y)
    assert torch.equal(cp.unshard([cp.shard(y.T, p, block, 0) for p in plan], plan, block, s, 0), y.T)


def test_shift_labels_and_shard_batch():
    labels = torch.tensor([[5, 6, 7, -100, 9]])
    assert cp.shift_labels(labels).tolist() == [[6, 7, -100, 9, -100]]
    s, block = 10, 2
    bam, _ = masks.random_bam("ee", s, 1, 1, 0)
    batch = {"input_ids": torch.arange(s)[None], "labels": torch.arange(100, 100 + s)[None], "bam": bam,
             "vision": {"pixel_values": torch.ones(1)}}
    plan = cp.distribute(bam, 2, "zigzag", block)  # 5 blocks in chunks [0,1],[2],[3],[4]: ranks [0,1,4], [2,3]
    local = cp.shard_batch(batch, plan, 1, block)
    assert local["input_ids"].tolist() == [[4, 5, 6, 7]]
    assert local["shift_labels"].tolist() == [[105, 106, 107, 108]]
    assert "labels" not in local and local["vision"] is batch["vision"]
    assert local["token_index"].tolist() == local["position_ids"].tolist() == [[4, 5, 6, 7]]
    rank0 = cp.shard_batch(batch, plan, 0, block)  # tokens 0..3, 8, 9: the last has no next token
    assert rank0["shift_labels"].tolist() == [[101, 102, 103, 104, 109, -100]]


# ----------------------------------------------------------------------------------------------------------
# CP attention, multi-process (gloo) against single-process dense attention on the full sequence
# ----------------------------------------------------------------------------------------------------------

# (layout, distribution, span words: Gemma 3's causal items that are bidirectional within themselves)
CASES = [(layout, method, False) for layout in masks.LAYOUTS for method in cp.METHODS] + [
    ("ee", "lpt", True), ("mp", "random", True)]


def _full_problem(layout, seed, s=38, heads=4, kv_heads=2, dim=8, spans=False):
    bam, seg = masks.random_bam(layout, s, 2, 2, seed, mean_item_tokens=5, spans=spans)
    bam[1, -3:] = 0  # padding rows must output zeros
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, s, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(2, kv_heads, s, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(2, kv_heads, s, dim, generator=gen, dtype=torch.float64)
    dout = torch.randn(2, heads, s, dim, generator=gen, dtype=torch.float64)
    return bam, seg, q, k, v, dout


def _cp_worker(rank, world, configs):
    from lightning_mm.attention import context_parallel

    block = 4
    for i, (layout, method, spans) in enumerate(CASES):
        bam, seg, q, k, v, dout = _full_problem(layout, i, spans=spans)
        s = bam.shape[1]
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = dense_attention(*leaves, bam, seg, 8 ** -0.5)
        ref.backward(dout)
        plan = cp.distribute(bam, world, method, block, seg, seed=i)
        mine = plan[rank]
        sh = lambda t, d=2: cp.shard(t, mine, block, d)  # noqa: E731
        idx = cp.token_index(mine, block, s).expand(2, -1)
        for head_groups, fallback, *recompute in configs:  # fallback: all_reduce + slice instead of reduce_scatter
            context_parallel._REDUCE_SCATTER_OK["gloo"] = not fallback
            lq, lk, lv = (sh(t).detach().requires_grad_() for t in (q, k, v))
            gathered = []  # the gathered keys and values, alive until backward unless recomputed there
            attend = context_parallel._attend_groups

            def recorded(*args):
                for leaves, out in attend(*args):
                    gathered.extend(weakref.ref(t) for t in leaves[1:])
                    yield leaves, out

            context_parallel._attend_groups = recorded
            try:
                with context_parallel.gathered_kv_recomputed(bool(recompute)):
                    out = cp.context_parallel_attention(lq, lk, lv, sh(bam, 1), None if seg is None else sh(seg, 1),
                                                        idx, None, head_groups=head_groups)
                gc.collect()
                alive = sum(r() is not None for r in gathered)
                out.backward(sh(dout))
            finally:
                context_parallel._attend_groups = attend
            ctx = f"rank {rank}/{world} {layout} {method} spans={spans} head_groups={head_groups} " \
                  f"fallback={fallback} recompute={bool(recompute)}"
            assert alive == (0 if recompute else 2 * head_groups), f"{alive} gathered tensors kept: {ctx}"
            torch.testing.assert_close(out, sh(ref.detach()), rtol=1e-9, atol=1e-10, msg=ctx)
            for name, got, full in (("dq", lq, leaves[0]), ("dk", lk, leaves[1]), ("dv", lv, leaves[2])):
                torch.testing.assert_close(got.grad, sh(full.grad), rtol=1e-9, atol=1e-10,
                                           msg=f"{name} {ctx}")
        whole = cp.gather_sequence(sh(q).transpose(1, 2), plan, block, s, None, 1)
        assert torch.equal(whole, q.transpose(1, 2))


@pytest.mark.parametrize("world,configs", [(2, [(1, False), (2, False), (2, True), (2, False, "recompute")]),
                                           pytest.param(4, [(1, False)], marks=pytest.mark.slow)])
def test_cp_attention_matches_single_process(world, configs):
    run_distributed(_cp_worker, world, configs)


def _ulysses_worker(rank, world, mode, degree):
    from lightning_mm.attention.ulysses import ContextParallelGroups, ulysses_attention

    if mode == "hybrid":  # every rank creates every group, in the same order
        inner = [dist.new_group(list(range(g * degree, (g + 1) * degree))) for g in range(world // degree)]
        outer = [dist.new_group(list(range(j, world, degree))) for j in range(degree)]
        groups = ContextParallelGroups("hybrid", None, inner[rank // degree], outer[rank % degree])
    else:
        groups = ContextParallelGroups("ulysses", None, None)
    block = 4
    for i, (layout, method, spans) in enumerate(CASES):
        if world > 2 and method not in ("lpt", "random"):  # uneven and scattered local lengths suffice here
            continue
        for kv_heads in (2, 1):  # 1 < degree: each rank gets a copy of the one KV head
            bam, seg, q, k, v, dout = _full_problem(layout, i, kv_heads=kv_heads, spans=spans)
            s = bam.shape[1]
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = dense_attention(*leaves, bam, seg, 8 ** -0.5)
            ref.backward(dout)
            plan = cp.distribute(bam, world, method, block, seg, seed=i, ulysses=degree)
            mine = plan[rank]
            sh = lambda t, d=2: cp.shard(t, mine, block, d)  # noqa: E731
            idx = cp.token_index(mine, block, s).expand(2, -1)
            lq, lk, lv = (sh(t).detach().requires_grad_() for t in (q, k, v))
            cache = {}  # a second layer reuses the gathered metadata; the gradients of both add up
            outs = [ulysses_attention(lq, lk, lv, sh(bam, 1), None if seg is None else sh(seg, 1), idx, groups,
                                      cache=cache) for _ in range(2)]
            out = outs[1]
            (outs[0] + outs[1]).backward(sh(dout))
            ctx = f"rank {rank}/{world} {mode} K={degree} {layout} {method} kv_heads={kv_heads}"
            torch.testing.assert_close(out, sh(ref.detach()), rtol=1e-9, atol=1e-10, msg=ctx)
            for name, got, full in (("dq", lq, leaves[0]), ("dk", lk, leaves[1]), ("dv", lv, leaves[2])):
                torch.testing.assert_close(got.grad, 2 * sh(full.grad), rtol=1e-9, atol=1e-10,
                                           msg=f"{name} {ctx}")


@pytest.mark.slow
@pytest.mark.parametrize("world,mode,degree", [pytest.param(2, "ulysses", 2, marks=pytest.mark.ci), (4, "ulysses", 4),
                                               (4, "hybrid", 2)])
def test_ulysses_and_hybrid_attention_match_single_process(world, mode, degree):
    """Output and dQ/dK/dV of Ulysses (all-to-all over cp ranks) and hybrid (Ulysses in groups of 2, all-gather
    across) equal dense attention on the whole sequence in one process, on EP/EE/MP with every distribution
    (uneven local lengths), with 4 query heads and 2 or 1 KV heads (fewer than the Ulysses ranks: repeated)."""
    run_distributed(_ulysses_worker, world, mode, degree)


def test_ulysses_specs_and_plans():
    from lightning_mm.attention.ulysses import check_ulysses_heads
    from lightning_mm.plan.layout import ParallelSpec

    assert ParallelSpec(cp=4, cp_mode="ulysses").ulysses_degree == 4
    assert ParallelSpec(cp=8, cp_mode="hybrid", ulysses=2).ulysses_degree == 2
    assert ParallelSpec(cp=4).ulysses_degree == 1 and ParallelSpec(cp_mode="ulysses").ulysses_degree == 1
    with pytest.raises(ValueError, match=r"1 < K < cp and K dividing cp=6.*choose K in \[2, 3\]"):
        ParallelSpec(cp=6, cp_mode="hybrid", ulysses=4)
    with pytest.raises(ValueError, match="cp=2 has no such divisor: use cp_mode='ulysses'"):
        ParallelSpec(cp=2, cp_mode="hybrid", ulysses=2)
    with pytest.raises(ValueError, match="needs cp_mode='hybrid'"):
        ParallelSpec(cp=4, ulysses=2)
    with pytest.raises(ValueError, match="use cp_mode='hybrid' with ulysses=2"):
        ParallelSpec(cp=4, cp_mode="ulysses", ulysses=2)
    with pytest.raises(ValueError, match="unknown cp_mode 'ring'"):
        ParallelSpec(cp=4, cp_mode="ring")
    with pytest.raises(ValueError, match="6 query heads are not divisible by the Ulysses degree 4"):
        check_ulysses_heads(6, 2, 4)
    with pytest.raises(ValueError, match="3 key/value heads cannot be split over 2 Ulysses ranks"):
        check_ulysses_heads(6, 3, 2)
    check_ulysses_heads(8, 2, 4)  # KV heads repeated
    check_ulysses_heads(8, 8, 4)
    # plans: groups of K ranks share the LPT group's blocks round-robin; short sequences still give every rank blocks
    bam, seg = masks.random_bam("mp", 300, 2, 2, 0)
    groups = cp.distribute(bam, 2, "lpt", 8, seg)
    plan = cp.distribute(bam, 4, "lpt", 8, seg, ulysses=2)
    assert [p.tolist() for p in plan] == [groups[0][0::2].tolist(), groups[0][1::2].tolist(),
                                          groups[1][0::2].tolist(), groups[1][1::2].tolist()]
    whole = cp.distribute(bam, 4, "zigzag", 8, seg, ulysses=4)
    assert [p.tolist() for p in whole] == [list(range(j, 38, 4)) for j in range(4)]
    short = masks.random_bam("ep", 16, 2, 1, 0)[0]  # 4 blocks of 4 for 4 ranks in 2 groups
    plan = cp.distribute(short, 4, "lpt", 4, None, ulysses=2)
    cp.validate_plan(plan, 4, 4)
    assert all(len(p) == 1 for p in plan)
    with pytest.raises(ValueError, match="must be a positive divisor of cp_size=4"):
        cp.distribute(bam, 4, "lpt", 8, seg, ulysses=3)


def test_cp_attention_input_errors():
    q = torch.randn(1, 4, 6, 8)
    k = v = torch.randn(1, 2, 6, 8)
    bam = torch.full((1, 6), masks.text_word(0))
    idx = torch.arange(6)[None]
    with pytest.raises(ValueError, match="needs token_index"):
        cp.context_parallel_attention(q, k, v, bam, None, None, None)
    with pytest.raises(ValueError, match="head_groups=3 must divide the 2 key/value heads"):
        cp.context_parallel_attention(q, k, v, bam, None, idx, None, head_groups=3)
    with pytest.raises(ValueError, match="bam has shape"):
        cp.context_parallel_attention(q, k, v, bam[:, :5], None, idx, None)
