"""PipelineTimeline: measured timelines of a real run, and the simulator's prediction from the same run's
per-stage costs agreeing within 15% (2 processes on 2 cores: not oversubscribed by this test itself)."""

import json
import os
import statistics
import subprocess
import sys

import pytest

from lightning_mm.trainer.callbacks.timeline import RankTimings, measured_result, stage_costs
from lightning_mm.plan.schedule import build_stage_graph, one_f_one_b
from lightning_mm.planner.simulator import simulate_1f1b


def _fake_records():
    """2-stage 1F1B with 2 microbatches, compute F=1, B=2, recorded as the engine would."""
    graph = build_stage_graph({}, 2, "parallel", {"language_model.0": True, "language_model.1": True})
    sim = simulate_1f1b(graph, 2, {"language_model.0": 1.0, "language_model.1": 1.0},
                        {"language_model.0": 2.0, "language_model.1": 2.0})
    records = []
    for rank, stage in enumerate(graph.names):
        acts = [(e.kind, e.microbatch, e.start + 0.5, e.end + 0.5) for e in sim.events if e.stage == stage]
        acts.insert(1, ("send_fwd" if stage.endswith("0") else "send_bwd", 0, acts[0][3], acts[0][3] + 0.25))
        records.append(RankTimings(rank, stage, 0, tuple(acts)))
    return graph, sim, records


def test_measured_result_from_records():
    """Hand case: 1F1B iteration (M + S - 1)(F + B) = 3 x 3 = 9, busy 2 x 3 = 6 per stage."""
    graph, sim, records = _fake_records()
    assert sim.iteration_time == 9.0
    got = measured_result(records, list(graph.names), {s: True for s in graph.names})
    assert got.iteration_time == pytest.approx(9.0)  # offsets (0.5) removed, sends are not compute
    assert got.busy == {"language_model.0": pytest.approx(6.0), "language_model.1": pytest.approx(6.0)}
    assert got.bubble_fraction["language_model.0"] == pytest.approx(1 / 3)
    assert got.peak_inflight == {"language_model.0": 2, "language_model.1": 1}
    fwd, bwd = stage_costs(records)
    assert fwd == {"language_model.0": 1.125, "language_model.1": 1.0}  # median of 1 + 0.25 (its send) and 1
    assert stage_costs(records, include_sends=False)[0]["language_model.0"] == 1.0
    assert bwd == {"language_model.0": 2.0, "language_model.1": 2.0}


@pytest.mark.slow
def test_measured_and_simulated_iteration_agree(tmp_path):
    out = tmp_path / "timeline.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "tests/helpers/timeline_case.py", str(out), str(tmp_path / "tl")],
                          capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = json.loads(out.read_text())
    assert sorted(steps) == ["2", "3", "4"]
    ratios = [s["measured"] / s["predicted"] for s in steps.values()]
    print("measured/predicted per step:", [f"{r:.3f}" for r in ratios], "bubbles:",
          [s["bubble"] for s in steps.values()])
    assert abs(statistics.median(ratios) - 1) < 0.15, ratios
    files = {p.name for p in (tmp_path / "tl").iterdir()}
    assert {"timeline-step3.trace.json", "predicted-step3.trace.json"} <= files
