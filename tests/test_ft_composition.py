"""Fault tolerance composed with the other capabilities: replica groups (torchft, each a torchrun launch of 2 or 3
gloo ranks on CPU, ``tests/helpers/ft_case.py``) that run context parallelism (of the LLM or the encoder), packed
rows, activation checkpointing, LoRA, gradient accumulation, expert parallelism or a resume from a checkpoint inside
each group; both groups' final parameters are compared with one process trained on the same global batches (fp32,
SGD with momentum and a step schedule). Samples hold 0-5 images (some are text only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lightning_mm.fault_tolerance.sampler import placed_rows
from lightning_mm.plan.balance import plan_batch
from tests.helpers.checkpoint_runs import case_env
from tests.test_fault_tolerance import (CASE, _assert_equal_to_reference, _launch, _log, _params, _wait,  # noqa: F401
                                        lighthouse)

torchft = pytest.importorskip("torchft")

STEPS = 6
IMAGES = {"items_per_sample": [0, 5]}


def test_a_groups_share_is_placed_over_its_replicas_as_the_loaders_place_a_batch():
    """Contiguous (per replica, then in microbatches of about the usual size), per-module (the group's replicas one
    after the other), or by the balancing planner; None where the share does not split over the replicas."""
    share = list(range(100, 112))
    assert placed_rows(share, 2, [1], 2) == [(106 + i, i // 2, i // 2, 0) for i in range(6)]
    assert placed_rows(share, 2, [0, 1], 4) == [(100 + i, i % 6 // 3, i % 6 // 3, i // 6) for i in range(12)]
    assert placed_rows(share[:11], 2, [0], 2) is None
    enc = torch.tensor([float(i % 5) for i in range(12)], dtype=torch.float64)
    llm = torch.tensor([float((7 * i) % 11) for i in range(12)], dtype=torch.float64)
    plan = plan_batch(enc, llm, 2, 3, "entrain")
    rows = [r for j in (0, 1) for r in placed_rows(share, 2, [j], 2, "entrain", lambda idx: (enc, llm))]
    assert sorted(i for i, *_ in rows) == share  # every sample once
    for j in (0, 1):
        mine = placed_rows(share, 2, [j], 2, "entrain", lambda idx: (enc, llm))
        assert [[i for i, e, *_ in mine if e == m] for m in range(3)] == \
            [[share[s] for s in samples] for samples in plan.assignment[j]]
        assert all(lm in (e, e + 1) for _, e, lm, _ in mine)


def _reference(out: str, cfg: dict, steps: int) -> dict:
    """One process over the global batches the groups recorded (``data.json``), built like the groups' model."""
    ref = {k: cfg[k] for k in ("lora", "moe", "data", "accumulate", "precision", "train_encoder") if k in cfg}
    subprocess.run([sys.executable, CASE, json.dumps({"mode": "reference", "steps": steps, "out": out, **ref})],
                   check=True, env=case_env(), cwd=out, capture_output=True, timeout=600)
    return torch.load(os.path.join(out, "reference.pt"))


def _two_groups(out: str, address, cfg: dict, steps: int, kill=None, survivors=(0, 1)) -> dict:
    """Two replica groups of ``cfg`` (2 ranks each) to ``steps``; the results of ``survivors`` (which must end
    cleanly; a killed group is not restarted)."""
    host, port = address
    base = {"mode": "group", "lighthouse": f"{host}:{port}", "groups": 2, "steps": steps, "out": out,
            "timeout": 60.0, "fault_timeout": 120.0, "kill": kill, **cfg}
    procs = [_launch({**base, "group": g}, restarts=0, nproc=cfg.get("devices", 2)) for g in (0, 1)]
    codes = _wait(procs, 1500)
    assert [codes[g] for g in survivors] == [0] * len(survivors), _log(out, "launch_*.log")
    results = {}
    for g in survivors:
        with open(os.path.join(out, f"result_{g}.json")) as f:
            results[g] = json.load(f)
    return results


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.combines("ft", "llm_cp", "packing", "activation_checkpointing", "lora", "accumulation")
def test_groups_with_llm_cp_packing_recomputation_lora_and_accumulation_train_like_one_process(tmp_path, lighthouse):
    """Each group: the LLM over 2 context-parallel ranks, rows packed with several samples (segment ids), every
    layer recomputed in backward, LoRA adapters on q/v (the LLM's weights frozen), accumulate_grad_batches=2. Group
    1 loses a rank inside the first micro-batch of step 3 and never returns: group 0's step fails at the
    cross-group sum and is redone alone, both micro-batches of the whole global batch; every committed step equals
    one process's step over its 2 global micro-batches."""
    out = str(tmp_path)
    cfg = {"llm": {"cp": 2}, "lora": True, "accumulate": 2,
           "data": {"layout": "mp", "seq_len": 160, **IMAGES},
           "strategy": {"activation_checkpointing": True, "cp_block_size": 8}}
    kill = {"group": 1, "rank": 1, "step": 2, "where": "backward"}
    r0 = _two_groups(out, lighthouse, cfg, STEPS, kill=kill, survivors=(0,))[0]
    assert r0["global_step"] == STEPS and r0["stats"]["redone_steps"] >= 1
    assert all(e["step"] == kill["step"] for e in r0["events"] if e["event"] == "redo")
    assert [s for s, _ in r0["steps"]][1::2] == list(range(1, STEPS + 1))  # 2 batches a step, none applied twice
    assert r0["shares"][str(STEPS - 1)] == 2 * 2 * 2  # alone: both micro-batches of 2 x 2 samples
    ref = _reference(out, cfg, STEPS)
    assert any(".lora_" in n for n in ref)
    _assert_equal_to_reference(_params(out, 0), ref)


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.combines("ft", "ep", "balancing", "checkpoint")
def test_groups_with_expert_parallelism_and_balancing_resume_from_a_checkpoint_like_one_process(tmp_path, lighthouse):
    """Each group: a Qwen3-MoE LLM whose experts are split over its 2 data-parallel ranks (ep 2), the group's share
    of every step placed over them by ENTRAIN. Both groups train 2 steps and save a checkpoint; a new job of both
    groups resumes from it (``trainer.fit(ckpt_path=...)``, the first quorum adopts its step) and trains to step 4:
    equal to 4 uninterrupted steps of one process."""
    out = str(tmp_path)
    cfg = {"llm": {"ep": 2}, "moe": "qwen3_moe", "data": IMAGES, "strategy": {"batch_balancing": "entrain"}}
    first = _two_groups(out, lighthouse, {**cfg, "save_every": 2, "ckpt_dir": os.path.join(out, "ckpt_{group}")}, 2)
    assert first[0]["global_step"] == first[1]["global_step"] == 2
    saved = os.path.join(out, "ckpt_{group}", "step=2.ckpt")
    assert all(os.path.isdir(saved.format(group=g)) for g in (0, 1))
    for f in os.listdir(out):
        if f.startswith(("params_", "result_", "steps_")):
            os.remove(os.path.join(out, f))
    results = _two_groups(out, lighthouse, {**cfg, "resume": saved}, 4)
    for g in (0, 1):
        assert results[g]["resumed_from"] == saved.format(group=g) and results[g]["global_step"] == 4
        assert [s for s, _ in results[g]["steps"]] == list(range(3, 5))
    ref = _reference(out, cfg, 4)
    assert any(".mlp.experts." in n for n in ref)
    _assert_equal_to_reference(_params(out, 0), ref)
    _assert_equal_to_reference(_params(out, 1), ref)


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.combines("ft", "per_module_dp")
def test_groups_with_per_module_data_parallelism_train_like_one_process(tmp_path, lighthouse):
    """Each group (3 ranks): the vision encoder on 2 data-parallel replicas, the LLM on 1 (per-module degrees);
    each group's share is routed between the encoder's replicas and the LLM's. Both equal one process."""
    out = str(tmp_path)
    cfg = {"vision": {"dp": 2}, "llm": {"dp": 1}, "devices": 3, "data": IMAGES,
           "strategy": {"encoder_placement": "parallel", "num_microbatches": 1}}
    results = _two_groups(out, lighthouse, cfg, STEPS)
    assert results[0]["global_step"] == results[1]["global_step"] == STEPS
    ref = _reference(out, cfg, STEPS)
    for g in (0, 1):
        _assert_equal_to_reference(_params(out, g), ref)


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("inside", [
    pytest.param({"llm": {"tp": 2}}, id="tp2", marks=pytest.mark.combines("ft", "tp")),
    pytest.param({"llm": {"tp": 2}, "precision": "bf16-mixed"}, id="tp2-bf16",
                 marks=pytest.mark.combines("ft", "tp", "mixed_precision")),
    pytest.param({"llm": {"pp": 1}, "strategy": {"sharding_strategy": "FULL_SHARD"}}, id="full_shard-dp2",
                 marks=pytest.mark.combines("ft", "fsdp"))])
def test_groups_with_sharded_parameters_heal_and_train_like_one_process(tmp_path, lighthouse, inside):
    """Each group (2 ranks, groups of one layout): the LLM's weights split over tensor-parallel ranks (also under
    bf16-mixed), or the model under FULL_SHARD over the group's 2 data-parallel ranks. Group 1 loses a rank inside
    step 3 and restarts: group 0 redoes that step alone, group 1 heals from it (its sharded parameters and optimiser
    state) and rejoins; both equal one process (autocast to bf16 like the groups, for the bf16 case)."""
    from tests.test_fault_tolerance import _run_two_groups

    kill = {"group": 1, "rank": 1, "step": 3, "where": "backward"}
    cfg = {"data": IMAGES, "timeout": 60.0, "fault_timeout": 120.0, **inside}
    out, codes, results = _run_two_groups(tmp_path, lighthouse, kill, restarts_1=1, wait_rejoin=True,
                                          layouts=(cfg, cfg), restarts_0=0, wait=1500)
    assert codes == [0, 0], _log(out, "launch_*.log")
    r0, r1 = results[0], results[1]
    assert r0["global_step"] == r1["global_step"] == 8 and r0["stats"]["redone_steps"] >= 1
    assert r1["restart"] == 1 and r1["stats"]["healed_steps"] == 1
    ref = _reference(out, cfg, 8)
    tol = 2e-3 if cfg.get("precision") == "bf16-mixed" else 1e-5  # bf16 matmuls: the groups' sums in another order
    for g in (0, 1):
        got = _params(out, g)
        assert set(got) == set(ref)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=tol, atol=tol, msg=lambda m: f"{n}: {m}")


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.combines("ft", "encoder_cp")
def test_groups_with_encoder_context_parallelism_train_like_one_process(tmp_path, lighthouse):
    """Each group (3 ranks): the vision tower trained over 2 context-parallel ranks (each encodes part of a
    microbatch's 0-5 images, features gathered back in order), the LLM on the third. Both groups equal one
    process."""
    out = str(tmp_path)
    cfg = {"vision": {"cp": 2}, "llm": {"pp": 1}, "devices": 3, "data": IMAGES, "train_encoder": True,
           "strategy": {"encoder_placement": "parallel"}}
    results = _two_groups(out, lighthouse, cfg, STEPS)
    assert results[0]["global_step"] == results[1]["global_step"] == STEPS
    ref = _reference(out, cfg, STEPS)
    assert any(n.startswith("encoders.vision") and "proj" not in n for n in ref), sorted(ref)[:5]
    for g in (0, 1):
        _assert_equal_to_reference(_params(out, g), ref)
