"""A 2-process run (text + a tiny SigLIP) in which every rank stays alive but the run stops progressing: one rank
sleeps inside a training step, or one rank skips a collective the others enter. Used by the stuck-run watchdog
tests.

``python tests/helpers/stuck_case.py '<json>'`` with keys: rank (the one that sleeps, or that skips), step (at
which step), fault_timeout (s), marker (file written with time.time() when the fault begins), skip (true: the
other ranks enter an all-reduce that ``rank`` skips, instead of ``rank`` sleeping), placement ("replicated":
SigLIP in LLM stage 0, LLM pp=2, the default; "parallel": SigLIP on its own rank, LLM pp=1; "colocated": SigLIP
fused into the LLM's chain, one stage each)."""

import json
import sys
import time

import lightning as L
import torch
import torch.distributed as dist

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


class SkipCollective(L.Callback):
    """At one step, every rank but ``rank`` enters an all-reduce over a group of every rank and waits for it through
    its work handle, as FSDP waits for its all-gathers; ``rank`` skips it and goes on to the next step's
    collectives. Every rank stays alive and nothing progresses."""

    def __init__(self, cfg: dict):
        self.cfg, self.group = cfg, None

    def setup(self, trainer, pl_module, stage):
        self.group = dist.new_group(list(range(trainer.world_size)), group_desc="skipped-by-one")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.cfg["step"] and trainer.global_rank != self.cfg["rank"]:
            with open(self.cfg["marker"], "w") as f:
                f.write(str(time.time()))
            dist.all_reduce(torch.ones(3), group=self.group, async_op=True).wait()


def strategy(cfg: dict) -> lmm.MultimodalParallelStrategy:
    placement = cfg.get("placement", "replicated")
    llm_pp = 2 if placement == "replicated" else 1
    return lmm.MultimodalParallelStrategy(encoders={"vision": lmm.ParallelSpec()},
                                          language_model=lmm.ParallelSpec(pp=llm_pp), num_microbatches=2,
                                          encoder_placement=placement, fault_timeout=cfg["fault_timeout"])


def main(cfg: dict):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))}, tiny_language_model("llama"))
    model.freeze(encoders=True, projectors=False, language_model=False)
    module = lmm.MultimodalLightningModule(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    data = lmm.data.SyntheticMultimodalDataModule(num_samples=32, batch_size=4)
    fault = SkipCollective(cfg) if cfg.get("skip") else SleepInStep(cfg)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy(cfg), max_steps=6, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[fault])
    trainer.fit(module, data)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
