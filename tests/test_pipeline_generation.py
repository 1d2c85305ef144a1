"""Generation across pipeline stages (``lightning_mm.parallel.pipeline_generation``): ``trainer.predict`` with
``generation=`` under LLM pipeline parallelism returns the tokens of one-process references (``model.generate``
for a LLaVA-style model; HF's own ``Qwen2VLForConditionalGeneration.generate`` for Qwen2-VL's M-RoPE), and what
it does not serve is refused with the fix."""

import os

import pytest

from lightning_mm.parallel.pipeline_generation import GreedySettings, greedy_settings, unserved_options
from tests.helpers.launch import run_trainer_case

CASE = os.path.join(os.path.dirname(__file__), "helpers", "pipeline_generation_case.py")


def _run(case: dict, tmp_path, name: str) -> dict:
    result, _ = run_trainer_case(CASE, case, tmp_path, name)
    return result


def _check(result: dict, ranks_per_replica: int) -> None:
    assert "error" not in result, result.get("error")
    for rank, got in enumerate(result["generated"]):
        assert got == result["expected"][rank // ranks_per_replica], (rank, got, result["expected"])


def test_unserved_options_are_refused_with_the_fix():
    assert unserved_options({"max_new_tokens": 4, "do_sample": False}) is None
    assert "greedily" in unserved_options({"max_new_tokens": 4, "do_sample": True})
    assert "greedily" in unserved_options({"max_new_tokens": 4, "num_beams": 2})
    assert "not ['temperature']" in unserved_options({"max_new_tokens": 4, "temperature": 0.5})
    assert "max_new_tokens" in unserved_options({"do_sample": False})


def test_greedy_settings_follow_the_generation_config():
    from lightning_mm.model import tiny_language_model

    lm = tiny_language_model("llama")
    eos = lm.generation_config.eos_token_id
    assert greedy_settings(lm, {"max_new_tokens": 3})[0] == GreedySettings(3, (eos,), eos)
    assert greedy_settings(lm, {"max_new_tokens": 3, "eos_token_id": [4, 5], "pad_token_id": 0})[0] == \
        GreedySettings(3, (4, 5), 0)
    lm.generation_config.repetition_penalty = 1.2
    settings, problem = greedy_settings(lm, {"max_new_tokens": 3})
    assert settings is None and "repetition_penalty" in problem


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.combines("generation", "pipeline")
def test_llava_generation_under_llm_pp2_equals_one_process(tmp_path):
    """Vision pp 1 + LLM pp 2 (3 gloo ranks), three prompts of different lengths with 1, 2 and 1 images, stop tokens
    that end the rows at different steps (rows leave the stages' caches) and all before 8 (every stage stops): the
    greedy tokens of one-process ``model.generate``."""
    result = _run({"kind": "llava", "llm_pp": 2, "early_stop": True}, tmp_path, "pp2_eos")
    _check(result, 3)
    assert 1 < len(result["generated"][0][0]) < 8 and len(result["eos"]) > 1, result


@pytest.mark.slow
@pytest.mark.combines("generation", "pipeline")
def test_qwen2_vl_generation_under_llm_pp2_equals_hf_generate(tmp_path):
    """M-RoPE: two rows with 2 and 1 images of different grids; the pipeline's tokens equal HF's own composite
    ``generate`` (its rope_deltas positions) on the left-padded batch."""
    from tests.test_hf_composites import save_composite

    folder = save_composite("qwen2_vl", tmp_path / "src")
    result = _run({"kind": "qwen2_vl", "folder": folder, "llm_pp": 2}, tmp_path, "qwen_pp2")
    _check(result, 3)
    assert len(result["generated"][0][0]) == 8
    _check(_run({"kind": "qwen2_vl", "folder": folder, "llm_pp": 2, "early_stop": True}, tmp_path, "qwen_eos"), 3)


@pytest.mark.slow
def test_llava_generation_under_llm_pp3_and_dp2(tmp_path):
    """LLM pp 3 (4 ranks), and two data-parallel replicas of vision pp 1 + LLM pp 2 (6 ranks) each decoding its own
    prompts for all 8 tokens."""
    _check(_run({"kind": "llava", "llm_pp": 3, "early_stop": True}, tmp_path, "pp3"), 4)
    result = _run({"kind": "llava", "llm_pp": 2, "dp": 2}, tmp_path, "dp2")
    _check(result, 3)
    assert len(result["generated"][0][0]) == 8 and result["expected"][0] != result["expected"][1]


@pytest.mark.slow
@pytest.mark.combines("generation", "pipeline", "tp")
def test_generation_under_llm_tp2_equals_one_process(tmp_path):
    """LLM pp 2 x tp 2 (5 ranks: each stage's layers and KV cache split by heads, the vocabulary-parallel logits of
    the last position gathered to pick), LLaVA with stop tokens; and Qwen2-VL (M-RoPE) under LLM tp 2 in one stage
    against HF's ``generate``."""
    from tests.test_hf_composites import save_composite

    _check(_run({"kind": "llava", "llm_pp": 2, "llm_tp": 2, "early_stop": True}, tmp_path, "pp2_tp2"), 5)
    folder = save_composite("qwen2_vl", tmp_path / "src")
    _check(_run({"kind": "qwen2_vl", "folder": folder, "llm_pp": 1, "llm_tp": 2}, tmp_path, "qwen_tp2"), 3)


@pytest.mark.slow
@pytest.mark.combines("generation", "pipeline", "placement")
def test_llava_generation_with_an_encoder_pipeline_and_with_encoders_in_the_first_llm_stage(tmp_path):
    """Vision pp 2 + LLM pp 2 (5 ranks: features cross two encoder stages first), and encoders replicated into the
    LLM's stages with LLM pp 2 (2 ranks: the first LLM stage encodes the images itself)."""
    _check(_run({"kind": "llava", "llm_pp": 2, "vision_pp": 2, "early_stop": True}, tmp_path, "vpp2"), 4)
    _check(_run({"kind": "llava", "llm_pp": 2, "placement": "replicated", "early_stop": True}, tmp_path, "repl"), 2)


@pytest.mark.slow
@pytest.mark.combines("generation", "encoder_cp", "llm_cp", "fsdp", "packing")
def test_packed_prompts_under_encoder_cp_llm_cp_and_fsdp_equal_one_process(tmp_path):
    """Vision cp 2 + LLM cp 2, FULL_SHARD (4 ranks: the images shared over the vision cp ranks, each stage's
    parameters sharded over its cp ranks and gathered once for the whole generation, each LLM cp rank decoding the
    whole prompt), three prompts packed into two rows (one prompt per sample comes back) and stop tokens ending them
    at different steps: the greedy tokens of one-process ``model.generate`` on the prompts one per row."""
    result = _run({"kind": "llava", "llm_pp": 1, "llm_cp": 2, "vision_cp": 2, "sharding": "FULL_SHARD",
                   "packed": True, "early_stop": True}, tmp_path, "ecp_cp_fsdp_packed")
    _check(result, 4)
    assert len(result["generated"][0]) == 3 and 1 < len(result["generated"][0][0]) < 8, result
    assert all(result["sharded"]), result["sharded"]  # every rank's stage is sharded


@pytest.mark.refuses("generation", "ep", message="runs each LLM stage without expert parallelism")
@pytest.mark.refuses("generation", "per_module_dp", message="needs one data-parallel degree for every module")
def test_layouts_it_does_not_serve_are_refused_with_the_fix():
    """Expert parallelism on the LLM (the replicas of an ep group would exchange tokens every step in lockstep) and
    per-module data parallelism; every rank derives the same answer from the layout, before any message."""
    from types import SimpleNamespace

    from lightning_mm import ParallelSpec
    from lightning_mm.parallel.pipeline_generation import unserved_layout
    from lightning_mm.plan.layout import build_layout

    def engine(world, fsdp=False, vision=ParallelSpec(pp=1), **llm):
        layout = build_layout({"vision": vision}, ParallelSpec(**llm), world, model_encoders=["vision"])
        plan = SimpleNamespace(language_model=object())
        return SimpleNamespace(layout=layout, plan=plan, fsdp_params={1} if fsdp else set())

    assert unserved_layout(engine(3, pp=2)) is None
    assert unserved_layout(engine(6, pp=2)) is None  # dp 2
    assert unserved_layout(engine(5, pp=2, tp=2)) is None
    assert unserved_layout(engine(5, pp=2, cp=2)) is None  # each cp rank decodes the whole prompt
    assert unserved_layout(engine(6, fsdp=True, pp=2)) is None  # gathered once for the whole generation
    without = unserved_layout(engine(4, ep=2))  # dp 2, the experts split over both replicas
    assert "runs each LLM stage without expert parallelism" in without and "ep=1" in without
    per_module = unserved_layout(engine(4, vision=ParallelSpec(dp=2), pp=2, dp=1))  # vision dp 2, LLM dp 1 pp 2
    assert "needs one data-parallel degree for every module" in per_module
