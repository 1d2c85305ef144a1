"""MultimodalParallelStrategy: modality-parallel pipelines with data parallelism, as a Lightning strategy.

Launch, process groups, samplers and teardown are Lightning's DDP machinery (plain ``python script.py``,
torchrun, SLURM; NCCL on GPU, gloo on CPU); the model is never wrapped in DDP. Instead each rank keeps only its
pipeline stage and ``training_step`` runs the whole 1F1B schedule (forward and backward of every microbatch)
through :class:`PipelineEngine`, so Lightning's own backward is a gradient sync only.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

from lightning_mm.parallel.engine import PipelineEngine
from lightning_mm.parallel.layout import ParallelSpec, RankLayout, build_layout

DEFAULT_TIMEOUT = timedelta(minutes=10)


class MultimodalParallelStrategy(DDPStrategy):
    """Encoders and the LLM cut into pipeline stages on disjoint ranks, replicated over data-parallel groups.

    ``encoders`` maps each encoder name to its ParallelSpec (default ``ParallelSpec()`` for every encoder of the
    model); ``language_model`` is the LLM's. The data-parallel size is ``devices / ranks per replica``.
    ``partition``: "uniform" or explicit ``{module: [layers per stage]}``. ``encoder_placement``: "parallel"
    (modality parallelism), "colocated" (Megatron-style fused encoder stages) or "replicated" (encoders whole in
    the LLM's first stage). Each rank's batch is cut into ``num_microbatches``. ``language_model=ParallelSpec(cp=N)``
    shards every LLM sequence over N ranks in blocks of ``cp_block_size`` tokens distributed by ``cp_distribution``
    ("lpt", "zigzag", "random", "contiguous"); sequences must span at least N blocks.
    """

    strategy_name = "multimodal"

    def __init__(self, encoders: dict[str, ParallelSpec] | None = None, language_model: ParallelSpec | None = None,
                 num_microbatches: int = 1, partition: str | dict[str, list[int]] = "uniform",
                 encoder_placement: str = "parallel", cp_distribution: str = "lpt", cp_block_size: int = 128,
                 process_group_backend: str | None = None,
                 timeout: timedelta | None = DEFAULT_TIMEOUT, start_method: str = "popen", **kwargs):
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,
                         **kwargs)
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        self.encoder_specs = encoders
        self.language_model_spec = language_model or ParallelSpec()
        self.num_microbatches, self.partition, self.encoder_placement = num_microbatches, partition, encoder_placement
        self.cp_distribution, self.cp_block_size = cp_distribution, cp_block_size
        self.layout: RankLayout | None = None
        self.engine: PipelineEngine | None = None

    # ------------------------------------------------------------------ layout, before any process group
    def plan_layout(self) -> RankLayout:
        model = self.lightning_module.model
        specs = self.encoder_specs if self.encoder_specs is not None else {e: ParallelSpec() for e in model.encoders}
        return build_layout(specs, self.language_model_spec, self.num_nodes * self.num_processes,
                            self.encoder_placement, list(model.encoders))

    def setup_environment(self) -> None:
        self.layout = self.plan_layout()
        super().setup_environment()

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.layout.dp, "rank": self.layout.coordinate(self.global_rank).dp}

    # ------------------------------------------------------------------ stage building
    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.engine = PipelineEngine(self.lightning_module.model, self.layout, self.global_rank,
                                     self.num_microbatches, self.partition, self.cp_distribution, self.cp_block_size)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def configure_ddp(self) -> None:  # the model is pipelined, never wrapped in DDP
        pass

    # ------------------------------------------------------------------ the step
    def run_pipeline(self, batch: dict, train: bool = True) -> torch.Tensor:
        """The schedule over the batch's microbatches (forward and backward); the global normalised loss."""
        return self.engine.run(batch, train=train)

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        """The schedule already ran backward: only sum gradients over replicas (and CP ranks)."""
        self.engine.sync_gradients()
        return closure_loss

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        optimizer.zero_grad()  # see MultimodalLightningModule.optimizer_zero_grad
        return out

    def clip_gradients_by_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm over every stage and replica."""
        return self.engine.clip_gradients(max_norm)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """A folder with one file per stage (written by its first replica), keyed by the unparallelised names."""
        coord = self.layout.coordinate(self.global_rank)
        os.makedirs(filepath, exist_ok=True)
        if coord.dp == 0 and coord.cp == 0:
            owned = {f"model.{n}" for n in self.engine.owned}
            trainable = [f"model.{n}" for n, p in self.lightning_module.model.named_parameters()
                         if n in self.engine.owned and p.requires_grad]
            shard = {k: v for k, v in checkpoint.items() if k != "state_dict"}
            shard["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in owned}
            shard["trainable"] = trainable
            torch.save(shard, os.path.join(filepath, f"stage-{coord.stage}.pt"))
        if self.global_rank == 0:
            with open(os.path.join(filepath, "layout.json"), "w") as f:
                json.dump({"stages": self.layout.stages, "dp": self.layout.dp, "placement": self.layout.placement,
                           "module_stages": self.layout.module_stages}, f)

    def remove_checkpoint(self, filepath) -> None:
        if self.global_rank == 0:
            import shutil

            shutil.rmtree(filepath, ignore_errors=True)


StrategyRegistry.register("multimodal", MultimodalParallelStrategy,
                          description="modality-parallel pipelines with data parallelism (lightning-mm)")
