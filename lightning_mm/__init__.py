"""lightning-mm: distributed training of multimodal LLMs as a PyTorch Lightning strategy."""

from lightning_mm import attention, masks  # noqa: F401  (registers the "bitfield" attention with transformers)

__version__ = "0.1.0"
