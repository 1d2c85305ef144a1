"""Context-parallel plans made in the data loader (``data/cp_plans.py``): the collate wrapper's item shards and
block owners equal what the step computed from its own microbatches (the reference below is the step's former
code), with and without balancing; the wrapper survives loader workers; and under the strategy, encoder cp 2 and
LLM cp 2 train like one process while the step plans nothing itself.
"""

import json
import os
import pickle

import pytest
import torch
from torch.utils.data import DataLoader

import lightning_mm as lmm
from lightning_mm.data.balanced import BalancedCollate, BalancedDataset
from lightning_mm.data.cp_plans import CPPlanCollate, CPPlans, EncoderItems, batch_plans
from lightning_mm.data.metadata import encoder_input_tokens
from lightning_mm.data.microbatch import PLAN_KEY, microbatch_rows, split_microbatches
from lightning_mm.parallel.context import distribute, pad_for_context_parallel
from lightning_mm.parallel.context import BlockOwners
from lightning_mm.plan.items import shard_items
from tests.helpers.launch import run_trainer_case
from tests.test_balancing import tiny_model
from tests.test_lightning_contracts import assert_same_training, run

CASE = os.path.join(os.path.dirname(__file__), "helpers", "loader_plans_case.py")


# ---------------------------------------------------------------------------------------------- the step's former code
def step_item_plan(enc, inputs, ranks):
    """``PipelineEngine.item_shards`` before plans moved to the loader."""
    tokens = enc.num_tokens(inputs)
    width = getattr(enc.config, "hidden_size", 0) or getattr(enc.config, "embed_dim", 0)
    work = [t * (t + 6 * width) for t in (encoder_input_tokens(enc, n) for n in tokens)]
    return shard_items(work, ranks), tokens


def step_owner(mb, cp, method, block, ulysses):
    """``PipelineEngine.cp_owners`` for one (padded) microbatch before plans moved to the loader."""
    plan = distribute(mb["bam"], cp, method, block, mb.get("segment_ids"), ulysses=ulysses)
    owner = torch.empty(sum(len(p) for p in plan), dtype=torch.long)
    for r, blocks in enumerate(plan):
        owner[blocks] = r
    return owner


def assert_plans_match_the_step(batch, model, k, ranks, blocks):
    plans = batch_plans(batch)
    assert isinstance(plans, CPPlans)
    encoder_rows, llm_rows = microbatch_rows(batch, k)
    enc = model.encoders["vision"]
    for m, mb in enumerate(split_microbatches(batch, encoder_rows, model)):
        want = step_item_plan(enc, mb["vision"], ranks) if "vision" in mb else None
        assert plans.items["vision"][m] == want, m
    mbs = [pad_for_context_parallel(mb, blocks.cp, blocks.block_size)
           for mb in split_microbatches(batch, llm_rows, model)]
    assert len(plans.owners) == len(mbs)
    for mb, owner in zip(mbs, plans.owners):
        assert torch.equal(owner, step_owner(mb, blocks.cp, blocks.method, blocks.block_size, blocks.ulysses))
    return plans


# ---------------------------------------------------------------------------------------------- pure
@pytest.mark.parametrize("layout", ["ee", "ep", "mp"])
@pytest.mark.parametrize("k,ranks,blocks", [
    (1, 2, BlockOwners(2, "lpt", 8)),
    (2, 3, BlockOwners(4, "lpt", 16)),  # 4 x 16 tokens: short microbatches pad to whole blocks first
    (4, 2, BlockOwners(4, "zigzag", 8, ulysses=2)),
])
def test_loader_plans_equal_the_steps_for_equal_microbatches(layout, k, ranks, blocks):
    model = tiny_model()
    data = lmm.data.SyntheticMultimodalDataset(model, 8, items_per_sample=(0, 4), layout="ee" if layout == "mp"
                                               else layout, seed=1)
    collate = lmm.data.MultimodalCollator(model, seq_len=96 if layout == "mp" else None, pack=layout == "mp")
    wrapper = CPPlanCollate(collate, k, {"vision": EncoderItems.of(model.encoders["vision"], ranks)}, blocks)
    batch = wrapper([data[i] for i in range(8)])
    if batch["input_ids"].shape[0] % k:  # packed into fewer rows than microbatches: no plan, the step refuses it
        assert batch_plans(batch) is None
        return
    plans = assert_plans_match_the_step(batch, model, k, ranks, blocks)
    assert plans.items["vision"] and any(p is not None for p in plans.items["vision"])


@pytest.mark.parametrize("assignment,deferred", [
    ([(0, 0, 0), (1, 0, 1), (2, 1, 1), (3, 1, 1)], True),  # row 1's LLM work deferred into microbatch 1
    ([(5, 0, 0), (2, 0, 0), (7, 1, 2), (1, 1, 1), (0, 2, 2), (3, 2, 2)], True),  # three, out of index order
    ([(6, 0, 0), (4, 1, 1), (1, 1, 1)], False),
])
def test_loader_plans_equal_the_steps_under_balancing(assignment, deferred):
    """The wrapper sits outside BalancedCollate and plans the balanced row lists (encoder and LLM microbatches
    differ where work is deferred)."""
    model = tiny_model()
    data = BalancedDataset(lmm.data.SyntheticMultimodalDataset(model, 8, items_per_sample=(0, 4), seed=2))
    k = max(e for _, e, _ in assignment) + 1
    blocks = BlockOwners(2, "lpt", 8)
    wrapper = CPPlanCollate(BalancedCollate(lmm.data.MultimodalCollator(model), model.placeholder_ids), k,
                            {"vision": EncoderItems.of(model.encoders["vision"], 2)}, blocks)
    batch = wrapper([data[key] for key in assignment])
    assert batch[PLAN_KEY]["encoder"] == [e for _, e, _ in assignment]  # the balancing plan is kept
    encoder_rows, llm_rows = microbatch_rows(batch, k)
    assert (encoder_rows != llm_rows) == deferred
    assert_plans_match_the_step(batch, model, k, 2, blocks)


def test_a_batch_the_step_refuses_gets_no_plan_and_the_wrapper_pickles():
    """Rows that do not divide into the microbatches: no plan (the step's validation raises on every rank alike).
    The wrapper round-trips through pickle (spawned loader workers) and plans the same after it."""
    model = tiny_model()
    data = lmm.data.SyntheticMultimodalDataset(model, 4, items_per_sample=(1, 3), seed=0)
    wrapper = CPPlanCollate(lmm.data.MultimodalCollator(model), 2,
                            {"vision": EncoderItems.of(model.encoders["vision"], 2)}, BlockOwners(2, "lpt", 8))
    assert batch_plans(wrapper([data[i] for i in range(3)])) is None
    copy = pickle.loads(pickle.dumps(wrapper))
    a, b = wrapper([data[i] for i in range(4)]), copy([data[i] for i in range(4)])
    assert batch_plans(a).items == batch_plans(b).items
    assert all(torch.equal(x, y) for x, y in zip(batch_plans(a).owners, batch_plans(b).owners))


@pytest.mark.slow
def test_plans_come_back_from_a_spawned_loader_worker():
    """num_workers=1 under spawn: the wrapper and the collator are pickled into the worker, the plans come back
    with the batch, equal to planning in this process."""
    model = tiny_model()
    data = lmm.data.SyntheticMultimodalDataset(model, 4, items_per_sample=(0, 3), seed=4)
    wrapper = CPPlanCollate(lmm.data.MultimodalCollator(model), 2,
                            {"vision": EncoderItems.of(model.encoders["vision"], 2)}, BlockOwners(2, "lpt", 8))
    loader = DataLoader(data, batch_size=4, collate_fn=wrapper, num_workers=1, multiprocessing_context="spawn")
    (batch,) = list(loader)
    assert_plans_match_the_step(batch, model, 2, 2, wrapper.blocks)


def test_transfer_to_the_device_leaves_the_plans_on_the_host():
    """Lightning's batch transfer moves tensors inside collections; the plans are no collection."""
    from lightning.fabric.utilities.apply_func import move_data_to_device

    owners = [torch.tensor([0, 1, 1, 0])]
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), PLAN_KEY: {"cp": CPPlans({}, owners)}}
    moved = move_data_to_device(batch, torch.device("meta"))
    assert moved["input_ids"].is_meta and batch_plans(moved).owners[0] is owners[0]


# ---------------------------------------------------------------------------------------------- under the strategy
ENCODER_CP = dict(steps=2, optimizer="sgd", lr=0.5, modalities=["vision"], vision="qwen2_vl", items=[0, 5],
                  batch_size=4, microbatches=2, freeze="all", validate=True)


@pytest.mark.slow
@pytest.mark.combines("encoder_cp", "llm_cp")
@pytest.mark.combines("encoder_cp", "balancing", note="balancing: the default entrain, not asserted")
def test_encoder_and_llm_cp_train_like_one_process_without_planning_in_the_step(tmp_path):
    """vision cp 2 + LLM cp 2 (4 processes), balanced training batches and unbalanced validation batches, loader
    workers (num_workers=1): every CP rank's batches carry their plans, planning inside the step raises, and
    training and validation equal one process."""
    ref = run(ENCODER_CP, tmp_path, "single")
    got = run_trainer_case(CASE, {**ENCODER_CP, "encoder_cp": [2], "llm_cp": 2, "llm_pp": 1, "workers": 1},
                           tmp_path, "cp2x2")
    assert_same_training(got, ref)
    assert got[0]["val"] == pytest.approx(ref[0]["val"], rel=1e-5)
    stats = [json.loads(f.read_text()) for f in (tmp_path / "cp2x2").glob("loader_plans_*.json")]
    assert sorted(s["rank"] for s in stats) == [0, 1, 2, 3] and all(s["runs_cp"] for s in stats)
    assert all(s["steps"] == s["with_plans"] == 2 + 2 for s in stats), stats  # 2 training + 2 validation batches
