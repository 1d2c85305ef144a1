"""Pairs of capabilities refused before any process group, each with the fix in its message (the refusals the
other test files do not already assert; docs/compatibility.md lists them all)."""

from types import SimpleNamespace

import pytest
import torch.distributed as dist

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model
from lightning_mm.plan.layout import ParallelSpec, build_layout


def test_expert_parallelism_under_per_module_dp_needs_an_llm_dp_that_ep_divides():
    """Served (``tests/test_moe.py`` trains it like one process); an ep that does not divide the LLM's own dp is
    named before any process group."""
    from lightning_mm.parallel.expert_parallel import check_expert_parallel
    from lightning_mm.plan.layout import LayoutError

    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))},
                                tiny_language_model("qwen3_moe"))
    check_expert_parallel(model, build_layout({"vision": ParallelSpec(dp=1)}, ParallelSpec(dp=2, ep=2), 3, "parallel",
                                              ["vision"]))
    with pytest.raises(LayoutError, match=r"ep=2 splits experts over its data-parallel replicas, but its dp=3"):
        build_layout({"vision": ParallelSpec(dp=1)}, ParallelSpec(dp=3, ep=2), 4, "parallel", ["vision"])
    assert not dist.is_initialized()


@pytest.mark.refuses("ft", "mixed_precision", message="precision='16-mixed' (the grad scaler's skipped steps")
def test_fault_tolerance_with_16_mixed_is_refused_and_bf16_mixed_is_served():
    from lightning_mm.fault_tolerance.training import unservable

    def reasons(precision):
        strategy = SimpleNamespace(precision_plugin=SimpleNamespace(precision=precision), batch_balancing=None,
                                   lightning_module=None)
        return unservable(SimpleNamespace(accumulate_grad_batches=1), strategy)

    assert reasons("bf16-mixed") == [] and reasons("32-true") == []
    (reason,) = reasons("16-mixed")
    assert "precision='16-mixed' (the grad scaler's skipped steps" in reason and "use bf16-mixed" in reason
