"""Batch balancing in the schedule simulator (lightning_mm.planner.heterogeneity) and the marks of deferred work in
simulated and measured timelines. Pure and single-process: about a second."""

import json
import types

import pytest
import torch

from lightning_mm.trainer.callbacks.timeline import (RankTimings, deferral_of, deferred_shares, measured_result,
                                             predicted_result)
from lightning_mm.data.microbatch import PLAN_KEY
from lightning_mm.plan.balance import METHODS, BatchPlan, Deferral, plan_batch
from lightning_mm.plan.schedule import build_stage_graph, one_f_one_b
from lightning_mm.planner.heterogeneity import (compare_methods, num_pipeline_stages, replica_costs, simulate_batch,
                                                simulate_plan)
from lightning_mm.planner.simulator import chrome_trace, mark_deferred, simulate, timeline_png

RATES = {"vision": (1.0, 2.0), "language_model": (1.0, 2.0)}


def vision_graph(vision_pp=1, llm_pp=2, vision_trainable=True):
    trainable = {f"vision.{i}": vision_trainable for i in range(vision_pp)}
    trainable.update({f"language_model.{i}": True for i in range(llm_pp)})
    return build_stage_graph({"vision": vision_pp}, llm_pp, "parallel", trainable)


def deferring_batch():
    """Two microbatches on one replica: entrain pairs {0: heavy image + heavy text, 2} with {1: heavy image,
    short text, 3} and defers sample 2's LLM work (1.0 of microbatch 0's 11.0) to microbatch 1."""
    return (torch.tensor([10.0, 10.0, 1.0, 1.0], dtype=torch.float64),
            torch.tensor([10.0, 0.1, 1.0, 1.0], dtype=torch.float64))


def test_images_in_one_microbatch_entrain_beats_none():
    """Every image of the global batch sits in replica 0's first microbatch (what a contiguous split gives a sorted
    data set): balancing spreads them over microbatches and replicas."""
    graph = vision_graph(vision_pp=2)
    B, R, K = 32, 2, 4
    enc = torch.zeros(B, dtype=torch.float64)
    enc[:4] = 10.0
    llm = torch.ones(B, dtype=torch.float64)
    llm[:4] = 3.0
    reports = compare_methods(graph, [(enc, llm)], RATES, R, K)
    assert set(reports) == set(METHODS)
    none, entrain, disttrain = (reports[m].iteration_time for m in ("none", "entrain", "disttrain"))
    assert entrain < 0.5 * none and disttrain < 0.5 * none
    assert reports["entrain"].forward_std["vision.0"] < reports["none"].forward_std["vision.0"]
    assert reports["entrain"].module_forward_std("language_model") == pytest.approx(0.0)  # equal LLM loads
    # the idle time of a rank is the batch's iteration (slowest replica) minus its busy time
    sim = simulate_batch(graph, enc, llm, RATES, R, K, "none")
    assert sim.iteration_time == max(r.iteration_time for r in sim.replicas)
    assert sim.idle()["vision.0/dp1"] == pytest.approx(sim.iteration_time - sim.replicas[1].busy["vision.0"])
    assert reports["none"].idle["vision.0/dp1"] == pytest.approx(sim.idle()["vision.0/dp1"])


@pytest.mark.parametrize("placement", ["parallel", "colocated", "replicated"])
def test_no_heterogeneity_all_methods_equal(placement):
    if placement == "parallel":
        graph = vision_graph(vision_pp=2, llm_pp=2)
    else:
        graph = build_stage_graph({"vision": 2}, 2, placement,
                                  {"vision.0": True, "vision.1": True, "language_model.0": True,
                                   "language_model.1": True})
    B, R, K = 48, 3, 4
    enc, llm = torch.full((B,), 2.0, dtype=torch.float64), torch.full((B,), 3.0, dtype=torch.float64)
    reports = compare_methods(graph, [(enc, llm)] * 2, RATES, R, K)
    times = {m: r.iteration_time for m, r in reports.items()}
    assert times["disttrain"] == pytest.approx(times["none"]) and times["entrain"] == pytest.approx(times["none"])
    assert all(r.deferred_samples == 0 for r in reports.values())
    assert all(v == pytest.approx(0.0) for r in reports.values() for v in r.forward_std.values())
    assert len(reports["none"].iteration_times) == 2 and reports["none"].total_time == pytest.approx(2 * times["none"])


def test_deferral_shows_up_in_the_events():
    graph = vision_graph()
    enc, llm = deferring_batch()
    plan = plan_batch(enc, llm, 1, 2, "entrain")
    assert plan.deferred == (Deferral(0, 0, 1, (2,)),)
    sim = simulate_batch(graph, enc, llm, RATES, 1, 2, "entrain")
    assert sim.deferred == ((0,),)
    events = {(e.stage, e.kind, e.microbatch): e for e in sim.replicas[0].events}
    share = 1.0 / 2.1  # sample 2's LLM work in microbatch 1 (0.1 + 1.0 own + 1.0 deferred)
    for stage in ("language_model.0", "language_model.1"):
        for kind in ("forward", "backward"):
            assert events[(stage, kind, 1)].deferred == pytest.approx(share)
            assert events[(stage, kind, 0)].deferred == 0.0
        assert events[(stage, "forward", 1)].end - events[(stage, "forward", 1)].start == pytest.approx(1.05)
    # the encoder's backward of the deferring microbatch waits for microbatch 1's LLM backward at the first stage
    assert events[("vision.0", "backward", 0)].deferred == 1.0
    assert events[("vision.0", "backward", 0)].start == pytest.approx(events[("language_model.0", "backward", 1)].end)
    assert events[("vision.0", "backward", 1)].deferred == 0.0
    # the same plan without deferral (its LLM work kept in place) is slower here
    flat = BatchPlan(plan.assignment)
    assert simulate_plan(graph, flat, enc, llm, RATES).iteration_time > sim.iteration_time


def test_costs_follow_the_plan_and_rates():
    """Per-microbatch costs are the plan's encoder loads (encoder stages) and post-deferral LLM loads (LLM stages),
    times the rate split evenly over the module's stages; a stage's own rate overrides its module's."""
    graph = vision_graph(vision_pp=2, llm_pp=2)
    enc = torch.tensor([4.0, 1.0, 0.0, 2.0, 8.0, 1.0, 3.0, 5.0], dtype=torch.float64)
    llm = torch.tensor([1.0, 9.0, 2.0, 2.0, 1.0, 7.0, 1.0, 3.0], dtype=torch.float64)
    plan = plan_batch(enc, llm, 2, 2, "entrain")
    rates = {"vision": (2.0, 4.0), "language_model": 1.0, "language_model.1": (3.0, 5.0)}
    for r in range(2):
        costs = replica_costs(graph, plan, r, enc, llm, rates)
        e, l = plan.encoder_loads(enc)[r].tolist(), plan.llm_loads(llm)[r].tolist()
        assert costs.forward["vision.1"] == pytest.approx([w * 1.0 for w in e])
        assert costs.backward["vision.0"] == pytest.approx([w * 2.0 for w in e])
        assert costs.forward["language_model.0"] == pytest.approx([w * 0.5 for w in l])
        assert costs.backward["language_model.0"] == pytest.approx([w * 0.5 for w in l])
        assert costs.forward["language_model.1"] == pytest.approx([w * 3.0 for w in l])
    frozen = replica_costs(vision_graph(vision_trainable=False), plan, 0, enc, llm, rates)
    assert frozen.backward["vision.0"] == [0.0, 0.0]  # a frozen encoder with nothing upstream runs no backward


def test_several_encoders_and_replicated_encoders():
    graph = build_stage_graph({"vision": 1, "audio": 1}, 1, "parallel",
                              {"vision.0": True, "audio.0": False, "language_model.0": True})
    B = 4
    works = {"vision": torch.tensor([1.0, 2.0, 3.0, 4.0]), "audio": torch.tensor([0.0, 5.0, 0.0, 5.0])}
    llm = torch.ones(B, dtype=torch.float64)
    rates = {"vision": 1.0, "audio": 2.0, "language_model": 1.0}
    sim = simulate_batch(graph, works, llm, rates, 1, 2, "none")
    assert sim.forward["vision.0"] == [[3.0, 7.0]] and sim.forward["audio.0"] == [[10.0, 10.0]]
    with pytest.raises(ValueError, match="encoder_work=\\{name: tensor\\}"):
        simulate_batch(graph, works["vision"], llm, rates, 1, 2, "none")
    with pytest.raises(ValueError, match="rates\\['audio.0'\\] or rates\\['audio'\\]"):
        simulate_batch(graph, works, llm, {"vision": 1.0, "language_model": 1.0}, 1, 2, "none")
    replicated = build_stage_graph({"vision": 1}, 2, "replicated", {"vision.0": True, "language_model.0": True,
                                                                    "language_model.1": True})
    sim = simulate_batch(replicated, works["vision"], llm, {"vision": 1.0, "language_model": 2.0}, 1, 2, "none")
    assert sim.forward["language_model.0"] == [[3.0 + 2.0, 7.0 + 2.0]]  # the encoder's work, then half the LLM's
    assert sim.forward["language_model.1"] == [[2.0, 2.0]]
    assert num_pipeline_stages(graph) == 2 and num_pipeline_stages(replicated) == 2


def test_deferred_marks_in_trace_and_png(tmp_path):
    graph = vision_graph()
    enc, llm = deferring_batch()
    result = simulate_batch(graph, enc, llm, RATES, 1, 2, "entrain").replicas[0]
    chrome_trace(result, tmp_path / "t.json")
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    marked = [e for e in trace if "deferred" in e.get("args", {})]
    assert {(e["tid"], e["name"]) for e in marked} >= {(0, "B0"), (1, "F1"), (2, "B1")}
    pytest.importorskip("matplotlib")
    timeline_png(result, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0
    plain = simulate(graph, one_f_one_b(graph, 2), {s: 1.0 for s in graph.names}, {s: 2.0 for s in graph.names})
    assert mark_deferred(plain, {}) is plain
    assert mark_deferred(plain, {("vision.0", "backward", 0): 1.0}).events != plain.events


def test_timeline_callback_marks_deferral_from_the_batch_plan():
    """The callback reads the deferral from the batch's plan (the engine's own split), marks the measured events
    and predicts with the slowest replica's deferral schedule."""
    batch = {"input_ids": torch.zeros(4, 3, dtype=torch.long),
             PLAN_KEY: {"encoder": [0, 0, 1, 1], "llm": [0, 1, 1, 1], "tokens": {}}}
    held, share = deferral_of(batch, 2)
    assert held == (0,) and share == pytest.approx((0.0, 1 / 3))
    assert deferral_of({"input_ids": torch.zeros(4, 3)}, 2) == ((), ())
    assert deferred_shares("vision.0", True, held, share) == {("backward", 0): 1.0}
    assert deferred_shares("vision.0", False, held, share) == {}
    assert deferred_shares("language_model.1", True, held, share) == {("forward", 1): pytest.approx(1 / 3),
                                                                       ("backward", 1): pytest.approx(1 / 3)}
    graph = vision_graph()
    sim = simulate(graph, one_f_one_b(graph, 2, held), {s: 1.0 for s in graph.names}, {s: 2.0 for s in graph.names})
    records = []
    for rank, stage in enumerate(graph.names):
        acts = tuple((e.kind, e.microbatch, e.start, e.end) for e in sim.events if e.stage == stage)
        records.append(RankTimings(rank, stage, 0, acts, held, share))
        records.append(RankTimings(rank + 3, stage, 1, acts))  # replica 1 deferred nothing
    got = measured_result(records, list(graph.names), {s: True for s in graph.names})
    marks = {(e.stage, e.kind, e.microbatch): e.deferred for e in got.events if e.deferred}
    assert marks == {("vision.0/dp0", "backward", 0): 1.0,
                     **{(f"language_model.{i}/dp0", k, 1): pytest.approx(1 / 3)
                        for i in range(2) for k in ("forward", "backward")}}
    engine = types.SimpleNamespace(graph=graph, num_microbatches=2)
    predicted = predicted_result(engine, records)
    assert predicted.iteration_time == pytest.approx(sim.iteration_time)
    assert any(e.deferred for e in predicted.events)
