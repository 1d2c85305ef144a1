"""Generation across pipeline stages (``lightning_mm.parallel.pipeline_generation``): ``trainer.predict`` with
``generation=`` under LLM pipeline parallelism returns the tokens of one-process references (``model.generate``
for a LLaVA-style model; HF's own composite ``generate`` for Qwen2-VL's M-RoPE and for the Qwen3-VL-MoE, Gemma 3,
Qwen2-Audio, LLaVA-NeXT, LLaVA-OneVision and InternVL folders), and what it does not serve is refused with the
fix."""

import os

import pytest

from lightning_mm.parallel.pipeline_generation import GreedySettings, greedy_settings, unserved_options
from tests.helpers.launch import run_trainer_case

CASE = os.path.join(os.path.dirname(__file__), "helpers", "pipeline_generation_case.py")


def _run(case: dict, tmp_path, name: str, timeout: float = 420) -> dict:
    result, _ = run_trainer_case(CASE, case, tmp_path, name, timeout=timeout)
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
    """Vision pp 1 + LLM pp 2 (3 gloo ranks), four prompts of different lengths with 1, 2, 1 and 5 images, stop
    tokens that end the rows at different steps (rows leave the stages' caches) and all before 8 (every stage
    stops): the greedy tokens of one-process ``model.generate``."""
    result = _run({"kind": "llava", "llm_pp": 2, "early_stop": True, "five": True}, tmp_path, "pp2_eos")
    _check(result, 3)
    assert len(result["generated"][0]) == 4, result
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


@pytest.mark.slow
@pytest.mark.combines("ep", "generation", "fsdp")
def test_moe_generation_under_ep2_over_dp2_equals_one_process(tmp_path):
    """A Qwen3-MoE LLM with ep 2 over dp 2 and FULL_SHARD (vision + LLM stage per replica, 4 ranks): each LLM rank
    gathers its stage's experts from the other replica once and decodes alone, though the replicas stop at
    different steps (stop tokens end replica 0's rows early; replica 1's other images run on). Prompts with 0, 1
    and 2 images: the greedy tokens of one-process ``model.generate``; after it every LLM rank holds its half of
    the experts again."""
    result = _run({"kind": "moe", "llm_pp": 1, "llm_ep": 2, "dp": 2, "sharding": "FULL_SHARD", "early_stop": True},
                  tmp_path, "ep2_fsdp")
    _check(result, 2)
    assert len(result["generated"][0]) == 4 and len(result["generated"][2]) == 3, result
    assert len(result["generated"][1][0]) != len(result["generated"][3][0]), result  # different step counts
    assert [held for held, _ in result["experts_held"]] == [0, 24576, 0, 24576], result["experts_held"]
    assert result["experts_held"][1][1] == 2 * 24576 and all(result["sharded"]), result


@pytest.mark.slow
@pytest.mark.combines("ep", "generation", "placement", note="generation only: no training step runs here")
def test_moe_generation_of_the_whole_model_per_rank_under_ep2(tmp_path):
    """Replicated encoders and one LLM stage (2 ranks, ep 2 over dp 2): transformers' ``generate`` on each rank
    runs with the experts gathered for the whole generation (not the per-token all-to-all, which would hang once
    the replicas stop at different steps): the tokens of one-process ``model.generate``."""
    result = _run({"kind": "moe", "llm_pp": 1, "llm_ep": 2, "dp": 2, "placement": "replicated",
                   "early_stop": True}, tmp_path, "ep2_repl")
    _check(result, 1)
    assert len(result["generated"][0][0]) != len(result["generated"][1][0]), result
    assert [held for held, _ in result["experts_held"]] == [24576, 24576], result["experts_held"]


@pytest.mark.slow
@pytest.mark.combines("per_module_dp", "generation", "pipeline")
def test_generation_under_per_module_dp_equals_one_process(tmp_path):
    """Vision dp 2 + LLM dp 1 pp 2 (4 ranks): the group's five prompts (1, 2, 1, 0 and 5 images) routed as one
    microbatch, the tower replicas each encoding some of the rows and both sending their features to the LLM's
    first stage, stop tokens ending the rows at different steps: every rank returns the greedy tokens of
    one-process ``model.generate``."""
    result = _run({"kind": "llava", "llm_pp": 2, "vision_dp": 2, "early_stop": True, "five": True}, tmp_path, "pmdp")
    _check(result, 4)
    assert len(result["generated"][0]) == 5 and 1 < len(result["generated"][0][0]) < 8, result


def test_generation_routes_the_group_batch_as_one_microbatch():
    """Per-module data parallelism (vision dp 2, LLM dp 1): ``whole_batch`` gives the LLM every row and the tower
    replicas the rows with images by LPT on their work (the two-image row alone, then the two one-image rows),
    ignoring the loader's plan for two microbatches; ``prompt_index`` places each row's prompts."""
    import torch

    import lightning_mm as lmm
    from lightning_mm import ParallelSpec
    from lightning_mm.data.cp_plans import EncoderItems, GroupRouter
    from lightning_mm.data.microbatch import PLAN_KEY, ROUTE_KEY
    from lightning_mm.model import tiny_encoder, tiny_language_model
    from lightning_mm.parallel.pipeline_generation import prompt_index
    from lightning_mm.parallel.routed import RoutedExchange
    from lightning_mm.plan.layout import build_layout
    from tests.helpers.pipeline_generation_case import llava_prompts

    torch.manual_seed(0)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"), projector="mlp")},
                                tiny_language_model("llama"))
    batch, _ = llava_prompts(model, 0, text_only=True)  # 1, 2, 1 and 0 images
    layout = build_layout({"vision": ParallelSpec(dp=2)}, ParallelSpec(pp=2, dp=1), 4, model_encoders=["vision"])
    router = GroupRouter({"vision": EncoderItems.of(model.encoders["vision"], 1)}, {"vision": 2}, 1, 2)
    batch[PLAN_KEY] = {ROUTE_KEY: router(batch)}  # the loader's routing for two microbatches
    tokens = {"vision": [4, 8, 4, 0]}
    rows = {r: RoutedExchange(router, layout, r, torch.device("cpu"), None).whole_batch(batch, tokens, r >= 2)
            for r in range(4)}
    assert rows == {0: [1], 1: [0, 2], 2: [0, 1, 2, 3], 3: [0, 1, 2, 3]}, rows
    assert prompt_index(batch, [1, 3]).tolist() == [1, 3]
    packed, _ = llava_prompts(model, 0, packed=True)  # rows [prompt 0, prompt 1] and [prompt 2]
    assert prompt_index(packed, [1]).tolist() == [2] and prompt_index(packed, [0, 1]).tolist() == [0, 1, 2]


def _save_family(kind: str, path) -> str:
    """The composite folder of ``kind`` as tests/test_family_layouts.py writes it (Qwen3-VL-MoE without router
    logits in its outputs: HF's composite adds its aux loss at every decoding step and fails at the second)."""
    from tests.helpers.pipeline_generation_case import TILED
    from tests.test_hf_composites import save_composite
    from tests.test_tile_composites import save_composite as save_tiled

    if kind in TILED:
        return save_tiled(kind, path)
    return save_composite(kind, path, **({"text": {"output_router_logits": False}} if kind == "qwen3_vl_moe" else {}))


@pytest.mark.slow
@pytest.mark.combines("generation", "pipeline")
@pytest.mark.parametrize("kind", ["qwen3_vl_moe", "gemma3", "qwen2_audio", "llava_next", "llava_onevision",
                                  "internvl"])
def test_a_family_generates_across_llm_stages_like_hf(kind, tmp_path):
    """Vision (audio) pp 1 + LLM pp 2 (3 ranks), four prompts of 0, 5, 1 and 2 items (images of different sizes or
    grids; Qwen2-Audio: clips), all 8 tokens: the greedy tokens of HF's own composite ``generate`` of the folder on
    the left-padded batch (Qwen3-VL-MoE's DeepStack into LLM layer 1 on the second stage, Gemma 3's image blocks
    and sliding window, the tiled families' processor inputs)."""
    result = _run({"kind": kind, "folder": _save_family(kind, tmp_path / "src"), "llm_pp": 2}, tmp_path, "pp2",
                  timeout=900)
    _check(result, 3)
    assert len(result["generated"][0]) == 4 and len(result["generated"][0][0]) == 8, result


@pytest.mark.slow
@pytest.mark.parametrize("kind, layout, ranks", [
    pytest.param("gemma3", {}, 3, marks=pytest.mark.combines("generation", "llm_cp", "fsdp"), id="gemma3"),
    pytest.param("qwen3_vl_moe", {"dp": 2, "llm_ep": 2}, 3,
                 marks=pytest.mark.combines("generation", "llm_cp", "fsdp", "ep"), id="qwen3_vl_moe-dp2-ep2")])
def test_a_family_generates_in_its_training_layout_like_hf(kind, layout, ranks, tmp_path):
    """The layout of tests/test_family_layouts.py (vision one rank, LLM cp 2 under FULL_SHARD), for Qwen3-VL-MoE
    with two replicas and its experts split ep 2 over them (6 ranks, each replica its own prompts); stop tokens end
    the rows at different steps: HF's own composite ``generate`` of the folder."""
    case = {"kind": kind, "folder": _save_family(kind, tmp_path / "src"), "llm_pp": 1, "llm_cp": 2,
            "sharding": "FULL_SHARD", "early_stop": True, **layout}
    result = _run(case, tmp_path, "cp2_fsdp", timeout=900)
    _check(result, ranks)
    assert 1 < len(result["generated"][0][0]) < 8 and all(result["sharded"][1:ranks]), result
    if layout.get("llm_ep"):  # each LLM rank holds half its stage's experts again after generating
        held = [h for h, _ in result["experts_held"]]
        assert held[0] == held[3] == 0 and 2 * held[1] == result["experts_held"][1][1] > 0, result["experts_held"]
        assert result["expected"][0] != result["expected"][1]


@pytest.mark.slow
@pytest.mark.combines("generation", "placement", "fsdp")
def test_a_tied_head_under_fsdp_generates_on_whole_model_replicas_like_hf(tmp_path):
    """Gemma 3 (its head tied to the embedding: one FSDP unit of two modules) with replicated encoders and one LLM
    stage, FULL_SHARD over 2 replicas, predicting before any training step: transformers' ``generate`` on each
    rank's gathered model returns HF's composite ``generate`` of the folder for each replica's prompts."""
    result = _run({"kind": "gemma3", "folder": _save_family("gemma3", tmp_path / "src"), "llm_pp": 1, "dp": 2,
                   "placement": "replicated", "sharding": "FULL_SHARD", "early_stop": True}, tmp_path, "repl_fsdp",
                  timeout=900)
    _check(result, 1)
    assert all(result["sharded"]) and result["expected"][0] != result["expected"][1], result
