"""Lightning callbacks of lightning-mm."""

from lightning_mm.trainer.callbacks.cp_callback import ContextParallel
from lightning_mm.trainer.callbacks.generation_writer import GenerationWriter
from lightning_mm.trainer.callbacks.loss_curve import LossCurve
from lightning_mm.trainer.callbacks.progress import StepProgressBar
from lightning_mm.trainer.callbacks.timeline import PipelineTimeline

__all__ = ["ContextParallel", "GenerationWriter", "LossCurve", "PipelineTimeline", "StepProgressBar"]
