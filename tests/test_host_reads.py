"""No per-layer synchronisation: the host reads of a training forward and backward do not grow with the layers.

Each read of a tensor's value on the host waits for the GPU to finish everything queued before it; one per layer
serialises the step (counted by ``helpers.host_reads``).
"""

import torch

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model
from tests.helpers.host_reads import HostReads


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
