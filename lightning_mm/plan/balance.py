"""Batch balancing plans: which replica and microbatch each sample of a global batch goes to, and which samples'
LLM work is deferred to the next microbatch.

Pure: per-sample work in (1-D tensors over the global batch, from the cost model and the samples' metadata), a
``BatchPlan`` out; no process group, so every rank computes the same plan from the same batch without talking.
Samples only move within the global batch, so every step still sees the same samples (DistTrain §3, §6.1).

Methods:
- ``"none"``: today's contiguous split (replica r gets samples [r*n, (r+1)*n), microbatch m the m-th equal slice).
- ``"disttrain"``: DistTrain (seed 004, §6, Alg. 2-3): replicas by greedy to the least encoder-loaded replica,
  then microbatches reordered to fill the 1F1B intervals of the first pipeline stage. No deferral.
- ``"entrain"``: Entrain (seed 003 ch. 4, §4.3 and §4.5, Alg. 4): replicas balanced on LLM work, stratified
  microbatches balanced on encoder work, then pairwise deferral of LLM work from overloaded to underloaded
  microbatches, chosen by a bottleneck matching (Eq. 4.3).

Choices where the seed papers leave it open:
- Every microbatch is non-empty and there are always exactly K of them, because the runtime's schedule has a
  fixed number of microbatches. Entrain's K_eff = min(K, floor(sum w_enc / max w_enc)) is therefore not used to
  shrink K: when K_eff < K the heaviest sample simply fills its own microbatch, which any plan must accept, and
  the extra microbatches carry the rest.
- Sample order inside a microbatch is ascending global-batch index (deterministic; "none" keeps today's order).
- DistTrain D1 (fixes 7, 8): sort by encoder work descending (not ascending as printed: that only guarantees
  2 - 1/m), cap each replica at n = B/R samples (the LLM needs equal counts), m = the number of replicas,
  size = encoder work (we have no generator).
- DistTrain microbatches within a replica: equal counts (n/K, the first n % K microbatches one sample more),
  capped LPT on encoder work. In DistTrain's setting LLM sequences are fixed-length, so equal counts mean equal
  LLM work; the paper itself does not form microbatches, it only orders them.
- DistTrain D2 (fix 9): smallest microbatch first, the p - 1 smallest of the rest last (in descending order, so
  the very smallest drains the pipeline), the loop runs until the pool is empty. Intervals come from a 1F1B
  simulation of p equal stages where a microbatch's forward takes its encoder work and its backward twice that
  (end = max(previous op on the stage, upstream/downstream end) + t), advanced incrementally (O(p) amortised per
  microbatch). interval_1 = (p - 1)(f_1 + b_1), the contention-free round trip of the first microbatch (the
  other microbatches in flight are the ones being chosen). The p - 1 microbatches for interval_1 are the k-subset
  whose sum is closest (exhaustive when C(pool, p - 1) <= 4096, else greedy), placed in ascending size.
- Entrain E3: ties go to the lowest replica index. E3 orders samples by encoder work but balances LLM work, so
  it is list scheduling with caps in an arbitrary order: it has no constant bound better than R (see tests).
- Entrain E4: S_f = the floor(n/2) samples of lowest LLM work (a rank-based median split, robust to ties), but at
  least K so that every microbatch can be seeded with one S_f sample (the seeds' guarantee that each microbatch
  gets fine-grained units for deferral, which the plain greedy does not give). Seeds = the K S_f samples of
  largest encoder work, one per microbatch; then S_c, then the rest of S_f, each sorted by encoder work
  descending, to the least encoder-loaded microbatch. A sample without encoder work (text-only) changes no
  encoder load, so it goes to the least LLM-loaded microbatch instead (otherwise all text-only samples pile onto
  one microbatch and deferral, which halves a pair's gap, cannot repair it). This is still list scheduling, so
  Graham's 2 - 1/K bound on the encoder makespan holds.
- Entrain E5: S_ol = the K//2 microbatches of highest LLM load, S_ul = the K//2 lowest; for odd K the median is
  unpaired. Subset-sum quantum q = max microbatch LLM load / 1000; each sample counts max(1, round(w/q)) quanta,
  so the whole microbatch is the only subset summing to its total, which is excluded (a microbatch keeps at least
  one sample in its LLM part), as is the empty subset. Ties in |delta - k| go to the smaller k (less moved). A
  pair defers only if it lowers the pair's max (V_ij < L_i); otherwise V_ij = L_i.
- Bottleneck matching: binary search over the sorted values of V and L, Kuhn's augmenting paths for each check
  (K <= 64). Critical rows (L_i > T*) defer to their matched column; the other rows take the leftover columns
  in order (rows by descending load, columns by ascending load) without deferral, as in the paper.
- Execution order: pairs by descending overloaded load (ol0, ul0, ol1, ul1, ...), the unpaired median last; a
  deferral always goes from a microbatch to the one right after it (target == source + 1).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

import torch

METHODS = ("none", "disttrain", "entrain")
QUANTA = 1000  # subset-sum resolution: the heaviest microbatch's LLM load is this many quanta
EXHAUSTIVE_LIMIT = 4096  # DistTrain's first interval: exact k-subset search up to this many combinations


@dataclass(frozen=True)
class Deferral:
    """The LLM work of ``samples`` (taken from microbatch ``source`` of replica ``replica``) runs in ``target``."""

    replica: int
    source: int
    target: int
    samples: tuple[int, ...]

    def __post_init__(self):
        if self.target != self.source + 1:
            raise ValueError(f"a deferral runs in the microbatch right after its source: target must be "
                             f"{self.source + 1}, got {self.target}")
        if not self.samples:
            raise ValueError("a deferral must move at least one sample")


@dataclass(frozen=True)
class BatchPlan:
    """``assignment[r][m]``: the global-batch sample indices of replica r's m-th microbatch (execution order).
    Encoder work always runs in the assigned microbatch; LLM work too, except for the deferred samples."""

    assignment: list[list[list[int]]]
    deferred: tuple[Deferral, ...] = ()

    @property
    def num_replicas(self) -> int:
        return len(self.assignment)

    @property
    def num_microbatches(self) -> int:
        return len(self.assignment[0]) if self.assignment else 0

    def _loads(self, work, llm: bool) -> torch.Tensor:
        work = torch.as_tensor(work)
        if not work.is_floating_point():
            work = work.double()
        R, K = self.num_replicas, self.num_microbatches
        slot = [0] * work.numel()
        for r, row in enumerate(self.assignment):
            for m, samples in enumerate(row):
                for s in samples:
                    slot[s] = r * K + m
        if llm:
            for d in self.deferred:
                for s in d.samples:
                    slot[s] = d.replica * K + d.target
        loads = torch.zeros(R * K, dtype=work.dtype)
        return loads.index_add_(0, torch.tensor(slot, dtype=torch.long), work).view(R, K)

    def encoder_loads(self, encoder_work) -> torch.Tensor:
        """[R, K] summed encoder work per microbatch (deferral never moves encoder work)."""
        return self._loads(encoder_work, llm=False)

    def llm_loads(self, llm_work) -> torch.Tensor:
        """[R, K] summed LLM work per microbatch after deferral."""
        return self._loads(llm_work, llm=True)

    def llm_rows(self, r: int) -> list[list[int]]:
        """Replica r's LLM microbatches: each one's own non-deferred samples, then the samples deferred into it."""
        mine = [d for d in self.deferred if d.replica == r]
        moved = {s for d in mine for s in d.samples}
        rows = [[s for s in samples if s not in moved] for samples in self.assignment[r]]
        for d in sorted(mine, key=lambda d: d.source):
            rows[d.target].extend(d.samples)
        return rows


# ------------------------------------------------------------------------------------------------ entry point

def plan_batch(encoder_work: torch.Tensor, llm_work: torch.Tensor, num_replicas: int, num_microbatches: int,
               method: str = "none", **options) -> BatchPlan:
    """Plan one global batch: samples over ``num_replicas`` replicas x ``num_microbatches`` microbatches.

    ``encoder_work`` / ``llm_work``: 1-D, one non-negative cost per sample of the global batch, ordered replica by
    replica as the sampler gives it. Options: ``num_stages`` (pipeline depth p for DistTrain's ordering, default
    2; accepted and ignored by the other methods so callers can always pass it) and ``equal`` (method 'none':
    microbatches of equal sizes, the default, or contiguous ones differing by at most one sample)."""
    num_stages = options.pop("num_stages", 2)
    equal = options.pop("equal", True)
    if options:
        raise TypeError(f"plan_batch() got unknown option(s) {sorted(options)}: the options are num_stages "
                        f"(pipeline depth, used by method 'disttrain') and equal (method 'none')")
    if method not in METHODS:
        raise ValueError(f"unknown balancing method {method!r}: use one of {', '.join(map(repr, METHODS))}")
    for name, v in (("num_replicas", num_replicas), ("num_microbatches", num_microbatches),
                    ("num_stages", num_stages)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    enc, llm = _check_works(encoder_work, llm_work)
    B, R, K = len(enc), num_replicas, num_microbatches
    if B % R:
        raise ValueError(f"a global batch of {B} samples cannot be split over {R} replicas: give each replica the "
                         f"same number of samples: make the global batch size a multiple of {R}")
    n = B // R
    if n < K:
        raise ValueError(f"each replica gets {n} samples but there are {K} microbatches and every microbatch needs "
                         f"at least one sample: use at most {n} microbatches or a global batch of at least {R * K}")
    if method == "none":
        if n % K and equal:
            raise ValueError(f"method 'none' splits each replica's {n} samples into {K} equal microbatches: make "
                             f"the per-replica batch a multiple of {K}, or use 'disttrain' or 'entrain' (they allow "
                             f"microbatches of different sizes)")
        return BatchPlan([[list(range(r * n + m * n // K, r * n + (m + 1) * n // K)) for m in range(K)]
                          for r in range(R)])
    if method == "disttrain":
        return _disttrain(enc, R, K, num_stages)
    return _entrain(enc, llm, R, K)


def _check_works(encoder_work, llm_work) -> tuple[list[float], list[float]]:
    out = []
    for name, work in (("encoder_work", encoder_work), ("llm_work", llm_work)):
        t = torch.as_tensor(work).double()
        if t.ndim != 1:
            raise ValueError(f"{name} must be 1-D with one entry per sample of the global batch, got shape "
                             f"{tuple(t.shape)}")
        bad = ~torch.isfinite(t) | (t < 0)
        if bad.any():
            i = int(bad.nonzero()[0])
            raise ValueError(f"{name} must be finite and >= 0 (a cost per sample), got {t[i].item()} for sample "
                             f"{i}: fix the cost model or the sample's metadata")
        out.append(t.tolist())
    if len(out[0]) != len(out[1]):
        raise ValueError(f"encoder_work has {len(out[0])} entries but llm_work has {len(out[1])}: give both one "
                         f"entry per sample of the global batch")
    return out[0], out[1]


def _capped_greedy(order: list[int], weight: list[float], caps: list[int]) -> list[list[int]]:
    """Each item of ``order`` to the least-loaded bin that is not full (ties: lowest bin index)."""
    bins = [[] for _ in caps]
    heap = [(0.0, b) for b, c in enumerate(caps) if c > 0]
    heapq.heapify(heap)
    for i in order:
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        if len(bins[b]) < caps[b]:
            heapq.heappush(heap, (load + weight[i], b))
    return bins


# ------------------------------------------------------------------------------------------------ DistTrain

def _disttrain(enc, R, K, num_stages) -> BatchPlan:
    B = len(enc)
    n = B // R
    by_enc = sorted(range(B), key=lambda i: -enc[i])  # descending (fix 7), stable: ties keep batch order
    replicas = _capped_greedy(by_enc, enc, [n] * R)  # D1, capped at n (fix 8)
    assignment = []
    for samples in replicas:
        caps = [n // K + (m < n % K) for m in range(K)]
        mbs = [sorted(mb) for mb in _capped_greedy(sorted(samples, key=lambda i: -enc[i]), enc, caps)]
        sizes = [sum(enc[i] for i in mb) for mb in mbs]
        assignment.append([mbs[m] for m in interval_order(sizes, num_stages)])
    return BatchPlan(assignment)


def _stage_ops(l: int, p: int, s: int) -> list[tuple[str, int]]:
    """1F1B op order on stage s of p: min(p - s, l) warm-up forwards, then alternating B, F, then the last Bs."""
    warm = min(p - s, l)
    ops, f = [("F", k) for k in range(warm)], warm
    for b in range(l):
        ops.append(("B", b))
        if f < l:
            ops.append(("F", f))
            f += 1
    return ops


class _OneFOneB:
    """Incremental 1F1B simulation over p equal stages; runs every op whose microbatch time is known (F = t,
    B = 2t) and whose dependency is done, so the intervals of a growing prefix cost O(p) each, amortised."""

    def __init__(self, l: int, p: int):
        self.p, self.times = p, [None] * l
        self.ops = [_stage_ops(l, p, s) for s in range(p)]
        self.at, self.clock, self.end = [0] * p, [0.0] * p, {}

    def place(self, position: int, t: float) -> None:
        self.times[position] = t
        progress = True
        while progress:
            progress = False
            for s in range(self.p):
                while self.at[s] < len(self.ops[s]):
                    kind, k = self.ops[s][self.at[s]]
                    if self.times[k] is None:
                        break
                    dep = (kind, k, s - 1) if kind == "F" and s > 0 else (kind, k, s + 1) if kind == "B" and \
                        s < self.p - 1 else None
                    if dep is not None and dep not in self.end:
                        break
                    start = max(self.clock[s], self.end[dep] if dep else 0.0)
                    self.clock[s] = start + self.times[k] * (1 if kind == "F" else 2)
                    self.end[(kind, k, s)] = self.clock[s]
                    self.at[s] += 1
                    progress = True

    def interval(self, i: int) -> float:
        """Idle window at stage 0 between B_{i-1} and B_i (filled by F_{i+p-1}); needs positions <= i+p-2."""
        ready, anchor = self.end.get(("B", i, 1)), self.end.get(("B", i - 1, 0))
        return 0.0 if ready is None or anchor is None else max(0.0, ready - anchor)


def _closest_subset(pool: list[int], sizes: list[float], k: int, target: float) -> list[int]:
    """k members of ``pool`` whose summed size is closest to ``target`` (exact when small, else greedy)."""
    if k >= len(pool):
        return list(pool)
    if math.comb(len(pool), k) <= EXHAUSTIVE_LIMIT:
        return list(min(itertools.combinations(pool, k), key=lambda c: abs(sum(sizes[m] for m in c) - target)))
    chosen, left = [], list(pool)
    for slot in range(k, 0, -1):
        goal = (target - sum(sizes[m] for m in chosen)) / slot
        best = min(left, key=lambda m: abs(sizes[m] - goal))
        chosen.append(best)
        left.remove(best)
    return chosen


def interval_order(sizes: list[float], num_stages: int) -> list[int]:
    """DistTrain's inter-microbatch reordering (D-Alg.3): microbatch indices in execution order for a 1F1B
    pipeline of ``num_stages`` stages, filling each first-stage interval with the forward closest to it."""
    l, p = len(sizes), num_stages
    pool = sorted(range(l), key=lambda m: (sizes[m], m))
    if p == 1 or l <= 1:
        return pool  # no pipeline bubbles to fill
    order = [pool.pop(0)]
    rear, pool = pool[:p - 1][::-1], pool[p - 1:]
    sim = _OneFOneB(l, p)
    sim.place(0, sizes[order[0]])
    for pos, m in enumerate(rear):
        sim.place(l - len(rear) + pos, sizes[m])
    if pool:  # interval_1: the first microbatch's round trip through stages 2..p, filled by forwards 2..p
        first = _closest_subset(pool, sizes, p - 1, (p - 1) * 3 * sizes[order[0]])
        for m in sorted(first, key=lambda m: (sizes[m], m)):
            pool.remove(m)
            sim.place(len(order), sizes[m])
            order.append(m)
    while pool:  # interval_i is filled by forward i+p-1 (0-based), until the pool is empty (fix 9)
        gap = sim.interval(len(order) - p + 1)
        m = min(pool, key=lambda m: (abs(sizes[m] - gap), sizes[m], m))
        pool.remove(m)
        sim.place(len(order), sizes[m])
        order.append(m)
    return order + rear


# ------------------------------------------------------------------------------------------------ Entrain

def _entrain(enc, llm, R, K) -> BatchPlan:
    B = len(enc)
    n = B // R
    # E3: samples by encoder work descending, each to the replica with least LLM work among those under n
    replicas = _capped_greedy(sorted(range(B), key=lambda i: -enc[i]), llm, [n] * R)
    assignment, deferred = [], []
    for r, samples in enumerate(replicas):
        mbs = stratified_microbatches(sorted(samples), enc, llm, K)
        order, moves = pairwise_deferral(mbs, llm)
        assignment.append([mbs[m] for m in order])
        deferred += [Deferral(r, pos, pos + 1, subset) for pos, subset in moves]
    return BatchPlan(assignment, tuple(deferred))


def stratified_microbatches(samples: list[int], enc: list[float], llm: list[float], K: int) -> list[list[int]]:
    """E4: K non-empty microbatches balanced on encoder work, each seeded with one low-LLM-work (S_f) sample."""
    by_llm = sorted(samples, key=lambda i: llm[i])
    n_fine = max(K, len(samples) // 2)
    fine = sorted(by_llm[:n_fine], key=lambda i: -enc[i])
    coarse = sorted(by_llm[n_fine:], key=lambda i: -enc[i])
    mbs = [[i] for i in fine[:K]]
    llm_load = [llm[i] for i in fine[:K]]
    heap = [(enc[i], m) for m, i in enumerate(fine[:K])]
    heapq.heapify(heap)
    for i in coarse + fine[K:]:
        if enc[i] > 0:
            load, m = heapq.heappop(heap)
            heapq.heappush(heap, (load + enc[i], m))
        else:  # no encoder work: every microbatch is as good for the encoder, so take the least LLM-loaded one
            m = min(range(K), key=llm_load.__getitem__)
        mbs[m].append(i)
        llm_load[m] += llm[i]
    return [sorted(mb) for mb in mbs]


def _subset_sums(weights: list[int]) -> list[int]:
    """Reachable sums after each prefix of ``weights``, as Python-int bitsets (bit k set = sum k reachable)."""
    steps = [1]
    for w in weights:
        steps.append(steps[-1] | (steps[-1] << w))
    return steps


def _closest_sum(reach: int, x: float) -> int | None:
    """The set bit of ``reach`` nearest to x (ties: the lower one), or None when no bit is set."""
    if not reach:
        return None
    lo_cap = max(-1, math.floor(x))
    below = (reach & ((1 << (lo_cap + 1)) - 1)).bit_length() - 1 if lo_cap >= 0 else -1
    hi_from = max(0, math.ceil(x))
    above_bits = reach >> hi_from
    above = hi_from + (above_bits & -above_bits).bit_length() - 1 if above_bits else None
    if below < 0:
        return above
    if above is None or x - below <= above - x:
        return below
    return above


def _backtrack(steps: list[int], weights: list[int], total: int) -> list[int]:
    """Positions of one subset of ``weights`` summing to ``total`` (reachable in ``steps[-1]``)."""
    chosen = []
    for pos in range(len(weights) - 1, -1, -1):
        if not (steps[pos] >> total) & 1:
            chosen.append(pos)
            total -= weights[pos]
    return chosen[::-1]


def pairwise_deferral(mbs: list[list[int]], llm: list[float]) -> tuple[list[int], list[tuple[int, tuple]]]:
    """E5: the execution order of ``mbs`` (indices) and the deferrals as (source position, samples); the
    target is always the next position."""
    K = len(mbs)
    loads = [sum(llm[i] for i in mb) for mb in mbs]
    by_load = sorted(range(K), key=lambda m: -loads[m])
    half = K // 2
    ol, ul, median = by_load[:half], by_load[K - half:][::-1], by_load[half:K - half]
    quantum = max(loads) / QUANTA if loads else 0.0
    V = [[loads[i]] * len(ul) for i in ol]
    subsets = {}
    if quantum > 0:
        for a, i in enumerate(ol):
            if len(mbs[i]) < 2:
                continue
            weights = [max(1, round(llm[s] / quantum)) for s in mbs[i]]
            steps = _subset_sums(weights)
            total = sum(weights)
            inner = steps[-1] & ~1 & ~(1 << total)  # never nothing, never the whole microbatch
            for b, j in enumerate(ul):
                delta = (loads[i] - loads[j]) / 2
                k = _closest_sum(inner, delta / quantum) if delta > 0 else None
                if k is None:
                    continue
                subset = tuple(mbs[i][pos] for pos in _backtrack(steps, weights, k))
                moved = sum(llm[s] for s in subset)
                v = max(loads[i] - moved, loads[j] + moved)
                if v < loads[i]:
                    V[a][b], subsets[a, b] = v, subset
    L = [loads[i] for i in ol]
    T, match = bottleneck_matching(V, L)
    order, moves = [], []
    for a, i in enumerate(ol):
        b = match[a]
        if L[a] > T:
            moves.append((len(order), subsets[a, b]))
        order += [i, ul[b]]
    return order + median, moves


def bottleneck_matching(V: list[list[float]], L: list[float]) -> tuple[float, dict[int, int]]:
    """Entrain's BOTTLENECKMATCH: the least T in V u L such that every row i with L[i] > T is matched to its own
    column j with V[i][j] <= T. Returns T and a row -> column pairing: critical rows get their matched column,
    the other rows (by descending L) the leftover columns in column order, while any are left."""
    rows, cols = len(V), len(V[0]) if V else 0
    if rows == 0:
        return 0.0, {}

    def match_at(T):
        owner = {}  # column -> row

        def augment(i, seen):
            for j in range(cols):
                if V[i][j] <= T and j not in seen:
                    seen.add(j)
                    if j not in owner or augment(owner[j], seen):
                        owner[j] = i
                        return True
            return False

        for i in range(rows):
            if L[i] > T and not augment(i, set()):
                return None
        return {i: j for j, i in owner.items()}

    values = sorted(set(L).union(*V))
    lo, hi = 0, len(values) - 1  # values[hi] >= max(L): no critical row, always feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if match_at(values[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    T = values[lo]
    match = match_at(T)
    free = [j for j in range(cols) if j not in match.values()]
    for i in sorted((i for i in range(rows) if i not in match), key=lambda i: (-L[i], i)):
        if free:
            match[i] = free.pop(0)
    return T, match
