"""Data: synthetic multimodal data (the embedded default), conversation data, the collator, and the processor."""

from lightning_mm.data.collator import MultimodalCollator
from lightning_mm.data.conversation import (BadRecordError, ConversationDataModule, ConversationDataset,
                                            load_processor)
from lightning_mm.data.metadata import SampleMeta, WithSampleMetadata, metadata_of
from lightning_mm.data.packing import PackingCollator, pack_multimodal
from lightning_mm.data.processor import MultimodalProcessor
from lightning_mm.data.records import DataFileError
from lightning_mm.data.synthetic import SyntheticMultimodalDataModule, SyntheticMultimodalDataset

__all__ = ["BadRecordError", "ConversationDataModule", "DataFileError", "ConversationDataset", "MultimodalCollator",
           "MultimodalProcessor", "PackingCollator", "SampleMeta", "SyntheticMultimodalDataModule",
           "SyntheticMultimodalDataset", "WithSampleMetadata", "load_processor", "metadata_of", "pack_multimodal"]
