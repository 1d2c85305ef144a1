"""A 2-process Lightning run (text + a tiny SigLIP replicated in LLM stage 0, LLM pp=2) with what a new user
leaves at its defaults: the CSV logger, the model summary, ``PipelineTimeline()`` without arguments, plus
``LossCurve()``, ``peak_flops`` (so ``train/mfu`` is logged on CPU) and bubbles every 2 steps.

``python tests/helpers/usability_case.py ROOT_DIR``; rank 0 writes ``ROOT_DIR/result.json`` (the log dir and
the timeline callback's recorded steps)."""

import json
import os
import sys

import lightning as L
import torch

import lightning_mm as lmm
from lightning_mm.trainer.callbacks import LossCurve, PipelineTimeline
from lightning_mm.model import tiny_encoder, tiny_language_model


def main(root: str):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))}, tiny_language_model("llama"))
    model.freeze(encoders=True, projectors=False, language_model=False)
    module = lmm.MultimodalLightningModule(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.05), peak_flops=1e9,
                                           bubble_every_n_steps=2)
    data = lmm.data.SyntheticMultimodalDataModule(num_samples=32, batch_size=4)
    strategy = lmm.MultimodalParallelStrategy(encoders={"vision": lmm.ParallelSpec()},
                                              language_model=lmm.ParallelSpec(pp=2), num_microbatches=2,
                                              encoder_placement="replicated", fault_timeout=20.0)
    timeline = PipelineTimeline()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=6, default_root_dir=root,
                        log_every_n_steps=2, enable_checkpointing=False, enable_progress_bar=False,
                        callbacks=[timeline, LossCurve()])
    trainer.fit(module, data)
    log_dir = trainer.log_dir  # a collective (rank 0 broadcasts it): asked on every rank
    if trainer.global_rank == 0:
        with open(os.path.join(root, "result.json"), "w") as f:
            json.dump({"log_dir": log_dir, "timeline_steps": sorted(timeline.results)}, f)


if __name__ == "__main__":
    main(sys.argv[1])
