"""lightning-mm: distributed training of multimodal LLMs as a PyTorch Lightning strategy."""

from lightning_mm import attention, masks  # noqa: F401  (registers the "bitfield" attention with transformers)

from lightning_mm.model import ModalityEncoder, MultimodalModel  # noqa: E402
from lightning_mm.module import MultimodalLightningModule  # noqa: E402
from lightning_mm import data  # noqa: E402,F401
from lightning_mm.plan.layout import ParallelSpec  # noqa: E402
from lightning_mm.strategy import MultimodalParallelStrategy  # noqa: E402  (registers "multimodal")
from lightning_mm.fault_tolerance import FaultTolerance  # noqa: E402

__version__ = "0.1.0"
__all__ = ["ModalityEncoder", "MultimodalModel", "MultimodalLightningModule", "MultimodalParallelStrategy",
           "ParallelSpec", "FaultTolerance", "masks", "attention", "data"]
