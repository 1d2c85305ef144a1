"""MultimodalLightningModule: trains a MultimodalModel; with MultimodalParallelStrategy it runs pipelined."""

from __future__ import annotations

import time
from typing import Callable, Iterable

import lightning.pytorch as pl
import torch
from torchmetrics.aggregation import SumMetric

from lightning_mm.loss import count_label_tokens
from lightning_mm.model.multimodal import MultimodalModel

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


class MultimodalLightningModule(pl.LightningModule):
    """Optimises the trainable parameters of ``model`` only; logs loss and label tokens/s (torchmetrics).

    ``optimizer`` maps parameters to an optimiser (LightningCLI's ``OptimizerCallable``); default AdamW(``lr``).
    ``lr_scheduler`` maps the optimiser to a scheduler, stepped every optimiser step. ``freeze`` is passed to
    ``model.freeze`` (so a YAML can say ``freeze: {encoders: true, language_model: true}``).
    """

    def __init__(self, model: MultimodalModel, optimizer: OptimizerFactory | None = None,
                 lr_scheduler: SchedulerFactory | None = None, lr: float = 1e-3,
                 freeze: dict[str, bool] | None = None):
        super().__init__()
        self.model = model.freeze(**freeze) if freeze else model
        self.optimizer_factory, self.scheduler_factory, self.lr = optimizer, lr_scheduler, lr
        self.train_tokens = SumMetric()
        self.train_seconds = SumMetric()
        self._step_start = None

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def configure_optimizers(self):
        params = self.trainable_parameters()
        if not params:
            raise ValueError("the model has no trainable parameter: unfreeze something (model.freeze(projectors=False))")
        opt = (self.optimizer_factory or (lambda p: torch.optim.AdamW(p, lr=self.lr)))(params)
        if self.scheduler_factory is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.scheduler_factory(opt), "interval": "step"}}

    def forward(self, batch: dict):
        return self.model(**batch)

    def on_train_batch_start(self, batch, batch_idx):
        self._step_start = time.perf_counter()

    def training_step(self, batch: dict, batch_idx: int):
        loss = self(batch).loss
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.train_tokens.update(count_label_tokens(batch["labels"]).float())
        self.train_seconds.update(time.perf_counter() - self._step_start)
        seconds = self.train_seconds.compute()
        if seconds > 0:
            self.log("train/tokens_per_s", self.train_tokens.compute() / seconds, prog_bar=True)

    def validation_step(self, batch: dict, batch_idx: int):
        loss = self(batch).loss
        self.log("val/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0], sync_dist=True)
        return loss
