"""Capabilities combined four to six at a time, each run against the unparallelised model in one process under the
same precision (fp32: exact to float rounding; bf16-mixed: within bf16 tolerance).

Every case trains a vision + LLM model on 0-5 images per sample (some samples text-only) with LoRA adapters or
trainable parts, SGD, and packs samples several to a row (``segment_ids``) where packing is named; a resumed case
saves after its first optimiser step and continues from that checkpoint in a fresh run.
"""

import pytest
import torch

from tests.helpers.launch import run_trainer_case
from tests.test_lightning_contracts import CASE

LORA = ["q_proj", "v_proj"]
BASE = dict(modalities=["vision"], items=[0, 5], optimizer="sgd", lr=0.5, text_tokens=[4, 16])
BF16 = dict(rtol=2e-2, atol=2e-2)  # bf16 keeps 8 bits of mantissa: relative steps of 2**-8 per rounding


def run(case: dict, tmp_path, name: str) -> tuple[dict, dict]:
    """``tests/helpers/trainer_case.py`` on ``case``, allowed 15 minutes (six processes on a loaded 2-core
    machine)."""
    return run_trainer_case(CASE, case, tmp_path, name, timeout=900)


def same_training(got: tuple, ref: tuple, tol: dict | None = None, first: int = 0) -> None:
    """``got``'s losses equal ``ref``'s from micro-step ``first`` on, and its trained parameters equal ``ref``'s."""
    (res, params), (ref_res, ref_params) = got, ref
    tol = tol or dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(res["train"]), torch.tensor(ref_res["train"][first:]), **tol)
    assert set(params) == set(ref_params)
    for n, p in ref_params.items():
        ptol = tol if tol.get("rtol", 0) > 1e-3 else dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(params[n].float(), p.float(), msg=n, **ptol)


def run_and_resume(case: dict, tmp_path, name: str) -> tuple[tuple, tuple]:
    """``case`` run uninterrupted, saving after its first optimiser step, and continued from that checkpoint in a
    fresh run: ((result, parameters) of the uninterrupted run, the same of the resumed one)."""
    full = run({**case, "save_every": 1}, tmp_path, f"{name}-full")
    checkpoint = tmp_path / f"{name}-full" / "ckpt" / "step=1.ckpt"
    return full, run({**case, "resume": str(checkpoint)}, tmp_path, f"{name}-resumed")


def assert_packed(result: dict) -> None:
    """Every micro-step's rows were packed (segment ids) and rows held several samples (the packing path ran)."""
    assert len(result["packed"]) == len(result["train"]) and max(result["packed"]) >= 2, result.get("packed")


@pytest.mark.slow
@pytest.mark.combines("pipeline", "packing", "activation_checkpointing", "accumulation", "lora", "checkpoint")
def test_pipeline_packing_recompute_accumulation_lora_resumes_like_one_process(tmp_path):
    """LLM pp 2 (3 processes, 2 microbatches of packed rows), activations recomputed, accumulate 2, LoRA on the
    LLM and a trainable projector: the run, and the run resumed from its step-1 checkpoint, give one process's
    micro-step losses and parameters after step 2."""
    case = dict(BASE, steps=2, accumulate=2, pack=128, lora=LORA, recompute=True)
    ref = run(case, tmp_path, "single")
    assert_packed(ref[0])
    assert len(ref[0]["train"]) == 4
    full, resumed = run_and_resume({**case, "llm_pp": 2, "microbatches": 2}, tmp_path, "pp2")
    assert_packed(full[0])
    same_training(full, ref)
    same_training(resumed, ref, first=2)


@pytest.mark.slow
@pytest.mark.combines("tp", "placement", "packing", "accumulation", "mixed_precision", "checkpoint")
def test_tensor_parallel_packing_accumulation_bf16_resumes_like_one_process(tmp_path):
    """LLM tp 2 with the encoder replicated on both ranks (2 processes), packed rows, accumulate 2, bf16-mixed,
    the LLM and projector trained: the run, and the run resumed from its step-1 checkpoint, give one process's
    numbers under bf16-mixed within bf16 tolerance."""
    case = dict(BASE, steps=2, accumulate=2, pack=128, precision="bf16-mixed", freeze="llm")
    ref = run(case, tmp_path, "single")
    full, resumed = run_and_resume({**case, "llm_tp": 2, "placement": "replicated"}, tmp_path, "tp2")
    assert_packed(full[0])
    same_training(full, ref, BF16)
    same_training(resumed, ref, BF16, first=2)


@pytest.mark.slow
@pytest.mark.combines("ep", "placement", "packing", "accumulation", "lora", "mixed_precision")
def test_expert_parallel_replicated_packing_accumulation_lora_bf16_like_one_process(tmp_path):
    """A mixture-of-experts LLM with its experts split over 2 data-parallel replicas (ep 2), the encoder replicated
    on both, packed rows, accumulate 2, LoRA on attention, bf16-mixed: one process's global batch within bf16
    tolerance."""
    case = dict(BASE, steps=2, accumulate=2, pack=128, lora=LORA, precision="bf16-mixed", llm="qwen3_moe",
                batch_size=2)
    ref = run({**case, "batch_size": 4}, tmp_path, "single")
    got = run({**case, "dp": 2, "llm_pp": 1, "llm_ep": 2, "placement": "replicated"}, tmp_path, "ep2")
    assert_packed(got[0])
    same_training(got, ref, BF16)


@pytest.mark.slow
@pytest.mark.combines("per_module_dp", "packing", "activation_checkpointing", "accumulation", "lora",
                      "mixed_precision")
def test_per_module_dp_packing_recompute_accumulation_lora_bf16_like_one_process(tmp_path):
    """Vision dp 2 + LLM dp 1 (3 processes: the two tower replicas encode halves of the items), packed rows,
    activations recomputed, accumulate 2, LoRA, bf16-mixed: one process within bf16 tolerance."""
    case = dict(BASE, steps=2, accumulate=2, pack=128, lora=LORA, precision="bf16-mixed", recompute=True)
    ref = run(case, tmp_path, "single")
    got = run({**case, "encoder_dp": [2], "llm_pp": 1, "llm_dp": 1}, tmp_path, "vdp2")
    assert_packed(got[0])
    same_training(got, ref, BF16)


@pytest.mark.slow
@pytest.mark.combines("llm_cp", "fsdp", "packing", "accumulation", "lora", "mixed_precision")
@pytest.mark.parametrize("fsdp_reduce", ["microbatch", "step"])
def test_context_parallel_full_shard_packing_accumulation_lora_bf16_like_one_process(tmp_path, fsdp_reduce):
    """LLM cp 2 (blocks of 8 tokens) sharded by FULL_SHARD over its 2 CP ranks (3 processes), packed rows,
    accumulate 2, LoRA, bf16-mixed, reduce-scattering after every microbatch or once per optimiser step (the
    unsharded gradients accumulated in fp32 across microbatches and batches): one process within bf16 tolerance."""
    case = dict(BASE, steps=2, accumulate=2, pack=128, lora=LORA, precision="bf16-mixed")
    ref = run(case, tmp_path, "single")
    got = run({**case, "llm_cp": 2, "sharding": "FULL_SHARD", "microbatches": 2, "fsdp_reduce": fsdp_reduce},
              tmp_path, "cp2")
    assert_packed(got[0])
    same_training(got, ref, BF16)


@pytest.mark.slow
@pytest.mark.combines("mixed_precision", "generation", "pipeline", "lora")
def test_bf16_mixed_training_and_generation_across_pipeline_stages_like_one_process(tmp_path):
    """LoRA trained under bf16-mixed with the LLM in 2 pipeline stages (3 processes), then trainer.predict with
    generation= decodes greedily stage to stage under the same autocast: the losses within bf16 tolerance and
    the tokens those of one process (its trainer.predict and its model.generate agree too)."""
    from tests.test_lora import CASE as LORA_CASE

    ref, ref_params = run_trainer_case(LORA_CASE, {"devices": 1, "precision": "bf16-mixed"}, tmp_path, "single",
                                       timeout=900)
    got, params = run_trainer_case(LORA_CASE, {"devices": 3, "llm_pp": 2, "precision": "bf16-mixed"}, tmp_path,
                                   "pp2", timeout=900)
    assert ref["generated"] == ref["expected"][:1], ref  # one process predicts the first prompts batch only
    same_training((got, params), (ref, ref_params), BF16)
    assert all(g == ref["expected"][0] for g in got["generated"]), (got, ref["expected"])


@pytest.mark.slow
@pytest.mark.combines("encoder_cp", "ep", "balancing", "lora", "checkpoint")
def test_encoder_cp_expert_parallel_balancing_lora_resumes_like_one_process(tmp_path):
    """dp 2 x (vision cp 2 + a Qwen3-MoE LLM whose experts are split over the 2 replicas, ep 2), 6 processes, ENTRAIN
    balancing each global batch over replicas and microbatches, LoRA on attention with the vision tower and projector
    trained: the run, and the run resumed from its step-1 checkpoint in a fresh job, give one process's losses and
    parameters on the same global batches (aux loss off: balancing regroups rows, whose per-microbatch aux differs)."""
    case = dict(steps=2, optimizer="sgd", lr=0.5, modalities=["vision"], vision="qwen2_vl", items=[0, 5],
                freeze="all", llm="qwen3_moe", llm_config={"output_router_logits": False}, batch_size=6, dp=2,
                lora=LORA, plans=True)
    ref = run(case, tmp_path, "single")
    full, resumed = run_and_resume({**case, "encoder_cp": [2], "llm_pp": 1, "llm_ep": 2, "microbatches": 2,
                                    "balancing": "entrain"}, tmp_path, "ecp2_ep2")
    same_training(full, ref)
    same_training(resumed, ref, first=1)
    assert len(full[0]["plans"]) == 2 and full[0]["deferred_samples"] > 0  # the balanced plans ran
    assert any(".lora_" in n for n in ref[1]) and any("vision" in n or "visual" in n for n in ref[1])


@pytest.mark.slow
@pytest.mark.combines("balancing", "packing", "per_module_dp")
def test_balanced_packed_rows_under_per_module_dp_like_one_process(tmp_path):
    """Vision dp 2 + LLM dp 1 (3 processes), ENTRAIN placing each global batch over 2 microbatches whose samples are
    packed several to a row (no deferral with packing: docs/balancing.md), 0-5 images per sample: one process's
    losses and parameters on the same global batches."""
    case = dict(BASE, vision="qwen2_vl", freeze="all", steps=2, batch_size=6, pack=128, plans=True)
    ref = run(case, tmp_path, "single")
    got = run({**case, "encoder_dp": [2], "llm_pp": 1, "llm_dp": 1, "microbatches": 2, "balancing": "entrain"},
              tmp_path, "vdp2_packed")
    same_training(got, ref)
    assert_packed(got[0])
    assert len(got[0]["plans"]) == 2  # the balanced plans ran
