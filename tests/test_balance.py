"""Batch balancing planner (lightning_mm.plan.balance): valid plans for every method, the seeds' worked example,
brute-force optima on small cases, and the error messages. Pure and single-process: runs in about a second."""

import itertools
import math

import pytest
import torch

from lightning_mm.plan.balance import (METHODS, BatchPlan, Deferral, bottleneck_matching, interval_order,
                                       pairwise_deferral, plan_batch, stratified_microbatches)
from lightning_mm.planner.heterogeneity import llava_like_works


def heterogeneous_batch(B: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return llava_like_works(B, seed)


def check_plan(plan: BatchPlan, enc, llm, R: int, K: int) -> None:
    """Every structural promise of a BatchPlan."""
    B = len(enc)
    n = B // R
    assert len(plan.assignment) == R and all(len(row) == K for row in plan.assignment)
    seen = [s for row in plan.assignment for mb in row for s in mb]
    assert sorted(seen) == list(range(B)), "every sample exactly once"
    assert all(sum(len(mb) for mb in row) == n for row in plan.assignment), "equal samples per replica"
    assert all(mb for row in plan.assignment for mb in row), "no empty microbatch"
    before = torch.tensor([[float(sum(llm[s] for s in mb)) for mb in row] for row in plan.assignment])
    moved = set()
    for d in plan.deferred:
        assert 0 <= d.replica < R and 0 <= d.source and d.target == d.source + 1 < K
        source = plan.assignment[d.replica][d.source]
        assert set(d.samples) <= set(source) and 0 < len(d.samples) < len(source), "a proper, non-empty subset"
        assert not moved & set(d.samples)
        moved |= set(d.samples)
        assert before[d.replica, d.source] > before[d.replica, d.target], "from overloaded to underloaded"
        shift = float(sum(llm[s] for s in d.samples))
        after = max(before[d.replica, d.source] - shift, before[d.replica, d.target] + shift)
        assert after < before[d.replica, d.source], "a deferral lowers the pair's max"
    sources = [(d.replica, d.source) for d in plan.deferred]
    assert not set(sources) & {(d.replica, d.target) for d in plan.deferred}, "pairs are disjoint"
    enc_loads, llm_loads = plan.encoder_loads(enc), plan.llm_loads(llm)
    assert enc_loads.shape == llm_loads.shape == (R, K)
    torch.testing.assert_close(enc_loads, before.new_tensor(
        [[float(sum(enc[s] for s in mb)) for mb in row] for row in plan.assignment]).to(enc_loads.dtype))
    for r in range(R):
        rows = plan.llm_rows(r)
        assert sorted(s for row in rows for s in row) == sorted(s for mb in plan.assignment[r] for s in mb)
        assert all(rows), "every microbatch keeps LLM work"
        torch.testing.assert_close(llm_loads[r], torch.tensor([float(sum(llm[s] for s in row)) for row in rows],
                                                              dtype=llm_loads.dtype))
    torch.testing.assert_close(llm_loads.sum(), llm.sum().to(llm_loads.dtype))


CASES = [(64, 2, 4), (96, 4, 6), (48, 3, 16), (40, 2, 5), (30, 3, 5), (128, 4, 8), (27, 1, 3)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("B,R,K", CASES)
def test_plans_are_valid(method, B, R, K):
    for seed in range(3):
        enc, llm = heterogeneous_batch(B, seed)
        for stages in (1, 2, 4):
            plan = plan_batch(enc, llm, R, K, method, num_stages=stages)
            check_plan(plan, enc, llm, R, K)
            assert plan == plan_batch(enc.clone(), llm.clone(), R, K, method, num_stages=stages), "deterministic"
            if method != "disttrain":
                break


@pytest.mark.parametrize("method", ("disttrain", "entrain"))
def test_uneven_microbatch_counts_and_dominant_sample(method):
    """n % K != 0 is fine for the balancers; one sample heavier than all others together (Entrain's K_eff = 1)
    still yields K non-empty microbatches, because the runtime's schedule has a fixed K."""
    enc, llm = heterogeneous_batch(46, 1)
    check_plan(plan_batch(enc, llm, 2, 7, method), enc, llm, 2, 7)
    enc = torch.ones(32, dtype=torch.float64)
    enc[5] = 1000.0
    llm = torch.arange(1, 33, dtype=torch.float64)
    plan = plan_batch(enc, llm, 1, 8, method)
    check_plan(plan, enc, llm, 1, 8)
    if method == "entrain":  # DistTrain keeps equal counts per microbatch
        assert [5] in plan.assignment[0], "the dominant sample is alone in its microbatch"


def test_text_only_samples_do_not_pile_up():
    """Samples without encoder work leave every encoder load unchanged, so they go to the least LLM-loaded
    microbatch instead of all to the least encoder-loaded one."""
    enc = torch.tensor([8.0, 7, 6, 5] + [0.0] * 12, dtype=torch.float64)
    llm = torch.ones(16, dtype=torch.float64)
    mbs = stratified_microbatches(list(range(16)), enc.tolist(), llm.tolist(), 4)
    assert sorted(len(mb) for mb in mbs) == [4, 4, 4, 4]


def test_none_is_the_contiguous_split():
    enc, llm = heterogeneous_batch(48, 0)
    plan = plan_batch(enc, llm, 3, 4)
    assert plan.assignment == [[list(range(r * 16 + m * 4, r * 16 + m * 4 + 4)) for m in range(4)] for r in range(3)]
    assert plan.deferred == ()
    torch.testing.assert_close(plan.llm_loads(llm), llm.view(3, 4, 4).sum(-1))
    enc, llm = heterogeneous_batch(10, 0)  # 5 samples a replica into 2 microbatches: only without ``equal``
    with pytest.raises(ValueError, match="equal microbatches"):
        plan_batch(enc, llm, 2, 2)
    assert plan_batch(enc, llm, 2, 2, equal=False).assignment == [[[0, 1], [2, 3, 4]], [[5, 6], [7, 8, 9]]]


def test_bottleneck_matching_worked_example():
    """Entrain Fig. 4.10b: rows MB3, MB4, MB6; columns MB1, MB2, MB5. The pair sums of the table give the loads
    MB1..MB6 = x, x+1, 11-x, 9-x, x+3, 12-x; x = 2 (S_ol = {MB6, MB3, MB4} as in Fig. 4.10a) makes
    L = [9, 7, 10]: all above 6, so every row must be matched. T* = 6 with the unique matching 3-2, 4-5, 6-1."""
    V = [[6, 6, 8], [6, 6, 6], [6, 7, 9]]
    T, match = bottleneck_matching(V, [9, 7, 10])
    assert T == 6 and match == {0: 1, 1: 2, 2: 0}


def brute_force_bottleneck(V, L):
    """min over injective row -> column maps of max_i min(L_i, V_i,sigma(i)) (a row may pair without deferring)."""
    cols = range(len(V[0]))
    return min(max(min(L[i], V[i][j]) for i, j in enumerate(perm)) for perm in itertools.permutations(cols, len(V)))


def test_bottleneck_matching_equals_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        rows = int(torch.randint(1, 5, (1,), generator=g))
        cols = rows + int(torch.randint(0, 2, (1,), generator=g))
        V = torch.randint(0, 10, (rows, cols), generator=g).tolist()  # small integers: many ties
        L = torch.randint(0, 12, (rows,), generator=g).tolist()
        T, match = bottleneck_matching(V, L)
        assert T == brute_force_bottleneck(V, L)
        assert len(set(match.values())) == len(match) == rows
        assert all(V[i][match[i]] <= T for i in range(rows) if L[i] > T)


def min_makespan(work: list[float], bins: int, caps: list[int] | None = None) -> float:
    """Exact min over assignments of the largest bin sum (branch and bound), optionally with per-bin counts."""
    work = sorted(work, reverse=True)
    best = [math.inf]
    loads, counts = [0.0] * bins, [0] * bins

    def go(i):
        if i == len(work):
            best[0] = min(best[0], max(loads))
            return
        tried = set()
        for b in range(bins):
            if (caps and counts[b] >= caps[b]) or (loads[b], counts[b]) in tried or loads[b] + work[i] >= best[0]:
                continue
            tried.add((loads[b], counts[b]))
            loads[b] += work[i]
            counts[b] += 1
            go(i + 1)
            loads[b] -= work[i]
            counts[b] -= 1

    go(0)
    return best[0]


def test_stratified_encoder_makespan_within_graham_bound():
    """E4 is list scheduling: the seeds go one per empty (hence least-loaded) microbatch, every later sample with
    encoder work to the least encoder-loaded one, and text-only samples change no encoder load. Graham's bound for
    any list order is therefore (2 - 1/K) x the optimum (the optimum allowing empty microbatches, a lower bound)."""
    for seed in range(40):
        B = 8 + seed % 3
        K = 2 + seed % 2
        enc, llm = heterogeneous_batch(B, seed)
        greedy = float(plan_batch(enc, llm, 1, K, "entrain").encoder_loads(enc).max())
        assert greedy <= (2 - 1 / K) * min_makespan(enc.tolist(), K) + 1e-6


def test_replica_llm_makespan_vs_optimum():
    """E3 balances LLM work but visits samples in encoder order, with a cap of n per replica: list scheduling with
    caps in an arbitrary order. Graham's 2 - 1/R does not carry over (a full replica may hold less than the
    makespan one; the instance below reaches ~R), so the only general bound is the trivial min(R, n):
    makespan <= total <= R * OPT, and makespan <= n * max sample <= n * OPT."""
    for seed in range(30):
        R, n = (2, 4) if seed % 3 == 0 else (3, 3) if seed % 3 == 1 else (2, 5)
        enc, llm = heterogeneous_batch(R * n, seed)
        greedy = float(plan_batch(enc, llm, R, 1, "entrain").llm_loads(llm).sum(1).max())
        assert greedy <= min(R, n) * min_makespan(llm.tolist(), R, [n] * R) + 1e-6
    # the heaviest-encoder sample takes replica 0 first, the light ones fill replica 1, the heavy rest lands on 0
    enc = torch.tensor([9.0, 8, 7, 6, 5, 4, 3, 2], dtype=torch.float64)
    llm = torch.tensor([1.0, 1e-3, 1e-3, 1e-3, 1e-3, 1, 1, 1], dtype=torch.float64)
    greedy = float(plan_batch(enc, llm, 2, 1, "entrain").llm_loads(llm).sum(1).max())
    assert greedy / min_makespan(llm.tolist(), 2, [4, 4]) > 2 - 1 / 2


def test_deferral_subset_close_to_best():
    """E5's quantised subset sum: the moved LLM work is within 2 n q of the best proper subset's distance to
    delta (each sample's rounding error is at most one quantum q), and a deferral needs a source of >= 2
    samples and a heavier source."""
    g = torch.Generator().manual_seed(1)
    for _ in range(30):
        heavy = (torch.rand(7, generator=g) * 100 + 1).tolist()
        light = (torch.rand(3, generator=g) * 40).tolist()
        llm = heavy + light
        mbs = [list(range(7)), list(range(7, 10))]
        order, moves = pairwise_deferral(mbs, llm)
        assert order == [0, 1]
        w0, w1 = sum(heavy), sum(light)
        delta = (w0 - w1) / 2
        best = min(abs(sum(c) - delta) for k in range(1, 7) for c in itertools.combinations(heavy, k))
        q = max(w0, w1) / 1000
        assert len(moves) == 1 and moves[0][0] == 0
        assert abs(sum(llm[s] for s in moves[0][1]) - delta) <= best + 2 * 7 * q
    assert pairwise_deferral([[0], [1]], [10.0, 1.0]) == ([0, 1], [])  # a single sample never moves
    assert pairwise_deferral([[0, 1], [2, 3]], [3.0, 2.0, 4.0, 1.0]) == ([0, 1], [])  # equal loads


def test_deferral_order_pairs_overloaded_first():
    """Pairs run ol0, ul0, ol1, ul1, ... (by descending overloaded load); for odd K the median runs last."""
    loads = [5.0, 1.0, 9.0, 3.0, 7.0]
    mbs = [[2 * m, 2 * m + 1] for m in range(5)]
    llm = [x / 2 for w in loads for x in (w, w)]
    order, moves = pairwise_deferral(mbs, llm)
    assert order[:2] == [2, 1] and order[-1] == 0 and sorted(order) == list(range(5))
    assert all(loads[order[p]] > loads[order[p + 1]] for p, _ in moves)


def test_interval_order_places_small_microbatches_at_the_ends():
    """DistTrain D2: the smallest microbatch first, the p - 1 smallest of the rest last, every microbatch once."""
    g = torch.Generator().manual_seed(3)
    for l, p in [(8, 2), (8, 4), (6, 4), (16, 3), (3, 5), (5, 1)]:
        sizes = torch.rand(l, generator=g).tolist()
        order = interval_order(sizes, p)
        assert sorted(order) == list(range(l))
        ranked = sorted(range(l), key=sizes.__getitem__)
        assert order[0] == ranked[0]
        if p > 1:
            tail = min(p - 1, l - 1)
            assert sorted(order[l - tail:]) == sorted(ranked[1:1 + tail])


def test_disttrain_equal_counts_and_balanced_replicas():
    enc, llm = heterogeneous_batch(256, 2)
    plan = plan_batch(enc, llm, 4, 6, "disttrain", num_stages=3)
    assert all(len(mb) in (10, 11) for row in plan.assignment for mb in row)
    none = plan_batch(enc, llm, 4, 8)
    assert plan.encoder_loads(enc).sum(1).max() < none.encoder_loads(enc).sum(1).max()


def test_entrain_balances_better_than_none():
    for seed in range(3):
        enc, llm = heterogeneous_batch(256, seed)
        none, entrain = plan_batch(enc, llm, 4, 16), plan_batch(enc, llm, 4, 16, "entrain")
        assert entrain.llm_loads(llm).max() < 0.8 * none.llm_loads(llm).max()
        assert entrain.encoder_loads(enc).std() < 0.5 * none.encoder_loads(enc).std()
        assert entrain.deferred, "the heterogeneous batch needs deferral"


def test_errors_name_the_problem_and_the_fix():
    enc, llm = heterogeneous_batch(30, 0)
    with pytest.raises(ValueError, match=r"30 samples cannot be split over 4 replicas.*multiple of 4"):
        plan_batch(enc, llm, 4, 2, "entrain")
    with pytest.raises(ValueError, match=r"gets 10 samples but there are 12 microbatches.*at most 10 microbatches"):
        plan_batch(enc, llm, 3, 12, "disttrain")
    with pytest.raises(ValueError, match=r"unknown balancing method 'lpt'.*'none', 'disttrain', 'entrain'"):
        plan_batch(enc, llm, 3, 2, "lpt")
    with pytest.raises(ValueError, match=r"'none' splits each replica's 10 samples into 4 equal.*'entrain'"):
        plan_batch(enc, llm, 3, 4)
    with pytest.raises(ValueError, match=r"encoder_work has 30 entries but llm_work has 29"):
        plan_batch(enc, llm[:29], 3, 2, "entrain")
    bad = llm.clone()
    bad[7] = -1.0
    with pytest.raises(ValueError, match=r"llm_work must be finite and >= 0.*sample 7"):
        plan_batch(enc, bad, 3, 2, "entrain")
    with pytest.raises(ValueError, match=r"must be 1-D"):
        plan_batch(enc.view(3, 10), llm, 3, 2, "entrain")
    with pytest.raises(ValueError, match=r"num_microbatches must be an int >= 1"):
        plan_batch(enc, llm, 3, 0)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['stages'\].*num_stages"):
        plan_batch(enc, llm, 3, 2, "disttrain", stages=2)
    with pytest.raises(ValueError, match=r"target must be 4"):
        Deferral(0, 3, 5, (1,))
