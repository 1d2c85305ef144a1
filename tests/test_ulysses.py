"""Ulysses and hybrid context parallelism train exactly like one process (gloo, CPU, fp32, SGD), composed with
pipeline, data and tensor parallelism and activation checkpointing; bad specs fail before any process group."""

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.pipeline_case import run_rank, run_reference

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model
from lightning_mm.parallel.context import check_context_parallel
from lightning_mm.plan.layout import ParallelSpec, build_layout


def _assert_same(results, ref_losses, ref_params):
    merged = {}
    for res in results:
        losses, params = res[0], res[1]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for name, p in params.items():
            if name in merged:  # replicas (and CP ranks) of one stage agree
                torch.testing.assert_close(p, merged[name], rtol=0, atol=0)
            merged[name] = p
    assert set(merged) == set(ref_params)
    for name, p in ref_params.items():
        torch.testing.assert_close(merged[name], p, rtol=1e-4, atol=1e-5, msg=name)


# (llm pp, cp, cp_mode, ulysses, placement, dp, microbatches, layout, cp distribution); the tiny Llama has 4 query
# heads and 2 KV heads, so Ulysses over 4 ranks repeats each KV head
CASES = [
    (1, 2, "ulysses", None, "parallel", 1, 2, "ee", "lpt"),
    pytest.param((1, 2, "ulysses", None, "replicated", 1, 2, "ep", "zigzag"),
                 marks=pytest.mark.combines("llm_cp", "placement")),
    pytest.param((1, 2, "ulysses", None, "replicated", 1, 1, "mp", "lpt"),  # "mp": packed rows
                 marks=pytest.mark.combines("llm_cp", "placement", "packing")),
    (1, 4, "ulysses", None, "replicated", 1, 1, "mp", "lpt"),  # GQA: 2 KV heads < 4 Ulysses ranks
    pytest.param((1, 4, "hybrid", 2, "replicated", 1, 1, "mp", "lpt"),
                 marks=pytest.mark.combines("llm_cp", "placement", "packing")),
    (1, 4, "hybrid", 2, "replicated", 1, 1, "ee", "zigzag"),
    pytest.param((2, 2, "ulysses", None, "replicated", 1, 2, "ep", "lpt"),  # LLM pp 2
                 marks=pytest.mark.combines("llm_cp", "placement", "pipeline")),
    (1, 2, "ulysses", None, "replicated", 2, 2, "ee", "lpt"),  # dp 2
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: f"llm{c[0]}-cp{c[1]}-{c[2]}{c[3] or ''}-{c[4]}-dp{c[5]}-{c[7]}-{c[8]}")
def test_ulysses_and_hybrid_train_like_one_process(case):
    llm_pp, cp, mode, ulysses, placement, dp, microbatches, layout, method = case
    mods, freeze, enc_pp, steps, rows = ("vision",), "llm", (1,), 2, 4 * dp
    ref_losses, ref_params = run_reference(mods, freeze, steps, rows, layout)
    llm = ParallelSpec(pp=llm_pp, cp=cp, cp_mode=mode, ulysses=ulysses)
    world = build_layout({"vision": ParallelSpec()}, llm, 720720, placement).ranks_per_replica * dp
    results = run_distributed(run_rank, world, mods, freeze, enc_pp, llm_pp, placement, microbatches, steps, rows,
                              layout, 0.5, cp, method, 8, mode, ulysses)
    _assert_same(results, ref_losses, ref_params)


@pytest.mark.slow
@pytest.mark.combines("llm_cp", "activation_checkpointing")
def test_hybrid_with_activation_checkpointing_trains_like_one_process():
    """Recomputation re-runs the all-to-alls and the K/V all-gather in backward, on every rank alike."""
    from helpers.pipeline_case import run_rank_checkpointed

    ref_losses, ref_params = run_reference(("vision",), "llm", 2, 4)
    llm = ParallelSpec(cp=4, cp_mode="hybrid", ulysses=2)
    world = build_layout({"vision": ParallelSpec()}, llm, 720720, "parallel").ranks_per_replica
    results = run_distributed(run_rank_checkpointed, world, ("vision",), "llm", (1,), 1, 2, 2, 4, 4, "ee",
                              "hybrid", 2)
    _assert_same(results, ref_losses, ref_params)


@pytest.mark.slow
@pytest.mark.combines("tp", "llm_cp")
def test_tensor_parallel_times_ulysses_trains_like_one_process(tmp_path):
    """tp 2 x Ulysses 2 under the Lightning strategy: each tp rank's 2 query heads and 1 KV head are split over
    its 2 Ulysses ranks (the KV head repeated)."""
    from tests.test_lightning_contracts import assert_same_training, run

    sgd = dict(optimizer="sgd", lr=0.5, steps=2, microbatches=2)
    ref = run({**sgd, "freeze": "llm"}, tmp_path, "single")
    got = run({**sgd, "freeze": "llm", "llm_tp": 2, "llm_cp": 2, "cp_mode": "ulysses"}, tmp_path, "tp2_ulysses2")
    assert_same_training(got, ref)


def test_bad_ulysses_specs_fail_before_any_process_group():
    import torch.distributed as dist

    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))},
                                tiny_language_model("llama", num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="4 query heads are not divisible by the Ulysses degree 8"):
        check_context_parallel(model, ParallelSpec(cp=8, cp_mode="ulysses"))
    with pytest.raises(ValueError, match="tp=2: 2 query heads are not divisible by the Ulysses degree 4"):
        check_context_parallel(model, ParallelSpec(cp=4, tp=2, cp_mode="ulysses"))
    with pytest.raises(ValueError, match="cp_mode='hybrid' needs ulysses = K with 1 < K < cp and K dividing cp=8"):
        ParallelSpec(cp=8, cp_mode="hybrid", ulysses=3)
    check_context_parallel(model, ParallelSpec(cp=4, cp_mode="ulysses"))  # 2 KV heads, repeated
    check_context_parallel(model, ParallelSpec(cp=8, cp_mode="hybrid", ulysses=4))
    check_context_parallel(model, ParallelSpec(cp=8))  # allgather: no head constraint
    assert not dist.is_initialized()
