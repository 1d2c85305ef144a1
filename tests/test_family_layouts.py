"""Each composite family in the training layouts users pick for long rows: the LLM under context parallelism with
its parameters sharded (FSDP2 over the cp ranks), against one process's losses and trained parameters."""

import pytest
import torch

from tests.helpers.composite_case import run_case
from tests.test_hf_composites import save_composite as save_hf_composite
from tests.test_tile_composites import save_composite as save_tile_composite

# kind: (the runner, the keys that lay out its encoder and make its samples)
FAMILIES = {"qwen3_vl_moe": ("composite_case.py", {"microbatches": 1}),  # the aux loss: one microbatch, as one process
            "gemma3": ("composite_case.py", {"image_size": 16}),
            "qwen2_audio": ("composite_case.py", {"encoder": "audio"}),
            "llava_next": ("tile_case.py", {"kind": "llava_next"}),
            "llava_onevision": ("tile_case.py", {"kind": "llava_onevision"}),
            "internvl": ("tile_case.py", {"kind": "internvl"})}


@pytest.mark.slow
@pytest.mark.combines("llm_cp", "fsdp")
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_a_family_under_llm_cp_with_fsdp_trains_like_one_process(kind, tmp_path):
    """Encoder one rank, LLM cp 2 under FULL_SHARD (its layers sharded over the two cp ranks), rows with zero to two
    items (audio: every third sample text only): one process's losses and trained parameters."""
    runner, keys = FAMILIES[kind]
    save = save_tile_composite if runner == "tile_case.py" else save_hf_composite
    folder = save(kind, tmp_path / "src")
    ref_losses, ref_params = run_case(runner, {"folder": folder, **keys}, tmp_path, "single")
    assert len(ref_losses) == 3 and ref_losses[-1] < ref_losses[0]
    losses, params = run_case(runner, {"folder": folder, **keys, "llm_cp": 2, "sharding": "FULL_SHARD"}, tmp_path,
                              "cp2_fsdp")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert set(params) == set(ref_params)
    for n, p in ref_params.items():
        torch.testing.assert_close(params[n], p, rtol=1e-4, atol=1e-5, msg=n)
