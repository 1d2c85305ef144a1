"""MultimodalParallelStrategy inside a real Lightning Trainer equals single-process Lightning training."""

import json
import os

import pytest
import torch

import lightning_mm as lmm
from lightning_mm.checkpoint import consolidate
from tests.helpers.launch import run_script

CASE = os.path.join(os.path.dirname(__file__), "helpers", "lightning_case.py")


def run(mode, tmp_path, accumulate=1):
    out, ckpt = tmp_path / f"{mode}{accumulate}.json", tmp_path / f"{mode}{accumulate}.ckpt"
    run_script(CASE, mode, str(out), str(ckpt), str(accumulate), cwd=tmp_path, timeout=400)
    return json.loads(out.read_text()), ckpt


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, pytest.param(2, marks=[  # accumulate 2 also recomputes activations
    pytest.mark.combines("pipeline", "accumulation", "activation_checkpointing")])])
def test_strategy_trains_like_single_process_and_checkpoint_consolidates(tmp_path, accumulate):
    """Per-step losses, validation loss (after step 2), global-norm clipping, gradient accumulation."""
    single, single_ckpt = run("single", tmp_path, accumulate)
    pipe, pipe_ckpt = run("pipeline", tmp_path, accumulate)
    assert len(pipe["train"]) == 3 * accumulate and single["train"][0] != single["train"][-1]
    torch.testing.assert_close(torch.tensor(pipe["train"]), torch.tensor(single["train"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pipe["val"], single["val"], rtol=1e-5, atol=1e-6)
    expected = torch.load(single_ckpt, weights_only=True)
    merged = consolidate(str(pipe_ckpt))
    assert set(merged) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_strategy_registered_and_bad_spec_named():
    from lightning.pytorch.strategies import StrategyRegistry

    assert "multimodal" in StrategyRegistry
    strategy = StrategyRegistry.get("multimodal")
    assert isinstance(strategy, lmm.MultimodalParallelStrategy)
    with pytest.raises(ValueError, match="num_microbatches must be >= 1"):
        lmm.MultimodalParallelStrategy(num_microbatches=0)
