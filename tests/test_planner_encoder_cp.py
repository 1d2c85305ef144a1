"""Encoder context parallelism in the planner: an encoder's stages split each microbatch's items over N ranks (compute
and kept activations of the busiest rank), its last stage pays the feature all-gather (forward) and the
feature-gradient all-reduce (backward), its ranks come from the rank layout, and the search and ``lightning-mm plan``
offer it only with parallel placement. Pure: no process group."""

import json
import math
import os

import pytest
import yaml

from lightning_mm.plan.items import item_work, shard_items
from lightning_mm.plan.layout import ParallelSpec, build_layout
from lightning_mm.planner import LayerCost, ModuleSpec, evaluate_plan, search
from lightning_mm.planner.search import encoder_cp_split

LM = "language_model"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "tiny_valm_pp.yaml")
GB = 1e9


def _modules(vision_forward=4.0, feature_bytes=2 * GB, items=None, trainable_projector=True):
    """vision: a frozen layer (F = vision_forward) and a projector (F 2, B 2 when trainable), 100 bytes of state
    per layer, the projector keeping 8 bytes per in-flight microbatch; LLM: 2 trainable layers (F 1, B 2)."""
    projector = LayerCost(2.0, 2.0, True, True) if trainable_projector else LayerCost(2.0, 0.0, False, False)
    vision = ModuleSpec([LayerCost(vision_forward, 0.0, False, False), projector], param_bytes=100.0,
                        activation_bytes=[0.0, 8.0], grad_bytes=[0.0, 40.0], items=items, feature_bytes=feature_bytes)
    llm = ModuleSpec([LayerCost(1.0, 2.0, True, True)] * 2, param_bytes=50.0, activation_bytes=3.0, grad_bytes=50.0)
    return {"vision": vision, LM: llm}


def test_encoder_cp_halves_compute_and_pays_the_gather_hand_computed():
    """vision at cp 2 (items split evenly: no items given): compute (4 + 2) / 2 = 3 forward, 2 / 2 = 1 backward;
    the gather receives (2-1)/2 x 2 GB at 1 GB/s = 1 s in forward, the ring all-reduce of the 2 GB gradient
    2 (2-1)/2 x 2 GB / 1 GB/s = 2 s in backward; state stays whole, kept activations halve; 2 + 1 ranks."""
    layers = {"vision": [2], LM: [2]}
    one = evaluate_plan(_modules(), layers, "parallel", 4, cp_bandwidth=GB)
    two = evaluate_plan(_modules(), layers, "parallel", 4, cp_bandwidth=GB, encoder_cp={"vision": 2})
    assert (one.forward["vision.0"], one.backward["vision.0"]) == (6.0, 2.0)
    assert (two.forward["vision.0"], two.backward["vision.0"]) == (3.0 + 1.0, 1.0 + 2.0)
    assert two.cp_comm == {"vision.0": 3.0, "language_model.0": 0.0}
    assert two.forward[LM + ".0"] == one.forward[LM + ".0"] and two.encoder_cp == {"vision": 2}
    peak = two.result.peak_inflight["vision.0"]
    assert peak == one.result.peak_inflight["vision.0"] == 2
    assert one.memory["vision.0"] == 200.0 + 8.0 * peak and two.memory["vision.0"] == 200.0 + 4.0 * peak
    # ranks: the rank layout's (vision 2 ranks, LLM 1), times tp and dp
    assert (one.devices, two.devices) == (2, 3)
    wide = evaluate_plan(_modules(), layers, "parallel", 4, dp=2, tp=2, encoder_cp={"vision": 2})
    specs = {"vision": ParallelSpec(pp=1, cp=2, tp=2)}, ParallelSpec(pp=1, tp=2)
    assert wide.devices == build_layout(*specs, 12, "parallel").world_size == 12
    assert wide.layout.cp == {"vision.0": 2, LM + ".0": 1}
    # the simulator's forward events of the stage carry the gather as communication
    fwd = [e for e in two.result.events if e.stage == "vision.0" and e.kind == "forward"]
    bwd = [e for e in two.result.events if e.stage == "vision.0" and e.kind == "backward"]
    assert len(fwd) == 4 and all(e.end - e.start == 4.0 and e.comm == 1.0 for e in fwd)
    assert all(e.end - e.start == 3.0 and e.comm == 2.0 for e in bwd)
    assert all(e.comm == 0.0 for e in one.result.events)
    # free links: exactly half the compute, no communication
    free = evaluate_plan(_modules(), layers, "parallel", 4, encoder_cp={"vision": 2})
    assert (free.forward["vision.0"], free.backward["vision.0"]) == (3.0, 1.0)
    assert free.iteration_time < one.iteration_time


def test_gradients_reduce_over_dp_times_encoder_cp_and_a_frozen_encoder_has_no_gather_backward():
    """The CP ranks hold the same parameters, so the gradient all-reduce spans dp x N ranks (ring: 2 (4-1)/4 x
    40 bytes at 10 B/s = 6 s); with a frozen projector the stage runs no backward, and the gather none either."""
    plan = evaluate_plan(_modules(), {"vision": [2], LM: [2]}, "parallel", 4, dp=2, allreduce_bandwidth=10.0,
                         encoder_cp={"vision": 2})
    sync = [e for e in plan.result.events if e.stage == "vision.0" and e.kind == "sync"]
    assert [e.end - e.start for e in sync] == [pytest.approx(2 * 3 / 4 * 40.0 / 10.0)]
    frozen = evaluate_plan(_modules(trainable_projector=False), {"vision": [2], LM: [2]}, "parallel", 4,
                           cp_bandwidth=GB, encoder_cp={"vision": 2})
    assert frozen.backward["vision.0"] == 0.0 and frozen.cp_comm["vision.0"] == 1.0


def test_item_granularity_uses_the_runtimes_lpt_split():
    """With the microbatches' items the busiest rank's share comes from ``shard_items`` on ``item_work``: one item
    on 2 ranks gains nothing; 40/10/10/10-token items (work 4, 1, 1, 1) put 40 tokens on one rank and 30 on the
    other: work share 4/7, token share 40/70; over two microbatches the shares are ratios of sums."""
    one_item = ModuleSpec([LayerCost(1.0, 0.0, False, False)], items=[[(64, 5.0)]])
    assert encoder_cp_split(one_item, 2) == (1.0, 1.0)
    uneven = ModuleSpec([LayerCost(1.0, 0.0, False, False)], items=[[(40, 4.0), (10, 1.0), (10, 1.0), (10, 1.0)]])
    assert shard_items(item_work([40, 10, 10, 10], 0), 2) == [[0], [1, 2, 3]]
    assert encoder_cp_split(uneven, 2) == pytest.approx((4 / 7, 40 / 70))
    assert encoder_cp_split(uneven, 4) == pytest.approx((4 / 7, 40 / 70))
    two_mbs = ModuleSpec([LayerCost(1.0, 0.0, False, False)], items=[[(10, 1.0)], [(10, 1.0), (10, 1.0)]])
    assert encoder_cp_split(two_mbs, 2) == pytest.approx((2 / 3, 20 / 30))
    assert encoder_cp_split(ModuleSpec([LayerCost(1.0, 0.0, False, False)]), 4) == (0.25, 0.25)  # even: no items
    # in a plan: compute and kept activations at those shares, the padded gather at the token share
    modules = _modules(items=[[(40, 4.0), (10, 1.0), (10, 1.0), (10, 1.0)]])
    plan = evaluate_plan(modules, {"vision": [2], LM: [2]}, "parallel", 4, cp_bandwidth=GB, encoder_cp={"vision": 2})
    gather = (2 - 1) * 2 * GB * (40 / 70) / GB
    assert plan.forward["vision.0"] == pytest.approx(6.0 * 4 / 7 + gather)
    assert plan.cp_comm["vision.0"] == pytest.approx(gather + 2.0)
    peak = plan.result.peak_inflight["vision.0"]
    assert plan.memory["vision.0"] == pytest.approx(200.0 + 8.0 * 40 / 70 * peak)


def test_search_buys_encoder_cp_for_a_bottleneck_encoder_only():
    """A one-layer-deep encoder stage (pipelining cannot split it) 8x the LLM's layers: on 3 devices the search
    gives it 2 CP ranks (vision 2 + LLM 1); a cheap encoder whose gather costs more than CP saves keeps cp 1."""
    heavy = {"vision": ModuleSpec([LayerCost(8.0, 0.0, False, False)], feature_bytes=GB),
             LM: ModuleSpec([LayerCost(1.0, 2.0, True, True)] * 2)}
    found = search(heavy, 3, 8, data_parallel=False, encoder_cp_degrees=(1, 2), cp_bandwidth=100 * GB)
    assert found.best.encoder_cp == {"vision": 2} and found.best.devices == 3
    assert found.best.pp() == {"vision": 1, LM: 1}
    plain = search(heavy, 3, 8, data_parallel=False, cp_bandwidth=100 * GB)
    # 8 microbatches: cp 1 = 8 x 8 (vision) + 2 + 4 (the last microbatch through the LLM) = 70; cp 2 = 4 + 0.005
    # (the first half-forward and its 1 GB x 1/2 gather at 100 GB/s), then the LLM stage (2 + 4) x 8 bounds it
    assert plain.best.encoder_cp == {} and plain.best.iteration_time == 70.0
    assert found.best.iteration_time == pytest.approx(4.005 + 8 * 6.0)
    # too few devices for a 2-rank encoder stage next to an LLM stage: nothing with encoder CP is proposed
    assert all(p.encoder_cp == {} for p in search(heavy, 2, 8, encoder_cp_degrees=(1, 2)).candidates)
    cheap = {"vision": ModuleSpec([LayerCost(0.1, 0.0, False, False)], feature_bytes=GB),
             LM: ModuleSpec([LayerCost(1.0, 2.0, True, True)] * 2)}
    kept = search(cheap, 4, 8, data_parallel=False, encoder_cp_degrees=(1, 2), cp_bandwidth=10 * GB)
    assert kept.best.encoder_cp == {} and any(p.encoder_cp for p in kept.candidates)


def test_colocated_and_replicated_placements_are_not_offered_encoder_cp():
    """The rank layout's own check refuses encoder CP outside parallel placement: evaluate_plan raises its message,
    the search skips those placements for cp > 1 and says why."""
    modules = {"vision": _modules()["vision"], "audio": _modules()["vision"], LM: _modules()[LM]}
    with pytest.raises(ValueError) as layout_err:
        build_layout({"vision": ParallelSpec(cp=2), "audio": ParallelSpec()}, ParallelSpec(), 3, "colocated")
    with pytest.raises(ValueError) as plan_err:
        evaluate_plan(modules, {"vision": [2], "audio": [2], LM: [2]}, "colocated", 4, encoder_cp={"vision": 2})
    assert str(plan_err.value) == str(layout_err.value)
    assert "needs encoder_placement='parallel'" in str(layout_err.value)
    with pytest.raises(ValueError, match="not encoders of these modules"):
        evaluate_plan(modules, {"vision": [2], "audio": [2], LM: [2]}, "parallel", 4, encoder_cp={"text": 2})
    found = search(modules, 8, 4, encoder_cp_degrees=(1, 2), placements=("parallel", "colocated", "replicated"))
    assert {p.placement for p in found.candidates} == {"parallel", "colocated", "replicated"}
    assert all(not p.encoder_cp for p in found.candidates if p.placement != "parallel")
    assert {tuple(sorted(p.encoder_cp.items())) for p in found.candidates if p.placement == "parallel"} >= {
        (), (("vision", 2),), (("audio", 2),), (("audio", 2), ("vision", 2))}
    assert any("placement 'colocated'" in r and "needs encoder_placement='parallel'" in r for r in found.rejected)
    assert any("placement 'replicated'" in r for r in found.rejected)
    with pytest.raises(ValueError, match="no layout.*needs encoder_placement='parallel'"):
        search(modules, 8, 4, encoder_cp_degrees=(2,), placements=("colocated",))


def test_default_search_is_unchanged_and_more_degrees_only_add_candidates():
    """``encoder_cp_degrees=(1,)`` is the default; adding 2 keeps every cp-1 candidate as it was (same layouts and
    times) and can only improve the best."""
    modules = {"vision": _modules()["vision"], "audio": _modules(vision_forward=1.0)["vision"], LM: _modules()[LM]}
    kw = dict(allreduce_bandwidth=100.0, tp_degrees=(1, 2), placements=("parallel", "colocated", "replicated"),
              cp_bandwidth=GB)
    default, ones, more = (search(modules, 8, 4, **kw), search(modules, 8, 4, encoder_cp_degrees=(1,), **kw),
                           search(modules, 8, 4, encoder_cp_degrees=(1, 2), **kw))
    key = lambda p: (p.placement, json.dumps(p.layers), p.dp, p.tp, p.forward, p.backward, p.memory,  # noqa: E731
                     p.iteration_time, p.devices)
    assert [key(p) for p in default.candidates] == [key(p) for p in ones.candidates]
    assert key(default.best) == key(ones.best) and default.rejected == ones.rejected == []
    assert not any(p.encoder_cp for p in default.candidates)
    without = [key(p) for p in more.candidates if not p.encoder_cp]
    assert without == [key(p) for p in ones.candidates]
    assert more.best.iteration_time <= ones.best.iteration_time


@pytest.mark.slow
def test_data_stats_microbatches_give_the_split_and_the_feature_bytes():
    """``plan --data-stats`` draws 64 microbatches of the planned microbatch's samples from the metadata; the
    encoder's ModuleSpec gets their items (encoder tokens, work) and the features of their mean emitted tokens."""
    from types import SimpleNamespace

    import torch

    from lightning_mm import ModalityEncoder, MultimodalModel
    from lightning_mm.data import MultimodalCollator, SyntheticMultimodalDataModule
    from lightning_mm.model import tiny_encoder, tiny_language_model
    from lightning_mm.planner.data_stats import draw_microbatch_items, microbatch_items, plan_data_stats
    from lightning_mm.planner.model_costs import model_layer_costs
    from lightning_mm.plan.items import encoder_width
    from lightning_mm.planner.plan_cli import module_specs
    from lightning_mm.planner.workload import WorkloadModel

    torch.manual_seed(0)
    model = MultimodalModel({"vision": ModalityEncoder(tiny_encoder("siglip"))}, tiny_language_model("llama"))
    strategy = SimpleNamespace(encoder_specs=None, language_model_spec=ParallelSpec(), encoder_placement="parallel")
    trainer = SimpleNamespace(strategy=strategy, num_devices=4, num_nodes=1)
    dm = SyntheticMultimodalDataModule(num_samples=24, batch_size=4, text_tokens=(4, 40), items_per_sample=(0, 3),
                                       model=model)
    data = dm.train_dataloader().dataset
    batch = MultimodalCollator(model)([data[i] for i in range(4)])
    costs = model_layer_costs(model, batch=batch)
    stats, scaled, _ = plan_data_stats(model, dm, trainer, batch, costs, devices=8)
    workload = WorkloadModel.from_model(model)
    metas = [data.sample_metadata(i) for i in range(24)]
    drawn = stats.microbatches["vision"]
    assert drawn == draw_microbatch_items(metas, workload, ["vision"], 4)["vision"] and len(drawn) == 64
    assert any(len(mb) > 1 for mb in drawn)
    llm_cfg = model.language_model.config
    token_bytes = llm_cfg.hidden_size * next(model.language_model.parameters()).element_size()
    specs = module_specs(model, scaled, 1e-9, batch, microbatches=stats.microbatches)
    vision = specs["vision"]
    assert vision.items == tuple(tuple((t, w) for t, w, _ in mb) for mb in drawn)
    assert vision.feature_bytes == pytest.approx(sum(n for mb in drawn for *_, n in mb) / 64 * token_bytes)
    assert vision.item_width == encoder_width(model.encoders["vision"].config) > 0
    # without --data-stats: the planned microbatch's own items
    first = module_specs(model, costs, 1e-9, batch)["vision"]
    own = microbatch_items(model, workload, batch)["vision"]
    assert first.items == (tuple((t, w) for t, w, _ in own),)
    assert first.feature_bytes == sum(n for *_, n in own) * token_bytes
    # the split: ratio of sums of the busiest rank's work over the drawn microbatches
    slow = total = 0.0
    for mb in drawn:
        shards = shard_items(item_work([t for t, _, _ in mb], vision.item_width), 2)
        slow += max(sum(mb[i][1] for i in s) for s in shards)
        total += sum(w for _, w, _ in mb)
    assert encoder_cp_split(vision, 2)[0] == pytest.approx(slow / total) and 0.5 <= slow / total < 1.0


def test_plan_cli_writes_encoder_cp_that_the_real_cli_parses(tmp_path, capsys):
    """`lightning-mm plan --encoder-cp 2`: both encoders get 2 CP ranks (the table's cp column and "items" mode,
    the gather in "cp comm"); the printed YAML, layered over the example, loads with the real CLI and builds a
    strategy whose encoders have cp 2 on the planned devices."""
    from lightning_mm.trainer.cli import load_fit_config, main

    main(["plan", "--config", EXAMPLE, "--devices", "8", "--encoder-cp", "2", "--device-flops", "1e12",
          "--cp-bandwidth", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    auto = out.split("auto search on 8 devices")[1]
    assert "encoder_cp=vision:2,audio:2" in auto.splitlines()[0] and "cp comm (ms)" in auto
    rows = {line.split()[0]: line.split() for line in auto.splitlines() if line.startswith(("vision.", "audio."))}
    assert all(r[2:4] == ["items", "2"] and float(r[-1]) > 0 for r in rows.values())
    assert "not searched: encoder cp > 1 with placement 'colocated'" in out
    snippet = out.split("same global batch; dp = ")[1].split("\n", 2)[2].split("\nwrote ")[0]
    doc = yaml.safe_load(snippet)
    encoders = doc["trainer"]["strategy"]["init_args"]["encoders"]
    assert {m: e["init_args"].get("cp") for m, e in encoders.items()} == {"vision": 2, "audio": 2}
    assert "cp_mode" not in encoders["vision"]["init_args"]
    path = tmp_path / "auto.yaml"
    path.write_text(snippet)
    _, _, trainer = load_fit_config([EXAMPLE, str(path)], ["--trainer.logger=false"])
    strategy = trainer.strategy
    assert {m: s.cp for m, s in strategy.encoder_specs.items()} == {"vision": 2, "audio": 2}
    layout = build_layout(strategy.encoder_specs, strategy.language_model_spec, trainer.num_devices,
                          strategy.encoder_placement, ["vision", "audio"])
    assert trainer.num_devices == doc["trainer"]["devices"] <= 8 and layout.cp["vision.0"] == 2
    assert layout.dp == int(out.split("same global batch; dp = ")[1].split(")")[0])
    trace = json.loads((tmp_path / "auto.trace.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "comm" and e["tid"] == 0 for e in trace)  # the gather, nested in vision.0's steps
    assert math.isfinite(float(out.split("configured / auto predicted iteration time: ")[1].split("x")[0]))
