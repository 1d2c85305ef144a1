"""A 2-process Lightning run (text + a tiny SigLIP replicated in LLM stage 0, LLM pp=2, trainable LLM) with
PipelineTimeline recording steps 2-4; rank 0 writes measured vs predicted iteration times as JSON.

Launched as ``python tests/helpers/timeline_case.py OUT.json DIR`` (Lightning re-launches it for rank 1)."""

import json
import sys

import lightning as L
import torch

import lightning_mm as lmm
from lightning_mm.trainer.callbacks import PipelineTimeline
from lightning_mm.model import tiny_encoder, tiny_language_model


def main(out: str, dirpath: str):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    llm = tiny_language_model("llama", hidden_size=192, intermediate_size=512, num_attention_heads=4,
                              num_key_value_heads=2)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))}, llm)
    model.freeze(encoders=True, projectors=False, language_model=False)
    module = lmm.MultimodalLightningModule(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    data = lmm.data.SyntheticMultimodalDataModule(num_samples=48, batch_size=8, text_tokens=(120, 128))
    strategy = lmm.MultimodalParallelStrategy(encoders={"vision": lmm.ParallelSpec()},
                                              language_model=lmm.ParallelSpec(pp=2), num_microbatches=4,
                                              encoder_placement="replicated")
    timeline = PipelineTimeline(steps=(2, 3, 4), dirpath=dirpath)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=5, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timeline])
    trainer.fit(module, data)
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump({step: {"measured": m.iteration_time, "predicted": p.iteration_time,
                              "bubble": m.bubble_fraction, "predicted_bubble": p.bubble_fraction,
                              "busy": m.busy} for step, (m, p) in timeline.results.items()}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
