"""A Lightning run, single process or with MultimodalParallelStrategy (launched as ``python this.py``)."""

import json
import sys

import lightning as L
import torch

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model


class Record(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def main(mode: str, out: str, ckpt: str, accumulate: str = "1"):
    torch.manual_seed(0)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip")),
                                 "audio": lmm.ModalityEncoder(tiny_encoder("whisper"), projector="linear")},
                                tiny_language_model("llama"))
    model.freeze(encoders=True, projectors=False, language_model=False)
    module = lmm.MultimodalLightningModule(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
    data = lmm.data.SyntheticMultimodalDataModule(num_samples=24, batch_size=4, val_samples=8)
    kw = dict(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, gradient_clip_val=0.5, use_distributed_sampler=False,
              accumulate_grad_batches=int(accumulate), limit_val_batches=2, val_check_interval=2)
    record = Record()
    if mode == "single":
        trainer = L.Trainer(devices=1, callbacks=[record], **kw)
    else:
        strategy = lmm.MultimodalParallelStrategy(encoders={"vision": lmm.ParallelSpec(pp=2),
                                                            "audio": lmm.ParallelSpec()},
                                                  language_model=lmm.ParallelSpec(pp=2), num_microbatches=2,
                                                  # the accumulation run also recomputes activations: same numbers
                                                  activation_checkpointing=accumulate == "2")
        trainer = L.Trainer(devices=5, strategy=strategy, callbacks=[record], **kw)
    trainer.fit(module, data)
    if mode == "single":
        torch.save({n: p.detach() for n, p in model.named_parameters() if p.requires_grad}, ckpt)
    else:
        trainer.save_checkpoint(ckpt)
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump({"train": record.losses, "val": float(trainer.callback_metrics["val/loss"]),
                       "environment": type(getattr(trainer.strategy, "cluster_environment", None)).__name__}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
