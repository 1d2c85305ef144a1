"""Batch balancing in the schedule simulator: what a balancing method does to the iteration time of real batches.

For each global batch (per-sample encoder and LLM work, as ``plan.balance.plan_batch`` takes them) and each method,
the batch is planned, every replica's microbatches become per-microbatch forward/backward costs per stage, and each
replica's pipeline is simulated with the strategy's own action lists, ``one_f_one_b(graph, K, deferred)``:

- an encoder stage runs the encoder work of its encoder microbatch (deferral never moves encoder work);
- an LLM stage runs the LLM work of its LLM microbatch after deferral (its own samples plus those deferred into
  it from the microbatch before), and the LLM's first stage sends the encoders the gradients of a deferring
  microbatch only after the next microbatch's backward, so the encoder's backward of that microbatch waits.

Cost rates are seconds per unit of work, given per stage (``"vision.1"``) or per module (``"vision"``,
``"language_model"``: split evenly over the module's stages). With the encoders in the LLM's first stage
(placement "replicated") their work is charged to that stage; in a colocated chain ("encoders.i") every
encoder's work is charged to every fused stage at that encoder's rate.

The iteration time of a batch is the slowest replica's, as Entrain measures it (replicas run the same schedule
and meet in the gradient all-reduce, which is not modelled here). A rank's idle time is that iteration time minus
its busy time, so it includes the wait for slower replicas. Pure: no process group.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from lightning_mm.plan.balance import METHODS, BatchPlan, plan_batch
from lightning_mm.plan.placement import COLOCATED_ENCODERS, LANGUAGE_MODEL, stage_name
from lightning_mm.plan.schedule import StageGraph, one_f_one_b
from lightning_mm.planner.simulator import SimulationResult, mark_deferred, simulate

Rate = float | tuple[float, float]  # seconds per unit of work: one number for forward and backward, or (fwd, bwd)
Works = torch.Tensor | Mapping[str, torch.Tensor]


def _pair(rate: Rate) -> tuple[float, float]:
    if isinstance(rate, (int, float)):
        return float(rate), float(rate)
    fwd, bwd = rate
    return float(fwd), float(bwd)


def _module_stages(graph: StageGraph) -> dict[str, int]:
    count: dict[str, int] = {}
    for node in graph.nodes:
        count[node.module] = count.get(node.module, 0) + 1
    return count


def _encoder_modules(graph: StageGraph) -> list[str]:
    return [m for m in _module_stages(graph) if m not in (LANGUAGE_MODEL, COLOCATED_ENCODERS)]


def _encoder_works(graph: StageGraph, encoder_work: Works, rates: Mapping[str, Rate]) -> dict[str, torch.Tensor]:
    """Per-encoder work. A single tensor is the work of every encoder the graph (or, without encoder stages,
    the rates) name; the planner always sees the sum."""
    if isinstance(encoder_work, Mapping):
        return {name: torch.as_tensor(w, dtype=torch.float64) for name, w in encoder_work.items()}
    names = _encoder_modules(graph)
    if not names:  # colocated or replicated: the encoders are named by the rates
        stages = set(graph.names)
        names = [k for k in rates if k not in stages and k not in (LANGUAGE_MODEL, COLOCATED_ENCODERS)]
    if len(names) != 1:
        raise ValueError(f"encoder_work is one tensor but the model has encoders {names}: give "
                         "encoder_work={name: tensor} (one per encoder) so each stage gets its own encoder's work")
    return {names[0]: torch.as_tensor(encoder_work, dtype=torch.float64)}


def _rate(rates: Mapping[str, Rate], stage: str | None, module: str, stages_of_module: int) -> tuple[float, float]:
    if stage is not None and stage in rates:
        return _pair(rates[stage])
    if module in rates:
        fwd, bwd = _pair(rates[module])
        return fwd / stages_of_module, bwd / stages_of_module
    raise ValueError(f"no cost rate for stage {stage!r}: give rates[{stage!r}] or rates[{module!r}] (seconds per "
                     f"unit of work, split evenly over the module's stages)")


@dataclass(frozen=True)
class StageCosts:
    """Per-microbatch seconds of one replica: ``forward[stage][m]``, ``backward[stage][m]``, and
    ``deferred[(stage, kind, m)]``: the share of that interval that deferral moved (see ``Event.deferred``)."""

    forward: dict[str, list[float]]
    backward: dict[str, list[float]]
    deferred: dict[tuple[str, str, int], float]


def replica_costs(graph: StageGraph, plan: BatchPlan, replica: int, encoder_work: Works, llm_work: torch.Tensor,
                  rates: Mapping[str, Rate]) -> StageCosts:
    """Forward/backward seconds of every microbatch on every stage of ``replica`` under ``plan``."""
    encoders = _encoder_works(graph, encoder_work, rates)
    llm = torch.as_tensor(llm_work, dtype=torch.float64)
    K = plan.num_microbatches
    enc_rows = plan.assignment[replica]
    llm_rows = plan.llm_rows(replica)
    mine = [d for d in plan.deferred if d.replica == replica]
    held = {d.source for d in mine}
    enc_mb = {e: [float(w[rows].sum()) if rows else 0.0 for rows in enc_rows] for e, w in encoders.items()}
    llm_mb = [float(llm[rows].sum()) for rows in llm_rows]
    moved_mb = [0.0] * K  # LLM work deferred into each microbatch from the one before
    for d in mine:
        moved_mb[d.target] += float(llm[list(d.samples)].sum())
    counts = _module_stages(graph)
    has_encoder_stages = any(m != LANGUAGE_MODEL for m in counts)
    fwd, bwd, deferred = {}, {}, {}
    for node in graph.nodes:
        s, mod = node.name, node.module
        f, b = [0.0] * K, [0.0] * K
        moved_f, moved_b = [0.0] * K, [0.0] * K
        if mod == LANGUAGE_MODEL:
            rf, rb = _rate(rates, s, mod, counts[mod])
            for m in range(K):
                f[m], b[m] = llm_mb[m] * rf, llm_mb[m] * rb
                moved_f[m], moved_b[m] = moved_mb[m] * rf, moved_mb[m] * rb
            if s == stage_name(LANGUAGE_MODEL, 0) and not has_encoder_stages:  # replicated encoders
                for e, work in enc_mb.items():
                    rf, rb = _rate(rates, None, e, 1)
                    for m in range(K):
                        f[m] += work[m] * rf
                        b[m] += work[m] * rb
        else:
            parts = list(enc_mb) if mod == COLOCATED_ENCODERS else [mod]
            for e in parts:
                if e not in enc_mb:
                    raise ValueError(f"no encoder work for {e!r}: encoder_work names {sorted(enc_mb)}")
                rf, rb = _rate(rates, s if mod != COLOCATED_ENCODERS else None, e, counts[mod])
                for m in range(K):
                    f[m] += enc_mb[e][m] * rf
                    b[m] += enc_mb[e][m] * rb
            if node.needs_backward:  # the whole encoder backward of a deferring microbatch waits
                for m in held:
                    moved_b[m] = b[m]
        fwd[s], bwd[s] = f, (b if node.needs_backward else [0.0] * K)
        for m in range(K):
            for kind, total, part in (("forward", f[m], moved_f[m]), ("backward", b[m], moved_b[m])):
                if part > 0 and total > 0:
                    deferred[(s, kind, m)] = min(1.0, part / total)
    return StageCosts(fwd, bwd, deferred)


def num_pipeline_stages(graph: StageGraph) -> int:
    """Stages on the longest path to the sink (DistTrain's p)."""
    return 1 + max(graph.depth(n) for n in graph.names)


@dataclass(frozen=True)
class BatchSimulation:
    """One global batch under one method: the plan, each replica's simulated pipeline and its deferring
    microbatches, the per-stage forward seconds ``forward[stage][r][m]``."""

    method: str
    plan: BatchPlan
    replicas: tuple[SimulationResult, ...]
    deferred: tuple[tuple[int, ...], ...]
    forward: dict[str, list[list[float]]]

    @property
    def iteration_time(self) -> float:
        """The slowest replica's iteration (all-reduce not modelled)."""
        return max(r.iteration_time for r in self.replicas)

    def idle(self) -> dict[str, float]:
        """Idle seconds per rank ("<stage>/dp<r>"): the batch's iteration time minus the rank's busy time."""
        T = self.iteration_time
        return {f"{s}/dp{r}": T - res.busy[s] for r, res in enumerate(self.replicas) for s in res.stages}

    def forward_std(self, stage: str) -> float:
        """Standard deviation of ``stage``'s forward seconds over every microbatch of every replica."""
        values = [t for row in self.forward[stage] for t in row]
        return statistics.stdev(values) if len(values) > 1 else 0.0

    def module_forward_std(self, module: str) -> float:
        """Standard deviation over every microbatch of every replica of the module's forward seconds summed over
        its stages (Entrain's Table 4.3 statistic: a microbatch's forward time is the sum over the module's
        stages, so it does not depend on how many stages the module is split into)."""
        stages = [s for s in self.forward if s.rsplit(".", 1)[0] == module]
        values = [sum(self.forward[s][r][m] for s in stages)
                  for r in range(len(self.replicas)) for m in range(len(self.forward[stages[0]][r]))]
        return statistics.stdev(values) if len(values) > 1 else 0.0


def simulate_plan(graph: StageGraph, plan: BatchPlan, encoder_work: Works, llm_work: torch.Tensor,
                  rates: Mapping[str, Rate], method: str = "", p2p_latency: float = 0.0) -> BatchSimulation:
    """Simulate every replica of ``plan`` with the schedule's own action lists (deferral included)."""
    results, held, forward = [], [], {s: [] for s in graph.names}
    for r in range(plan.num_replicas):
        costs = replica_costs(graph, plan, r, encoder_work, llm_work, rates)
        deferred = tuple(sorted(d.source for d in plan.deferred if d.replica == r))
        actions = one_f_one_b(graph, plan.num_microbatches, deferred)
        result = simulate(graph, actions, costs.forward, costs.backward, p2p_latency)
        results.append(mark_deferred(result, costs.deferred))
        held.append(deferred)
        for s in graph.names:
            forward[s].append(costs.forward[s])
    return BatchSimulation(method, plan, tuple(results), tuple(held), forward)


def simulate_batch(graph: StageGraph, encoder_work: Works, llm_work: torch.Tensor, rates: Mapping[str, Rate],
                   num_replicas: int, num_microbatches: int, method: str = "none",
                   p2p_latency: float = 0.0) -> BatchSimulation:
    """Plan one global batch with ``plan_batch`` (the planner sees the summed encoder work; DistTrain orders for
    the graph's pipeline depth) and simulate it."""
    encoders = _encoder_works(graph, encoder_work, rates)
    total = sum(encoders.values())
    plan = plan_batch(total, llm_work, num_replicas, num_microbatches, method,
                      num_stages=num_pipeline_stages(graph))
    return simulate_plan(graph, plan, encoders, llm_work, rates, method, p2p_latency)


@dataclass(frozen=True)
class MethodReport:
    """One method over a sequence of global batches (means over batches unless named otherwise)."""

    method: str
    iteration_time: float
    iteration_times: tuple[float, ...]
    idle: dict[str, float]  # rank "<stage>/dp<r>" -> mean idle seconds per iteration
    forward_std: dict[str, float]  # stage -> mean over batches of the microbatch forward-time std
    deferred_samples: float  # samples whose LLM work was deferred, per batch

    @property
    def total_time(self) -> float:
        return sum(self.iteration_times)

    def module_forward_std(self, module: str) -> float:
        """The forward-time std of the module's first stage (every stage of a module sees the same split)."""
        return self.forward_std[stage_name(module, 0)]


def compare_methods(graph: StageGraph, batches: Sequence[tuple[Works, torch.Tensor]], rates: Mapping[str, Rate],
                    num_replicas: int, num_microbatches: int, methods: Sequence[str] = METHODS,
                    p2p_latency: float = 0.0, keep: bool = False) -> dict[str, MethodReport] | tuple[dict, dict]:
    """Every method on the same global batches ``[(encoder_work, llm_work), ...]``. With ``keep`` also returns
    ``{method: [BatchSimulation, ...]}`` (events for timelines)."""
    if not batches:
        raise ValueError("compare_methods needs at least one global batch")
    reports, kept = {}, {}
    for method in methods:
        sims = [simulate_batch(graph, enc, llm, rates, num_replicas, num_microbatches, method, p2p_latency)
                for enc, llm in batches]
        ranks = list(sims[0].idle())
        reports[method] = MethodReport(
            method=method,
            iteration_time=statistics.fmean(s.iteration_time for s in sims),
            iteration_times=tuple(s.iteration_time for s in sims),
            idle={k: statistics.fmean(s.idle()[k] for s in sims) for k in ranks},
            forward_std={st: statistics.fmean(s.forward_std(st) for s in sims) for st in graph.names},
            deferred_samples=statistics.fmean(sum(len(d.samples) for d in s.plan.deferred) for s in sims))
        kept[method] = sims
    return (reports, kept) if keep else reports


def llava_like_works(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample (encoder, LLM) work of a LLaVA-like mix, for planning benchmarks and tests: about half the samples
    are text-only, the others carry 1-8 images of 224-896 px (14-px patches, attention quadratic per image,
    patches/4 tokens into the LLM); text lengths are log-normal (heavy tail). Seeded."""
    g = torch.Generator().manual_seed(seed)
    enc, llm = torch.zeros(batch, dtype=torch.float64), torch.zeros(batch, dtype=torch.float64)
    for i in range(batch):
        images = int(torch.randint(1, 9, (1,), generator=g)) if torch.rand(1, generator=g) < 0.5 else 0
        for _ in range(images):
            h, w = torch.randint(224, 897, (2,), generator=g).tolist()
            patches = (h // 14) * (w // 14)
            enc[i] += patches + patches ** 2 / 4096
            llm[i] += patches / 4
        text = float(torch.exp(5 + 1.2 * torch.randn(1, generator=g)))
        llm[i] += text + text ** 2 / 8192
    return enc, llm
