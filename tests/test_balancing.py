"""Batch balancing at run time: per-sample work from metadata, the balanced sampler, microbatches of different
sizes, Entrain's deferral in the schedule, and training under each method against one process.

The planner itself (``plan/balance.py``) is tested in tests/test_balance.py. Multi-process cases compare every
trainable parameter after two SGD steps with plain single-process Lightning on the same global batches
(tests/helpers/trainer_case.py): moving samples between replicas and microbatches changes nothing but
summation order.
"""

import itertools

import pytest
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from torch.utils.data import DataLoader, DistributedSampler

import lightning_mm as lmm
from lightning_mm.data.balanced import (BalancedBatchSampler, BalancedCollate, BalancedDataset, balancing_obstacle,
                                        metadata_works)
from lightning_mm.data.metadata import SampleMeta
from lightning_mm.data.microbatch import deferrals, microbatch_rows, split_microbatches
from lightning_mm.model import tiny_encoder, tiny_language_model
from lightning_mm.plan.balance import plan_batch
from lightning_mm.plan.schedule import build_stage_graph, check_rendezvous, check_schedule, one_f_one_b
from lightning_mm.planner.workload import Quadratic, WorkloadModel
from tests.test_lightning_contracts import assert_same_training, run


def tiny_model(items=(0, 5)):
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("qwen2_vl"))},
                                tiny_language_model("llama", num_hidden_layers=2))
    return model.freeze(encoders=True, projectors=False, language_model=True)


# ---------------------------------------------------------------------------------------------- schedule
@pytest.mark.parametrize("placement,encoders", [("parallel", {"vision": 1, "audio": 2}),
                                                ("parallel", {"vision": 3}), ("colocated", {"a": 2, "b": 2})])
@pytest.mark.parametrize("llm_stages", [1, 2, 3])
def test_deferral_schedules_are_deadlock_free(placement, encoders, llm_stages):
    """Every deferral pattern of 2-6 microbatches (pairs and chains) runs to completion, with buffered and with
    rendezvous sends, for trainable and frozen encoders."""
    for trainable_encoders in (True, False):
        names = [f"{e}.{i}" for e, n in encoders.items() for i in range(n)] + \
                [f"language_model.{i}" for i in range(llm_stages)]
        trainable = {n: (trainable_encoders or n.startswith("language_model")) for n in names}
        graph = build_stage_graph(encoders, llm_stages, placement, trainable)
        for k in range(2, 7):
            for r in range(1, k):
                for deferred in itertools.combinations(range(k - 1), r):
                    actions = one_f_one_b(graph, k, deferred)
                    check_schedule(graph, actions, k)
                    check_rendezvous(actions)


def test_deferral_moves_the_gradient_sends_of_the_llm_first_stage_and_encoders_warm_up_one_more():
    graph = build_stage_graph({"vision": 1}, 2, "parallel", {"vision.0": True, "language_model.0": True,
                                                              "language_model.1": True})
    plain, deferred = one_f_one_b(graph, 4), one_f_one_b(graph, 4, (1,))
    assert plain["language_model.1"] == deferred["language_model.1"]
    compute = [(a.kind, a.microbatch) for a in deferred["vision.0"] if a.kind in ("forward", "backward")]
    assert compute == [("forward", 0), ("forward", 1), ("forward", 2), ("forward", 3), ("backward", 0),
                       ("backward", 1), ("backward", 2), ("backward", 3)]  # warm-up 3 instead of 2 (eager forward)
    first = [(a.kind, a.microbatch) for a in deferred["language_model.0"] if a.kind in ("backward", "send_bwd")]
    assert first == [("backward", 0), ("send_bwd", 0), ("backward", 1), ("backward", 2), ("send_bwd", 1),
                     ("send_bwd", 2), ("backward", 3), ("send_bwd", 3)]
    with pytest.raises(ValueError, match="no next microbatch"):
        one_f_one_b(graph, 4, (3,))


# ---------------------------------------------------------------------------------------------- microbatches
def test_microbatch_rows_follow_the_plan_and_reject_bad_ones():
    batch = {"input_ids": torch.zeros(5, 3, dtype=torch.long),
             "microbatches": {"encoder": [0, 0, 0, 1, 1], "llm": [0, 1, 0, 1, 1]}}
    enc, llm = microbatch_rows(batch, 2)
    assert enc == [[0, 1, 2], [3, 4]] and llm == [[0, 2], [3, 4, 1]] and deferrals(enc, llm) == (0,)
    assert microbatch_rows({"input_ids": torch.zeros(4, 3)}, 2) == ([[0, 1], [2, 3]], [[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="deferred to the next one"):
        microbatch_rows({**batch, "microbatches": {"encoder": [0, 0, 0, 1, 1], "llm": [0, 0, 0, 1, 0]}}, 2)
    with pytest.raises(ValueError, match="in row order, each at least once"):
        microbatch_rows({**batch, "microbatches": {"encoder": [0, 1, 0, 1, 1], "llm": [0, 1, 0, 1, 1]}}, 2)
    with pytest.raises(ValueError, match="equal microbatches"):
        microbatch_rows({"input_ids": torch.zeros(5, 3)}, 2)


def test_split_by_row_lists_carries_each_rows_items():
    """Rows picked out of order take exactly their own images (Qwen2-VL patch lists of different sizes)."""
    model = tiny_model()
    data = lmm.data.SyntheticMultimodalDataset(model, 6, items_per_sample=(0, 3), seed=3)
    samples = [data[i] for i in range(6)]
    batch = lmm.data.MultimodalCollator(model)(samples)
    (mb,) = split_microbatches(batch, [[4, 1, 2]], model)
    one = lmm.data.MultimodalCollator(model)([samples[4], samples[1], samples[2]])
    for key in ("input_ids", "labels", "bam"):
        assert torch.equal(mb[key][:, :one[key].shape[1]], one[key])
    assert torch.equal(mb["vision"]["pixel_values"], one["vision"]["pixel_values"])
    assert torch.equal(mb["vision"]["image_grid_thw"], one["vision"]["image_grid_thw"])


# ---------------------------------------------------------------------------------------------- work and sampler
def test_metadata_counts_the_tokens_each_sample_will_have():
    model = tiny_model()
    data = lmm.data.SyntheticMultimodalDataset(model, 8, items_per_sample=(0, 3), seed=1)
    collate = lmm.data.MultimodalCollator(model)
    pid = model.placeholder_ids["vision"]
    for i in range(8):
        meta = data.sample_metadata(i)
        row = collate([data[i]])
        assert meta.llm_tokens == int(row["attention_mask"].sum())
        assert sum(out for _, out in meta.items.get("vision", ())) == int((row["input_ids"] == pid).sum())
        grids = data[i]["vision"]["image_grid_thw"].tolist() if "vision" in data[i] else []
        assert [enc for enc, _ in meta.items.get("vision", ())] == [t * h * w for t, h, w in grids]


def test_workload_model_is_quadratic_per_item_and_frozen_aware():
    model = tiny_model()
    work = WorkloadModel.from_model(model)
    one, two = SampleMeta(10, {"vision": ((16, 4),)}), SampleMeta(10, {"vision": ((16, 4), (16, 4))})
    assert work.encoder_work(two) == pytest.approx(2 * work.encoder_work(one))  # items attend within themselves
    big = SampleMeta(10, {"vision": ((32, 8),)})
    assert work.encoder_work(big) > 2 * work.encoder_work(one)  # quadratic in an item's tokens
    assert work.llm_work(two) > work.llm_work(one)
    frozen_llm = work.language_model
    model.freeze(language_model=False)
    assert WorkloadModel.from_model(model).language_model.b == pytest.approx(1.5 * frozen_llm.b)  # 3 / 2
    fitted = WorkloadModel.fit({"vision": [64, 256, 1024], "language_model": [64, 256, 1024]},
                               {"vision": [Quadratic(2, 3, 5)(x) for x in (64, 256, 1024)],
                                "language_model": [Quadratic(0, 7, 1)(x) for x in (64, 256, 1024)]})
    assert fitted.encoders["vision"].a == pytest.approx(2) and fitted.language_model.b == pytest.approx(7)


def test_balanced_sampler_keeps_each_global_batch_and_resumes():
    """Each step's samples are those the loader's DistributedSampler gives all replicas; every rank of a replica
    plans the same; skipping n batches resumes the same order; every sample is tagged with its microbatches."""
    model = tiny_model()
    data = lmm.data.SyntheticMultimodalDataset(model, 40, items_per_sample=(0, 5), seed=2)
    work = metadata_works(data, WorkloadModel.from_model(model))
    plan = lambda e, l, r, k: plan_batch(e, l, r, k, "entrain")  # noqa: E731

    def sampler(replica):
        s = BalancedBatchSampler(data, 6, 2, replica, 3, plan, work, shuffle=True, seed=7)
        _set_sampler_epoch(DataLoader(BalancedDataset(data), batch_sampler=s), 1)  # as Lightning's fit loop does
        return s

    reference = [DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=7) for r in range(2)]
    for s in reference:
        s.set_epoch(1)
    ref = [list(s) for s in reference]
    batches = [list(sampler(r)) for r in range(2)]
    assert len(batches[0]) == len(sampler(0)) == 3
    deferred = 0
    for b in range(3):
        want = set(ref[0][6 * b:6 * b + 6]) | set(ref[1][6 * b:6 * b + 6])
        got = [i for r in range(2) for i, _, _ in batches[r][b]]
        assert sorted(got) == sorted(want) and len(batches[0][b]) == len(batches[1][b]) == 6
        for r in range(2):
            enc = [e for _, e, _ in batches[r][b]]
            assert enc == sorted(enc) and set(enc) == {0, 1, 2}
            deferred += sum(m == e + 1 for _, e, m in batches[r][b])
    assert deferred > 0  # entrain deferred some LLM work on this heterogeneous data
    resumed = sampler(1)
    resumed.skip = 2
    assert list(resumed) == batches[1][2:]
    assert list(sampler(1)) == batches[1]  # deterministic: every rank of replica 1 plans the same


def test_balanced_collate_adds_the_plan_as_host_lists():
    model = tiny_model()
    data = lmm.data.SyntheticMultimodalDataset(model, 4, items_per_sample=(1, 2), seed=0)
    collate = BalancedCollate(lmm.data.MultimodalCollator(model), model.placeholder_ids)
    batch = collate([BalancedDataset(data)[(i, e, m)] for i, e, m in [(0, 0, 0), (1, 0, 1), (2, 1, 1), (3, 1, 1)]])
    plan = batch["microbatches"]
    assert plan["encoder"] == [0, 0, 1, 1] and plan["llm"] == [0, 1, 1, 1]
    pid = model.placeholder_ids["vision"]
    assert plan["tokens"]["vision"] == (batch["input_ids"] == pid).sum(1).tolist()


def test_data_without_metadata_is_refused_by_name():
    with pytest.raises(TypeError, match="has no sample_metadata"):
        metadata_works(list(range(4)), None)
    assert "has no sample_metadata" in balancing_obstacle(DataLoader(list(range(8)), batch_size=2,
                                                                     sampler=DistributedSampler(list(range(8)), 1, 0)))
    assert "not a DistributedSampler" in balancing_obstacle(DataLoader(list(range(8)), batch_size=2))


def test_a_replica_batch_smaller_than_the_microbatches_is_refused_with_the_fix():
    model = tiny_model()
    data = lmm.data.SyntheticMultimodalDataset(model, 8)
    with pytest.raises(ValueError, match="every microbatch needs a sample; raise the batch size"):
        BalancedBatchSampler(data, 2, 2, 0, 3, plan_batch, metadata_works(data, WorkloadModel.from_model(model)))


# ---------------------------------------------------------------------------------------------- training
BALANCED = dict(steps=2, optimizer="sgd", lr=0.5, modalities=["vision"], vision="qwen2_vl", items=[0, 5],
                freeze="all", batch_size=6, plans=True)


def balanced_case(method, **extra):
    return {**BALANCED, "dp": 2, "llm_pp": 2, "microbatches": 2, "balancing": method, **extra}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run({**BALANCED, "dp": 2}, tmp_path_factory.mktemp("single"), "single")


@pytest.mark.slow
@pytest.mark.parametrize("method", [
    "none", pytest.param("disttrain", marks=pytest.mark.combines("balancing", "pipeline")),
    pytest.param("entrain", marks=pytest.mark.combines("balancing", "pipeline"))])
def test_balanced_training_equals_one_process(method, single, tmp_path):
    """dp 2 x (vision pp 1 + LLM pp 2), 0-5 images of different sizes per sample (some text-only), everything
    trainable: the same parameters as one process on the same global batches."""
    got = run(balanced_case(method), tmp_path, method)
    assert_same_training(got, single)
    assert len(got[0]["plans"]) == (0 if method == "none" else 2)  # balanced batches carry their plan
    if method == "entrain":
        assert got[0]["deferred_samples"] > 0, "nothing was deferred"


@pytest.mark.slow
@pytest.mark.parametrize("method", [
    "none", pytest.param("disttrain", marks=pytest.mark.combines("balancing", "pipeline", "llm_cp")),
    pytest.param("entrain", marks=pytest.mark.combines("balancing", "pipeline", "llm_cp"))])
@pytest.mark.combines("pipeline", "llm_cp")
def test_balanced_training_with_context_parallelism_equals_one_process(method, single, tmp_path):
    """Each method under dp 2 x (vision pp 1 + LLM pp 2 x cp 2), 10 processes: under entrain, deferred rows join
    the partner microbatch's CP plan."""
    got = run(balanced_case(method, llm_cp=2), tmp_path, f"{method}_cp2")
    assert_same_training(got, single)
    assert len(got[0]["plans"]) == (0 if method == "none" else 2)
    if method == "entrain":
        assert got[0]["deferred_samples"] > 0, "nothing was deferred"


@pytest.mark.slow
@pytest.mark.combines("balancing", "pipeline", "checkpoint")
def test_balanced_training_resumes_mid_epoch(tmp_path):
    """entrain, LLM pp 2: a run resumed from its step-3 checkpoint (mid-epoch: 4 batches an epoch) continues with
    exactly the batches and losses of the uninterrupted run, into the next epoch; both equal one process."""
    from tests.helpers.checkpoint_runs import run_case

    base = dict(steps=6, global_batch=8, num_samples=32, items=[0, 5])
    d = str(tmp_path)
    single = run_case({**base, "layout": "single", "out": f"{d}/single.json"})
    whole = run_case({**base, "layout": "pp2", "balancing": "entrain", "out": f"{d}/whole.json",
                      "ckpt_dir": f"{d}/ckpt", "save_every": 3})
    resumed = run_case({**base, "layout": "pp2", "balancing": "entrain", "out": f"{d}/resumed.json",
                        "resume": f"{d}/ckpt/step=3.ckpt"})
    assert resumed == whole[3:]
    torch.testing.assert_close(torch.tensor(whole), torch.tensor(single), rtol=1e-5, atol=1e-6)
