"""The frozen-aware planner: costs, partitioner, profiler, simulator and search against hand/brute-force references."""

import itertools
import json
import math
import random

import pytest
import torch

from lightning_mm.plan.schedule import build_stage_graph
from lightning_mm.planner import (
    CostModel,
    LayerCost,
    LayerProfile,
    ModuleSpec,
    ModuleTimes,
    chrome_trace,
    evaluate_plan,
    fit_cost_model,
    forward_only_costs,
    layer_costs,
    load_profile,
    mllm_layer_costs,
    partition,
    partition_module,
    plan_summary,
    profile_layers,
    save_profile,
    search,
    simulate_1f1b,
    stage_sums,
    timeline_png,
    uniform_partition,
)

LM = "language_model"

# ---------------------------------------------------------------- partition


def brute_force_bottleneck(costs, stages):
    n, best = len(costs), math.inf
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_partition_equals_brute_force():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 9)
        costs = [rng.choice([0.0, rng.uniform(0, 10), float(rng.randint(1, 4))]) for _ in range(n)]
        s = rng.randint(1, n)
        sizes = partition(costs, s)
        assert len(sizes) == s and sum(sizes) == n and min(sizes) >= 1
        assert max(stage_sums(costs, sizes)) == pytest.approx(brute_force_bottleneck(costs, s))


def test_partition_hand_cases_and_errors():
    assert partition([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert partition([1, 1, 1, 1, 8], 2) == [4, 1]
    assert partition([1] * 7, 3) == [2, 2, 3]  # ties: lighter early stages
    assert uniform_partition(7, 3) == [2, 2, 3]
    with pytest.raises(ValueError, match=r"cannot split 3 layers into 4 stages.*use pp <= 3"):
        partition([1, 1, 1], 4)
    with pytest.raises(ValueError, match="num_stages"):
        partition([1, 1], 0)
    with pytest.raises(ValueError, match=">= 0"):
        partition([1, -1], 1)


# ---------------------------------------------------------------- frozen-aware costs


def as_fb(costs):
    return [(c.forward, c.backward) for c in costs]


def test_frozen_encoder_trainable_projector_frozen_llm():
    # encoder: 3 frozen layers + trainable projector; LLM: 2 frozen layers
    enc = ModuleTimes([1, 1, 1, 0.5], [1, 1, 1, 0.5], [2, 2, 2, 0.25], [True, True, True, False])
    llm = ModuleTimes([2, 2], [3, 3], [4, 4], True)
    out = mllm_layer_costs({"vision": enc}, llm)
    # Eq. 3.2 by hand: frozen encoder layers have nothing upstream -> B = 0; projector B_w + B_d = 0.75;
    # frozen LLM layers with a trainable projector upstream -> B_d only = 3
    assert as_fb(out["vision"]) == [(1, 0), (1, 0), (1, 0), (0.5, 0.75)]
    assert as_fb(out[LM]) == [(2, 3), (2, 3)]
    assert [c.in_backward for c in out["vision"]] == [False, False, False, True]
    # the frozen-unaware baseline charges 3F everywhere
    assert forward_only_costs([1, 1, 1, 0.5]) == [3, 3, 3, 1.5]


def test_trainable_encoder_layer_propagates_into_llm_across_modalities():
    vision = ModuleTimes([1, 1, 1], [1, 1, 1], [2, 2, 2], [True, False, True])
    audio = ModuleTimes([4, 4], [5, 5], [6, 6], True)  # fully frozen, no projector trained
    llm = ModuleTimes([2, 2], [3, 3], [4, 4], True)
    out = mllm_layer_costs({"vision": vision, "audio": audio}, llm)
    assert as_fb(out["vision"]) == [(1, 0), (1, 3), (1, 1)]  # B_w+B_d at the trainable layer, B_d after it
    assert as_fb(out["audio"]) == [(4, 0), (4, 0)]  # nothing trainable upstream of audio
    assert as_fb(out[LM]) == [(2, 3), (2, 3)]
    fully_frozen = mllm_layer_costs({"audio": audio}, llm)
    assert as_fb(fully_frozen[LM]) == [(2, 0), (2, 0)]


def test_lora_like_partial_training_and_recompute():
    # LLM frozen except small adapters in the top two layers (B_w of the adapters only)
    costs = layer_costs([2, 2, 2, 2], [3, 3, 3, 3], [0.1, 0.1, 0.1, 0.1], [True, True, False, False])
    assert [c.backward for c in costs] == pytest.approx([0, 0, 3.1, 3.1])
    assert [c.trainable for c in costs] == [False, False, True, True]
    recomputed = layer_costs([2, 2, 2, 2], [3, 3, 3, 3], [0.1] * 4, [True, True, False, False], recompute=True)
    assert [c.backward for c in recomputed] == pytest.approx([0, 0, 5.1, 5.1])  # + F where backward runs
    upstream = layer_costs([2, 2], 3, 0.1, True, upstream_trainable=True, recompute=True)
    assert [c.backward for c in upstream] == pytest.approx([5, 5])
    with pytest.raises(ValueError, match="input_grad has 3 entries"):
        layer_costs([1, 1], [1, 1, 1], 0, True)


def test_partition_module_modes_differ_when_frozen():
    # frozen encoder-like first half, LLM-like second half needing B_d
    costs = layer_costs([1] * 4, [1] * 4, [1] * 4, [True] * 4, upstream_trainable=False) + \
        layer_costs([1] * 4, [1] * 4, [1] * 4, True, upstream_trainable=True)
    assert partition_module(costs, 2, "frozen-aware") == [5, 3]  # F=1 vs F+B_d=2 per layer: 4+2 vs 6
    assert partition_module(costs, 2, "forward-only") == [4, 4]
    assert partition_module(costs, 2, "uniform") == [4, 4]
    with pytest.raises(ValueError, match="unknown partition mode"):
        partition_module(costs, 2, "balanced")


# ---------------------------------------------------------------- cost model and profile files


def test_fit_cost_model_recovers_quadratic_and_roundtrips(tmp_path):
    xs = [64, 256, 1024, 4096]
    model = fit_cost_model(xs, [3e-9 * x * x + 2e-6 * x + 1e-4 for x in xs])
    assert (model.a, model.b, model.c) == pytest.approx((3e-9, 2e-6, 1e-4), rel=1e-6)
    assert fit_cost_model([10, 20], [1, 2])(30) == pytest.approx(3)  # two counts: linear
    assert fit_cost_model([10, 10], [1, 3])(99) == pytest.approx(2)  # one count: mean
    with pytest.raises(ValueError, match="equal-length"):
        fit_cost_model([1, 2], [1])
    profile = {"vision": [LayerProfile(model, CostModel(0, 1e-6, 0), CostModel(0, 0, 0), {64: [1.0, 2.0, 0.0]})]}
    path = tmp_path / "costs.json"
    save_profile(profile, path, meta={"device": "cpu"})
    assert load_profile(path) == profile


def test_profiler_measures_every_layer_on_cpu():
    torch.manual_seed(0)
    layers = {"enc": [torch.nn.Linear(16, 16), torch.nn.GELU()], LM: [torch.nn.Linear(16, 16)]}
    layers[LM][0].requires_grad_(False)  # frozen: still profiled, then restored

    def make_input(module, index, tokens):
        return torch.randn(tokens, 16)

    profile = profile_layers(layers, make_input, token_counts=[8, 32, 64], warmup=1, repeats=3)
    assert [len(profile[m]) for m in ("enc", LM)] == [2, 1]
    for layers_profile in profile.values():
        for layer in layers_profile:
            assert sorted(layer.samples) == [8, 32, 64]
            assert all(f > 0 and d > 0 and w >= 0 for f, d, w in layer.samples.values())
    assert all(sample[2] == 0.0 for sample in profile["enc"][1].samples.values())  # GELU has no weights
    assert all(sample[2] > 0.0 for sample in profile[LM][0].samples.values())
    assert not any(p.requires_grad for p in layers[LM][0].parameters())
    with pytest.raises(ValueError, match="token_counts is empty"):
        profile_layers(layers, make_input, token_counts=[])


# ---------------------------------------------------------------- simulator


def chain(p, trainable=True):
    return build_stage_graph({}, p, "parallel", {f"{LM}.{i}": trainable for i in range(p)})


@pytest.mark.parametrize("p, m, f, b", [(1, 5, 1, 1), (2, 2, 1, 2), (3, 4, 1, 2), (4, 8, 1.5, 2.5), (4, 2, 1, 3), (3, 12, 2, 2)])
def test_linear_chain_matches_closed_form(p, m, f, b):
    g = chain(p)
    r = simulate_1f1b(g, m, {s: f for s in g.names}, {s: b for s in g.names})
    assert r.iteration_time == pytest.approx((m + p - 1) * (f + b))
    assert r.bubble_fraction[g.names[0]] == pytest.approx((p - 1) / (m + p - 1))
    assert [r.peak_inflight[s] for s in g.names] == [min(p - i, m) for i in range(p)]


def test_linear_chain_with_p2p_latency_hand_computed():
    # P=2, M=2, F=1, B=2, latency L: stage 1 starts at 1+L; the last gradient arrives at 7+2L -> 9+2L
    g = chain(2)
    r = simulate_1f1b(g, 2, {s: 1 for s in g.names}, {s: 2 for s in g.names}, p2p_latency=0.5)
    assert r.iteration_time == pytest.approx(10.0)


def test_dag_frozen_encoders_hand_computed():
    # vision 2 stages (F=1 each), audio 1 stage (F=1.5), all frozen -> forward only; LLM 2 stages F=2 B=4.
    # LLM.0 gets mb 0 at max(2, 1.5) = 2, later inputs are always early, so the LLM runs a 2-stage
    # 1F1B shifted by 2: 2 + (M + 1)(F + B) = 2 + 5 * 6 = 32.
    t = {"vision.0": False, "vision.1": False, "audio.0": False, f"{LM}.0": True, f"{LM}.1": True}
    g = build_stage_graph({"vision": 2, "audio": 1}, 2, "parallel", t)
    fwd = {"vision.0": 1, "vision.1": 1, "audio.0": 1.5, f"{LM}.0": 2, f"{LM}.1": 2}
    bwd = {"vision.0": 0, "vision.1": 0, "audio.0": 0, f"{LM}.0": 4, f"{LM}.1": 4}
    r = simulate_1f1b(g, 4, fwd, bwd)
    assert r.iteration_time == pytest.approx(32)
    assert r.busy["audio.0"] == pytest.approx(6) and r.bubble_fraction["audio.0"] == pytest.approx(26 / 32)
    assert r.peak_inflight["vision.0"] == 0 and r.peak_inflight[f"{LM}.0"] == 2
    lm0 = [(e.kind[0], e.microbatch, e.start) for e in r.events if e.stage == f"{LM}.0"]
    assert lm0 == [("f", 0, 2), ("f", 1, 4), ("b", 0, 10), ("f", 2, 14), ("b", 1, 16), ("f", 3, 20), ("b", 2, 22), ("b", 3, 28)]


def test_dag_trainable_projectors_hand_computed():
    # vision.0 frozen (F=1), vision.1 projector (F=1,B=1), audio.0 with projector (F=2,B=1), LLM one
    # stage (F=1,B=2), M=2. Hand trace: LLM f0 [2,3] b0 [3,5] f1 [5,6] (audio mb1 ready at 4) b1 [6,8];
    # both encoders' last stages: b0 [5,6], b1 [8,9] -> iteration 9.
    t = {"vision.0": False, "vision.1": True, "audio.0": True, f"{LM}.0": False}
    g = build_stage_graph({"vision": 2, "audio": 1}, 1, "parallel", t)
    fwd = {"vision.0": 1, "vision.1": 1, "audio.0": 2, f"{LM}.0": 1}
    bwd = {"vision.0": 0, "vision.1": 1, "audio.0": 1, f"{LM}.0": 2}
    r = simulate_1f1b(g, 2, fwd, bwd)
    assert r.iteration_time == pytest.approx(9)
    assert r.busy == pytest.approx({"vision.0": 2, "vision.1": 4, "audio.0": 6, f"{LM}.0": 6})
    assert r.peak_inflight == {"vision.0": 0, "vision.1": 2, "audio.0": 2, f"{LM}.0": 1}


def test_timeline_outputs(tmp_path):
    g = chain(2)
    r = simulate_1f1b(g, 3, {s: 1e-3 for s in g.names}, {s: 2e-3 for s in g.names})
    chrome_trace(r, tmp_path / "trace.json")
    doc = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 12 and spans[0]["dur"] == pytest.approx(1000)
    timeline_png(r, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- search


def small_mllm():
    vision = layer_costs([1.0] * 6 + [0.2], [1.0] * 6 + [0.2], [1.0] * 6 + [0.1], [True] * 6 + [False])
    audio = layer_costs([0.5] * 4 + [0.1], [0.5] * 4 + [0.1], [0.5] * 4 + [0.05], [True] * 4 + [False])
    llm = layer_costs([2.0] * 8, [2.5] * 8, [2.0] * 8, True, upstream_trainable=True)
    return {"vision": ModuleSpec(vision, 1.0, 0.5), "audio": ModuleSpec(audio, 1.0, 0.5), LM: ModuleSpec(llm, 2.0, 1.0)}


def test_search_never_worse_than_enumerated_plans():
    modules = small_mllm()
    result = search(modules, num_devices=6, num_microbatches=4, p2p_latency=0.05)
    assert all(result.best.iteration_time <= p.iteration_time + 1e-12 for p in result.candidates if p.fits_memory)
    assert result.best.devices <= 6
    # hand plans: every stage count per module (frozen-aware boundaries), parallel placement, dp 1
    hand = []
    for lp, vp, ap in itertools.product(range(1, 5), range(1, 4), range(1, 3)):
        if lp + vp + ap <= 6:
            layers = {"vision": partition_module(modules["vision"].costs, vp), "audio": partition_module(modules["audio"].costs, ap),
                      LM: partition_module(modules[LM].costs, lp)}
            hand.append(evaluate_plan(modules, layers, "parallel", 4, 1, 0.05))
    best_hand = min(p.iteration_time for p in hand)
    assert result.best.iteration_time <= best_hand + 1e-12


def test_search_respects_memory_limit():
    modules = small_mllm()
    free = search(modules, num_devices=6, num_microbatches=4)
    limit = 0.75 * max(free.best.memory.values())
    tight = search(modules, num_devices=6, num_microbatches=4, memory_limit=limit)
    assert max(tight.best.memory.values()) <= limit
    assert tight.best.iteration_time >= free.best.iteration_time
    with pytest.raises(ValueError, match="no layout fits"):
        search(modules, num_devices=6, num_microbatches=4, memory_limit=1.0)


def test_state_bytes_per_device_under_tensor_parallelism_and_sharding():
    from lightning_mm.planner.search import state_bytes_per_device

    assert state_bytes_per_device(160.0, True, dp=4, tp=2, sharding="NO_SHARD") == 80.0
    assert state_bytes_per_device(160.0, True, dp=4, tp=2, sharding="FULL_SHARD") == 20.0
    assert state_bytes_per_device(160.0, True, dp=4, tp=1, sharding="SHARD_GRAD_OP") == 40.0 + 120.0 / 4
    assert state_bytes_per_device(160.0, False, dp=4, tp=1, sharding="SHARD_GRAD_OP") == 160.0  # weights only
    # fsdp_reduce="step": the gradients (a quarter) whole until the step's last backward, not a 1/dp shard of them
    assert state_bytes_per_device(160.0, True, dp=4, tp=2, sharding="FULL_SHARD", fsdp_reduce="step") == 20.0 + 15.0
    assert state_bytes_per_device(160.0, True, dp=4, tp=1, sharding="SHARD_GRAD_OP", fsdp_reduce="step") == \
        40.0 + 120.0 / 4 + 30.0
    assert state_bytes_per_device(160.0, False, dp=4, tp=1, sharding="FULL_SHARD", fsdp_reduce="step") == 40.0
    assert state_bytes_per_device(160.0, True, dp=4, tp=1, sharding="NO_SHARD", fsdp_reduce="step") == 160.0


def test_search_shards_or_splits_state_that_does_not_fit_and_times_their_traffic():
    modules = {m: ModuleSpec(s.costs, 20 * s.param_bytes, s.activation_bytes, s.grad_bytes)  # state dominates
               for m, s in small_mllm().items()}
    kw = dict(num_devices=12, num_microbatches=12, stages=3)  # 3 pipeline stages; the rest is dp (or tp)
    free = search(modules, **kw)
    assert free.best.sharding == "NO_SHARD" and free.best.tp == 1
    limit = 0.6 * min(max(p.memory.values()) for p in free.candidates)
    with pytest.raises(ValueError, match="no layout fits"):
        search(modules, memory_limit=limit, **kw)
    sharded = search(modules, memory_limit=limit, sharding_strategies=("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"), **kw)
    assert sharded.best.sharding != "NO_SHARD" and sharded.best.dp > 1
    assert max(sharded.best.memory.values()) <= limit
    split = search(modules, memory_limit=limit, tp_degrees=(1, 2), **kw)
    assert split.best.tp == 2 and split.best.devices <= 12
    # FULL_SHARD moves 1.5x the gradient bytes of an all-reduce; TP all-reduces cost time at finite bandwidth
    layers = {m: [len(spec.costs)] for m, spec in modules.items()}
    heavy = {m: ModuleSpec(s.costs, s.param_bytes, s.activation_bytes, 100.0) for m, s in modules.items()}
    plain = evaluate_plan(heavy, layers, "parallel", 4, dp=2, allreduce_bandwidth=1.0)
    full = evaluate_plan(heavy, layers, "parallel", 4, dp=2, allreduce_bandwidth=1.0, sharding="FULL_SHARD")
    assert full.iteration_time > plain.iteration_time
    # fsdp_reduce="step" holds a trainable stage's gradients whole (the encoder stages' projectors; the LLM is frozen)
    once = evaluate_plan(heavy, layers, "parallel", 4, dp=2, allreduce_bandwidth=1.0, sharding="FULL_SHARD",
                         fsdp_reduce="step")
    assert once.iteration_time == full.iteration_time and once.memory.keys() == full.memory.keys()
    assert [once.memory[s] > m for s, m in full.memory.items()] == ["language_model" not in s for s in full.memory]
    with_tp = {m: ModuleSpec(s.costs, s.param_bytes, s.activation_bytes, s.grad_bytes, tp_bytes=0.5)
               for m, s in modules.items()}
    fast = evaluate_plan(with_tp, layers, "parallel", 4, tp=2)
    slow = evaluate_plan(with_tp, layers, "parallel", 4, tp=2, tp_bandwidth=1.0)
    assert fast.iteration_time < evaluate_plan(with_tp, layers, "parallel", 4).iteration_time < slow.iteration_time


def test_forward_only_search_ranks_by_its_belief_and_is_not_faster():
    # a heavy frozen encoder: the unaware planner believes it costs 3F (it costs F) and ranks layouts so
    vision = layer_costs([2.0] * 8 + [0.1], [2.0] * 8 + [0.1], [2.0] * 8 + [0.1], [True] * 8 + [False])
    llm = layer_costs([1.0] * 8, [1.0] * 8, [1.0] * 8, True, upstream_trainable=True)
    modules = {"vision": ModuleSpec(vision), LM: ModuleSpec(llm)}
    for devices in (3, 4, 5, 6):
        aware = search(modules, num_devices=devices, num_microbatches=4, data_parallel=False)
        unaware = search(modules, num_devices=devices, num_microbatches=4, data_parallel=False, mode="forward-only")
        believed_best = min(unaware.candidates, key=lambda p: (p.iteration_time, p.devices))
        assert unaware.best.layers == believed_best.layers
        # the believed timing charges 2F of backward to the frozen encoder stages
        assert believed_best.backward["vision.0"] == pytest.approx(2 * believed_best.forward["vision.0"])
        assert unaware.best.backward["vision.0"] == 0.0  # re-timed with the true costs
        assert aware.best.iteration_time <= unaware.best.iteration_time + 1e-9
    # same stage count, boundaries only: 4 frozen layers (T=1), a trainable one (T=3), 3 frozen after it (T=2)
    costs = layer_costs([1] * 8, 1, 1, [True] * 4 + [False] + [True] * 3)
    chain_only = {LM: ModuleSpec(costs)}
    fast = evaluate_plan(chain_only, {LM: partition_module(costs, 2, "frozen-aware")}, "parallel", 4)
    slow = evaluate_plan(chain_only, {LM: partition_module(costs, 2, "forward-only")}, "parallel", 4)
    assert fast.layers[LM] == [5, 3] and slow.layers[LM] == [4, 4]
    assert fast.forward == {f"{LM}.0": 5, f"{LM}.1": 3} and fast.backward == {f"{LM}.0": 2, f"{LM}.1": 3}
    # hand: forward-only boundaries leave stage 0 forward-only (4/mb) and stage 1 at F4+B5 -> 4 + 4 * 9 = 40
    assert slow.iteration_time == pytest.approx(40)
    assert fast.iteration_time < slow.iteration_time


def test_plan_summary_and_colocated_replicated_evaluation():
    modules = small_mllm()
    layers = {"vision": [4, 3], "audio": [3, 2], LM: [4, 4]}
    colocated = evaluate_plan(modules, layers, "colocated", 4)
    assert colocated.forward["encoders.0"] == pytest.approx(4 * 1.0 + 3 * 0.5)
    assert colocated.backward["encoders.1"] == pytest.approx(0.2 + 0.1 + 0.1 + 0.05)
    replicated = evaluate_plan(modules, {"vision": [7], "audio": [5], LM: [4, 4]}, "replicated", 4)
    assert replicated.result.stages == (f"{LM}.0", f"{LM}.1")
    assert replicated.forward[f"{LM}.0"] == pytest.approx(6.2 + 2.1 + 8.0)
    text = plan_summary(colocated)
    assert "encoders.1" in text and "vision[4:7]+audio[3:5]" in text and "predicted iteration time" in text
    with pytest.raises(ValueError, match="equal encoder stage counts"):
        evaluate_plan(modules, {"vision": [4, 3], "audio": [5], LM: [8]}, "colocated", 4)


def test_search_with_fixed_stage_count_enumerates_every_split():
    # the seeds' Table 3.2 setting: the same total stage count for both modes; each chooses the split
    modules = small_mllm()
    for placement in ("parallel", "colocated"):
        result = search(modules, num_devices=6, num_microbatches=4, placements=(placement,), data_parallel=False, stages=5)
        assert all(p.stages_per_replica == 5 and p.dp == 1 and p.placement == placement for p in result.candidates)
        splits = {tuple(p.pp().values()) for p in result.candidates}
        if placement == "parallel":  # vision, audio, LLM stage counts summing to 5, each >= 1
            expected = {(v, a, 5 - v - a) for v in range(1, 4) for a in range(1, 4) if 5 - v - a >= 1}
        else:  # colocated: both encoders share the count
            expected = {(e, e, 5 - e) for e in range(1, 5)}
        assert splits == expected
        hand = [evaluate_plan(modules, {m: partition_module(modules[m].costs, n) for m, n in zip(modules, split)},
                              placement, 4) for split in expected]
        assert result.best.iteration_time == pytest.approx(min(p.iteration_time for p in hand))
    # the frozen-unaware mode keeps the stage count but may split it differently; never faster
    aware = search(modules, 5, 4, placements=("colocated",), data_parallel=False, stages=5)
    unaware = search(modules, 5, 4, placements=("colocated",), data_parallel=False, stages=5, mode="forward-only")
    assert unaware.best.stages_per_replica == 5
    assert aware.best.iteration_time <= unaware.best.iteration_time + 1e-12
    # dp is limited to dp * stages <= devices
    assert {p.dp for p in search(modules, 8, 4, data_parallel=True, stages=4).candidates} == {1, 2}
    with pytest.raises(ValueError, match="stages must be"):
        search(modules, 4, 4, stages=5)
    with pytest.raises(ValueError, match="no layout with stages"):
        search(modules, 30, 4, placements=("colocated",), stages=20)


def test_frozen_aware_search_never_slower_than_forward_only():
    # equal-bottleneck partitions differ in 1F1B time by where the heavier stages sit; the aware search also
    # times the forward-only proposals, so it can never lose to them (free search and fixed stage count)
    vision = layer_costs([0.3] * 10 + [0.05], [0.3] * 10 + [0.05], [0.3] * 10 + [0.05], [True] * 10 + [False])
    llm = layer_costs([1.0] * 11, [1.0] * 11, [1.0] * 11, True, upstream_trainable=True)
    modules = {"vision": ModuleSpec(vision), LM: ModuleSpec(llm)}
    for kwargs in ({}, {"stages": 5, "data_parallel": False}, {"stages": 6, "placements": ("colocated",)}):
        aware = search(modules, 6, 6, p2p_latency=0.01, **kwargs)
        unaware = search(modules, 6, 6, p2p_latency=0.01, mode="forward-only", **kwargs)
        assert aware.best.iteration_time <= unaware.best.iteration_time + 1e-12
        layouts = {(p.placement, tuple(map(tuple, p.layers.values())), p.dp) for p in aware.candidates}
        assert (unaware.best.placement, tuple(map(tuple, unaware.best.layers.values())), unaware.best.dp) in layouts


def test_forward_variance_baseline_picks_the_most_even_forward_split():
    # the seeds' unaware baseline minimises the variance of forward time across stages, which can differ from
    # minimising the slowest stage: here 5 encoder stages of 1.0 + 1 LLM stage of 1.5 (variance 0.035) beat
    # 4 encoder stages of 1.25 + 2 LLM stages of 0.75 (slowest stage lower, variance 0.063)
    vision = layer_costs([0.25] * 20, 0.25, 0.25, True)
    projector = layer_costs([1e-6], 1e-6, 1e-6, False)
    llm = layer_costs([0.375] * 4, 0.375, 0.375, True, upstream_trainable=True, recompute=True)
    modules = {"vision": ModuleSpec(vision + projector), LM: ModuleSpec(llm)}
    kwargs = dict(placements=("parallel",), data_parallel=False, stages=6)
    variance = search(modules, 6, 8, mode="forward-variance", **kwargs)
    minmax = search(modules, 6, 8, mode="forward-only", **kwargs)
    aware = search(modules, 6, 8, **kwargs)
    assert variance.best.pp() == {"vision": 5, LM: 1}
    assert minmax.best.pp() == {"vision": 4, LM: 2}
    # brute force: the variance rule over every candidate's forward times
    by_variance = min(variance.candidates, key=lambda p: (sum((f - sum(p.forward.values()) / 6) ** 2 for f in p.forward.values()),))
    assert by_variance.layers == variance.best.layers
    # timed with the true costs (frozen LLM backward = input grad + recompute = 2F, encoder backward only the
    # projector), the aware plan is never slower than either baseline
    assert aware.best.iteration_time <= min(variance.best.iteration_time, minmax.best.iteration_time) + 1e-12
    assert variance.best.iteration_time > minmax.best.iteration_time
    with pytest.raises(ValueError, match="unknown search mode"):
        search(modules, 6, 8, mode="variance")


def test_activation_bytes_are_the_saved_tensors():
    """Linear-GELU-Linear on B x d (fp32): trainable, it keeps x for W1's gradient, GELU's input, and GELU's
    output for W2's gradient; frozen, only GELU's input (the weights carry the input gradient); with no
    gradient path at all, nothing. Parameters are never counted."""
    from lightning_mm.planner.model_costs import part_activation_bytes

    b, d, h = 3, 4, 8
    net = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.GELU(), torch.nn.Linear(h, d))
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    x = torch.randn(b, d)
    assert part_activation_bytes(net, x, params) == 4 * (b * d + 2 * b * h)
    net.requires_grad_(False)
    assert part_activation_bytes(net, x, params) == 4 * b * h
    assert part_activation_bytes(net, x, params, input_grad=False) == 0


def test_gradient_allreduce_is_timed_and_can_favour_pipelining():
    """4 trainable LLM layers (F 1, B 2 each), 2 microbatches, 2 devices. dp 2 x pp 1: each replica runs one
    microbatch (4 + 8 = 12), then a ring all-reduce of the 40 gradient bytes: 2 (2-1)/2 x 40 / bandwidth.
    dp 1 x pp 2 (F 2, B 4 per stage): 1F1B over 2 microbatches = 18 by hand (stage 0: F0 0-2, F1 2-4,
    B0 8-12, B1 14-18), no all-reduce. Free all-reduce -> dp wins; at 5 bytes/s (8 s) -> pp wins."""
    from lightning_mm.planner.search import allreduce_seconds

    llm = layer_costs([1.0] * 4, 1.0, 1.0, False)
    modules = {LM: ModuleSpec(llm, grad_bytes=10.0)}
    dp2 = evaluate_plan(modules, {LM: [4]}, "parallel", 2, dp=2, allreduce_bandwidth=5.0)
    assert allreduce_seconds(40.0, 2, 5.0) == 8.0
    assert dp2.iteration_time == pytest.approx(12 + 8)
    assert [(e.kind, e.start, e.end) for e in dp2.result.events if e.kind == "sync"] == [("sync", 12.0, 20.0)]
    assert dp2.result.busy[f"{LM}.0"] == pytest.approx(12)
    pp2 = evaluate_plan(modules, {LM: [2, 2]}, "parallel", 2, dp=1, allreduce_bandwidth=5.0)
    assert pp2.iteration_time == pytest.approx(18)
    assert search(modules, 2, 2).best.pp() == {LM: 1} and search(modules, 2, 2).best.dp == 2
    slow = search(modules, 2, 2, allreduce_bandwidth=5.0).best
    assert (slow.dp, slow.pp()) == (1, {LM: 2})


@pytest.mark.slow
def test_write_profile_times_the_model_in_the_trainers_precision(tmp_path, monkeypatch):
    """`lightning-mm plan --write-profile` times every part of the YAML's model under the precision plugin's
    forward context (here bf16 autocast on CPU; on a GPU machine the strategy's CUDA device) and records both."""
    import json

    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_mm.trainer.cli import plan_main as plan

    entered = []
    original = MixedPrecision.forward_context

    def counted(self):
        entered.append(self.precision)
        return original(self)

    monkeypatch.setattr(MixedPrecision, "forward_context", counted)
    path = tmp_path / "profile.json"
    bf16 = tmp_path / "bf16.yaml"
    bf16.write_text("trainer:\n  precision: bf16-mixed\n")
    plan(["--config", "examples/tiny_valm_pp.yaml", "--config", str(bf16), "--write-profile", str(path),
          "--out", str(tmp_path / "plan")])
    data = json.loads(path.read_text())
    assert data["meta"]["precision"] == "bf16-mixed" and data["meta"]["device"] == "cpu"
    assert set(entered) == {"bf16-mixed"}
    assert set(data["modules"]) == {"vision", "audio", "language_model"}
    assert all(f > 0 for layers in data["modules"].values() for layer in layers
               for f, _, _ in layer["samples"].values())


@pytest.mark.slow
def test_plan_on_one_device_simulates_the_whole_model_in_one_process(tmp_path, capsys):
    """One device is the strategy's debug mode (the whole model in one process, whatever the specs say): `plan`
    simulates that layout, as the strategy runs it, instead of refusing the specs' two-stage layout."""
    from lightning_mm.trainer.cli import plan_main as plan

    one = tmp_path / "one.yaml"
    one.write_text("trainer:\n  devices: 1\n")
    plan(["--config", "examples/tiny_valm_pp.yaml", "--config", str(one), "--out", str(tmp_path / "plan")])
    out = capsys.readouterr().out
    assert "configured: 1 devices, placement=replicated, dp=1" in out
    assert "language_model[0:4]+vision[0:4]+audio[0:4]" in out and "on 1 devices (fits memory)" in out
    assert "no auto search on 1 device" in out and (tmp_path / "plan" / "configured.trace.json").exists()


# ---------------------------------------------------------------------------------- plan on the data's statistics
@pytest.mark.slow
def test_data_stats_scale_the_costs_to_the_datas_mean_work():
    """`plan --data-stats` scales each module's costs by (mean work per sample x samples) / (the microbatch's
    work as counted): data whose samples all equal the microbatch's leave them unchanged."""
    from types import SimpleNamespace

    from lightning_mm import MultimodalModel, ModalityEncoder, ParallelSpec
    from lightning_mm.data import MultimodalCollator, SyntheticMultimodalDataModule
    from lightning_mm.model import tiny_encoder, tiny_language_model
    from lightning_mm.planner.data_stats import microbatch_work, plan_data_stats
    from lightning_mm.planner.model_costs import model_layer_costs
    from lightning_mm.planner.workload import WorkloadModel

    torch.manual_seed(0)
    model = MultimodalModel({"vision": ModalityEncoder(tiny_encoder("siglip"))}, tiny_language_model("llama"))
    strategy = SimpleNamespace(encoder_specs=None, language_model_spec=ParallelSpec(), encoder_placement="parallel")
    trainer = SimpleNamespace(strategy=strategy, num_devices=4, num_nodes=1)  # vision + LLM rank: dp 2
    for text, items, same in (((16, 16), (1, 1), True), ((4, 40), (0, 3), False)):
        dm = SyntheticMultimodalDataModule(num_samples=24, batch_size=4, text_tokens=text, items_per_sample=items,
                                           model=model)
        data = dm.train_dataloader().dataset
        batch = MultimodalCollator(model)([data[i] for i in range(4)])
        costs = model_layer_costs(model, batch=batch)
        stats, scaled, factors = plan_data_stats(model, dm, trainer, batch, costs, devices=8)
        assert stats.num_samples == 24 and stats.gpus == 4 and stats.profiling.trials == 59  # 8 devices / dp 2
        if same:
            assert factors == pytest.approx({"vision": 1.0, "language_model": 1.0})
        else:
            workload = WorkloadModel.from_model(model)
            counted, samples = microbatch_work(model, workload, batch)
            metas = [data.sample_metadata(i) for i in range(24)]
            mean_llm = sum(workload.llm_work(m) for m in metas) / 24
            assert samples == 4 and factors["language_model"] == pytest.approx(mean_llm * 4 / counted[1])
            assert factors["language_model"] < 1  # the padded first batch overstates the LLM's work
        for module, layer_costs in costs.items():
            for c, s in zip(layer_costs, scaled[module]):
                assert s.forward == pytest.approx(c.forward * factors[module])
                assert (s.trainable, s.in_backward) == (c.trainable, c.in_backward)


@pytest.mark.slow
def test_plan_cli_data_stats_on_conversation_data(tmp_path, capsys):
    """`lightning-mm plan --data-stats` on a conversation YAML: the metadata of every record (no pixels), the
    vision:text workload ratio with its spread, b_min, and both plans costed on the data."""
    import runpy
    from pathlib import Path

    from lightning_mm.trainer.cli import plan_main as plan

    root = Path(__file__).resolve().parents[1]
    data = tmp_path / "data"
    runpy.run_path(str(root / "examples/make_conversation_data.py"))["main"]([str(data), "--records", "24"])
    extra = tmp_path / "extra.yaml"
    extra.write_text(f"trainer:\n  devices: 2\n  strategy: multimodal\ndata:\n  init_args:\n"
                     f"    data_path: {data}/train.json\n    media_root: {data}/images\n"
                     f"    processor: {data}/processor\n    cache_dir: {tmp_path}/cache\n")
    plan(["--config", str(root / "examples/conversation.yaml"), "--config", str(extra), "--devices", "4",
          "--data-stats", "--out", str(tmp_path / "plan")])
    out = capsys.readouterr().out
    assert "vision:language_model workload ratio" in out and "per sample mean" in out and "p95" in out
    assert "profiling batch (Bernoulli test, k = 59 batches): b_min = " in out
    assert "of 4 GPUs per replica" in out
    assert "costs scaled to the data's mean work: vision x" in out
    assert "auto search on 4 devices" in out and (tmp_path / "plan" / "auto.trace.json").exists()


# ---------------------------------------------------------------- context-parallel modes


def _cp_llm(heads, kv_heads, seq_len=1 << 20, layers=8):
    from lightning_mm.planner import AttentionShape

    costs = [LayerCost(1.0, 2.0, True, True) for _ in range(layers)]
    return {LM: ModuleSpec(costs, attention=AttentionShape(seq_len, heads, kv_heads, 128, 2))}


CP_BANDWIDTH = 100e9  # bytes/s per rank


@pytest.mark.parametrize("heads, kv_heads, winner", [(64, 8, "allgather"), (64, 64, "ulysses")])
def test_cp_mode_search_times_each_modes_bytes(heads, kv_heads, winner):
    """1M tokens on 8 CP ranks: a GQA model with 8 KV heads moves fewest bytes with allgather (3584 MiB per rank
    per layer forward, vs 3968 hybrid K=4 and 4032 ulysses); a 64-head MHA model with ulysses (7168 vs 28672).
    Each candidate's CP time is its layers x (forward + backward) bytes of cp_communication_bytes / bandwidth."""
    from lightning_mm.plan.cp_comm import cp_communication_bytes
    from lightning_mm.parallel.context import cp_communication_bytes as runtime_bytes

    assert runtime_bytes is cp_communication_bytes  # one formula, re-exported by the runtime
    modules = _cp_llm(heads, kv_heads)
    found = search(modules, 8, 8, data_parallel=False, cp_degrees=(8,), cp_modes=("allgather", "ulysses", "hybrid"),
                   cp_bandwidth=CP_BANDWIDTH)
    assert not found.rejected
    by_mode = {(p.cp_mode, p.ulysses): p for p in found.candidates}
    assert set(by_mode) == {("allgather", 1), ("ulysses", 8), ("hybrid", 2), ("hybrid", 4)}
    for (mode, k), plan in by_mode.items():
        b = cp_communication_bytes(mode, 1 << 20, 8, heads, kv_heads, 128, k if mode == "hybrid" else None, 2)
        assert plan.cp_comm["language_model.0"] == pytest.approx(8 * (b["forward"] + b["backward"]) / CP_BANDWIDTH)
        assert plan.forward["language_model.0"] == pytest.approx(8 * 1.0 / 8 + 8 * b["forward"] / CP_BANDWIDTH)
        assert plan.devices == 8
    mib = {m: cp_communication_bytes(m, 1 << 20, 8, heads, kv_heads, 128, 4 if m == "hybrid" else None)["forward"]
           / 2 ** 20 for m in ("allgather", "ulysses", "hybrid")}
    assert mib == ({"allgather": 3584, "ulysses": 4032, "hybrid": 3968} if kv_heads == 8 else
                   {"allgather": 28672, "ulysses": 7168, "hybrid": 10240})
    assert found.best.cp_mode == winner and min(mib, key=mib.get) == winner
    # free links: the modes tie (compute is split cp ways alike)
    free = search(modules, 8, 8, data_parallel=False, cp_degrees=(8,), cp_modes=("allgather", "ulysses"))
    assert len({round(p.iteration_time, 9) for p in free.candidates}) == 1


def test_cp_modes_the_heads_cannot_take_are_rejected_with_the_reason():
    modules = _cp_llm(12, 4, seq_len=1 << 16)
    found = search(modules, 8, 8, data_parallel=False, cp_degrees=(8,), cp_modes=("ulysses", "hybrid"))
    assert any("cp=8 cp_mode='ulysses'" in r and "12 query heads are not divisible by the Ulysses degree 8" in r
               for r in found.rejected)
    assert {(p.cp_mode, p.ulysses) for p in found.candidates} == {("hybrid", 2), ("hybrid", 4)}
    with pytest.raises(ValueError, match="not divisible by the Ulysses degree 8"):
        evaluate_plan(modules, {LM: [8]}, "parallel", 8, cp=8, cp_mode="ulysses")
    with pytest.raises(ValueError, match="ulysses in \\[2, 4\\]"):
        evaluate_plan(modules, {LM: [8]}, "parallel", 8, cp=8, cp_mode="hybrid", ulysses=3)
    with pytest.raises(ValueError, match="no layout.*rejected: cp=8 cp_mode='ulysses'"):
        search(modules, 8, 8, data_parallel=False, cp_degrees=(8,), cp_modes=("ulysses",))
    # tensor parallelism splits the heads first: 12 / 2 = 6 per tp rank, and Ulysses 4 no longer divides them
    found = search(modules, 16, 8, data_parallel=False, cp_degrees=(8,), cp_modes=("hybrid",), tp_degrees=(2,))
    assert {p.ulysses for p in found.candidates} == {2}
    assert any("ulysses=4 tp=2" in r for r in found.rejected)


def test_cp_llm_stages_take_cp_devices_and_the_table_and_yaml_show_the_mode():
    from lightning_mm.plan.layout import ParallelSpec
    from lightning_mm.planner.plan_cli import Units, stage_table, strategy_yaml
    import yaml

    modules = {"vision": ModuleSpec([LayerCost(1.0, 0.0, False, False)] * 4), **_cp_llm(64, 64)}
    plan = evaluate_plan(modules, {"vision": [4], LM: [4, 4]}, "parallel", 4, cp=4, cp_mode="hybrid", ulysses=2,
                         cp_bandwidth=CP_BANDWIDTH)
    assert plan.devices == 1 + 2 * 4 and plan.cp_comm["vision.0"] == 0
    table = stage_table(plan, "title", Units("ms", 1e3, True))
    assert "cp mode" in table and "cp comm (ms)" in table
    row = {line.split()[0]: line.split() for line in table.splitlines()[3:-1]}
    assert row["language_model.0"][2] == "hybrid(K=2)" and row["vision.0"][2] == "-"
    llm = yaml.safe_load(strategy_yaml(plan))["trainer"]["strategy"]["init_args"]["language_model"]["init_args"]
    assert llm == {"pp": 2, "tp": 1, "cp": 4, "cp_mode": "hybrid", "ulysses": 2}
    assert ParallelSpec(**llm).ulysses_degree == 2


@pytest.mark.slow
def test_plan_cli_searches_cp_modes_and_prints_the_mode_column(tmp_path, capsys):
    from lightning_mm.trainer.cli import main

    main(["plan", "--config", "examples/tiny_valm_pp.yaml", "--devices", "16", "--cp", "2,4", "--cp-mode",
          "allgather,ulysses,hybrid", "--device-flops", "1e12", "--cp-bandwidth", "50", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "not searched: cp=2 cp_mode='hybrid': cp=2 has no divisor K with 1 < K < cp" in out
    assert "CP attention traffic at 50 GB/s" in out
    auto = out.split("auto search on 16 devices")[1]
    assert "cp mode" in auto and "cp comm (ms)" in auto and "cp=" in auto.splitlines()[0]
    cp = int(auto.splitlines()[0].split("cp=")[1].split(",")[0])
    mode = auto.splitlines()[0].split("cp_mode=")[1].split(",")[0]
    llm_row = next(line for line in auto.splitlines() if line.startswith("language_model.0"))
    assert llm_row.split()[2] == mode
    if cp > 1:
        assert f"cp: {cp}, cp_mode: {mode.split('(')[0]}" in auto.split("put this in the fit YAML")[1]
