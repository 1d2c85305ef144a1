"""Qwen3-VL: DeepStack features from intermediate vision layers added to the first LLM layers, across pipeline
stages of the tower and of the LLM, context-parallel ranks and replicas, against one process and HF's own model
(the composite against HF itself is in ``tests/test_hf_composites.py``)."""

from __future__ import annotations

import pytest
import torch

import lightning_mm as lmm
from lightning_mm.model.families import encoder_family, tiny_encoder
from tests.helpers.composite_case import run_case
from tests.test_hf_composites import batch_for, load_hf, save_composite
from tests.test_pipeline_generation import _check as check_generation, _run as run_generation

# four LLM layers, DeepStack from tower layers 0, 1, 2 into LLM layers 0, 1, 2: under LLM pp 2 layer 2 is on the
# second stage, under pp 3 on the third; under vision pp 2 tower layer 0 is on the tower's first stage
DEEP = dict(text={"num_hidden_layers": 4}, vision={"deepstack_visual_indexes": [0, 1, 2]})


def test_tower_split_into_stages_equals_hf_tower():
    """The tower run as two pipeline stages (DeepStack hidden states packed beside the hidden state at the stage
    boundary) gives HF's merged features and DeepStack features, packed ``[tokens, H * (1 + k)]``."""
    torch.manual_seed(0)
    tower = tiny_encoder("qwen3_vl", depth=4, deepstack_visual_indexes=[0, 1, 3])
    fam = encoder_family(tower)
    inputs = fam.random_inputs(tower.config, 2, torch.Generator().manual_seed(0), grids=[(1, 8, 4), (1, 4, 4)])
    expected = fam.reference(tower, inputs)
    assert expected.shape == (12, 48 * 4) and fam.output_dim(tower) == 48  # each block projects alike
    hidden, ctx = fam.embed(tower, inputs)
    for layer in tower.blocks[:2]:
        hidden = fam.run_layer(tower, layer, hidden, ctx)
    sent = fam.stage_output(tower, hidden, ctx)
    assert sent.shape == (hidden.shape[0], 32 * 3)  # layers 0 and 1 collected so far
    ctx = fam.context(tower, inputs)  # the next stage computes its own context
    hidden = fam.stage_input(tower, sent, ctx)
    for layer in tower.blocks[2:]:
        hidden = fam.run_layer(tower, layer, hidden, ctx)
    torch.testing.assert_close(fam.final(tower, hidden, ctx), expected, rtol=0, atol=0)


def test_deepstack_reaches_the_first_llm_layers_as_in_hf(tmp_path):
    """The LLM adds each DeepStack block after its own layer: dropping them changes the logits, and the model
    equals HF with them (HF's composite runs the same features through ``_deepstack_process``)."""
    folder = save_composite("qwen3_vl", tmp_path / "src", **DEEP)
    ref = load_hf("qwen3_vl", folder)
    model = lmm.MultimodalModel.from_pretrained(folder)
    assert model.deepstack == {"vision": 3, "video": 3}  # videos run the same tower
    batch, hf_inputs = batch_for("qwen3_vl", ref.config)
    ours = {k: v for k, v in batch.items() if k != "item_counts"}
    with torch.no_grad():
        logits = model(**ours).logits
        expected = ref(**hf_inputs).logits
        keep = batch["attention_mask"].bool()
        torch.testing.assert_close(logits[keep], expected[keep], atol=1e-5, rtol=1e-5)
        model.deepstack_context = lambda *a, **k: {}  # without DeepStack: different logits
        assert not torch.allclose(model(**ours).logits[keep], expected[keep], atol=1e-3)


def test_planner_counts_the_deepstack_blocks_in_the_feature_bytes(tmp_path):
    """Encoder CP gathers the packed features: the planner's feature bytes are the emitted tokens x H x (1 + k)."""
    from lightning_mm.planner.model_costs import model_layer_costs
    from lightning_mm.planner.plan_cli import module_specs

    model = lmm.MultimodalModel.from_pretrained(save_composite("qwen3_vl", tmp_path / "src", **DEEP))
    batch, _ = batch_for("qwen3_vl", model.language_model.config)
    batch = {k: v for k, v in batch.items() if k != "item_counts"}
    spec = module_specs(model, model_layer_costs(model, batch=batch), 1e-9, batch)["vision"]
    emitted = int((batch["input_ids"] == model.placeholder_ids["vision"]).sum())
    assert emitted == 32 and spec.feature_bytes == emitted * model.hidden_size * 4 * (1 + 3)


def _run(case: dict, tmp_path, name: str):
    return run_case("composite_case.py", case, tmp_path, name)



@pytest.mark.slow
def test_deepstack_across_pipeline_stages_trains_like_one_process(tmp_path):
    """Qwen3-VL with its DeepStack layers on different stages: LLM pp 2 (lazy, each rank reading its stage) and
    pp 3, vision pp 2 + LLM pp 2, LLM cp 2, and vision pp 1 + LLM pp 2 with dp 2 give one process's losses and
    trained parameters (the DeepStack mergers included)."""
    folder = save_composite("qwen3_vl", tmp_path / "src", **DEEP)
    ref_losses, ref_params = _run({"folder": folder}, tmp_path, "single")
    assert len(ref_losses) == 3 and ref_losses[-1] < ref_losses[0]
    assert any(".deepstack_merger_list.2." in n for n in ref_params)
    cases = {"pp2": {"llm_pp": 2, "lazy": True}, "pp3": {"llm_pp": 3}, "vpp2_pp2": {"vision_pp": 2, "llm_pp": 2},
             "cp2": {"llm_cp": 2}, "pp2_dp2": {"llm_pp": 2, "dp": 2}}
    for name, case in cases.items():
        losses, params = _run({"folder": folder, **case}, tmp_path, name)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                                   msg=name)
        assert set(params) == set(ref_params), name
        for n, p in ref_params.items():
            torch.testing.assert_close(params[n], p, rtol=1e-4, atol=1e-5, msg=f"{name}: {n}")


@pytest.mark.slow
def test_generation_across_llm_stages_equals_hf_generate(tmp_path):
    """``trainer.predict`` with ``generation=`` under vision pp 1 + LLM pp 3: the prompt's DeepStack features reach
    the third stage's layer 2 through the second; the tokens equal HF's own ``Qwen3VLForConditionalGeneration
    .generate`` on the left-padded batch."""
    folder = save_composite("qwen3_vl", tmp_path / "src", **DEEP)
    result = run_generation({"kind": "qwen3_vl", "folder": folder, "llm_pp": 3}, tmp_path, "pp3")
    check_generation(result, 4)
    assert len(result["generated"][0][0]) == 8


@pytest.mark.parametrize("kind", ["qwen3_vl", pytest.param("qwen3_vl_moe", marks=pytest.mark.slow)])
def test_generate_equals_hf_generate(kind, tmp_path):
    """One-process ``generate``: the prompt's DeepStack features enter the first LLM layers at prefill only; the
    greedy tokens and every step's logits equal HF's composite ``generate`` on the left-padded batch."""
    from tests.test_mrope_generate import _assert_like_hf

    # HF's MoE composite adds its aux loss in every decoding step and fails at the second without this
    text = {**DEEP["text"], "output_router_logits": False} if kind == "qwen3_vl_moe" else DEEP["text"]
    folder = save_composite(kind, tmp_path / "src", text=text, vision=DEEP["vision"])
    model, ref = lmm.MultimodalModel.from_pretrained(folder).eval(), load_hf(kind, folder).eval()
    _assert_like_hf(model, ref, batch_for(kind, ref.config)[0])
