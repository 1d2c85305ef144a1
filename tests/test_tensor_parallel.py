"""Tensor parallelism (DTensor, HF plans) and sharded data parallelism (FSDP2) under MultimodalParallelStrategy.

Every multi-process case trains two optimiser steps and compares every trainable parameter (and the losses) with
plain single-process Lightning on the same global batch (tests/helpers/trainer_case.py). SGD: Adam turns last-bit
summation-order differences on near-zero gradients into lr-sized steps, which would hide nothing but noise.
"""

import json

import pytest
import torch

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model
from lightning_mm.parallel.tensor_parallel import check_tensor_parallel
from lightning_mm.plan.layout import ParallelSpec, build_layout, check_node_locality
from tests.helpers.launch import run_script
from tests.test_lightning_contracts import CASE, assert_same_training, run

SGD = dict(steps=2, optimizer="sgd", lr=0.5, microbatches=2)


# ---------------------------------------------------------------------------------------------- pure checks
def test_layout_places_tensor_parallel_ranks_and_pairs_them():
    layout = build_layout({"vision": ParallelSpec(tp=2)}, ParallelSpec(pp=2, cp=2, tp=2), 20)
    assert layout.ranks_per_replica == 2 + 4 + 4 and layout.dp == 2
    assert [layout.coordinate(r) for r in (0, 1, 2, 5, 13)] == [
        lmm_coord("vision.0", 0, 0, 0), lmm_coord("vision.0", 0, 0, 1), lmm_coord("language_model.0", 0, 0, 0),
        lmm_coord("language_model.0", 0, 1, 1), lmm_coord("language_model.0", 1, 0, 1)]
    # every LLM rank of the first stage reads the vision output from tp rank t % 2 of the encoder
    assert layout.activation_sources("vision.0", "language_model.0", 0) == {2: 0, 3: 1, 4: 0, 5: 1}
    # each encoder tp rank sums one gradient per CP shard, from the LLM's tp rank of the same index
    assert layout.gradient_sources("vision.0", "language_model.0", 0) == {0: [2, 4], 1: [3, 5]}
    # between LLM stages: the same (cp, tp) rank
    assert layout.activation_sources("language_model.0", "language_model.1", 1) == {16: 12, 17: 13, 18: 14, 19: 15}
    mesh = layout.mesh_ranks("language_model")
    assert mesh[1][1][1] == [18, 19] and len(mesh) == 2 and len(mesh[0]) == 2
    assert layout.shard_mesh_ranks("vision") == [[[0, 1], [10, 11]]]
    assert layout.grad_group_ranks("language_model.0", 1) == [3, 5, 13, 15]
    # an encoder with tp 1 feeding a tp-4 LLM: all four read rank 0, which sums the one gradient per CP shard
    layout = build_layout({"audio": ParallelSpec()}, ParallelSpec(tp=4), 5)
    assert layout.activation_sources("audio.0", "language_model.0", 0) == {1: 0, 2: 0, 3: 0, 4: 0}
    assert layout.gradient_sources("audio.0", "language_model.0", 0) == {0: [1]}


def test_tensor_and_context_parallel_ranks_stay_inside_a_node():
    layout = build_layout({"vision": ParallelSpec(tp=2)}, ParallelSpec(pp=2, cp=2, tp=2), 20)  # 10 ranks a replica
    check_node_locality(layout, 10)  # one replica per node
    check_node_locality(layout, 20)  # one node
    for per_node in (8, 2):  # ranks 6-9 (LLM stage 1) over nodes 0 and 1; a 4-wide stage over nodes of 2
        with pytest.raises(ValueError, match="must share a node"):
            check_node_locality(layout, per_node)
    layout = build_layout({"vision": ParallelSpec(tp=2)}, ParallelSpec(pp=1, cp=1, tp=2), 8)  # widths 2 + 2
    check_node_locality(layout, 2)


def lmm_coord(stage, dp, cp, tp):
    from lightning_mm.plan.layout import Coordinate

    return Coordinate(stage, dp, cp, tp)


def test_bad_tensor_parallel_specs_fail_before_any_process_group():
    import torch.distributed as dist

    with pytest.raises(ValueError, match=r"must share its tensor-parallel ranks: give \['b'\] tp=2"):
        build_layout({"a": ParallelSpec(tp=2), "b": ParallelSpec()}, ParallelSpec(), 4, "colocated")
    with pytest.raises(ValueError, match="tp=1: run whole on every rank"):
        build_layout({"a": ParallelSpec(tp=4)}, ParallelSpec(tp=2), 2, "replicated")
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip")),
                                 "image": lmm.ModalityEncoder(tiny_encoder("dinov2", use_swiglu_ffn=True)),
                                 "video": lmm.ModalityEncoder(tiny_encoder("qwen2_vl"))},
                                tiny_language_model("llama", num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="tp=4 does not divide num_key_value_heads=2"):
        check_tensor_parallel(model, {}, 4)
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=4"):
        check_tensor_parallel(model, {"vision": 3}, 1)
    with pytest.raises(ValueError, match=r"encoder 'image' \(Dinov2Model\) has no tensor-parallel plan; use "
                                         r"encoders=\{'image': ParallelSpec\(tp=1\)\}"):
        check_tensor_parallel(model, {"image": 2}, 1)  # SwiGLU Dinov2: fused input projection
    with pytest.raises(ValueError, match=r"encoder 'video': tp=3 does not divide num_attention_heads=4"):
        check_tensor_parallel(model, {"video": 3}, 1)  # the Qwen-VL towers' plan splits heads
    check_tensor_parallel(model, {"vision": 2, "image": 1, "video": 2}, 2)
    check_tensor_parallel(lmm.MultimodalModel({"image": lmm.ModalityEncoder(tiny_encoder("dinov2"))},
                                              tiny_language_model()), {"image": 2}, 1)
    with pytest.raises(ValueError, match="unknown sharding_strategy 'ZERO3'.*FULL_SHARD"):
        lmm.MultimodalParallelStrategy(sharding_strategy="ZERO3")
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------------- against one process
@pytest.mark.slow
@pytest.mark.parametrize("name, case, freeze", [
    pytest.param("tp2", dict(llm_tp=2), "llm",  # 2 microbatches: the strategy's default balancing places them
                 marks=pytest.mark.combines("tp", "balancing", note="balancing: the default entrain, not asserted")),
    pytest.param("pp2_tp2_vision_tp2", dict(llm_pp=2, llm_tp=2, encoder_tp=[2, 1]), "all",
                 marks=pytest.mark.combines("tp", "pipeline")),
    pytest.param("tp2_cp2", dict(llm_tp=2, llm_cp=2), "llm", marks=pytest.mark.combines("tp", "llm_cp")),
    pytest.param("tp2_colocated_tp2_recompute_clip", dict(llm_tp=2, encoder_tp=[2, 2], placement="colocated",
                                                          recompute=True, clip=0.05), "all",
                 marks=[pytest.mark.combines("tp", "placement", "activation_checkpointing"),
                        pytest.mark.combines("placement", "activation_checkpointing", "balancing",
                                             note="balancing: the default entrain, not asserted")]),
    ("qwen3_tp2", dict(llm="qwen3", llm_tp=2), "llm"),  # per-head q/k norms: gradients summed over tp
    ("phi3_tp2", dict(llm="phi3", llm_tp=2), "llm"),  # fused qkv: gathered output, split input
    ("dinov2_tp2", dict(vision="dinov2", llm_tp=2, encoder_tp=[2, 1]), "all"),
])
def test_tensor_parallel_trains_like_one_process(tmp_path, name, case, freeze):
    ref = run({**SGD, "freeze": freeze, "clip": case.get("clip"), "llm": case.get("llm", "llama"),
               "vision": case.get("vision", "siglip")}, tmp_path, "single")
    got = run({**SGD, **case, "freeze": freeze}, tmp_path, name)
    assert_same_training(got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("name, case, freeze", [
    pytest.param("full_shard_dp2", dict(sharding="FULL_SHARD"), "all",
                 marks=pytest.mark.combines("fsdp", "balancing", note="balancing: the default entrain, not asserted")),
    pytest.param("shard_grad_op_dp2_pp2_lazy", dict(sharding="SHARD_GRAD_OP", llm_pp=2, lazy=True), "projectors",
                 marks=pytest.mark.combines("fsdp", "pipeline")),
    pytest.param("full_shard_dp2_tp2_lazy", dict(sharding="FULL_SHARD", llm_tp=2, lazy=True), "llm",
                 marks=pytest.mark.combines("fsdp", "tp")),
    pytest.param("full_shard_dp2_tp2_lazy_reduce_once_per_step",
                 dict(sharding="FULL_SHARD", llm_tp=2, lazy=True, fsdp_reduce="step", microbatches=2, accumulate=2),
                 "llm", marks=pytest.mark.combines("fsdp", "tp", "accumulation")),
    pytest.param("full_shard_dp2_accumulate2_clip", dict(sharding="FULL_SHARD", accumulate=2, clip=0.05), "llm",
                 marks=[pytest.mark.combines("fsdp", "accumulation"),
                        pytest.mark.combines("accumulation", "balancing",
                                             note="balancing: the default entrain, not asserted")]),
])
def test_sharded_data_parallel_trains_like_one_process(tmp_path, name, case, freeze):
    """A lazy (meta) build is compared with a lazy build in one process (the strategy's devices=1 mode): its
    initial values are drawn by parameter name, not in HF's construction order."""
    single = {"devices": 1, "llm_pp": 1, "lazy": True, "batch_size": 8} if case.get("lazy") else {"dp": 2}
    ref = run({**SGD, "freeze": freeze, **single, **{k: case[k] for k in ("accumulate", "clip") if k in case}},
              tmp_path, "single")
    got = run({**SGD, **case, "freeze": freeze, "dp": 2}, tmp_path, name)
    assert_same_training(got, ref)


@pytest.mark.slow
@pytest.mark.combines("fsdp", "mixed_precision")
@pytest.mark.combines("mixed_precision", "balancing", note="balancing: the default entrain, not asserted")
def test_full_shard_bf16_mixed_matches_one_process_within_bf16_tolerance(tmp_path):
    """FSDP2 gathers parameters in bf16 and reduces gradients in fp32 (MixedPrecisionPolicy from the precision)."""
    base = dict(precision="bf16-mixed", steps=2, microbatches=2)
    got = run({**base, "dp": 2, "sharding": "FULL_SHARD"}, tmp_path, "fsdp")
    ref = run({**base, "dp": 2}, tmp_path, "single")
    torch.testing.assert_close(torch.tensor(got[0]["train"]), torch.tensor(ref[0]["train"]), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------- per-rank state
@pytest.mark.slow
def test_full_shard_and_tensor_parallel_cut_what_each_rank_holds(tmp_path):
    """Bytes of parameters + gradients + AdamW state each rank holds (local tensors, right before the second
    optimiser step), against one process holding everything: FULL_SHARD over dp 4 <= 0.3; tp 2 holds <= 0.6 of
    its stage's parameters."""
    base = dict(steps=2, freeze="all", placement="replicated", state_bytes=True, batch_size=1)
    one = _state(tmp_path, "one", {**base, "devices": 1})
    full = _state(tmp_path, "fsdp4", {**base, "dp": 4, "sharding": "FULL_SHARD"})
    tp = _state(tmp_path, "tp2", {**base, "llm_tp": 2, "encoder_tp": [2, 2]})
    whole = one[0]["params"] + one[0]["grads"] + one[0]["optimizer"]
    print(f"\none process: {whole} B; FULL_SHARD dp4 per rank: {[r['total'] for r in full]}; "
          f"tp2 parameters per rank: {[r['params'] for r in tp]} of {one[0]['params']}")
    assert len(full) == 4 and all(r["total"] <= 0.3 * whole for r in full)
    assert len(tp) == 2 and all(r["params"] <= 0.6 * one[0]["params"] for r in tp)


def _state(tmp_path, name, case):
    out = tmp_path / name
    out.mkdir()
    run_script(CASE, json.dumps(case), str(out), cwd=out)
    return [json.loads(f.read_text()) for f in sorted(out.glob("state_*.json"))]



BAD_TP_SCRIPT = """
import lightning as L, torch
import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model
strategy = lmm.MultimodalParallelStrategy(encoders={"vision": lmm.ParallelSpec()}, language_model=lmm.ParallelSpec(tp=2),
                                          encoder_placement="replicated", fault_timeout=30)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False)
with trainer.init_module(empty_init=True):
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))},
                                tiny_language_model("llama", intermediate_size=63))
trainer.fit(lmm.MultimodalLightningModule(model), lmm.data.SyntheticMultimodalDataModule(num_samples=4, batch_size=2))
"""


@pytest.mark.slow
def test_a_bad_tensor_parallel_spec_under_the_trainer_is_the_error_the_user_sees(tmp_path):
    """Raised in setup_environment, before any process group, on a meta-built model: teardown must not bury it
    under "Cannot copy out of meta tensor"."""
    script = tmp_path / "bad_tp.py"
    script.write_text(BAD_TP_SCRIPT)
    proc = run_script(str(script), cwd=tmp_path, timeout=240, check=False)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "tp=2 does not divide intermediate_size=63; choose a tp that divides it" in last, proc.stderr[-3000:]
    assert "meta tensor" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_qwen_vl_towers_split_over_tp_train_like_one_process(kind, tmp_path):
    """A Qwen-VL tower over 2 tensor-parallel ranks (the fused q/k/v whole with each rank's heads, output projection
    and MLP split; Qwen2.5-VL's window attention, Qwen3-VL's DeepStack mergers), the LLM on a third rank: one
    process's losses and trained parameters."""
    from tests.helpers.composite_case import run_case
    from tests.test_hf_composites import save_composite

    folder = save_composite(kind, tmp_path / "src")
    ref_losses, ref_params = run_case("composite_case.py", {"folder": folder}, tmp_path, "single")
    losses, params = run_case("composite_case.py", {"folder": folder, "vision_tp": 2}, tmp_path, "vision_tp2")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert set(params) == set(ref_params)
    for n, p in ref_params.items():
        torch.testing.assert_close(params[n], p, rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.slow
@pytest.mark.combines("tp", "fsdp")
def test_qwen_vl_tower_tp_with_fsdp_over_dp_trains_like_one_process(tmp_path):
    """A Qwen2.5-VL tower over 2 tp ranks inside FSDP2 (FULL_SHARD over 2 data-parallel replicas: a 2-D tp x dp
    mesh for the tower, the LLM sharded over dp): one process's losses and trained parameters."""
    from tests.helpers.composite_case import run_case
    from tests.test_hf_composites import save_composite

    folder = save_composite("qwen2_5_vl", tmp_path / "src")
    ref_losses, ref_params = run_case("composite_case.py", {"folder": folder}, tmp_path, "single")
    losses, params = run_case("composite_case.py", {"folder": folder, "vision_tp": 2, "dp": 2,
                                                    "sharding": "FULL_SHARD"}, tmp_path, "vision_tp2_fsdp_dp2")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert set(params) == set(ref_params)
    for n, p in ref_params.items():
        torch.testing.assert_close(params[n], p, rtol=1e-4, atol=1e-5, msg=n)
