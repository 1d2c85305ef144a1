"""Encoder context parallelism: a microbatch's items (images) split over an encoder's CP ranks by LPT on their
work, features all-gathered in item order, each item's gradient back on the rank that encoded it.

Multi-process cases train two SGD steps and compare every trainable parameter with plain single-process Lightning
on the same global batches (tests/helpers/trainer_case.py).
"""

import pytest
import torch

from lightning_mm.plan.items import gather_order, shard_items
from lightning_mm.plan.layout import ParallelSpec, build_layout
from tests.test_lightning_contracts import assert_same_training, run


def test_items_are_shared_by_lpt_and_gathered_back_in_order():
    work = [9.0, 1.0, 4.0, 4.0, 2.0]
    shards = shard_items(work, 2)
    assert shards == [[0, 1], [2, 3, 4]]  # 9 + 1 | 4 + 4 + 2
    assert sorted(i for s in shards for i in s) == list(range(5))
    assert shard_items([3.0], 4) == [[0], [], [], []]  # fewer items than ranks: some ranks encode nothing
    tokens = [2, 1, 3]
    shards = [[1], [0, 2]]
    gathered = ["i1", "i0a", "i0b", "i2a", "i2b", "i2c"]  # rank 0: item 1 (1 token); rank 1: items 0 (2), 2 (3)
    order = gather_order(shards, tokens)
    assert [gathered[i] for i in order] == ["i0a", "i0b", "i1", "i2a", "i2b", "i2c"]


def test_encoder_cp_layout_pairs_each_llm_rank_with_one_encoder_rank():
    layout = build_layout({"vision": ParallelSpec(cp=2)}, ParallelSpec(pp=1), 3)
    assert layout.widths == {"vision.0": 2, "language_model.0": 1}
    assert layout.activation_sources("vision.0", "language_model.0", 0) == {2: 0}
    assert layout.gradient_sources("vision.0", "language_model.0", 0) == {0: [2], 1: []}
    layout = build_layout({"vision": ParallelSpec(cp=2)}, ParallelSpec(cp=4), 6)
    assert layout.activation_sources("vision.0", "language_model.0", 0) == {2: 0, 3: 1, 4: 0, 5: 1}
    assert layout.gradient_sources("vision.0", "language_model.0", 0) == {0: [2, 4], 1: [3, 5]}
    assert layout.grad_group_ranks("vision.0") == [0, 1]  # both encode with the same weights: gradients summed


@pytest.mark.refuses("encoder_cp", "placement", message="needs encoder_placement='parallel'")
def test_bad_encoder_cp_specs_fail_before_any_process_group():
    with pytest.raises(ValueError, match="needs encoder_placement='parallel'"):
        build_layout({"vision": ParallelSpec(cp=2)}, ParallelSpec(), 3, "colocated")
    with pytest.raises(ValueError, match="leave the encoder's cp_mode unset"):
        build_layout({"vision": ParallelSpec(cp=2, cp_mode="ulysses")}, ParallelSpec(), 3)


CASE = dict(steps=2, optimizer="sgd", lr=0.5, modalities=["vision"], vision="qwen2_vl", items=[0, 5],
            batch_size=4, microbatches=2)


@pytest.mark.slow
@pytest.mark.parametrize("freeze", [pytest.param("all", marks=pytest.mark.ci), "llm"])
def test_encoder_cp2_trains_like_one_process(freeze, tmp_path):
    """vision cp 2 + LLM 1 stage (3 processes), 0-5 images of different sizes per sample, encoder trainable
    ("all") and frozen with a trainable projector ("llm")."""
    ref = run({**CASE, "freeze": freeze}, tmp_path, "single")
    got = run({**CASE, "freeze": freeze, "encoder_cp": [2], "llm_pp": 1}, tmp_path, "cp2")
    assert_same_training(got, ref)


@pytest.mark.slow
def test_encoder_cp4_with_fewer_images_than_ranks(tmp_path):
    """vision cp 4 (5 processes) on microbatches of 1 sample with 0-2 images: some CP ranks encode nothing and
    still join the gather and its backward."""
    case = {**CASE, "freeze": "all", "items": [0, 2], "batch_size": 2}
    ref = run(case, tmp_path, "single")
    got = run({**case, "encoder_cp": [4], "llm_pp": 1}, tmp_path, "cp4")
    assert_same_training(got, ref)



@pytest.mark.slow
@pytest.mark.combines("encoder_cp", "pipeline", "activation_checkpointing", "accumulation", "packing", "lora")
def test_encoder_cp_with_llm_pp2_recompute_accumulation_packing_and_lora(tmp_path):
    """vision cp 2 + LLM pp 2 (4 processes), every layer recomputed in backward, accumulate 2, samples of 0-5 images
    (some text-only) packed into rows of 96 tokens, LoRA on the LLM's q/v projections with the encoder trainable: the
    losses and every trainable parameter (encoder, projector, LoRA) of one process."""
    case = {**CASE, "freeze": "all", "layout": "mp", "seq_len": 96, "microbatches": 1, "accumulate": 2,
            "recompute": True, "lora": ["q_proj", "v_proj"]}
    ref = run(case, tmp_path, "single")
    got = run({**case, "encoder_cp": [2], "llm_pp": 2}, tmp_path, "ecp2_pp2")
    assert_same_training(got, ref)
    assert len(ref[0]["train"]) == 4 and any("lora" in n for n in ref[1]) and any("visual" in n or "vision" in n
                                                                                   for n in ref[1])


@pytest.mark.slow
@pytest.mark.combines("encoder_cp", "tp", "mixed_precision")
def test_encoder_cp_with_llm_tp2_under_bf16_mixed(tmp_path):
    """vision cp 2 + LLM tp 2 (4 processes) under bf16-mixed against one process under bf16-mixed: losses and
    parameters within bf16's resolution (the two run the same bf16 matmuls in different splits and orders)."""
    case = {**CASE, "freeze": "all", "precision": "bf16-mixed"}
    ref = run(case, tmp_path, "single")
    got = run({**case, "encoder_cp": [2], "llm_tp": 2}, tmp_path, "ecp2_tp2")
    assert_same_training(got, ref, rtol=5e-3, atol=5e-3, param_tol=(5e-3, 5e-3))  # measured: 3e-5 and 7e-4
