"""Data: synthetic multimodal data (the embedded default), the collator, and the processor for real inputs."""

from lightning_mm.data.collator import MultimodalCollator
from lightning_mm.data.processor import MultimodalProcessor
from lightning_mm.data.synthetic import SyntheticMultimodalDataModule, SyntheticMultimodalDataset

__all__ = ["MultimodalCollator", "MultimodalProcessor", "SyntheticMultimodalDataModule", "SyntheticMultimodalDataset"]
