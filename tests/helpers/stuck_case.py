"""A 2-process run (text + a tiny SigLIP replicated in LLM stage 0, LLM pp=2) in which one rank stays alive but
stops taking part: it sleeps inside a training step. Used by the stuck-rank watchdog test.

``python tests/helpers/stuck_case.py '<json>'`` with keys: rank (the one that sleeps), step (at which step),
fault_timeout (s), marker (file the sleeping rank writes time.time() to just before it sleeps)."""

import json
import sys
import time

import lightning as L
import torch

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model


class SleepInStep(L.Callback):
    """Sleeps (far longer than any timeout) between the forward/backward schedule and the optimiser step."""

    def __init__(self, cfg: dict):
        self.cfg = cfg

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_rank == self.cfg["rank"] and trainer.global_step == self.cfg["step"]:
            with open(self.cfg["marker"], "w") as f:
                f.write(str(time.time()))
            time.sleep(3600)


def main(cfg: dict):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))}, tiny_language_model("llama"))
    model.freeze(encoders=True, projectors=False, language_model=False)
    module = lmm.MultimodalLightningModule(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    data = lmm.data.SyntheticMultimodalDataModule(num_samples=32, batch_size=4)
    strategy = lmm.MultimodalParallelStrategy(encoders={"vision": lmm.ParallelSpec()},
                                              language_model=lmm.ParallelSpec(pp=2), num_microbatches=2,
                                              encoder_placement="replicated", fault_timeout=cfg["fault_timeout"])
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=6, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[SleepInStep(cfg)])
    trainer.fit(module, data)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
