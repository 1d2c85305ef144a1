"""Train a tiny VALM with MultimodalParallelStrategy on CPU processes (gloo), from a plain ``python`` launch.

    python examples/train_pipeline.py            # 5 processes: vision 2 stages, audio 1, LLM 2
"""

import lightning as L
import torch

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model


def main():
    torch.manual_seed(0)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"), projector="mlp"),
                                 "audio": lmm.ModalityEncoder(tiny_encoder("whisper"), projector="linear")},
                                tiny_language_model("llama"))
    model.freeze(encoders=True, projectors=False, language_model=False)
    strategy = lmm.MultimodalParallelStrategy(encoders={"vision": lmm.ParallelSpec(pp=2), "audio": lmm.ParallelSpec()},
                                              language_model=lmm.ParallelSpec(pp=2), num_microbatches=2)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=5, max_steps=20, log_every_n_steps=5,
                        enable_checkpointing=False, gradient_clip_val=1.0)
    trainer.fit(lmm.MultimodalLightningModule(model, lr=3e-3),
                datamodule=lmm.data.SyntheticMultimodalDataModule(num_samples=160, batch_size=4))


if __name__ == "__main__":
    main()
