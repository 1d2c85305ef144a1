"""Lightning callbacks of lightning-mm."""

from lightning_mm.callbacks.timeline import PipelineTimeline

__all__ = ["PipelineTimeline"]
