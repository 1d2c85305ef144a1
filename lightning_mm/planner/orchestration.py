"""Per-module data parallelism: DistTrain's disaggregated model orchestration (004 §5: Eq. 1-2, Algorithm 1).

Every module (each encoder, the LLM) gets its own (dp, tp, pp). For each outer choice of Algorithm 1 (the LLM's tp,
its dp among the divisors of the global microbatch count, every encoder's tp) the device split is Eq. 2's inner
problem

    min max_i a_i / x_i   s.t.  sum_i x_i <= N,  l_i <= x_i <= u_i        (l_i: the fewest devices memory allows)

whose continuous optimum is water-filling, x_i = clip(a_i / t, l_i, u_i) (``water_fill``, no solver). It is made
integral exactly on the real step functions (``integer_min_max``: LLM stage bottlenecks of the frozen-aware
partition, an encoder replica's ceil(|G_m| / dp_e) samples), ranked by Eq. 1 + Eq. 2 (``eq12_time``), and the best
few are replayed in the discrete-event simulator (``evaluate_plan`` with per-module dp). Outer choices are solved
from the lowest lower bound up and skipped once their bound exceeds the estimates already found
(``_Problem.lower_bound``), which leaves the replayed layouts unchanged. Pure: no process group.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from lightning_mm.plan.placement import LANGUAGE_MODEL
from lightning_mm.planner.search import SHARDING_TRAFFIC, ModuleSpec, Plan, _check_modules, _encoders, \
    allreduce_seconds, encoder_samples, evaluate_plan, state_bytes_per_device

_TOL = 1e-12  # relative slack when packing layers under a bottleneck computed from prefix sums


# ------------------------------------------------------------------------------------------------ the inner problem
def water_fill(work: Sequence[float], lower: Sequence[float], budget: float,
               upper: Sequence[float] | None = None) -> tuple[float, list[float]]:
    """Continuous min max_i work_i / x_i s.t. sum x_i <= budget, lower_i <= x_i <= upper_i (lower_i > 0).

    Closed form: x_i = clip(work_i / t, lower_i, upper_i) at the smallest level t whose allocation fits the budget
    (t >= work_i / upper_i for every i); t is the optimum. sum_i clip(work_i / t, .) is piecewise A / t + C between
    the breakpoints work_i / upper_i and work_i / lower_i, so t = A / (budget - C) on the right piece. Returns
    (t, x)."""
    n = len(work)
    upper = [math.inf] * n if upper is None else [float(u) for u in upper]
    if len(lower) != n or len(upper) != n:
        raise ValueError(f"work, lower and upper need one entry per module, got {n}, {len(lower)}, {len(upper)}")
    if any(a < 0 for a in work) or any(not 0 < lo <= hi for lo, hi in zip(lower, upper)):
        raise ValueError(f"need work >= 0 and 0 < lower <= upper, got work={list(work)}, lower={list(lower)}, "
                         f"upper={upper}")
    if sum(lower) > budget:
        raise ValueError(f"the modules need at least {sum(lower):g} devices (memory), more than the {budget:g} given")

    def allocation(t):
        return [min(hi, max(lo, a / t)) if t > 0 else hi for a, lo, hi in zip(work, lower, upper)]

    floor = max((a / hi for a, hi in zip(work, upper) if hi < math.inf), default=0.0)
    if max(work, default=0.0) == 0.0:
        return 0.0, [float(lo) for lo in lower]
    if floor > 0 and sum(allocation(floor)) <= budget:
        return floor, allocation(floor)
    points = sorted({p for a, lo, hi in zip(work, lower, upper) for p in (a / lo, a / hi) if p > floor})
    lo_t = floor
    for hi_t in points:
        if sum(allocation(hi_t)) <= budget:
            break
        lo_t = hi_t
    mid, clipped, free = (lo_t + hi_t) / 2, 0.0, 0.0  # on this piece each module is pinned or at a / t
    for a, lo, hi in zip(work, lower, upper):
        if a / mid < lo or a / mid > hi:
            clipped += lo if a / mid < lo else hi
        else:
            free += a
    t = min(hi_t, max(lo_t, free / (budget - clipped))) if free > 0 and budget > clipped else hi_t
    return t, allocation(t)


@dataclass(frozen=True)
class Unit:
    """One module of the integer inner problem: with n units of ``weight`` devices (lower <= n <= upper) its
    slowest stage takes ``time(n)`` per microbatch, non-increasing in n."""

    time: Callable[[int], float]
    weight: int
    lower: int
    upper: int


def _fewest(unit: Unit, level: float) -> int:
    """The fewest units whose time is <= level (binary search; level >= time(upper))."""
    lo, hi = unit.lower, unit.upper
    while lo < hi:
        mid = (lo + hi) // 2
        if unit.time(mid) <= level:
            hi = mid
        else:
            lo = mid + 1
    return lo


def integer_min_max(units: Sequence[Unit], budget: int, start: float = 0.0) -> tuple[float, list[int]] | None:
    """Exact integer min max_i time_i(n_i) s.t. sum_i weight_i n_i <= budget: raise the level from ``start`` (a lower
    bound, e.g. ``water_fill``'s t) through the breakpoints time_i(n_i - 1) until the fewest units meeting it fit.
    Returns (the optimum, units per module), or None when even the lower bounds do not fit."""
    if sum(u.weight * u.lower for u in units) > budget:
        return None
    level = max([start] + [u.time(u.upper) for u in units])
    while True:
        counts = [_fewest(u, level) for u in units]
        if sum(u.weight * n for u, n in zip(units, counts)) <= budget:
            return max((u.time(n) for u, n in zip(units, counts)), default=0.0), counts
        level = min(u.time(n - 1) for u, n in zip(units, counts) if n > u.lower)


# ------------------------------------------------------------------------------------------------- module cost tables
class _Chain:
    """One module's per-layer cost (F + B per microbatch at one tp) and its exact stage bottlenecks."""

    def __init__(self, weights: Sequence[float]):
        self.weights = [float(w) for w in weights]
        self.total = sum(self.weights)
        self.prefix = np.concatenate([[0.0], np.cumsum(self.weights)])
        self._candidates: list[float] | None = None
        self._bottleneck: dict[int, float] = {}

    def stages_under(self, level: float) -> int:
        """Fewest contiguous stages each at most ``level`` (greedy packing is exact)."""
        count, load, cap = 1, 0.0, level * (1 + _TOL)
        for w in self.weights:
            if w > cap:
                return len(self.weights) + 1
            if load + w > cap and load > 0:
                count, load = count + 1, 0.0
            load += w
        return count

    def bottleneck(self, stages: int) -> float:
        """The least possible slowest stage over ``stages`` contiguous stages (= ``partition``'s optimum): the
        smallest contiguous-sum value that greedy packing fits into that many stages. It lies between
        max(heaviest layer, total / stages) and total / stages + the heaviest layer (greedy packing at that cap closes
        each stage above total / stages), so only the contiguous sums in between are tried."""
        if stages not in self._bottleneck:
            if self._candidates is None:
                p = self.prefix
                sums = (p[None, :] - p[:, None])[np.triu_indices(len(p), 1)]
                self._candidates = np.unique(sums[sums >= max(self.weights) * (1 - _TOL)]).tolist()
            c, heaviest, average = self._candidates, max(self.weights), self.total / stages
            lo = bisect.bisect_left(c, max(heaviest, average) * (1 - 1e-9))
            hi = min(len(c) - 1, bisect.bisect_left(c, (average + heaviest) * (1 + 1e-9)))
            while lo < hi:
                mid = (lo + hi) // 2
                if self.stages_under(c[mid]) <= stages:
                    hi = mid
                else:
                    lo = mid + 1
            self._bottleneck[stages] = c[lo]
        return self._bottleneck[stages]

    def sizes(self, stages: int) -> list[int]:
        """Layers per stage of an optimal split, packed from the last stage (early stages, which hold the most
        in-flight microbatches, get the fewest layers), single layers split off the front to reach ``stages``."""
        cap, sizes, load = self.bottleneck(stages) * (1 + _TOL), [0], 0.0
        for w in reversed(self.weights):
            if load + w > cap and sizes[-1] > 0:
                sizes.append(0)
                load = 0.0
            sizes[-1] += 1
            load += w
        sizes.reverse()
        while len(sizes) < stages:
            i = next(i for i, n in enumerate(sizes) if n > 1)
            sizes[i:i + 1] = [1, sizes[i] - 1]
        return sizes


@dataclass
class _Module:
    spec: ModuleSpec
    chains: dict[int, _Chain] = field(default_factory=dict)

    @property
    def layers(self) -> int:
        return len(self.spec.costs)

    def chain(self, tp: int, tp_bandwidth: float) -> _Chain:
        """Per-layer F + B at ``tp`` with its tensor-parallel all-reduces (two in forward, two in backward)."""
        if tp not in self.chains:
            tb = self.spec.per_layer(self.spec.tp_bytes)
            self.chains[tp] = _Chain([c.total / tp + 2 * allreduce_seconds(b, tp, tp_bandwidth) * (1 + (c.backward > 0))
                                      for c, b in zip(self.spec.costs, tb)])
        return self.chains[tp]

    def __post_init__(self):
        self._stage_cache: dict[tuple[int, int], list[tuple[float, float, bool]]] = {}
        self._memory_cache: dict[tuple, float] = {}
        s = self.spec
        kept = sum(a for a, c in zip(s.per_layer(s.activation_bytes), s.costs) if c.in_backward)
        self.totals = (sum(s.per_layer(s.param_bytes)), kept, sum(s.per_layer(s.grad_bytes)),
                       any(c.trainable for c in s.costs))
        """(model-state bytes, activation bytes kept per microbatch, gradient bytes, holds a trainable parameter)"""

    def memory(self, tp: int, pp: int, dp: int, inflight: int, samples: float, sharding: str) -> float:
        """Bytes per device of an average stage (DistTrain's memory model: state / (pp tp), ZeRO over dp, the first
        stage's ``inflight`` microbatches of 1/pp of the activations, scaled by the samples per microbatch)."""
        state, kept, _, trainable = self.totals
        return state_bytes_per_device(state / pp, trainable, dp, tp, sharding) + kept / pp * inflight * samples

    def stage_memory(self, chain: _Chain, tp: int, pp: int, dp: int, depth: int, k: int, samples: float,
                     sharding: str) -> float:
        """Bytes per device of the fullest stage of ``chain.sizes(pp)``: stage i holds min(pp - i + depth, k)
        in-flight microbatches (``depth``: stages after the module), as ``evaluate_plan`` counts them."""
        key = (id(chain), tp, pp, dp, depth, k, samples, sharding)
        if key not in self._memory_cache:
            self._memory_cache[key] = max(
                state_bytes_per_device(state, trainable, dp, tp, sharding) + kept * samples * min(pp - i + depth, k)
                for i, (state, kept, trainable) in enumerate(self._stages(chain, pp)))
        return self._memory_cache[key]

    def _stages(self, chain: _Chain, pp: int) -> list[tuple[float, float, bool]]:
        """(state bytes, kept activation bytes, trainable) of each stage of ``chain.sizes(pp)``."""
        key = (id(chain), pp)
        if key not in self._stage_cache:
            s, start, out = self.spec, 0, []
            params, acts = s.per_layer(s.param_bytes), s.per_layer(s.activation_bytes)
            for n in chain.sizes(pp):
                costs = s.costs[start:start + n]
                out.append((sum(params[start:start + n]),
                            sum(a for a, c in zip(acts[start:start + n], costs) if c.in_backward),
                            any(c.trainable for c in costs)))
                start += n
            self._stage_cache[key] = out
        return self._stage_cache[key]


# ------------------------------------------------------------------------------------------------------ the estimate
@dataclass(frozen=True)
class Orchestration:
    """One per-module layout: dp, tp and pp of every module, its devices and its Eq. 1 + Eq. 2 estimate."""

    dp: dict[str, int]
    tp: dict[str, int]
    pp: dict[str, int]
    devices: int
    estimate: float


def eq12_time(warm: float, steady: float, microbatches: int, sync: float = 0.0, p2p: float = 0.0) -> float:
    """T_iter = T_warm + T_steady (Eq. 1 + Eq. 2) + the gradient sync: ``warm`` is one microbatch's F + B along the
    path (C_lm + (DP_lm / DP_me) C_me), ``steady`` the slowest stage, run ``microbatches`` - 1 more times."""
    return warm + steady * (microbatches - 1) + sync + p2p


@dataclass(frozen=True)
class OrchestrationResult:
    """``best``: the replayed plan with the least simulated time; ``candidates``: the integer optimum of every outer
    choice solved (not skipped by its bound), by estimate; ``replayed``: the plans simulated; times of the search and
    of the replay (seconds); ``subproblems``: the outer choices solved."""

    best: Plan
    estimate: float
    candidates: list[Orchestration]
    replayed: list[Plan]
    solve_seconds: float
    replay_seconds: float
    subproblems: int


class _Problem:
    def __init__(self, modules, num_devices, num_microbatches, samples, tp_degrees, memory_limit,
                 allreduce_bandwidth, tp_bandwidth, sharding, p2p_latency):
        self.specs, self.modules = modules, {m: _Module(s) for m, s in modules.items()}
        self.encoders = _encoders(modules)
        self.n, self.m, self.b = num_devices, num_microbatches, samples
        self.tps, self.limit, self.ar_bw, self.tp_bw = tp_degrees, memory_limit, allreduce_bandwidth, tp_bandwidth
        self.sharding, self.p2p = sharding, p2p_latency

    @functools.lru_cache(maxsize=None)
    def fewest_stages(self, module: str, tp: int, dp: int, samples: float, extra_depth: int, k: int) -> int | None:
        """The fewest stages whose fullest stage fits memory (None: none does), from the first whose average stage
        fits (``_Module.memory``, a bound that skips the hopeless counts)."""
        mod = self.modules[module]
        chain = mod.chain(tp, self.tp_bw)
        for pp in range(1, mod.layers + 1):
            if mod.memory(tp, pp, dp, min(pp + extra_depth, k), samples, self.sharding) <= self.limit and (
                    mod.stage_memory(chain, tp, pp, dp, extra_depth, k, samples, self.sharding) <= self.limit):
                return pp
        return None

    def estimate(self, dp, tp, pp) -> float:
        lm, k = self.modules[LANGUAGE_MODEL], self.m // dp[LANGUAGE_MODEL]
        chain = lm.chain(tp[LANGUAGE_MODEL], self.tp_bw)
        warm_enc, steady = 0.0, chain.bottleneck(pp[LANGUAGE_MODEL])
        for e in self.encoders:
            share = encoder_samples(dp[LANGUAGE_MODEL], dp[e], self.b) / self.b
            c = self.modules[e].chain(tp[e], self.tp_bw)
            warm_enc = max(warm_enc, share * c.total)
            steady = max(steady, share * c.bottleneck(pp[e]))
        sync = max(SHARDING_TRAFFIC[self.sharding] * allreduce_seconds(
            self.modules[m].totals[2] / (pp[m] * tp[m]), dp[m], self.ar_bw) for m in self.modules)
        depth = pp[LANGUAGE_MODEL] + max((pp[e] for e in self.encoders), default=0)
        return eq12_time(chain.total + warm_enc, steady, k, sync, 2 * self.p2p * depth)

    def too_full(self, dp, tp, pp) -> list[str]:
        """The modules whose fullest stage exceeds the memory limit."""
        if self.limit == math.inf:
            return []
        lm_dp, k, out = dp[LANGUAGE_MODEL], self.m // dp[LANGUAGE_MODEL], []
        for m, mod in self.modules.items():
            depth = 0 if m == LANGUAGE_MODEL else pp[LANGUAGE_MODEL]
            share = 1.0 if m == LANGUAGE_MODEL else encoder_samples(lm_dp, dp[m], self.b) / self.b
            chain = mod.chain(tp[m], self.tp_bw)
            if mod.stage_memory(chain, tp[m], pp[m], dp[m], depth, k, share, self.sharding) > self.limit:
                out.append(m)
        return out

    def solve(self, lm_tp: int, lm_dp: int, enc_tp: dict[str, int]) -> Orchestration | None:
        """The integer optimum of one outer choice (Eq. 2's min max), encoder stages added where an encoder is the
        bottleneck with every replica it can use or does not fit memory, spare devices spent on Eq. 1's warm-up."""
        k, group = self.m // lm_dp, lm_dp * self.b
        lm, self.strained = self.modules[LANGUAGE_MODEL], set(self.encoders)  # strained unless solved below
        lm_pp = self.fewest_stages(LANGUAGE_MODEL, lm_tp, lm_dp, 1.0, 0, k)
        if lm_pp is None:
            return None
        enc_pp = {}
        for e in self.encoders:
            enc_pp[e] = self.fewest_stages(e, enc_tp[e], group, 1.0 / self.b, 1, k)
            if enc_pp[e] is None:
                return None
        lm_chain = lm.chain(lm_tp, self.tp_bw)
        best, strained = None, set()
        for _ in range(sum(mod.layers for mod in self.modules.values()) + 1):
            units = [Unit(lm_chain.bottleneck, lm_dp * lm_tp, lm_pp, lm.layers)]
            work = [lm_dp * lm_tp * lm_chain.total]  # time_i(n) >= work_i / (weight_i n): water_fill's t is a bound
            for e in self.encoders:
                c, p = self.modules[e].chain(enc_tp[e], self.tp_bw), enc_pp[e]
                units.append(Unit(lambda n, c=c, p=p: encoder_samples(lm_dp, n, self.b) / self.b * c.bottleneck(p),
                                  enc_tp[e] * p, 1, group))
                work.append(enc_tp[e] * p * group / self.b * c.bottleneck(p))
            if sum(u.weight * u.lower for u in units) > self.n:
                break
            start = water_fill(work, [u.weight * u.lower for u in units], self.n,
                               [u.weight * u.upper for u in units])[0]
            found = integer_min_max(units, self.n, start)
            if found is None:
                break
            level, counts = found
            dp = {LANGUAGE_MODEL: lm_dp, **dict(zip(self.encoders, counts[1:]))}
            tp = {LANGUAGE_MODEL: lm_tp, **enc_tp}
            pp = {LANGUAGE_MODEL: counts[0], **enc_pp}
            estimate = self._spend_spare(dp, tp, pp)
            full = self.too_full(dp, tp, pp)
            if not full:
                plan = Orchestration(dp, tp, pp, self.devices(dp, tp, pp), estimate)
                if best is None or (plan.estimate, plan.devices) < (best.estimate, best.devices):
                    best = plan
            times = [u.time(n) for u, n in zip(units, counts)]
            strained |= {e for e, u, n in zip(self.encoders, units[1:], counts[1:]) if n == u.upper}
            grow = {}  # encoders to deepen: to the stage count that brings them under the others' slowest stage
            for i, e in enumerate(self.encoders, 1):
                mod = self.modules[e]
                capped = counts[i] == units[i].upper and times[i] >= level
                if enc_pp[e] < mod.layers and (capped or e in full):
                    others = max(times[:i] + times[i + 1:])
                    target = mod.chain(enc_tp[e], self.tp_bw).stages_under(others * self.b) if capped else 0
                    if e in full:
                        share = encoder_samples(lm_dp, counts[i], self.b) / self.b
                        target = max(target, self.fewest_stages(e, enc_tp[e], counts[i], share, counts[0], k) or 0)
                    grow[e] = min(mod.layers, max(enc_pp[e] + 1, target))
            if LANGUAGE_MODEL in full and counts[0] < lm.layers:
                lm_pp = counts[0] + 1
            elif not grow:
                break
            enc_pp.update(grow)
            strained |= set(grow)
        if best is not None:
            self.strained = strained
        return best

    def devices(self, dp, tp, pp) -> int:
        return sum(dp[m] * tp[m] * pp[m] for m in self.modules)

    def lower_bound(self, lm_tp: int, lm_dp: int, enc_tp: dict[str, int]) -> float:
        """A bound no layout of this outer choice beats on ``estimate``: the LLM's slowest stage at the most stages
        its devices allow, each encoder's slowest layer on one sample, and the total work over all devices
        (n units at p stages of a module hold n p tp devices for a slowest stage >= its work / (n p)) for Eq. 2,
        one pass of the LLM and of the slowest encoder for Eq. 1, the LLM's sync at its most stages."""
        lm = self.modules[LANGUAGE_MODEL]
        chain, k = lm.chain(lm_tp, self.tp_bw), self.m // lm_dp
        stages = min(lm.layers, (self.n - sum(enc_tp.values())) // (lm_dp * lm_tp))
        if stages < 1:
            return math.inf
        chains = {e: self.modules[e].chain(enc_tp[e], self.tp_bw) for e in self.encoders}
        work = lm_dp * (lm_tp * chain.total + sum(enc_tp[e] * c.total for e, c in chains.items()))
        steady = max([chain.bottleneck(stages), work / self.n] + [max(c.weights) / self.b for c in chains.values()])
        warm = chain.total + max((c.total / self.b for c in chains.values()), default=0.0)
        sync = SHARDING_TRAFFIC[self.sharding] * allreduce_seconds(lm.totals[2] / (stages * lm_tp), lm_dp, self.ar_bw)
        return eq12_time(warm, steady, k, sync, 2 * self.p2p * (1 + bool(self.encoders)))

    def _spend_spare(self, dp, tp, pp) -> float:
        """Spare devices buy replicas of the encoder with the longest warm-up (Eq. 1: fewer samples per replica per
        m) while that lowers the estimate; returns the estimate."""
        group, current = dp[LANGUAGE_MODEL] * self.b, self.estimate(dp, tp, pp)
        while self.encoders:
            e = max(self.encoders, key=lambda e: encoder_samples(dp[LANGUAGE_MODEL], dp[e], self.b)
                    * self.modules[e].chain(tp[e], self.tp_bw).total)
            per = encoder_samples(dp[LANGUAGE_MODEL], dp[e], self.b)
            more = -(-group // (per - 1)) if per > 1 else 0  # the fewest replicas with one sample less each
            if not more or (more - dp[e]) * tp[e] * pp[e] > self.n - self.devices(dp, tp, pp):
                break
            better = self.estimate({**dp, e: more}, tp, pp)
            if better >= current:
                break
            dp[e], current = more, better
        return current


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_per_module_dp(
    modules: dict[str, ModuleSpec],
    num_devices: int,
    num_microbatches: int,
    *,
    samples_per_microbatch: int = 1,
    tp_degrees: Sequence[int] = (1, 2, 4, 8),
    memory_limit: float = math.inf,
    allreduce_bandwidth: float = math.inf,
    tp_bandwidth: float = math.inf,
    sharding: str = "NO_SHARD",
    p2p_latency: float = 0.0,
    placement: str = "parallel",
    replay: int = 1,
) -> OrchestrationResult:
    """Each module's (dp, tp, pp) on at most ``num_devices`` devices for a global batch of ``num_microbatches``
    microbatches of ``samples_per_microbatch`` samples (DistTrain Algorithm 1 with the closed-form inner problem).

    Outer loop: the LLM's tp and its dp (a divisor of ``num_microbatches``, so that every replica runs the same
    count), each encoder's tp, all from ``tp_degrees``. Inner: the LLM's stage count and each encoder's replicas
    (at the fewest stages its memory allows, more where it stays the bottleneck) minimising the slowest stage
    (Eq. 2), exactly on the frozen-aware costs, then spare devices for Eq. 1. Candidates are ranked by
    Eq. 1 + Eq. 2 + gradient sync; the ``replay`` best that fit ``memory_limit`` (bytes per device) are simulated
    (``evaluate_plan``; each module split into its stages at the least slowest stage, packed from the last stage so
    that early stages, which hold the most in-flight microbatches, get the fewest layers) and the fastest is
    ``best``. Outer choices run from the lowest lower bound up; one whose bound exceeds the ``replay``-th best estimate
    found is skipped (and solved after all if too few replayed candidates fit), so the result is that of solving
    every choice. Encoders run on their own devices (``placement`` must be "parallel": the runtime refuses unequal
    dps otherwise)."""
    _check_modules(modules)
    _check_request(placement, sharding, (("num_devices", num_devices), ("num_microbatches", num_microbatches),
                                         ("samples_per_microbatch", samples_per_microbatch), ("replay", replay)))
    tps = sorted(set(tp_degrees))
    if not tps or any(not isinstance(t, int) or t < 1 for t in tps):
        raise ValueError(f"tp_degrees must be ints >= 1, got {tuple(tp_degrees)!r}")
    started = time.perf_counter()
    problem = _Problem(modules, num_devices, num_microbatches, samples_per_microbatch, tps, memory_limit,
                       allreduce_bandwidth, tp_bandwidth, sharding, p2p_latency)
    outer = _OuterSearch(problem, replay)
    outer.solve_by_bound()
    candidates, solved = outer.ranked(), time.perf_counter()
    if not candidates:
        raise ValueError(f"no per-module layout of these modules fits {num_devices} devices with "
                         f"memory_limit={memory_limit:.3g} bytes (tp in {tps}); add devices, allow larger tp, or "
                         "recompute activations")
    replayed = outer.replayed(candidates, min((p[0] for p in outer.pruned), default=math.inf))
    if replayed is None or (len(replayed) < replay and outer.pruned):  # a pruned choice may rank first: solve them all
        outer.solve_pruned()
        candidates = outer.ranked()
        replayed = outer.replayed(candidates, math.inf)
    if not replayed:
        raise ValueError(f"none of the {len(candidates)} per-module layouts fits {memory_limit:.3g} bytes per device "
                         "once simulated; add devices or recompute activations")
    best = min(replayed, key=lambda p: (p.iteration_time, p.devices))
    estimate = next(c.estimate for c in candidates if dict(c.dp) == best.module_dp and dict(c.tp) == best.module_tp
                    and c.pp == best.pp())
    return OrchestrationResult(best, estimate, candidates, replayed, solved - started,
                               time.perf_counter() - solved, outer.subproblems)


def _check_request(placement: str, sharding: str, counts: Sequence[tuple[str, object]]) -> None:
    """Raise (with the fix) for a placement other than parallel, an unknown sharding or a count below 1."""
    if placement != "parallel":
        raise ValueError(f"per-module data parallelism needs encoder_placement='parallel' (got {placement!r}): "
                         "colocated encoders share stages and replicated ones run inside the LLM's first stage, so "
                         "neither can have its own dp; use encoder_placement='parallel' or the uniform search")
    if sharding not in SHARDING_TRAFFIC:
        raise ValueError(f"unknown sharding {sharding!r}; use one of {tuple(SHARDING_TRAFFIC)}")
    for name, value in counts:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


class _OuterSearch:
    """Algorithm 1's outer loop on one ``_Problem``: its outer choices (the LLM's tp and dp, every encoder's tp)
    solved from the lowest lower bound up, each skipped (kept in ``pruned``: bound, order, choice) while its bound
    exceeds the ``replay``-th best estimate found, so that the layouts replayed are those of solving every choice.
    ``found``: (order in the full enumeration, candidate); ``subproblems``: the choices solved."""

    def __init__(self, problem: _Problem, replay: int):
        self.problem, self.replay = problem, replay
        self.base = dict.fromkeys(problem.encoders, problem.tps[0])  # every encoder at the smallest tp
        self.found: list[tuple[tuple, Orchestration]] = []
        self.pruned: list[tuple[float, tuple, int, int, dict[str, int]]] = []
        self.subproblems = 0

    def threshold(self) -> float:
        """The replay-th best estimate so far: a choice whose bound exceeds it cannot be replayed."""
        if len(self.found) < self.replay:
            return math.inf
        return sorted(c.estimate for _, c in self.found)[self.replay - 1] * (1 + 1e-9) + 1e-300

    def solve(self, order: tuple, lm_tp: int, lm_dp: int, enc_tp: dict[str, int]) -> None:
        self.subproblems += 1
        found = self.problem.solve(lm_tp, lm_dp, enc_tp)
        if found is not None:
            self.found.append((order, found))

    def solve_choice(self, i: int, lm_tp: int, lm_dp: int, prune: bool) -> None:
        """Outer choice ``i`` at the smallest encoder tp, then at every larger tp of the encoders strained there
        (each skipped, with ``prune``, where its bound exceeds the threshold). An encoder's larger tp only pays where
        it is strained at the smallest (no fit, its replicas capped at the samples of a microbatch position, or more
        stages for memory): otherwise tp x C(tp) >= C(smallest tp) makes the same devices as replicas at least as
        fast for Eq. 2 and Eq. 1."""
        problem, tps = self.problem, self.problem.tps
        self.solve((i, 0), lm_tp, lm_dp, self.base)
        strained = [e for e in problem.encoders if e in problem.strained]
        for j, combo in enumerate(itertools.product(tps, repeat=len(strained))):
            if any(t != tps[0] for t in combo):
                enc_tp = {**self.base, **dict(zip(strained, combo))}
                bound = problem.lower_bound(lm_tp, lm_dp, enc_tp) if prune else -math.inf
                if bound > self.threshold():
                    self.pruned.append((bound, (i, j), lm_tp, lm_dp, enc_tp))
                else:
                    self.solve((i, j), lm_tp, lm_dp, enc_tp)

    def solve_by_bound(self) -> None:
        """Every outer choice from the lowest bound up, each skipped when its bound (and that of every larger encoder
        tp) exceeds the replay-th best estimate found: the same layouts are replayed as when every choice is solved."""
        problem, tps, encoders, base = self.problem, self.problem.tps, self.problem.encoders, self.base
        outer = [(lm_tp, lm_dp) for lm_tp, lm_dp in itertools.product(tps, _divisors(problem.m))
                 if lm_dp * lm_tp + len(encoders) <= problem.n]
        combos = [c for c in itertools.product(tps, repeat=len(encoders)) if any(t != tps[0] for t in c)]
        bounds = {o: problem.lower_bound(*o, base) for o in outer}
        for i, (lm_tp, lm_dp) in sorted(enumerate(outer), key=lambda io: bounds[io[1]]):
            if bounds[lm_tp, lm_dp] > self.threshold():
                bound = min([bounds[lm_tp, lm_dp]] + [problem.lower_bound(lm_tp, lm_dp, dict(zip(encoders, c)))
                                                      for c in combos])
                if bound > self.threshold():
                    self.pruned.append((bound, (i,), lm_tp, lm_dp, base))
                    continue
            self.solve_choice(i, lm_tp, lm_dp, prune=True)

    def solve_pruned(self) -> None:
        """Solve the choices skipped so far (a whole outer choice, or one of its larger encoder tps)."""
        for _, order, lm_tp, lm_dp, enc_tp in self.pruned:
            if len(order) == 2:
                self.solve(order, lm_tp, lm_dp, enc_tp)
            else:
                self.solve_choice(order[0], lm_tp, lm_dp, prune=False)

    def ranked(self) -> list[Orchestration]:
        """The candidates by estimate, then devices, then the order of the full enumeration."""
        return [c for _, c in sorted(self.found, key=lambda oc: (oc[1].estimate, oc[1].devices, oc[0]))]

    def replayed(self, candidates: list[Orchestration], floor: float) -> list[Plan] | None:
        """The first ``replay`` of ``candidates`` that fit once simulated (``evaluate_plan``); None where the list
        runs into the estimates a pruned choice may reach (``floor``, the least of their bounds) first."""
        p, plans = self.problem, []
        for c in candidates:
            if c.estimate * (1 + 1e-9) >= floor:
                return None
            layers = {m: p.modules[m].chain(c.tp[m], p.tp_bw).sizes(c.pp[m]) for m in p.specs}
            plan = evaluate_plan(p.specs, layers, "parallel", p.m, dict(c.dp), p.p2p, p.limit, p.ar_bw, dict(c.tp),
                                 p.sharding, p.tp_bw, samples_per_microbatch=p.b)
            if plan.fits_memory:
                plans.append(plan)
                if len(plans) == self.replay:
                    break
        return plans


def flop_ratio_split(work: dict[str, float], num_devices: int) -> dict[str, float]:
    """The strawman DistTrain compares against (§5.1, §8.2.1): devices in proportion to each module's work."""
    total = sum(work.values())
    return {m: num_devices * w / total for m, w in work.items()}


__all__ = ["Orchestration", "OrchestrationResult", "Unit", "eq12_time", "flop_ratio_split", "integer_min_max",
           "search_per_module_dp", "water_fill"]
