"""Layer-wise sync across replica groups of different layouts: the pure bucket plan, and its reduction on gloo
processes against the weighted mean computed in one process."""

import random

import pytest
import torch

from lightning_mm.plan.layer_sync import GroupHoldings, buckets_of, holdings, layer_buckets
from lightning_mm.plan.layout import ParallelSpec, build_layout

LLM = ["language_model.embed"] + [f"language_model.layers.{i}.w" for i in range(4)] + ["language_model.head"]
VISION = ["vision.projector.w"]
ORDER = VISION + LLM


def _stage_params(layout, cuts):
    """Parameter names per stage: the vision stage holds the projector, LLM stages hold ``cuts`` layers each, the
    first the embedding and the last the head (which also holds the embedding when ``tied``)."""
    out = {"vision.0": list(VISION)}
    start = 0
    llm_stages = [s for s in layout.stages if s.startswith("language_model")]
    for i, (stage, n) in enumerate(zip(llm_stages, cuts)):
        names = [f"language_model.layers.{j}.w" for j in range(start, start + n)]
        start += n
        if i == 0:
            names.insert(0, "language_model.embed")
        if i == len(llm_stages) - 1:
            names.append("language_model.head")
        out[stage] = names
    return out


def _group(llm_pp, cuts, tp=1):
    layout = build_layout({"vision": ParallelSpec(pp=1, tp=tp)}, ParallelSpec(pp=llm_pp, tp=tp), (1 + llm_pp) * tp)
    return layout, holdings(layout, _stage_params(layout, cuts))


def test_pp2_beside_pp1_pairs_each_llm_stage_of_a_with_the_one_of_b():
    (_, a), (_, b) = _group(2, [2, 2]), _group(1, [4])
    buckets = layer_buckets([a, b], ORDER)
    assert [(bk.stages, bk.members) for bk in buckets] == [
        (("vision.0", "vision.0"), (((0, 0), (1, 0)),)),
        (("language_model.0", "language_model.0"), (((0, 1), (1, 1)),)),
        (("language_model.1", "language_model.0"), (((0, 2), (1, 1)),)),
    ]
    assert buckets[1].names == ("language_model.embed", "language_model.layers.0.w", "language_model.layers.1.w")
    assert buckets[2].names == ("language_model.layers.2.w", "language_model.layers.3.w", "language_model.head")
    # B's single LLM rank reduces two buckets, one with each of A's LLM ranks
    assert [(i, t, pos) for i, _, t, pos in buckets_of(buckets, 1, 1)] == [(1, 0, 1), (2, 0, 1)]
    assert [i for i, *_ in buckets_of(buckets, 0, 2)] == [2]


def test_tied_embedding_is_reduced_on_its_first_stage():
    layout, _ = _group(2, [2, 2])
    params = _stage_params(layout, [2, 2])
    params["language_model.1"].append("language_model.embed")  # the head's tied copy
    tied = holdings(layout, params)
    assert tied.stage_of["language_model.embed"] == "language_model.0"
    buckets = layer_buckets([tied, _group(1, [4])[1]], ORDER)
    assert sum(b.names.count("language_model.embed") for b in buckets) == 1


@pytest.mark.parametrize("seed", range(6))
def test_every_parameter_in_one_bucket_with_the_stages_that_hold_it(seed):
    """Random cuts of 3 groups (pp 1-3, tp 2): each name is in exactly one bucket, whose stages are the name's
    holder stages and whose members are those stages' tp holders; at most sum(stages) buckets, in model order."""
    rng = random.Random(seed)
    groups = []
    for _ in range(3):
        pp = rng.randint(1, 3)
        cut = sorted(rng.sample(range(1, 4), pp - 1))
        cuts = [b - a for a, b in zip([0] + cut, cut + [4])]
        groups.append(_group(pp, cuts, tp=2))
    buckets = layer_buckets([h for _, h in groups], ORDER)
    seen = [n for b in buckets for n in b.names]
    assert sorted(seen) == sorted(ORDER) and len(seen) == len(ORDER)
    assert [ORDER.index(b.names[0]) for b in buckets] == sorted(ORDER.index(b.names[0]) for b in buckets)
    assert len(buckets) <= sum(len(lay.stages) for lay, _ in groups)
    for b in buckets:
        for name in b.names:
            assert b.stages == tuple(h.stage_of[name] for _, h in groups)
        for t in range(2):
            assert b.members[t] == tuple((g, lay.rank(s, 0, 0, t)) for g, ((lay, _), s) in enumerate(zip(groups, b.stages)))


def test_groups_that_cannot_sync_are_refused_by_name():
    a = _group(2, [2, 2])[1]
    with pytest.raises(ValueError, match="one tp degree in every group"):
        layer_buckets([a, _group(1, [4], tp=2)[1]], ORDER)
    fewer = GroupHoldings({k: v for k, v in a.stage_of.items() if k != "vision.projector.w"}, a.holders)
    with pytest.raises(ValueError, match="replica group 1 holds a different set of trainable parameters"):
        layer_buckets([a, fewer], ORDER)


# ------------------------------------------------------------------------------------------------ on processes

NAMES = ["language_model.embed"] + [f"language_model.layers.{i}.w" for i in range(4)] + ["language_model.head"]
WEIGHTS = {0: 3.0, 1: 5.0}  # label tokens of group A and group B
UNUSED = {"language_model.layers.3.w": {1}, "language_model.head": {0, 1}}  # groups in which a parameter got no grad


def _grad(name, group):
    g = torch.Generator().manual_seed(1000 * group + NAMES.index(name))
    return torch.randn(4, 3, generator=g)


def _llm_group(pp):
    layout = build_layout({}, ParallelSpec(pp=pp), pp)
    per = -(-4 // pp)
    stage_params = {}
    for i, stage in enumerate(layout.stages):
        names = [f"language_model.layers.{j}.w" for j in range(i * per, min(4, (i + 1) * per))]
        stage_params[stage] = (["language_model.embed"] if i == 0 else []) + names + \
            (["language_model.head"] if i == pp - 1 else [])
    return holdings(layout, stage_params)


def _sync_rank(world_rank, world, store_port):
    """Group A = world ranks 0, 1 (LLM pp 2); group B = world rank 2 (pp 1). Every bucket's process group is a
    torchft ProcessGroupGloo configured under its own prefix of one TCPStore, as a quorum configures them."""
    from torchft.process_group import ProcessGroupGloo

    from lightning_mm.parallel.layerwise_reduce import bucket_process_groups, sync_layers

    group, rank = (0, world_rank) if world_rank < 2 else (1, 0)
    holding = [_llm_group(2), _llm_group(1)]
    buckets = layer_buckets(holding, NAMES)
    store = torch.distributed.TCPStore("127.0.0.1", store_port, world, is_master=world_rank == 0,
                                       wait_for_workers=False)

    def make(i, t, pos, size):
        pg = ProcessGroupGloo()
        pg.configure(f"127.0.0.1:{store_port}/lmm/q1/h{i}_{t}", f"group{group}", pos, size)
        return pg

    pgs = bucket_process_groups(buckets, group, rank, make)
    mine = [n for n, s in holding[group].stage_of.items() if holding[group].holders[s][0] == rank]
    params = {}
    for n in mine:
        p = torch.nn.Parameter(torch.zeros(4, 3))
        p.grad = None if group in UNUSED.get(n, ()) else _grad(n, group)
        params[n] = p
    sync_layers(buckets, group, rank, params, torch.tensor([WEIGHTS[group]]), pgs)
    del store
    return {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}


@pytest.mark.slow
@pytest.mark.ci
def test_groups_of_different_stages_reduce_each_layer_with_its_own_peers():
    """A (pp 2) and B (pp 1) end with the label-token weighted mean of their gradients on every rank that holds a
    parameter; a parameter no group used keeps no gradient, one only A used gets A's share."""
    pytest.importorskip("torchft")
    from helpers.distributed import _free_port, run_distributed

    results = run_distributed(_sync_rank, 3, _free_port())
    total = sum(WEIGHTS.values())
    expected = {}
    for n in NAMES:
        users = [g for g in (0, 1) if g not in UNUSED.get(n, ())]
        expected[n] = None if not users else sum(WEIGHTS[g] * _grad(n, g) for g in users) / total
    a = {**results[0], **results[1]}
    assert sorted(a) == sorted(results[2]) == sorted(NAMES)
    for n in NAMES:
        for got in (a[n], results[2][n]):
            if expected[n] is None:
                assert got is None, n
            else:
                torch.testing.assert_close(got, expected[n], rtol=1e-6, atol=1e-6)


@pytest.mark.refuses("ft", "tp", message="with global_batch (replica groups of different layouts) cannot serve this "
                                          "run: tensor parallelism inside a group")
@pytest.mark.refuses("ft", "fsdp", message="with global_batch (replica groups of different layouts) cannot serve this "
                                            "run: sharding_strategy='FULL_SHARD'")
def test_what_layerwise_fault_tolerance_does_not_serve_is_named_before_training():
    from types import SimpleNamespace

    from lightning_mm.fault_tolerance import FaultToleranceError
    from lightning_mm.fault_tolerance.layerwise import check_servable

    def strategy(dp=1, cp=1, tp=1, sharding="NO_SHARD"):
        layout = build_layout({}, ParallelSpec(pp=2, dp=dp, cp=cp, tp=tp), 2 * dp * cp * tp)
        return SimpleNamespace(layout=layout, sharding_strategy=sharding)

    check_servable(strategy())
    check_servable(strategy(dp=2, cp=2))  # a stage's copies take the synced result from its holder
    with pytest.raises(FaultToleranceError, match="use tp 1") as refused:
        check_servable(strategy(tp=2))
    assert ("with global_batch (replica groups of different layouts) cannot serve this run: "
            "tensor parallelism inside a group") in str(refused.value)
    with pytest.raises(FaultToleranceError, match="use NO_SHARD") as refused:
        check_servable(strategy(sharding="FULL_SHARD"))
    assert ("with global_batch (replica groups of different layouts) cannot serve this run: "
            "sharding_strategy='FULL_SHARD'") in str(refused.value)


def test_a_published_group_reads_back_as_its_holdings():
    from lightning_mm.fault_tolerance.layerwise import group_holdings

    from lightning_mm.fault_tolerance import FaultToleranceError

    doc = {"stage_params": {"language_model.0": ["a", "b"], "language_model.1": ["c"]},
           "holders": {"language_model.0": [0], "language_model.1": [1]}, "fingerprint": 7}
    holding, order = group_holdings(doc)
    assert order == ["a", "b", "c"] and holding.stage_of == {"a": "language_model.0", "b": "language_model.0",
                                                             "c": "language_model.1"}
    assert holding.holders == {"language_model.0": (0,), "language_model.1": (1,)}
    doc["stage_params"]["language_model.1"].append("a")  # tied across stages
    with pytest.raises(FaultToleranceError, match="tie_word_embeddings=False"):
        group_holdings(doc)


def test_template_shares_split_whole_microbatches_by_planned_step_time():
    """Eq. 2.6 as split_batch solves it: a 2-node template at 1.0 per microbatch beside a 1-node one at 2.0 gets 3
    of 4 microbatches; samples past the last whole microbatch go one each in order; too few microbatches for
    every group is refused by name."""
    from lightning_mm.fault_tolerance import FaultToleranceError
    from lightning_mm.fault_tolerance.layerwise import template_shares
    from lightning_mm.plan.templates import PipelineTemplate

    def template(nodes, pp, time):
        return PipelineTemplate(nodes=nodes, devices_per_node=1, specs={"language_model": ParallelSpec(pp=pp)},
                                partition={"language_model": (4,) if pp == 1 else (2, 2)},
                                microbatch_time=time).to_dict()

    fast, slow = template(2, 2, 1.0), template(1, 1, 2.0)
    assert template_shares([fast, slow], 4, 1) == [(0, 3), (3, 4)]
    assert template_shares([slow, fast], 4, 1) == [(0, 1), (1, 4)]
    assert template_shares([fast, slow], 5, 2) == [(0, 3), (3, 5)]  # 1 + 1 microbatches of 2, one sample over
    with pytest.raises(FaultToleranceError, match="cannot give each of the 2 groups one"):
        template_shares([fast, slow], 3, 2)
