"""The runtime on a real GPU (``pytest -m gpu``; skipped without CUDA): NCCL, bf16-mixed, several ranks sharing one
GPU, and per-rank GPU memory, each against plain single-device Lightning on the same GPU and global batch
(tests/helpers/trainer_case.py). The Triton kernels' native runs are in tests/test_kernels.py."""

import json
import os

import pytest
import torch

from tests.helpers.launch import run_script, run_trainer_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CASE = os.path.join(os.path.dirname(__file__), "helpers", "trainer_case.py")


def run(case, tmp_path, name):
    return run_trainer_case(CASE, {"accelerator": "cuda", "optimizer": "sgd", "lr": 0.05, **case}, tmp_path, name)


def peaks(tmp_path, name):
    return {int(f.stem.split("_")[1]): json.loads(f.read_text())["peak_allocated"]
            for f in (tmp_path / name).glob("memory_*.json")}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_one_gpu_under_nccl_trains_like_plain_lightning(tmp_path, precision):
    """World size 1 with NCCL (Lightning's DDP machinery), the strategy's debug mode: the whole model."""
    tol = dict(rtol=1e-4, atol=1e-5) if precision == "32-true" else dict(rtol=2e-2, atol=2e-2)
    single, single_params = run({"precision": precision}, tmp_path, "single")
    ours, params = run({"precision": precision, "llm_pp": 1, "devices": 1}, tmp_path, "ours")
    assert single["train"][0] != single["train"][-1]
    torch.testing.assert_close(torch.tensor(ours["train"]), torch.tensor(single["train"]), **tol)
    for name, value in single_params.items():
        torch.testing.assert_close(params[name], value, **tol, msg=name)


def test_ranks_sharing_one_gpu_pipeline_like_one_process(tmp_path):
    """Vision 1 stage + audio 1 stage + LLM 2 stages = 4 ranks on cuda:0 with gloo (NCCL refuses a shared GPU):
    stage P2P staged through host copies, gradients all-reduced on the GPU; built lazily, so each rank's peak GPU
    memory is its stage's, below one process holding the whole model."""
    single, single_params = run({"validate": True}, tmp_path, "single")
    ours, params = run({"validate": True, "share_gpu": True, "backend": "gloo", "encoder_pp": [1, 1], "llm_pp": 2,
                        "microbatches": 2, "lazy": True}, tmp_path, "shared")
    torch.testing.assert_close(torch.tensor(ours["train"]), torch.tensor(single["train"]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours["val"], single["val"], rtol=1e-4, atol=1e-5)
    assert set(params) == set(single_params)
    for name, value in single_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-5, msg=name)
    whole, ranks = peaks(tmp_path, "single")[0], peaks(tmp_path, "shared")
    assert len(ranks) == 4 and max(ranks.values()) < whole, (ranks, whole)


def test_nccl_on_a_shared_gpu_is_refused_by_name(tmp_path):
    out = tmp_path / "nccl"
    out.mkdir()
    case = {"accelerator": "cuda", "share_gpu": True, "backend": "nccl", "encoder_pp": [1, 1], "llm_pp": 1}
    proc = run_script(CASE, json.dumps(case), str(out), cwd=out, check=False)
    assert proc.returncode != 0 and "NCCL refuses a GPU shared by ranks" in proc.stderr, proc.stderr[-3000:]


def test_qwen2_vl_tower_trains_and_resumes_on_one_gpu_like_plain_lightning(tmp_path):
    """Qwen2-VL's tower on CUDA (its rotary table and item rows made on the grid's device), then a resume from the
    step-2 checkpoint, which holds the GPU's random state, continues with the uninterrupted run's losses."""
    from lightning_mm.checkpoint import read_dcp_metadata

    case = {"vision": "qwen2_vl", "modalities": ["vision"], "steps": 4}
    single, single_params = run(case, tmp_path, "single")
    ours, params = run({**case, "llm_pp": 1, "devices": 1, "save_every": 2}, tmp_path, "ours")
    torch.testing.assert_close(torch.tensor(ours["train"]), torch.tensor(single["train"]), rtol=1e-4, atol=1e-5)
    for name, value in single_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-5, msg=name)
    checkpoint = tmp_path / "ours" / "ckpt" / "step=2.ckpt"
    assert "rng/0/cuda" in read_dcp_metadata(str(checkpoint)).state_dict_metadata
    resumed, _ = run({**case, "llm_pp": 1, "devices": 1, "resume": str(checkpoint)}, tmp_path, "resumed")
    # the first resumed loss is a forward of the saved parameters; the next follows a backward that may add atomically
    torch.testing.assert_close(torch.tensor(resumed["train"]), torch.tensor(ours["train"][2:]), rtol=1e-5, atol=1e-6)
