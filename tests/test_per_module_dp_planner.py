"""Per-module data parallelism in the planner (DistTrain's orchestration) against brute-force references."""

import itertools
import math
import random

import pytest
import yaml

from lightning_mm.plan.layout import ParallelSpec
from lightning_mm.planner import LayerCost, ModuleSpec, evaluate_plan
from lightning_mm.planner.orchestration import Unit, integer_min_max, search_per_module_dp, water_fill
from lightning_mm.planner.partition import partition_module
from lightning_mm.planner.plan_cli import strategy_yaml

LM = "language_model"


# ---------------------------------------------------------------------------------------------- the inner problem
def brute_min_max(times, weights, lower, upper, budget):
    """min over integer unit counts of max_i times[i](n_i), sum_i weights[i] n_i <= budget (None if infeasible)."""
    best = None
    for counts in itertools.product(*(range(lo, hi + 1) for lo, hi in zip(lower, upper))):
        if sum(w * n for w, n in zip(weights, counts)) <= budget:
            value = max(t(n) for t, n in zip(times, counts))
            best = value if best is None else min(best, value)
    return best


def test_water_fill_closed_form_is_optimal_and_bounds_every_integer_allocation():
    rng = random.Random(3)
    for _ in range(300):
        k = rng.randint(1, 4)
        work = [rng.choice([0.0, rng.uniform(0.1, 10.0)]) for _ in range(k)]
        lower = [rng.randint(1, 3) for _ in range(k)]
        upper = [rng.choice([math.inf, lo + rng.randint(0, 6)]) for lo in lower]
        budget = sum(lower) + rng.randint(0, 12)
        t, x = water_fill(work, lower, budget, upper)
        assert sum(x) <= budget + 1e-9 and all(lo - 1e-12 <= v <= hi + 1e-12 for v, lo, hi in zip(x, lower, upper))
        assert max(a / v for a, v in zip(work, x)) == pytest.approx(t, abs=1e-12)
        floor = max((a / hi for a, hi in zip(work, upper) if hi < math.inf), default=0.0)
        if t > floor + 1e-12:  # optimal: any lower level needs more than the budget
            lower_level = t * (1 - 1e-7)
            assert sum(min(hi, max(lo, a / lower_level)) for a, lo, hi in zip(work, lower, upper)) > budget
        finite = [min(hi, budget) for hi in upper]
        brute = brute_min_max([lambda n, a=a: a / n for a in work], [1] * k, lower, finite, budget)
        assert t <= brute + 1e-12


def test_integer_min_max_equals_brute_force():
    rng = random.Random(5)
    for case in range(300):
        k = rng.randint(1, 3)
        weights = [rng.randint(1, 3) for _ in range(k)]
        lower = [rng.randint(1, 2) for _ in range(k)]
        upper = [lo + rng.randint(0, 5) for lo in lower]
        budget = sum(w * lo for w, lo in zip(weights, lower)) + rng.randint(-1, 14)
        times = []
        for _ in range(k):  # a / n, or an encoder replica's ceil(G / n) samples times its stage
            a, group = rng.uniform(0.5, 9.0), rng.randint(1, 7)
            times.append((lambda n, a=a: a / n) if case % 2 else (lambda n, a=a, g=group: -(-g // n) * a))
        units = [Unit(t, w, lo, hi) for t, w, lo, hi in zip(times, weights, lower, upper)]
        found = integer_min_max(units, budget)
        brute = brute_min_max(times, weights, lower, upper, budget)
        if brute is None:
            assert found is None
            continue
        level, counts = found
        assert level == pytest.approx(brute, rel=1e-12)
        assert sum(w * n for w, n in zip(weights, counts)) <= budget
        assert max(t(n) for t, n in zip(times, counts)) == pytest.approx(level, rel=1e-12)


def test_water_fill_refuses_too_few_devices():
    with pytest.raises(ValueError, match="at least 5 devices"):
        water_fill([1.0, 1.0], [2, 3], 4)


# ---------------------------------------------------------------------------------------------------- evaluate_plan
def mllm(encoder_trainable=True, vision_layers=4, llm_layers=4, vision_cost=1.0, llm_cost=3.0):
    def module(n, f, trainable, upstream):
        return ModuleSpec([LayerCost(f * (1 + 0.1 * i), (2 * f if trainable else 0.0) + (f if upstream else 0.0),
                                     trainable, trainable or upstream) for i in range(n)],
                          param_bytes=[16e6 if trainable else 2e6] * n, activation_bytes=[3e6] * n,
                          grad_bytes=[4e6 if trainable else 0.0] * n, tp_bytes=[1e6] * n)
    return {"vision": module(vision_layers, vision_cost, encoder_trainable, False),
            LM: module(llm_layers, llm_cost, True, encoder_trainable)}


def same_plan(a, b):
    assert a.iteration_time == b.iteration_time and a.forward == b.forward and a.backward == b.backward
    assert a.memory == b.memory and a.result.events == b.result.events and a.devices == b.devices


@pytest.mark.parametrize("placement, layers", [("parallel", {"vision": [2, 2], LM: [1, 3]}),
                                               ("colocated", {"vision": [1, 3], LM: [2, 2]}),
                                               ("replicated", {"vision": [4], LM: [2, 2]})])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_equal_dps_evaluate_exactly_as_one_dp(placement, layers, dp):
    modules = mllm()
    kwargs = dict(allreduce_bandwidth=1e9, tp_bandwidth=5e9, sharding="SHARD_GRAD_OP", tp=2)
    today = evaluate_plan(modules, layers, placement, 8, dp, **kwargs)
    per_module = evaluate_plan(modules, layers, placement, 8, {"vision": dp, LM: dp}, **{**kwargs, "tp": {
        "vision": 2, LM: 2}})
    same_plan(today, per_module)
    assert per_module.parallel_specs()[1].dp == dp and today.parallel_specs()[1].dp is None


def test_encoder_with_fewer_replicas_takes_its_share_of_each_microbatch_position():
    modules = mllm()
    layers = {"vision": [4], LM: [2, 2]}
    bw = 1e9
    for llm_dp, vision_dp, per_replica in ((4, 2, 2), (3, 2, 2), (4, 1, 4), (2, 4, 1)):
        samples = -(-4 // llm_dp) if llm_dp < vision_dp else 1  # microbatches of enough samples for every replica
        plan = evaluate_plan(modules, layers, "parallel", 12 * llm_dp, {"vision": vision_dp, LM: llm_dp},
                             allreduce_bandwidth=bw, samples_per_microbatch=samples)
        n = -(-llm_dp * samples // vision_dp) / samples
        assert n == per_replica / samples
        # reference: one replica of today's planner with the vision layers' costs and activations scaled by n
        scaled = dict(modules, vision=ModuleSpec(
            [LayerCost(c.forward * n, c.backward * n, c.trainable, c.in_backward) for c in modules["vision"].costs],
            param_bytes=modules["vision"].param_bytes, activation_bytes=[3e6 * n] * 4, grad_bytes=[4e6] * 4))
        ref = evaluate_plan(scaled, layers, "parallel", 12, 1)
        assert plan.microbatches_per_replica == 12 and plan.devices == vision_dp + 2 * llm_dp
        assert plan.forward == pytest.approx(ref.forward) and plan.backward == pytest.approx(ref.backward)
        assert plan.memory == pytest.approx(ref.memory)
        # each chain all-reduces its gradients over its own replicas, after its last backward
        sync = {e.stage: e.end - e.start for e in plan.result.events if e.kind == "sync"}
        assert sync.get("vision.0", 0.0) == pytest.approx(2 * (vision_dp - 1) / vision_dp * 16e6 / bw)
        assert sync["language_model.0"] == pytest.approx(2 * (llm_dp - 1) / llm_dp * 8e6 / bw)
        computed = [(e.stage, e.kind, e.microbatch, e.start, e.end) for e in plan.result.events if e.kind != "sync"]
        assert computed == [(e.stage, e.kind, e.microbatch, pytest.approx(e.start), pytest.approx(e.end))
                            for e in ref.result.events]
        ends = {s: max(e.end for e in ref.result.events if e.stage == s) for s in ref.result.stages}
        assert plan.iteration_time == pytest.approx(max(t + sync.get(s, 0.0) for s, t in ends.items()))


def test_unequal_dps_the_runtime_does_not_serve_are_refused_with_the_fix():
    modules = mllm()
    with pytest.raises(ValueError, match="encoder_placement='parallel'"):
        evaluate_plan(modules, {"vision": [2, 2], LM: [2, 2]}, "colocated", 8, {"vision": 2, LM: 4})
    with pytest.raises(ValueError, match="encoder_placement='parallel'"):
        evaluate_plan(modules, {"vision": [4], LM: [2, 2]}, "replicated", 8, {"vision": 1, LM: 2})
    with pytest.raises(ValueError, match=r"vision dp <= 2, or LLM microbatches of >= 2 samples"):
        evaluate_plan(modules, {"vision": [4], LM: [2, 2]}, "parallel", 8, {"vision": 4, LM: 2})
    with pytest.raises(ValueError, match="one int >= 1 for every module"):
        evaluate_plan(modules, {"vision": [4], LM: [2, 2]}, "parallel", 8, {LM: 2})
    with pytest.raises(ValueError, match="encoder_placement='parallel'"):
        search_per_module_dp(modules, 8, 8, placement="colocated")


# --------------------------------------------------------------------------------------------------------- search
def exhaustive(modules, devices, microbatches, tps, samples=1, **kwargs):
    """Every (dp, tp, pp) of both modules on at most ``devices``, simulated; the fastest (then fewest devices)."""
    best = None
    for lm_dp, lm_tp, v_tp in itertools.product(range(1, microbatches + 1), tps, tps):
        if microbatches % lm_dp:
            continue
        for lm_pp, v_pp in itertools.product(range(1, len(modules[LM].costs) + 1),
                                             range(1, len(modules["vision"].costs) + 1)):
            for v_dp in range(1, lm_dp * samples + 1):
                if lm_dp * lm_tp * lm_pp + v_dp * v_tp * v_pp > devices:
                    continue
                layers = {m: partition_module(modules[m].costs, pp) for m, pp in (("vision", v_pp), (LM, lm_pp))}
                plan = evaluate_plan(modules, layers, "parallel", microbatches, {"vision": v_dp, LM: lm_dp},
                                     tp={"vision": v_tp, LM: lm_tp}, samples_per_microbatch=samples, **kwargs)
                if plan.fits_memory and (best is None or (plan.iteration_time, plan.devices)
                                         < (best.iteration_time, best.devices)):
                    best = plan
    return best


@pytest.mark.parametrize("devices, trainable, vision_cost", [(8, True, 1.0), (11, False, 1.0), (12, True, 2.5),
                                                             (7, True, 0.3)])
def test_search_is_within_two_percent_of_exhaustive_simulation(devices, trainable, vision_cost):
    modules = mllm(trainable, vision_cost=vision_cost)
    kwargs = dict(allreduce_bandwidth=2e8, tp_bandwidth=2e9)
    found = search_per_module_dp(modules, devices, 8, tp_degrees=(1, 2), **kwargs)
    ref = exhaustive(modules, devices, 8, (1, 2), **kwargs)
    assert found.best.devices <= devices
    assert found.best.iteration_time <= 1.02 * ref.iteration_time
    # the estimate (Eq. 1 + 2) of the chosen layout is close to its simulated time
    assert found.estimate == pytest.approx(found.best.iteration_time, rel=0.15)


def test_frozen_encoder_gets_fewer_devices_and_per_module_beats_one_dp():
    from lightning_mm.planner import search

    frozen, trained = (search_per_module_dp(mllm(t, vision_cost=6.0, llm_layers=12), 20, 64, tp_degrees=(1,)).best
                       for t in (False, True))
    assert frozen.module_dp["vision"] * frozen.pp()["vision"] == 4  # F only: a quarter of the cost of F + B_w + B_d
    assert trained.module_dp["vision"] * trained.pp()["vision"] == 8
    modules = mllm(False, vision_cost=0.4, llm_layers=12)
    uniform = search(modules, 17, 64, placements=("parallel",)).best  # 2 replicas of vision 1 + LLM pp 7
    per_module = search_per_module_dp(modules, 17, 64, tp_degrees=(1,)).best  # vision dp 1 feeds LLM dp 16
    assert (uniform.dp, uniform.devices) == (2, 16)
    assert per_module.module_dp == {"vision": 1, LM: 16} and per_module.devices == 17
    assert uniform.iteration_time / per_module.iteration_time > 1.5


def test_memory_limit_is_met_and_forces_stages():
    modules = mllm()
    free = search_per_module_dp(modules, 16, 16, tp_degrees=(1,)).best
    limit = 0.6 * max(free.memory.values())
    tight = search_per_module_dp(modules, 16, 16, tp_degrees=(1,), memory_limit=limit).best
    assert tight.fits_memory and max(tight.memory.values()) <= limit
    assert tight.pp()[LM] + tight.pp()["vision"] > free.pp()[LM] + free.pp()["vision"]
    with pytest.raises(ValueError, match="no per-module layout"):
        search_per_module_dp(modules, 16, 16, tp_degrees=(1,), memory_limit=1e3)


def test_yaml_carries_dp_on_every_spec_and_parses_back():
    modules = mllm(False, vision_cost=0.4)
    plan = search_per_module_dp(modules, 16, 16, tp_degrees=(1, 2)).best
    doc = yaml.safe_load(strategy_yaml(plan))
    args = doc["trainer"]["strategy"]["init_args"]
    specs = {**{e: ParallelSpec(**s["init_args"]) for e, s in args["encoders"].items()},
             LM: ParallelSpec(**args["language_model"]["init_args"])}
    assert {m: s.dp for m, s in specs.items()} == plan.module_dp
    assert {m: s.tp for m, s in specs.items()} == plan.module_tp
    assert doc["trainer"]["devices"] == sum(s.dp * s.size for s in specs.values()) == plan.devices
    assert args["encoder_placement"] == "parallel" and args["num_microbatches"] == 16 // plan.dp


def test_plan_cli_per_module_dp_writes_a_yaml_with_dp(tmp_path, capsys):
    from lightning_mm.cli import main

    main(["plan", "--config", "examples/tiny_valm_pp.yaml", "--devices", "8", "--per-module-dp", "--tp", "1,2",
          "--device-flops", "1e12", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "per-module dp search on 8 devices" in out and "subproblems solved in" in out
    text = out.split("put this in the fit YAML")[1].split(":\n\n", 1)[1].split("\nwrote ")[0]
    args = yaml.safe_load(text)["trainer"]["strategy"]["init_args"]
    specs = [ParallelSpec(**s["init_args"]) for s in (*args["encoders"].values(), args["language_model"])]
    assert all(s.dp is not None for s in specs) and set(args["encoders"]) == {"vision", "audio"}
    assert yaml.safe_load(text)["trainer"]["devices"] == sum(s.dp * s.size for s in specs) <= 8
    assert (tmp_path / "auto.png").exists() or (tmp_path / "auto.trace.json").exists()
