"""Lightning callbacks of lightning-mm."""

from lightning_mm.callbacks.context_parallel import ContextParallel
from lightning_mm.callbacks.generation_writer import GenerationWriter
from lightning_mm.callbacks.loss_curve import LossCurve
from lightning_mm.callbacks.progress import StepProgressBar
from lightning_mm.callbacks.timeline import PipelineTimeline

__all__ = ["ContextParallel", "GenerationWriter", "LossCurve", "PipelineTimeline", "StepProgressBar"]
