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
    from lightning_mm.cli import plan_main as plan

    out = tmp_path / "templates.yaml"
    plan(["--config", "examples/tiny_valm_pp.yaml", "--templates", "--nodes", "5", "--devices-per-node", "1",
          "--failures", "1", "--out", str(out)])
    ts = Templates.load(out)
    assert ts.node_counts == [2, 3] and ts.failures == 1  # n0 = 2 (encoders and LLM), n_max = 5 - 1 x 2
    text = capsys.readouterr().out
    assert "planning (s)" in text and f"wrote {out}" in text
    with pytest.raises(SystemExit, match="--templates needs --nodes N and --devices-per-node M"):
        plan(["--config", "examples/tiny_valm_pp.yaml", "--templates"])
