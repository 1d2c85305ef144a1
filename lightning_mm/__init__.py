"""lightning-mm: distributed training of multimodal LLMs as a PyTorch Lightning strategy.

The layers, one way down (docs/architecture.md): ``plan/`` (pure plans) <- ``parallel/`` (build a rank's stage,
run a planned step) <- ``trainer/`` (the Lightning strategy, module, CLI and callbacks); ``model/``, ``attention/``
and ``data/`` beside them.
"""

import sys

from lightning_mm import attention  # noqa: F401  (registers the "bitfield" attention with transformers)
from lightning_mm.attention import mask as masks

from lightning_mm.model import ModalityEncoder, MultimodalModel  # noqa: E402
from lightning_mm.trainer.module import MultimodalLightningModule  # noqa: E402
from lightning_mm import data  # noqa: E402,F401
from lightning_mm.plan.layout import ParallelSpec  # noqa: E402
from lightning_mm.trainer.strategy import MultimodalParallelStrategy  # noqa: E402  (registers "multimodal")
from lightning_mm.trainer import callbacks  # noqa: E402
from lightning_mm.fault_tolerance import FaultTolerance  # noqa: E402

# the public import paths of the mask and the callbacks (``lightning_mm.callbacks.StepProgressBar`` in YAML files)
sys.modules[f"{__name__}.masks"] = masks
sys.modules[f"{__name__}.callbacks"] = callbacks

__version__ = "0.1.0"
__all__ = ["ModalityEncoder", "MultimodalModel", "MultimodalLightningModule", "MultimodalParallelStrategy",
           "ParallelSpec", "FaultTolerance", "masks", "attention", "callbacks", "data"]
