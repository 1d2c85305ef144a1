"""Per-module data parallelism: each encoder and the language model at its own data-parallel degree trains exactly
like the unparallelised model in one process (gloo, CPU, fp32, SGD); the layout, routing and refusals (pure)."""

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.per_module_dp_case import run_rank, run_reference
from helpers.pipeline_case import check_like_reference

# (modalities, freeze, encoder specs, llm spec, microbatches, rows per global batch[, sharding_strategy])
CASES = [
    pytest.param((("vision",), "encoder", {"vision": dict(dp=2)}, dict(dp=1, pp=2), 2, 4), id="vision-dp2-llm-dp1-pp2",
                 marks=pytest.mark.combines("per_module_dp", "pipeline")),
    pytest.param((("vision",), "encoder", {"vision": dict(dp=1)}, dict(dp=2), 2, 8), id="vision-dp1-llm-dp2"),
    pytest.param((("vision", "audio"), "encoder", {"vision": dict(dp=2), "audio": dict(dp=1)}, dict(dp=1), 2, 4),
                 id="vision-dp2-audio-dp1-llm-dp1"),
    pytest.param((("vision", "audio"), "encoder", {"vision": dict(dp=2), "audio": dict(dp=1)}, dict(dp=2), 2, 8),
                 id="vision-dp2-audio-dp1-llm-dp2"),
    pytest.param((("vision",), "encoder", {"vision": dict(dp=2)}, dict(dp=1, cp=2), 2, 4), id="vision-dp2-llm-cp2",
                 marks=pytest.mark.combines("per_module_dp", "llm_cp")),
    pytest.param((("vision",), "encoder", {"vision": dict(dp=2)}, dict(dp=3), 2, 12), id="vision-dp2-llm-dp3"),
    # with the other pieces: encoder stages, a frozen tower, LLM tensor parallelism; encoder CP, the LLM under FSDP2
    pytest.param((("vision",), "projectors", {"vision": dict(dp=2, pp=2)}, dict(dp=1, tp=2), 2, 4),
                 id="vision-dp2-pp2-frozen-llm-tp2", marks=pytest.mark.combines("per_module_dp", "pipeline", "tp")),
    pytest.param((("vision",), "encoder", {"vision": dict(dp=1, cp=2)}, dict(dp=2), 2, 8, "FULL_SHARD"),
                 id="vision-dp1-cp2-llm-dp2-fsdp",
                 marks=[pytest.mark.combines("per_module_dp", "encoder_cp"),
                        pytest.mark.combines("per_module_dp", "fsdp"),
                        pytest.mark.combines("encoder_cp", "fsdp", note="FSDP shards only the LLM (tower dp 1)")]),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_per_module_dp_trains_like_one_process(case):
    mods, freeze, encoder_specs, llm_spec, microbatches, rows, *sharding = case
    steps = 3
    ref_losses, ref_params = run_reference(mods, freeze, steps, rows)
    world = sum(s.get("dp", 1) * s.get("pp", 1) * s.get("cp", 1) * s.get("tp", 1)
                for s in [*encoder_specs.values(), llm_spec])
    results = run_distributed(run_rank, world, mods, freeze, encoder_specs, llm_spec, microbatches, steps, rows,
                              0.5, False, *sharding)
    check_like_reference(results, ref_losses, ref_params)


@pytest.mark.slow
def test_every_row_gets_its_own_samples_features():
    """Probe: vision dp 2 feeding LLM dp 3 (rows of 3 replicas over 2 encoder replicas): in the first step the
    features each row of each LLM microbatch receives are exactly the one-process encoder's features of that
    row's images (rows without images get none)."""
    from helpers.per_module_dp_case import build_model, global_batches

    mods, rows = ("vision",), 12
    results = run_distributed(run_rank, 5, mods, "encoder", {"vision": dict(dp=2)}, dict(dp=3), 2, 1, rows,
                              0.5, True)
    model = build_model(mods, "encoder")
    batch = global_batches(model, 1, rows)[0]
    with torch.no_grad():
        features = model.encoders["vision"](batch["vision"])
    tokens = (batch["input_ids"] == model.placeholder_ids["vision"]).sum(1).tolist()
    start = [sum(tokens[:r]) for r in range(rows)]
    probes = [r[2] for r in results if r[2] is not None]
    assert len(probes) == 3  # one per LLM replica
    checked = set()
    for probe in probes:
        assert len(probe) == 2  # microbatches
        for got, mb_rows in probe:
            want = torch.cat([features[start[r]:start[r] + tokens[r]] for r in mb_rows])
            torch.testing.assert_close(got.get("vision", want[:0]), want, rtol=1e-5, atol=1e-6)
            checked.update(mb_rows)
    assert checked == set(range(rows))
    assert 0 < sum(1 for t in tokens if t == 0) < rows  # text-only rows and rows with images both occur


# ---------------------------------------------------------------------------------------------- pure
def test_one_degree_keeps_todays_layout():
    """dp given on every module with one value, or on none: the same ranks as today's derived degree."""
    from lightning_mm.plan.layout import ParallelSpec as P, build_layout

    for enc, llm in [({"vision": P(tp=2), "audio": P()}, P(pp=2, cp=2)), ({"vision": P(pp=2)}, P(pp=3))]:
        today = build_layout(enc, llm, 3 * sum(s.size for s in [*enc.values(), llm]))
        given = build_layout({n: P(pp=s.pp, tp=s.tp, cp=s.cp, dp=3) for n, s in enc.items()},
                             P(pp=llm.pp, cp=llm.cp, tp=llm.tp, dp=3), today.world_size)
        assert not given.per_module_dp and given.dp == today.dp == 3
        assert [given.coordinate(r) for r in range(today.world_size)] == \
               [today.coordinate(r) for r in range(today.world_size)]
        assert given.to_dict() == today.to_dict()


def test_groups_hold_each_chains_share_of_replicas():
    import json
    from dataclasses import replace

    from lightning_mm.plan.layout import ParallelSpec as P, RankLayout, build_layout

    layout = build_layout({"vision": P(dp=4)}, P(pp=2, dp=2), 8)
    assert (layout.num_groups, layout.group_size, layout.dp) == (2, 4, 2)
    assert [(c.stage, c.dp) for c in map(layout.coordinate, range(8))] == [
        ("vision.0", 0), ("vision.0", 1), ("language_model.0", 0), ("language_model.1", 0),
        ("vision.0", 2), ("vision.0", 3), ("language_model.0", 1), ("language_model.1", 1)]
    assert layout.peer_replicas("vision.0", "language_model.0", 3) == [1]
    assert layout.peer_replicas("language_model.0", "vision.0", 1) == [2, 3]
    assert layout.peer_replicas("language_model.0", "language_model.1", 1) == [1]
    assert layout.grad_group_ranks("vision.0") == [0, 1, 4, 5]
    assert layout.mesh_ranks("language_model") == [[[[2]], [[3]]], [[[6]], [[7]]]]
    uneven = build_layout({"vision": P(dp=2, tp=2), "audio": P(dp=1)}, P(dp=3, cp=2), 11)
    assert uneven.num_groups == 1
    assert all(uneven.rank(**vars(uneven.coordinate(r))) == r for r in range(11))
    assert uneven.to_dict()["replicas_per_chain"] == {"vision": 2, "audio": 1, "language_model": 3}
    assert RankLayout.from_dict(json.loads(json.dumps(uneven.to_dict()))) == uneven  # through a checkpoint's JSON
    assert RankLayout.from_dict({**uneven.to_dict(), "ep": 2}) != uneven and hash(uneven) == hash(replace(uneven))


@pytest.mark.refuses("per_module_dp", "placement", message="need encoder_placement='parallel'")
def test_bad_per_module_degrees_fail_with_the_fix():
    from lightning_mm.plan.layout import ParallelSpec as P, build_layout
    from lightning_mm.plan.routing import check_group_batch

    with pytest.raises(ValueError, match="dp on every module"):
        build_layout({"vision": P(dp=2)}, P(), 3)
    with pytest.raises(ValueError, match="need 5 devices.*vision 2x1 \\+ language_model 1x3"):
        build_layout({"vision": P(dp=2)}, P(dp=1, pp=3), 4)
    with pytest.raises(ValueError, match="need encoder_placement='parallel'"):
        build_layout({"vision": P(dp=2)}, P(dp=1), 3, "replicated")
    with pytest.raises(ValueError, match="dp must be an int >= 1"):
        P(dp=0)
    with pytest.raises(ValueError, match="encoder 'vision' has 4 replicas.*raise batch_size to at least 4"):
        check_group_batch(2, 2, 2, {"vision": 4})
    check_group_batch(4, 2, 2, {"vision": 4})


def test_routing_encodes_each_row_once_and_both_ends_agree():
    """Random groups: every row with items is encoded once, in its own microbatch, by one replica; LPT keeps the
    replicas within one row of the optimum's bound; what each encoder replica sends language-model replica j is
    exactly j's rows it encoded, and the rows j assembles are its rows with items; an encoder with as many replicas
    as the language model pairs them."""
    import random

    from lightning_mm.plan.routing import route

    rng = random.Random(0)
    for _ in range(200):
        replicas, micro, per = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 4)
        rows = replicas * micro * per
        llm_rows = [[list(range((j * micro + m) * per, (j * micro + m + 1) * per)) for m in range(micro)]
                    for j in range(replicas)]
        work = {"vision": [rng.choice([0, 0, rng.randint(1, 100)]) for _ in range(rows)],
                "audio": [rng.randint(0, 5) for _ in range(rows)]}
        enc = {"vision": rng.randint(1, 5), "audio": replicas if rng.random() < 0.3 else rng.randint(1, 3)}
        routing = route(llm_rows, work, enc)
        for name, n in enc.items():
            for m in range(micro):
                g_m = [r for j in range(replicas) for r in llm_rows[j][m] if work[name][r]]
                got = [r for i in range(n) for r in routing.encoder_rows[name][i][m]]
                assert sorted(got) == sorted(g_m) and len(got) == len(set(got))
                loads = [sum(work[name][r] for r in routing.encoder_rows[name][i][m]) for i in range(n)]
                if n != replicas:  # LPT's list-scheduling bound
                    assert max(loads) <= sum(loads) / n + max([work[name][r] for r in g_m], default=0)
                for j in range(replicas):
                    sent = [r for i in range(n) for r in routing.sent_rows(name, i, j, m)]
                    assert sorted(sent) == [r for r in llm_rows[j][m] if work[name][r]]
                    if n == replicas:  # paired replicas (peer_replicas gives one peer): j encodes j's rows only
                        assert routing.encoder_rows[name][j][m] == [r for r in llm_rows[j][m] if work[name][r]]
        assert routing.fingerprint() == route(llm_rows, work, enc).fingerprint()


def test_many_to_many_schedules_are_deadlock_free_at_every_rank():
    """The schedule expanded to every replica (each message to every peer replica of its group) completes under
    rendezvous sends, with and without deferrals, frozen and trainable encoders."""
    import itertools

    from lightning_mm.plan.layout import ParallelSpec as P, build_layout
    from lightning_mm.plan.routing import expand_replicas
    from lightning_mm.plan.schedule import build_stage_graph, check_rendezvous, one_f_one_b

    for (v, a, l), llm_pp, k in itertools.product([(2, 1, 1), (1, 1, 3), (4, 2, 2), (2, 3, 6)], (1, 2), (1, 3)):
        layout = build_layout({"vision": P(pp=2, dp=v), "audio": P(dp=a)}, P(pp=llm_pp, dp=l),
                              2 * v + a + llm_pp * l)
        replicas = {s: layout.per_group(layout.chain_of(s)) for s in layout.stages}
        for trainable in (True, False):
            graph = build_stage_graph({"vision": 2, "audio": 1}, llm_pp, "parallel",
                                      {s: trainable or s.startswith("language") for s in layout.stages})
            for deferred in [()] + [(m,) for m in range(k - 1)]:
                check_rendezvous(expand_replicas(one_f_one_b(graph, k, deferred), replicas, layout.peer_replicas))


# ---------------------------------------------------------------------------------------------- Lightning
@pytest.mark.slow
@pytest.mark.parametrize("balancing", [pytest.param("entrain", marks=pytest.mark.ci), "disttrain"])
@pytest.mark.combines("per_module_dp", "pipeline", "balancing")
def test_trainer_fit_validate_test_predict_like_one_process(tmp_path, balancing):
    """Trainer.fit under vision dp 2 + LLM dp 1 pp 2 (4 processes, the vision tower trained) with batch
    balancing, then validate/test/predict: every loss, every trainable parameter, the evaluation losses and the
    predicted ids equal plain single-process Lightning on the same global batches (0-5 images per sample)."""
    from tests.test_lightning_contracts import assert_same_training, run

    base = dict(modalities=["vision"], vision="qwen2_vl", freeze="all", items=[0, 5], optimizer="sgd", lr=0.5,
                steps=2, batch_size=4, validate=True, test=True, predict=True)
    ref = run(base, tmp_path, "single")
    got = run({**base, "llm_pp": 2, "microbatches": 2, "encoder_dp": [2], "llm_dp": 1, "balancing": balancing,
               "plans": True}, tmp_path, balancing)
    assert_same_training(got, ref)
    for key in ("val", "test"):
        assert got[0][key] == pytest.approx(ref[0][key], rel=1e-5)
    assert got[0]["predicted_ids"] == ref[0]["predicted_ids"]
    assert len(got[0]["plans"]) == 2  # the balanced plans ran


def _trainer_llm_dp2(tmp_path, name: str, **case):
    """Trainer.fit with the vision tower on 1 replica and the LLM on 2 (3 processes) vs plain one-process Lightning on
    the same global batches of 8 (samples of 0-5 images of different sizes, everything trained, SGD)."""
    from tests.test_lightning_contracts import assert_same_training, run

    base = dict(modalities=["vision"], vision="qwen2_vl", freeze="all", items=[0, 5], optimizer="sgd", lr=0.5,
                steps=2, batch_size=4, **case.pop("base", {}))
    ref = run({**base, "dp": 2, "accumulate": case.get("accumulate", 1)}, tmp_path, "single")
    got = run({**base, "encoder_dp": [1], "llm_dp": 2, **case}, tmp_path, name)
    assert sorted(p.name for p in (tmp_path / name).glob("fsdp_*.json")) == [f"fsdp_{r}.json" for r in range(3)]
    assert_same_training(got, ref)
    return got


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    pytest.param(dict(balancing="none"), id="contiguous"),
    pytest.param(dict(balancing="entrain", microbatches=2, accumulate=2), id="entrain-mb2-accumulate2",
                 marks=pytest.mark.combines("per_module_dp", "balancing", "accumulation")),
])
def test_trainer_vision_dp1_llm_dp2_like_one_process(tmp_path, case):
    """Under the Trainer each LLM replica trains its DistributedSampler share of the global batch (the vision
    replica encodes the rows of both): every micro-step loss and every trained parameter as one process."""
    _trainer_llm_dp2(tmp_path, case["balancing"], **case)


@pytest.mark.slow
@pytest.mark.combines("ep", "per_module_dp")
def test_trainer_vision_dp1_moe_llm_dp2_ep2_like_one_process(tmp_path):
    """The same with a Qwen3-MoE LLM whose experts are split over its 2 replicas (ep 2; aux loss off: a mean over
    microbatches that no split of the batch reproduces)."""
    got = _trainer_llm_dp2(tmp_path, "ep2", balancing="none", llm_ep=2,
                           base=dict(llm="qwen3_moe", llm_config={"output_router_logits": False}))
    assert any(".mlp.experts." in n for n in got[1])
