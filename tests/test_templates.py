"""Pipeline templates (plan/templates.py): YAML round trip, coverage errors, Eq. 2.6's batch split against brute
force, instantiation, and the planner building them (plan_cli.build_templates)."""

import itertools

import pytest

from lightning_mm.plan.layout import ParallelSpec
from lightning_mm.plan.templates import PipelineTemplate, Templates, instantiate, split_batch, step_time
from lightning_mm.planner.costs import LayerCost
from lightning_mm.planner.plan_cli import build_templates
from lightning_mm.planner.search import ModuleSpec


def template(nodes, per_mb=1.0, fill=0.0, pp=None):
    pp = pp or nodes
    sizes = tuple([1] * (pp - 1) + [8 - (pp - 1)])
    return PipelineTemplate(nodes, 1, {"language_model": ParallelSpec(pp=pp)}, {"language_model": sizes},
                            microbatch_time=per_mb, fill_time=fill)


def test_yaml_round_trip_and_template_for(tmp_path):
    ts = Templates((template(2, 0.5, 1.0), template(3, 0.4, 1.5), template(4, 0.3, 2.0)), failures=1)
    ts.save(tmp_path / "t.yaml")
    back = Templates.load(tmp_path / "t.yaml")
    assert back == ts
    assert back.template_for(3).partition == {"language_model": (1, 1, 6)}
    with pytest.raises(ValueError, match=r"cover 2, 3, 4 ranks.*lightning-mm plan --templates"):
        back.template_for(5)
    assert ts.templates[1].fqns_per_stage("language_model", [f"l{i}" for i in range(8)]) == [
        ["l0"], ["l1"], ["l2", "l3", "l4", "l5", "l6", "l7"]]


def test_bad_templates_refused(tmp_path):
    with pytest.raises(ValueError, match="consecutive"):
        Templates((template(2), template(4)))
    with pytest.raises(ValueError, match="pp=3"):
        PipelineTemplate(2, 1, {"language_model": ParallelSpec(pp=3)}, {"language_model": (4, 4)})
    (tmp_path / "x.yaml").write_text("a: 1\n")
    with pytest.raises(ValueError, match="not a templates file"):
        Templates.load(tmp_path / "x.yaml")


@pytest.mark.parametrize("seed", range(6))
def test_split_batch_is_optimal_and_covers_the_batch(seed):
    import random

    rng = random.Random(seed)
    groups = [template(2, rng.uniform(0.2, 2.0), rng.uniform(0.0, 3.0)) for _ in range(rng.randint(1, 4))]
    for b in range(len(groups), 10):
        counts = split_batch(groups, b)
        assert sum(counts) == b and min(counts) >= 1
        best = min(step_time(groups, c) for c in itertools.product(range(1, b + 1), repeat=len(groups))
                   if sum(c) == b)
        assert step_time(groups, counts) == pytest.approx(best)


def test_split_batch_refuses_too_small_a_batch():
    with pytest.raises(ValueError, match="cannot give each of the 3 groups one; use a global batch of at least 3"):
        split_batch([template(2)] * 3, 2)


def test_instantiate_uses_every_node_and_f_plus_one_groups():
    ts = Templates(tuple(template(n, 1.0 / n, 0.1 * n) for n in range(2, 6)), failures=1)  # N = 7, n0 = 2
    for nodes in range(4, 8):
        sizes = instantiate(ts, nodes, 16)
        assert sum(sizes) == nodes and len(sizes) >= 2
        every = [c for k in range(2, nodes // 2 + 1) for c in itertools.combinations_with_replacement(range(2, 6), k)
                 if sum(c) == nodes]
        groups = [[ts.template_for(n) for n in c] for c in every]
        best = min(step_time(g, split_batch(g, 16)) for g in groups)
        chosen = [ts.template_for(n) for n in sizes]
        assert step_time(chosen, split_batch(chosen, 16)) == pytest.approx(best)
    with pytest.raises(ValueError, match="3 nodes cannot hold 2 groups"):
        instantiate(ts, 3, 16)


def test_build_templates_from_the_search():
    costs = [LayerCost(1.0, 2.0, True, True)] * 8
    specs = {"language_model": ModuleSpec(costs, param_bytes=10.0, activation_bytes=1.0)}
    ts = build_templates(specs, nodes=7, devices_per_node=1, failures=1, num_microbatches=8, memory_limit=60.0)
    assert ts.node_counts == [2, 3, 4, 5]  # 8 layers x 10 bytes (+ activations) need 2 devices; n_max = 7 - 1 x 2
    for t in ts.templates:
        assert t.devices == t.nodes and sum(t.partition["language_model"]) == 8
        assert t.specs["language_model"].pp * t.dp == t.nodes
    assert ts.templates[-1].step_time(8) < ts.templates[0].step_time(8)


def test_templates_branch_prints_the_table_and_writes_the_file(tmp_path, capsys):
    import argparse

    from lightning_mm.planner.plan_cli import Units, _templates

    specs = {"language_model": ModuleSpec([LayerCost(1.0, 2.0, True, True)] * 8, param_bytes=10.0,
                                          activation_bytes=1.0)}
    args = argparse.Namespace(nodes=6, devices_per_node=1, failures=1, memory_limit=60.0 / 2 ** 30,
                              allreduce_bandwidth=float("inf"), tp_bandwidth=float("inf"), out=None)
    _templates(args, specs, 8, [1], Units("GFLOP", 1.0, False), tmp_path)
    assert Templates.load(tmp_path / "templates.yaml").node_counts == [2, 3, 4]
    lines = capsys.readouterr().out.splitlines()
    assert "planning (s)" in lines[1] and len(lines) == 3 + 3 + 1


@pytest.mark.slow
def test_plan_cli_writes_templates(tmp_path, capsys):
    from lightning_mm.trainer.cli import plan_main as plan

    out = tmp_path / "templates.yaml"
    plan(["--config", "examples/tiny_valm_pp.yaml", "--templates", "--nodes", "5", "--devices-per-node", "1",
          "--failures", "1", "--out", str(out)])
    ts = Templates.load(out)
    assert ts.node_counts == [2, 3] and ts.failures == 1  # n0 = 2 (encoders and LLM), n_max = 5 - 1 x 2
    text = capsys.readouterr().out
    assert "planning (s)" in text and f"wrote {out}" in text
    with pytest.raises(SystemExit, match="--templates needs --nodes N and --devices-per-node M"):
        plan(["--config", "examples/tiny_valm_pp.yaml", "--templates"])


def _every_candidate_template(specs, nodes, devices_per_node, num_microbatches, memory_limit=float("inf"),
                              tp_degrees=(1,), allreduce_bandwidth=float("inf"), tp_bandwidth=float("inf"),
                              placements=("parallel", "colocated")):
    """plan_template's answer by brute force: every candidate that fills the devices simulated at the batch, the
    fastest (time, dp, enumeration order) that fits and is node-local; its (specs, partition, placement, dp,
    times)."""
    from lightning_mm.plan.layout import check_node_locality, replica_layout
    from lightning_mm.planner.search import candidate_layouts, evaluate_plan

    devices = nodes * devices_per_node

    def fastest(microbatches):
        plans = []
        for tp in (t for t in tp_degrees if devices % t == 0):
            for dp in (d for d in range(1, devices // tp + 1) if (devices // tp) % d == 0 and microbatches % d == 0):
                for placement, layers in candidate_layouts(specs, devices // (dp * tp), placements):
                    encoders = {m: ParallelSpec(pp=len(v), tp=tp) for m, v in layers.items() if m != "language_model"}
                    llm = ParallelSpec(pp=len(layers["language_model"]), tp=tp)
                    if replica_layout(encoders, llm, placement, replicas=dp).world_size == devices:
                        plans.append(evaluate_plan(specs, layers, placement, microbatches, dp, tp=tp,
                                                   memory_limit=memory_limit, tp_bandwidth=tp_bandwidth,
                                                   allreduce_bandwidth=allreduce_bandwidth))

        def local(plan):
            try:
                check_node_locality(plan.layout, devices_per_node)
            except ValueError:
                return False
            return True

        fit = [p for p in plans if p.devices == devices and p.fits_memory and local(p)]
        return min(fit, key=lambda p: (p.iteration_time, p.dp), default=None)

    best = fastest(num_microbatches)
    if best is None and num_microbatches % devices:
        num_microbatches = -(-num_microbatches // devices) * devices
        best = fastest(num_microbatches)
    if best is None:
        return None
    twice = evaluate_plan(specs, best.layers, best.placement, 2 * num_microbatches, best.dp, memory_limit=memory_limit,
                          tp=best.tp, allreduce_bandwidth=allreduce_bandwidth, tp_bandwidth=tp_bandwidth)
    per_mb = max((twice.iteration_time - best.iteration_time) / num_microbatches, 1e-30)
    encoders, llm = best.parallel_specs()
    return ({**encoders, "language_model": llm}, {m: tuple(v) for m, v in best.layers.items()}, best.placement,
            best.dp, per_mb, max(best.iteration_time - num_microbatches * per_mb, 0.0))


def _planner_cases():
    """Small grids of LLM-only and multimodal specs: uneven and frozen layers, tight memory, finite bandwidths."""
    import random

    rng = random.Random(3)

    def llm(n, frozen=0, uneven=False):
        costs = [LayerCost(f, 0.0 if i < frozen else 3.0 * f, i >= frozen, i >= frozen)
                 for i, f in enumerate(rng.uniform(0.5, 2.0) if uneven else 1.0 for _ in range(n))]
        return ModuleSpec(costs, param_bytes=[20.0 if i == 0 else 10.0 for i in range(n)], activation_bytes=2.0,
                          grad_bytes=4.0, tp_bytes=1.0)

    def encoder(n, trainable):
        return ModuleSpec([LayerCost(0.7, 2.1 if trainable else 0.0, trainable, trainable)] * n, param_bytes=8.0,
                          activation_bytes=1.0, grad_bytes=2.0, tp_bytes=0.5)

    specs = {"even": {"language_model": llm(8)}, "uneven": {"language_model": llm(7, uneven=True)},
             "frozen": {"language_model": llm(6, frozen=2, uneven=True)},
             "vision": {"vision": encoder(3, False), "language_model": llm(6)},
             "two": {"vision": encoder(2, True), "audio": encoder(3, False), "language_model": llm(5, uneven=True)},
             "short": {"language_model": llm(2)}}  # few layers: only a dp the batch does not divide fills 8 devices
    for name, s in specs.items():
        for nodes, per_node in ((1, 1), (1, 4), (2, 1), (2, 2), (3, 2), (2, 4), (4, 2)):
            for tp, memory, microbatches, bandwidth in (((1,), float("inf"), 4, float("inf")),
                                                        ((1, 2), 120.0, 6, 50.0), ((1, 2, 4), 60.0, 3, 5.0),
                                                        ((1,), float("inf"), 3, 5.0)):
                placements = ("parallel", "colocated", "replicated") if name == "two" else ("parallel", "colocated")
                yield (f"{name}-{nodes}x{per_node}-tp{tp[-1]}-mem{memory}-n{microbatches}", s, nodes, per_node,
                       microbatches, dict(memory_limit=memory, tp_degrees=tp, allreduce_bandwidth=bandwidth,
                                          tp_bandwidth=bandwidth, placements=placements))


def test_plan_template_equals_simulating_every_candidate():
    """The bound-pruned search returns the brute force's template exactly (same layout, same times)."""
    from lightning_mm.planner.plan_cli import plan_template

    found = 0
    for name, specs, nodes, per_node, microbatches, kwargs in _planner_cases():
        want = _every_candidate_template(specs, nodes, per_node, microbatches, **kwargs)
        got = plan_template(specs, nodes, per_node, microbatches, **kwargs)
        if want is None:
            assert got is None, name
            continue
        found += 1
        assert (got.specs, got.partition, got.placement, got.dp, got.microbatch_time, got.fill_time) == want, name
    assert found > 60  # most cases have a layout that fits


def test_partition_equals_the_loop_dp():
    """The vectorised, cached partition DP gives the loop DP's splits, ties included (earliest boundaries)."""
    import importlib
    import random
    from itertools import accumulate

    partition_module = importlib.import_module("lightning_mm.planner.partition")
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(1, 14)
        pick = trial % 3
        costs = [float(rng.randint(0, 3)) if pick == 0 else rng.random() if pick == 1 else rng.choice([0.1, 0.2, 1e-17])
                 for _ in range(n)]
        prefix = [0.0, *accumulate(costs)]
        for stages in range(1, n + 1):
            assert partition_module.partition(costs, stages) == partition_module._partition_loops(prefix, stages)
