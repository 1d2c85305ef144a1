"""Per-module data parallelism: each encoder and the language model at its own data-parallel degree trains exactly
like the unparallelised model in one process (gloo, CPU, fp32, SGD); the layout, routing and refusals (pure)."""

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.per_module_dp_case import check_like_reference, run_rank, run_reference

# (modalities, freeze, encoder specs, llm spec, microbatches, rows per global batch)
CASES = [
    pytest.param((("vision",), "encoder", {"vision": dict(dp=2)}, dict(dp=1, pp=2), 2, 4), marks=pytest.mark.ci,
                 id="vision-dp2-llm-dp1-pp2"),
    pytest.param((("vision",), "encoder", {"vision": dict(dp=1)}, dict(dp=2), 2, 8), id="vision-dp1-llm-dp2"),
    pytest.param((("vision", "audio"), "encoder", {"vision": dict(dp=2), "audio": dict(dp=1)}, dict(dp=1), 2, 4),
                 id="vision-dp2-audio-dp1-llm-dp1"),
    pytest.param((("vision",), "encoder", {"vision": dict(dp=2)}, dict(dp=1, cp=2), 2, 4), id="vision-dp2-llm-cp2"),
    pytest.param((("vision",), "encoder", {"vision": dict(dp=2)}, dict(dp=3), 2, 12), id="vision-dp2-llm-dp3"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_per_module_dp_trains_like_one_process(case):
    mods, freeze, encoder_specs, llm_spec, microbatches, rows = case
    steps = 3
    ref_losses, ref_params = run_reference(mods, freeze, steps, rows)
    world = sum(s.get("dp", 1) * s.get("pp", 1) * s.get("cp", 1) for s in [*encoder_specs.values(), llm_spec])
    results = run_distributed(run_rank, world, mods, freeze, encoder_specs, llm_spec, microbatches, steps, rows)
    check_like_reference(results, ref_losses, ref_params)
