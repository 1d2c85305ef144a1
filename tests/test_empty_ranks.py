"""Ranks with nothing to do: every rank runs every collective of every step, whatever its data.

A replica whose samples are all text-only (or have images but no audio) skips an encoder; under FSDP the other
replicas' ranks then wait for its all-gathers and reduce-scatters. The engine runs such a rank's encoder stage on a
stand-in item with zero weight (``PipelineEngine.encoder_part``). Each case trains two replicas, the second
without the modality, against one process (gloo, fp32), under the test timeout: a hang is a failure."""

import pytest
from helpers.distributed import run_distributed
from helpers.empty_ranks_case import run_per_module_rank, run_per_module_reference, run_rank, run_reference
from helpers.pipeline_case import check_like_reference

VA = ("vision", "audio")
CASES = [  # (modalities, freeze, the modalities replica 1 lacks, placement, llm pp, sharding, world)
    (("vision",), "encoder", ("vision",), "parallel", 1, "FULL_SHARD", 4),
    pytest.param((("vision",), "encoder", ("vision",), "replicated", 2, "FULL_SHARD", 4),
                 marks=[pytest.mark.ci, pytest.mark.combines("fsdp", "placement", "pipeline")]),
    pytest.param((("vision",), "projectors", ("vision",), "parallel", 2, "SHARD_GRAD_OP", 6),
                 marks=pytest.mark.combines("fsdp", "pipeline")),
    pytest.param((("vision",), "encoder", ("vision",), "colocated", 1, "FULL_SHARD", 4),
                 marks=pytest.mark.combines("fsdp", "placement")),
    (("vision",), "encoder", ("vision",), "parallel", 2, "SHARD_GRAD_OP", 6),
    (VA, "encoder", ("audio",), "parallel", 1, "FULL_SHARD", 6),
    # with the rows above, every pair of (sharding, encoder trained or frozen, placement, LLM pp) is covered
    pytest.param((("vision",), "projectors", ("vision",), "colocated", 2, "FULL_SHARD", 6),
                 marks=pytest.mark.combines("fsdp", "placement", "pipeline")),
    (("vision",), "encoder", ("vision",), "colocated", 1, "SHARD_GRAD_OP", 4),
    (("vision",), "projectors", ("vision",), "replicated", 1, "SHARD_GRAD_OP", 2),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{'+'.join(c[0])}-{c[1]}-no-{'+'.join(c[2])}-{c[3]}-llm{c[4]}-"
                                                      f"{c[5]}")
def test_a_replica_without_items_trains_like_one_process(case):
    modalities, freeze, without, placement, llm_pp, sharding, world = case
    ref_losses, ref_params = run_reference(modalities, freeze, without)
    results = run_distributed(run_rank, world, modalities, freeze, without, placement, llm_pp, sharding)
    check_like_reference(results, ref_losses, ref_params)


SHARDED_ENCODER_CASES = [  # (encoder specs, LLM spec, world)
    pytest.param({"vision": dict(dp=2)}, dict(dp=1, pp=2), 4, id="per-module-dp-vision-dp2-llm-pp2",
                 marks=pytest.mark.combines("fsdp", "per_module_dp", "pipeline")),
    pytest.param({"vision": dict(cp=2)}, dict(), 3, id="vision-cp2", marks=pytest.mark.combines("fsdp", "encoder_cp")),
]


@pytest.mark.slow
@pytest.mark.parametrize("encoder_specs,llm_spec,world", SHARDED_ENCODER_CASES)
def test_a_sharded_encoder_rank_without_items(encoder_specs, llm_spec, world):
    """The vision tower trained under FULL_SHARD over two ranks (two per-module dp replicas, or two encoder CP
    ranks), on batches where one microbatch holds a single image (one of the two ranks gets nothing) and another
    none: like one process, and each of the two ranks holds about half of the tower's parameters."""
    ref_losses, ref_params = run_per_module_reference()
    results = run_distributed(run_per_module_rank, world, encoder_specs, llm_spec)
    check_like_reference(results, ref_losses, ref_params)
    shards = [sizes for *_, sizes in results if sizes[1]]
    assert len(shards) == 2
    for local, full in shards:
        assert 0.4 * full <= local <= 0.6 * full, shards
    assert sum(local for local, _ in shards) == shards[0][1]
