"""Discrete-event simulation of the pipeline's own action lists (`plan.schedule`), plus timeline output.

Each stage is one device executing its action list in order: compute takes the stage's forward/backward
cost, sends are non-blocking and arrive `p2p_latency` later, receives block until the message arrived.
Every stage starts at time 0; the iteration ends when the last stage finishes. The collectives a stage runs inside
a forward or backward (tensor- and context-parallel traffic, encoder CP's feature gather) are part of that cost;
``forward_comm`` / ``backward_comm`` say how much, so the timeline draws that share as communication.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from lightning_mm.plan.schedule import Action, ScheduleError, StageGraph, one_f_one_b

Cost = float | Sequence[float]


@dataclass(frozen=True)
class Event:
    """One compute interval on one stage. ``deferred``: the share of the interval that batch balancing's deferral
    moved there (0 without deferral): on an LLM stage, the LLM work of samples deferred from the previous
    microbatch; on an encoder stage, the backward of a deferring microbatch (all of it, as it waits for the
    deferred samples' gradients). ``comm``: seconds of the interval spent in collectives (0 when none are costed),
    drawn at the end of a forward and the start of a backward, where encoder CP's gather and its gradient
    all-reduce run (per-layer collectives are spread through the interval; the drawing sums them)."""

    stage: str
    kind: str  # "forward" | "backward" | "sync" (gradient all-reduce, microbatch -1)
    microbatch: int
    start: float
    end: float
    deferred: float = 0.0
    comm: float = 0.0


@dataclass(frozen=True)
class SimulationResult:
    iteration_time: float
    stages: tuple[str, ...]
    events: tuple[Event, ...]
    busy: dict[str, float]
    idle: dict[str, float]
    bubble_fraction: dict[str, float]
    peak_inflight: dict[str, int]  # microbatches whose activations a stage holds at once (0: runs under no_grad)

    def summary_rows(self) -> list[tuple[str, float, float, int]]:
        """(stage, busy, bubble fraction, peak in-flight) per stage, in graph order."""
        return [(s, self.busy[s], self.bubble_fraction[s], self.peak_inflight[s]) for s in self.stages]


def _cost_of(costs: dict[str, Cost], stage: str, mb: int, what: str) -> float:
    if stage not in costs:
        raise ValueError(f"no {what} cost for stage {stage!r}; give one per stage ({what}_cost[{stage!r}] = seconds)")
    value = costs[stage]
    if isinstance(value, (int, float)):
        return float(value)
    if mb >= len(value):
        raise ValueError(f"{what} cost of stage {stage!r} has {len(value)} microbatch entries, needs > {mb}")
    return float(value[mb])


def simulate(
    graph: StageGraph,
    actions: dict[str, list[Action]],
    forward_cost: dict[str, Cost],
    backward_cost: dict[str, Cost],
    p2p_latency: float = 0.0,
    sync_cost: dict[str, float] | None = None,
    forward_comm: dict[str, float] | None = None,
    backward_comm: dict[str, float] | None = None,
) -> SimulationResult:
    """Time the action lists. Costs are per stage: one number, or one per microbatch. ``sync_cost``: seconds of
    each stage's gradient all-reduce over its replicas, run after its last action (an event of kind "sync",
    microbatch -1); it lengthens the iteration but is not busy compute. ``forward_comm`` / ``backward_comm``:
    seconds of each stage's forward / backward cost that are collectives (included in the cost, not added; they
    set ``Event.comm``)."""
    clock = {s: 0.0 for s in actions}
    cursor = {s: 0 for s in actions}
    channels: dict[tuple[str, str, str], deque] = {}
    events, inflight = [], {s: 0 for s in actions}
    peak = {s: 0 for s in actions}
    progressed = True
    while progressed:
        progressed = False
        for stage, acts in actions.items():
            while cursor[stage] < len(acts):
                a = acts[cursor[stage]]
                if a.kind.startswith("recv"):
                    queue = channels.get((a.peer, stage, a.kind[-3:]))
                    if not queue:
                        break
                    mb, arrival = queue.popleft()
                    if mb != a.microbatch:
                        raise ScheduleError(f"stage {stage!r} {a}: next message is microbatch {mb}")
                    clock[stage] = max(clock[stage], arrival)
                elif a.kind.startswith("send"):
                    channels.setdefault((stage, a.peer, a.kind[-3:]), deque()).append((a.microbatch, clock[stage] + p2p_latency))
                else:
                    costs, comm = ((forward_cost, forward_comm) if a.kind == "forward" else
                                   (backward_cost, backward_comm))
                    start = clock[stage]
                    clock[stage] += _cost_of(costs, stage, a.microbatch, a.kind)
                    share = min((comm or {}).get(stage, 0.0), clock[stage] - start)
                    events.append(Event(stage, a.kind, a.microbatch, start, clock[stage], comm=share))
                    if graph.node(stage).needs_backward:
                        inflight[stage] += 1 if a.kind == "forward" else -1
                        peak[stage] = max(peak[stage], inflight[stage])
                cursor[stage] += 1
                progressed = True
    blocked = [f"{s!r} at {actions[s][cursor[s]]}" for s in actions if cursor[s] < len(actions[s])]
    if blocked:
        raise ScheduleError("simulation deadlocked: " + "; ".join(blocked))
    for stage, cost in (sync_cost or {}).items():
        if cost > 0:
            events.append(Event(stage, "sync", -1, clock[stage], clock[stage] + cost))
            clock[stage] += cost
    total = max(clock.values(), default=0.0)
    busy = {s: sum(e.end - e.start for e in events if e.stage == s and e.kind != "sync") for s in actions}
    idle = {s: total - busy[s] for s in actions}
    bubble = {s: (idle[s] / total if total > 0 else 0.0) for s in actions}
    return SimulationResult(total, tuple(graph.names), tuple(events), busy, idle, bubble, peak)


def simulate_1f1b(
    graph: StageGraph,
    num_microbatches: int,
    forward_cost: dict[str, Cost],
    backward_cost: dict[str, Cost],
    p2p_latency: float = 0.0,
    sync_cost: dict[str, float] | None = None,
    forward_comm: dict[str, float] | None = None,
    backward_comm: dict[str, float] | None = None,
) -> SimulationResult:
    """Simulate the strategy's own 1F1B schedule for this graph."""
    return simulate(graph, one_f_one_b(graph, num_microbatches), forward_cost, backward_cost, p2p_latency, sync_cost,
                    forward_comm, backward_comm)


def mark_deferred(result: SimulationResult, shares: dict[tuple[str, str, int], float]) -> SimulationResult:
    """``result`` with ``Event.deferred`` set from ``shares[(stage, kind, microbatch)]``."""
    if not shares:
        return result
    events = tuple(replace(e, deferred=shares.get((e.stage, e.kind, e.microbatch), e.deferred)) for e in result.events)
    return replace(result, events=events)


def _label(e: Event) -> str:
    return "allreduce" if e.kind == "sync" else f"{'F' if e.kind == 'forward' else 'B'}{e.microbatch}"


def chrome_trace(result: SimulationResult, path: str | Path, time_scale: float = 1e6) -> None:
    """Write a Chrome-trace JSON (open it in Perfetto or chrome://tracing); one thread per stage.
    `time_scale` converts the simulation's time unit to microseconds (1e6 for seconds)."""
    tid = {s: i for i, s in enumerate(result.stages)}
    trace = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid[s], "args": {"name": s}} for s in result.stages
    ]
    for e in result.events:
        trace.append({
            "name": _label(e),
            "cat": e.kind,
            "ph": "X",
            "pid": 0,
            "tid": tid[e.stage],
            "ts": e.start * time_scale,
            "dur": (e.end - e.start) * time_scale,
            "args": {"microbatch": e.microbatch, **({"deferred": round(e.deferred, 4)} if e.deferred else {}),
                     **({"comm": e.comm} if e.comm else {})},
        })
        if e.comm > 0:  # nested slice: the collectives inside the compute step
            start = e.end - e.comm if e.kind == "forward" else e.start
            trace.append({"name": "comm", "cat": "comm", "ph": "X", "pid": 0, "tid": tid[e.stage],
                          "ts": start * time_scale, "dur": e.comm * time_scale, "args": {"microbatch": e.microbatch}})
    Path(path).write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))


def timeline_png(result: SimulationResult, path: str | Path, title: str | None = None, scale: float = 1.0,
                 xlabel: str = "time") -> None:
    """Draw the schedule as a Gantt chart (forward blue, backward orange, microbatch numbers inside; gradient
    all-reduce grey; collectives inside a step (``Event.comm``: TP / CP traffic, encoder CP's gather) in a lighter
    shade with dots, at the end of a forward and the start of a backward; the share of an interval that deferral
    moved there hatched at its end). The x axis shows the
    result's units times ``scale`` (e.g. 1e3 for seconds shown in ms), labelled ``xlabel``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("timeline_png needs matplotlib: pip install 'lightning-mm[plots]'") from err
    rows = {s: i for i, s in enumerate(result.stages)}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(result.events) ** 0.5 * 4), 0.6 * len(rows) + 1.2))
    for e in result.events:
        y = len(rows) - 1 - rows[e.stage]
        color = {"forward": "#4C72B0", "backward": "#DD8452"}.get(e.kind, "#8C8C8C")
        ax.broken_barh([(e.start * scale, (e.end - e.start) * scale)], (y - 0.4, 0.8), facecolors=color,
                       edgecolor="white", linewidth=0.5)
        if e.comm > 0:
            start = e.end - e.comm if e.kind == "forward" else e.start
            ax.broken_barh([(start * scale, e.comm * scale)], (y - 0.4, 0.8),
                           facecolors={"forward": "#A6BDDB", "backward": "#F4C9A8"}.get(e.kind, "#C8C8C8"),
                           edgecolor="black", hatch="..", linewidth=0.0)
        text = "AR" if e.kind == "sync" else str(e.microbatch)
        if e.deferred > 0:
            width = (e.end - e.start) * e.deferred
            ax.broken_barh([((e.end - width) * scale, width * scale)], (y - 0.4, 0.8), facecolors="none",
                           edgecolor="black", hatch="///", linewidth=0.0)
        ax.text((e.start + e.end) / 2 * scale, y, text, ha="center", va="center", fontsize=7, color="white")
    from matplotlib.patches import Patch

    kinds = {e.kind for e in result.events}
    handles = [Patch(facecolor="#4C72B0", label="forward (number: microbatch)"),
               Patch(facecolor="#DD8452", label="backward (number: microbatch)")]
    if "sync" in kinds:
        handles.append(Patch(facecolor="#8C8C8C", label="AR: gradient all-reduce"))
    if any(e.comm > 0 for e in result.events):
        handles.append(Patch(facecolor="#A6BDDB", edgecolor="black", hatch="..", label="communication"))
    if any(e.deferred > 0 for e in result.events):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="deferred LLM work"))
    handles.append(Patch(facecolor="white", edgecolor="none", label="blank: idle (bubble)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{s} ({result.bubble_fraction[s]:.0%} idle)" for s in reversed(result.stages)])
    ax.set_xlim(0, result.iteration_time * scale)
    ax.set_xlabel(xlabel)
    ax.set_title(title or f"1F1B iteration {result.iteration_time * scale:.4g}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
