"""PipelineTimeline: the real per-stage timeline of chosen training steps, beside the simulator's prediction.

At a recorded step every rank passes a barrier (so all start together, as the simulator assumes; times are
taken relative to it, so nodes need no common clock), runs the step, and sends its engine's ``timings``
[(kind, microbatch, start, end)] to every rank with ``all_gather_object``. Rank 0 then writes the measured timeline (PNG + Chrome trace, the simulator's own
drawing code) and the simulated one with per-stage costs measured in the same step, and every rank logs
per-rank bubble fractions, the measured and the predicted iteration time through the Lightning logger.

With batch balancing's deferral (``batch_balancing="entrain"``) each rank also records which of its replica's
microbatches deferred LLM work (from the batch's plan): the LLM stages' intervals that ran deferred samples and the
encoder backwards that waited for them are marked (``Event.deferred``, hatched in the PNG; on the LLM stages the
share is the deferred rows' share of the microbatch's rows), and the prediction runs the deferral schedule of the
replica that the simulator finds slowest.

The output folder is resolved in ``setup`` on every rank alike (``trainer.log_dir`` is itself a collective
under a multi-process strategy, so it must never be asked on rank 0 alone).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch.distributed as dist

from lightning_mm.data.microbatch import deferrals, replica_microbatch_rows
from lightning_mm.plan.placement import LANGUAGE_MODEL
from lightning_mm.plan.schedule import one_f_one_b
from lightning_mm.planner.simulator import Event, SimulationResult, chrome_trace, mark_deferred, simulate, timeline_png

COMPUTE = ("forward", "backward")


@dataclass(frozen=True)
class RankTimings:
    """One rank's recorded step: its stage, replica, and the engine's actions with times relative to the
    common start (seconds). ``deferred``: the replica's microbatches whose LLM work was partly deferred to the
    next one; ``deferred_share[m]``: the share of LLM microbatch m's rows deferred into it (empty: none)."""

    rank: int
    stage: str
    dp: int
    actions: tuple[tuple[str, int, float, float], ...]
    deferred: tuple[int, ...] = ()
    deferred_share: tuple[float, ...] = ()


def deferral_of(batch: dict, num_microbatches: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The deferring microbatches of a batch's plan and, per LLM microbatch, the share of its rows deferred into it
    from the microbatch before (the engine's own split: ``data.microbatch``)."""
    if not isinstance(batch, dict) or "input_ids" not in batch:
        return (), ()
    replicas = replica_microbatch_rows(batch, num_microbatches)  # one, or a group's (per-module data parallelism)
    held = tuple(sorted({m for enc, llm in replicas for m in deferrals(enc, llm)}))
    if not held:
        return (), ()
    share = tuple(0.0 if m == 0 else sum(r in set(enc[m - 1]) for enc, llm in replicas for r in llm[m]) /
                  sum(len(llm[m]) for _, llm in replicas) for m in range(num_microbatches))
    return held, share


def deferred_shares(stage: str, needs_backward: bool, deferred: tuple[int, ...],
                    share: tuple[float, ...]) -> dict[tuple[str, int], float]:
    """``{(kind, microbatch): share}`` of one stage's intervals that deferral moved (see ``Event.deferred``)."""
    if stage.startswith(LANGUAGE_MODEL + "."):
        return {(kind, m): s for m, s in enumerate(share) if s > 0 for kind in ("forward", "backward")}
    return {("backward", m): 1.0 for m in deferred} if needs_backward else {}


def rank_label(t: RankTimings, dp: int) -> str:
    return t.stage if dp == 1 else f"{t.stage}/dp{t.dp}"


def measured_result(records: list[RankTimings], stage_order: list[str],
                    needs_backward: dict[str, bool]) -> SimulationResult:
    """The recorded step as a SimulationResult (one row per rank): iteration time from the first action of any
    rank to the last, busy = forward + backward time, bubble = idle / iteration."""
    dp = 1 + max(r.dp for r in records)
    ordered = sorted(records, key=lambda r: (stage_order.index(r.stage), r.dp))
    origin = min(a[2] for r in records for a in r.actions)
    events, peak = [], {}
    for r in ordered:
        label, inflight = rank_label(r, dp), 0
        peak[label] = 0
        moved = deferred_shares(r.stage, needs_backward[r.stage], r.deferred, r.deferred_share)
        for kind, mb, start, end in r.actions:
            if kind in COMPUTE:
                events.append(Event(label, kind, mb, start - origin, end - origin, moved.get((kind, mb), 0.0)))
                if needs_backward[r.stage]:
                    inflight += 1 if kind == "forward" else -1
                    peak[label] = max(peak[label], inflight)
    labels = [rank_label(r, dp) for r in ordered]
    total = max(a[3] for r in records for a in r.actions) - origin
    busy = {s: sum(e.end - e.start for e in events if e.stage == s) for s in labels}
    idle = {s: total - busy[s] for s in labels}
    bubble = {s: idle[s] / total if total > 0 else 0.0 for s in labels}
    return SimulationResult(total, tuple(labels), tuple(events), busy, idle, bubble, peak)


def stage_costs(records: list[RankTimings], include_sends: bool = True) -> tuple[dict[str, float], dict[str, float]]:
    """Median forward and backward seconds per stage over microbatches and replicas. With ``include_sends``
    the time a stage spends issuing the send that follows a compute step is charged to that step (the
    simulator's sends are free)."""
    fwd: dict[str, list[float]] = {}
    bwd: dict[str, list[float]] = {}
    for r in records:
        acts = r.actions
        for i, (kind, _, start, end) in enumerate(acts):
            if kind not in COMPUTE:
                continue
            extra, j = 0.0, i + 1
            while include_sends and j < len(acts) and acts[j][0] == ("send_fwd" if kind == "forward" else "send_bwd"):
                extra += acts[j][3] - acts[j][2]
                j += 1
            (fwd if kind == "forward" else bwd).setdefault(r.stage, []).append(end - start + extra)
    med = lambda d: {s: statistics.median(v) for s, v in d.items()}  # noqa: E731
    f, b = med(fwd), med(bwd)
    return f, {s: b.get(s, 0.0) for s in f}


def predicted_result(engine, records: list[RankTimings]) -> SimulationResult:
    """The simulator on the engine's own graph and microbatch count, with costs measured in the same step. With
    deferral, each replica's deferral schedule is simulated and the slowest one is returned."""
    fwd, bwd = stage_costs(records)
    graph, K = engine.graph, engine.num_microbatches
    replicas = {}
    for r in records:
        replicas.setdefault(r.dp, (r.deferred, r.deferred_share))
    best = None
    for deferred, share in sorted(set(replicas.values())) or [((), ())]:
        result = simulate(graph, one_f_one_b(graph, K, deferred), fwd, bwd)
        moved = {(s, kind, m): v for s in graph.names
                 for (kind, m), v in deferred_shares(s, graph.node(s).needs_backward, deferred, share).items()}
        result = mark_deferred(result, moved)
        if best is None or result.iteration_time > best.iteration_time:
            best = result
    return best


class PipelineTimeline(pl.Callback):
    """Record the pipeline's real timeline at ``steps`` (global steps, default the 4th) or every
    ``every_n_steps``; write ``timeline-step{N}.{png,trace.json}`` and ``predicted-step{N}.*`` to ``dirpath``
    (default ``<trainer.log_dir or default_root_dir>/timeline``); log ``timeline/bubble/<rank label>``,
    ``timeline/iteration_s`` and ``timeline/predicted_s``. ``results[step] = (measured, predicted)``."""

    def __init__(self, steps: list[int] | tuple[int, ...] = (3,), every_n_steps: int | None = None,
                 dirpath: str | None = None, png: bool = True):
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.steps, self.every_n_steps, self.dirpath, self.png = set(steps), every_n_steps, dirpath, png
        self.results: dict[int, tuple[SimulationResult, SimulationResult]] = {}
        self._recording: int | None = None
        self._out: Path | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Every rank resolves the folder (``trainer.log_dir`` broadcasts rank 0's)."""
        self._out = self._folder(trainer.log_dir or trainer.default_root_dir)

    def _folder(self, root) -> Path:
        return Path(self.dirpath) if self.dirpath else Path(root) / "timeline"

    def _wanted(self, step: int) -> bool:
        return step in self.steps or (self.every_n_steps is not None and step % self.every_n_steps == 0)

    @staticmethod
    def _engine(trainer):
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None:
            raise RuntimeError("PipelineTimeline records the pipeline engine: use "
                               "strategy=lightning_mm.MultimodalParallelStrategy(...)")
        return engine

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        self._recording = None
        if self._wanted(step) and step not in self.results:
            self._engine(trainer)
            dist.barrier()
            self._recording, self._t0 = step, time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._recording is None:
            return
        step, engine = self._recording, self._engine(trainer)
        timings = trainer.strategy.last_step.timings
        rel = tuple((k, m, a - self._t0, b - self._t0) for k, m, a, b in timings)  # clocks differ per node
        mine = RankTimings(trainer.global_rank, engine.stage, engine.coord.dp, rel,
                           *deferral_of(batch, engine.num_microbatches))
        records: list = [None] * dist.get_world_size()
        dist.all_gather_object(records, mine)
        needs_backward = {s: engine.graph.node(s).needs_backward for s in engine.graph.names}
        measured = measured_result(records, list(engine.graph.names), needs_backward)
        predicted = predicted_result(engine, records)
        self.results[step] = (measured, predicted)
        metrics = {f"timeline/bubble/{s}": v for s, v in measured.bubble_fraction.items()}
        metrics["timeline/iteration_s"] = measured.iteration_time
        metrics["timeline/predicted_s"] = predicted.iteration_time
        pl_module.log_dict(metrics, rank_zero_only=True)
        if trainer.global_rank == 0:
            self._write(trainer, step, measured, predicted)

    def _write(self, trainer, step: int, measured: SimulationResult, predicted: SimulationResult) -> None:
        out = self._out if self._out is not None else self._folder(trainer.default_root_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name, result in ((f"timeline-step{step}", measured), (f"predicted-step{step}", predicted)):
            chrome_trace(result, out / f"{name}.trace.json")
            if self.png:
                try:
                    timeline_png(result, out / f"{name}.png", title=f"{name}: {result.iteration_time * 1e3:.1f} ms",
                                 scale=1e3, xlabel="time (ms)")
                except ImportError:
                    self.png = False
