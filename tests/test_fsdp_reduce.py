"""``fsdp_reduce``: FSDP reduce-scatters a sharded stage's gradients after every microbatch's backward
("microbatch") or once per optimiser step, in its last backward ("step"). Both train like one process; "step"
launches exactly 1 / (microbatches x accumulated batches) of the reduce-scatters (counted on every rank)."""

import pytest
from helpers.distributed import run_distributed
from helpers.fsdp_reduce_case import ACCUMULATE, MICROBATCHES, run_rank, run_reference
from helpers.pipeline_case import check_like_reference

import lightning_mm as lmm

LAYOUTS = [  # (placement, LLM pp, world): two replicas
    pytest.param("replicated", 1, 2, id="one-stage-dp2"),
    pytest.param("parallel", 2, 6, id="vision-llm-pp2-dp2", marks=[pytest.mark.slow,
                                                                      pytest.mark.combines("fsdp", "pipeline")]),
]


@pytest.mark.parametrize("placement,llm_pp,world", LAYOUTS)
def test_once_per_step_reduces_once_and_trains_like_one_process(placement, llm_pp, world):
    ref_losses, ref_params = run_reference()
    counts = {}
    for mode in ("microbatch", "step"):
        results = run_distributed(run_rank, world, mode, placement, llm_pp)
        check_like_reference(results, ref_losses, ref_params)
        counts[mode] = [per_step for *_, per_step in results]
    for every, once in zip(counts["microbatch"], counts["step"]):
        assert once == [once[0]] * len(once)
        assert every == [n * MICROBATCHES * ACCUMULATE for n in once]
    assert sum(sum(once) for once in counts["step"]) > 0  # some rank reduce-scattered at all


def test_unknown_fsdp_reduce_names_the_choices():
    with pytest.raises(ValueError, match="unknown fsdp_reduce 'per_step'.*'microbatch'.*'step'"):
        lmm.MultimodalParallelStrategy(sharding_strategy="FULL_SHARD", fsdp_reduce="per_step")
