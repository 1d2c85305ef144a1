"""No per-layer synchronisation: the host reads of a training forward and backward do not grow with the layers.

Each read of a tensor's value on the host waits for the GPU to finish everything queued before it; one per layer
serialises the step (counted by ``helpers.host_reads``).
"""

import torch

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model
from tests.helpers.distributed import run_distributed
from tests.helpers.host_reads import HostReads, pipeline_step_reads


def _reads(layers: int) -> int:
    torch.manual_seed(0)
    encoder = lmm.ModalityEncoder(tiny_encoder("qwen2_vl", depth=layers))
    model = lmm.MultimodalModel({"vision": encoder}, tiny_language_model(num_hidden_layers=layers))
    data = lmm.data.SyntheticMultimodalDataset(model, num_samples=4)
    batch = lmm.data.MultimodalCollator(model)([data[i] for i in range(4)])
    with HostReads() as mode:
        model(**batch).loss.backward()
    return mode.count


def test_host_reads_do_not_grow_with_the_layers():
    assert _reads(2) == _reads(5)


def test_pipeline_step_reads_do_not_grow_with_the_microbatches():
    """A pipeline step validates the batch's placeholders and words once (``MultimodalModel.check_batch``), not
    every microbatch's words on every LLM stage: each rank's host waits are the same with 2 and 4 microbatches."""
    two, four = (run_distributed(pipeline_step_reads, 3, m) for m in (2, 4))
    for (stage, reads2), (_, reads4) in zip(two, four):
        assert reads4 == reads2, (stage, reads2, reads4)
        assert len(reads2) <= 4, (stage, reads2)
