"""MultimodalLightningModule: trains a MultimodalModel; with MultimodalParallelStrategy it runs pipelined."""

from __future__ import annotations

import os
from typing import Callable, Iterable

import lightning.pytorch as pl
import torch

from lightning_mm.trainer.callbacks.throughput import TrainingMetrics
from lightning_mm.data.microbatch import as_one_microbatch
from lightning_mm.data.validate import validate_batch
from lightning_mm.fault_tolerance.watchdog import check_finite_loss
from lightning_mm.model import moe
from lightning_mm.model.composites import fill_positions
from lightning_mm.model.multimodal import MultimodalModel
from lightning_mm.trainer.summary import use_whole_model_summary

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


class MultimodalLightningModule(pl.LightningModule):
    """Optimises the trainable parameters of ``model`` only; logs the loss, ``train/tokens_per_s`` (label tokens per
    second of the whole job, all replicas), ``train/mfu`` (with ``peak_flops`` FLOP/s per device, or on a GPU
    Lightning knows) and ``pipeline/bubble/<stage>`` every ``bubble_every_n_steps`` (default: each logging step);
    see ``lightning_mm/trainer/callbacks/throughput.py``.

    ``model`` may be a composite HF folder (``MultimodalModel.from_pretrained``), so a YAML can name it.
    ``optimizer`` maps parameters to an optimiser (LightningCLI's ``OptimizerCallable``); default AdamW(``lr``).
    ``lr_scheduler`` maps the optimiser to a scheduler, stepped every optimiser step. ``freeze`` is passed to
    ``model.freeze`` (so a YAML can say ``freeze: {encoders: true, language_model: true}``). Every batch is
    validated first (``lightning_mm.data.validate``); ``nan_guard``: None, "skip" (drop a step whose loss is not
    finite) or "stop" (raise).

    ``generation`` (keyword arguments of ``MultimodalModel.generate``, e.g. ``{"max_new_tokens": 32}``) makes
    ``trainer.predict`` decode with a KV cache and return ``{"generated_ids": [B, N]}``; where the strategy splits
    the model into pipeline stages, greedily, stage to stage (``lightning_mm.parallel.pipeline_generation``). ``lora``
    (keyword arguments of ``MultimodalModel.add_lora``, e.g. ``{"modules": ["q_proj", "v_proj"], "r": 8}``) adds
    LoRA adapters after ``freeze``.
    """

    def __init__(self, model: MultimodalModel | str, optimizer: OptimizerFactory | None = None,
                 lr_scheduler: SchedulerFactory | None = None, lr: float = 1e-3,
                 freeze: dict[str, bool] | None = None, nan_guard: str | None = None,
                 peak_flops: float | None = None, bubble_every_n_steps: int | None = None,
                 generation: dict | None = None, lora: dict | None = None):
        super().__init__()
        check_finite_loss(torch.zeros(()), 0, nan_guard)  # rejects an unknown mode at construction
        if isinstance(model, (str, os.PathLike)):
            model = MultimodalModel.from_pretrained(model)
        self.model = model.freeze(**freeze) if freeze else model
        if lora:
            self.model.add_lora(**lora)
        self.generation = dict(generation) if generation is not None else None
        self.optimizer_factory, self.scheduler_factory, self.lr = optimizer, lr_scheduler, lr
        with torch.device("cpu"):  # real tensors even under trainer.init_module() (meta): the strategy moves them
            self.train_metrics = TrainingMetrics(peak_flops, bubble_every_n_steps)
        self.nan_guard = nan_guard

    @property
    def attached_trainer(self) -> pl.Trainer | None:
        """The Trainer this module is attached to, or None (where ``trainer`` raises)."""
        try:
            return self.trainer
        except RuntimeError:
            return None

    @property
    def pipeline(self):
        """The MultimodalParallelStrategy running this module, or None in a single process / other strategies."""
        trainer = self.attached_trainer
        strategy = trainer.strategy if trainer is not None else None
        return strategy if hasattr(strategy, "run_pipeline") else None

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def configure_optimizers(self):
        params = self.trainable_parameters()
        if not params and self.pipeline is not None:
            # a stage with nothing trainable still steps with the others; an empty parameter keeps loops aligned
            params = [torch.nn.Parameter(torch.zeros(0))]
        if not params:
            raise ValueError("the model has no trainable parameter: unfreeze something (model.freeze(projectors=False))")
        opt = (self.optimizer_factory or (lambda p: torch.optim.AdamW(p, lr=self.lr)))(params)
        if self.scheduler_factory is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.scheduler_factory(opt), "interval": "step"}}

    def forward(self, batch: dict):
        return self.model(**batch)

    def setup(self, stage: str) -> None:
        self.train_metrics.prepare(self, stage)  # before the strategy cuts the model into stages
        use_whole_model_summary(self.attached_trainer)  # the summary shows every stage, not rank 0's only

    def on_train_batch_start(self, batch, batch_idx):
        self.train_metrics.batch_start()

    def compute_loss(self, batch: dict, train: bool = True) -> torch.Tensor:
        """The pipeline schedule under MultimodalParallelStrategy (backward included), else the plain forward.

        The batch is validated first, on every rank alike, before any collective."""
        batch = fill_positions(self.model, batch)  # a composite's own positions (M-RoPE) when the batch has none
        validate_batch(batch, self.model, self.pipeline.num_microbatches if self.pipeline is not None else 1)
        if self.pipeline is not None:
            return self.pipeline.run_pipeline(batch, train=train)
        out = self(batch)
        self.router_metrics = moe.step_metrics(self, out)
        return out.loss

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.pipeline is not None and gradient_clip_val:
            if gradient_clip_algorithm not in (None, "norm"):
                raise ValueError("MultimodalParallelStrategy clips by the global norm only: use "
                                 "gradient_clip_algorithm='norm'")
            self.pipeline.clip_gradients_by_norm(gradient_clip_val)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        # Lightning zeroes between training_step and backward; the pipeline's backward runs inside
        # training_step, so under the strategy gradients are zeroed after each optimiser step instead.
        if self.pipeline is None:
            optimizer.zero_grad()

    def training_step(self, batch: dict, batch_idx: int):
        loss = self.compute_loss(batch)
        if not check_finite_loss(loss.detach(), self.global_step, self.nan_guard):
            # the loss is global under the pipeline, so every rank skips alike; drop this step's gradients
            if self.pipeline is not None:
                self.pipeline.discard_gradients()
            for opt in self.trainer.optimizers:
                opt.zero_grad()
            self.print(f"skipping step {self.global_step}: the loss is {float(loss)} (nan_guard='skip')")
            # Lightning refuses a None step under several processes; a NaN leaf keeps every rank's loop alike and
            # changes no parameter (their gradients are None, which optimisers skip)
            return torch.full((), float("nan"), device=loss.device, requires_grad=True)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        moe.log_router_metrics(self, self.router_metrics if self.pipeline is None else moe.step_metrics(self),
                               batch["input_ids"].shape[0])
        self.log_balance()
        return loss

    def log_balance(self) -> None:
        """Where batch balancing runs, this step's global batch as the balanced sampler planned it: replica
        imbalance before and after, deferred samples (``balance/*``; ``data/balanced.py``)."""
        loader = getattr(self.attached_trainer, "train_dataloader", None)
        planned = getattr(getattr(loader, "batch_sampler", None), "planned", None)
        if planned:
            for key, value in planned.popleft().items():
                self.log(f"balance/{key}", value)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.train_metrics.batch_end(self, batch)

    def validation_step(self, batch: dict, batch_idx: int):
        loss = self.compute_loss(batch, train=False)
        self.log("val/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0], sync_dist=True)
        return loss

    def test_step(self, batch: dict, batch_idx: int):
        loss = self.compute_loss(batch, train=False)
        self.log("test/loss", loss, batch_size=batch["input_ids"].shape[0], sync_dist=True)
        return loss

    def predict_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> dict:
        """``{"logits": [B, S, V], "predicted_ids": [B, S]}``: the greedy next token at every position. Under the
        strategy every rank returns the ids; the logits only where the LLM head lives (else None). With
        ``generation=...``: ``{"generated_ids": [B, N]}``, the tokens ``MultimodalModel.generate`` decodes."""
        batch = fill_positions(self.model, batch)  # a composite's own positions (M-RoPE) when the batch has none
        cut = self.pipeline is not None and self.generation is None  # generation decodes the batch as one piece
        if self.generation is not None:
            batch = as_one_microbatch(batch)  # not the loader's plan of the training microbatches
        validate_batch(batch, self.model, self.pipeline.num_microbatches if cut else 1)
        if self.generation is not None:
            from lightning_mm.model.generation import predict_generate, whole_model_on_rank

            pipeline = self.pipeline
            if pipeline is not None and not whole_model_on_rank(pipeline.engine, self.model):
                from lightning_mm.parallel.pipeline_generation import pipeline_generate  # greedy, stage to stage

                with pipeline.precision_plugin.forward_context():
                    return {"generated_ids": pipeline_generate(pipeline.engine, batch, self.generation)}
            if pipeline is None:
                return {"generated_ids": predict_generate(self, batch, self.generation)}
            from lightning_mm.parallel.pipeline_generation import unsharded  # FSDP, ep: gathered once, not per step

            with unsharded(pipeline.engine):
                return {"generated_ids": predict_generate(self, batch, self.generation)}
        if self.pipeline is not None:
            return self.pipeline.predict_pipeline(batch)
        logits = self.model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        return {"logits": logits, "predicted_ids": logits.argmax(-1)}
