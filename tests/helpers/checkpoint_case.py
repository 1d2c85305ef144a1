"""A Lightning run of MultimodalParallelStrategy that checkpoints, resumes, reshards or loses a rank.

``python checkpoint_case.py '<json>'`` with keys: layout ("pp2": vision 1 stage + LLM 2 stages on 3 ranks, dp 1;
"dp2": vision + LLM 1 stage each, dp 2 on 4 ranks; "cp2": vision 1 stage + LLM 1 stage of 2 context-parallel
ranks (blocks of 8 tokens) on 3 ranks, dp 1; "pp2cp2": vision + LLM 2 stages of 2 CP ranks each on 5 ranks;
"cp2dp2": "cp2" replicated twice on 6 ranks; "tp2": vision + LLM 1 stage of 2 tensor-parallel ranks on 3 ranks;
"vdp2pp2": per-module data parallelism, vision dp 2 + LLM dp 1 of 2 stages on 4 ranks; "ep2dp2": vision + LLM 1
stage each, dp 2 with the LLM's experts split over both replicas (ep 2) on 4 ranks;
"single": one process; a layout name ending in "_fsdp" is that layout under sharding_strategy="FULL_SHARD",
e.g. "dp2_fsdp": each stage sharded over its 2 replicas, "cp2_fsdp": the LLM stage over its 2 CP ranks,
"vdp2pp2_fsdp", "vdp1dp2_fsdp": vision dp 1 + LLM dp 2 on 3 ranks (per-module data parallelism shards the LLM
only); "_sgo" likewise under sharding_strategy="SHARD_GRAD_OP"), steps, out (losses JSON, rank 0),
ckpt_dir, save_every (steps), resume (a checkpoint folder), kill ({"rank": r, "step": s}: SIGKILL that rank
after step s), weights (file for the trained parameters; each rank of a distributed run writes ``<weights>.<rank>``
with the whole tensors of the trainable parameters it holds), hang (same, SIGSTOP: a frozen rank whose sockets stay open, like a lost node), raise (same, an
exception), fault_timeout, pids (folder for one pid file per rank), balancing (batch_balancing), global_batch (default
4), num_samples (default 16), items ([min, max] images per sample), llm (the language model's kind, default
"llama"; "qwen3_moe": routed experts).
"""

import json
import os
import signal
import sys
import time

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

import lightning_mm as lmm
from lightning_mm.model import tiny_encoder, tiny_language_model

GLOBAL_BATCH = 4
LAYOUTS = {"pp2": dict(devices=3, llm_pp=2, microbatches=2), "dp2": dict(devices=4, llm_pp=1, microbatches=1),
           "cp2": dict(devices=3, llm_pp=1, llm_cp=2, microbatches=2),
           "pp2cp2": dict(devices=5, llm_pp=2, llm_cp=2, microbatches=2),
           "cp2dp2": dict(devices=6, llm_pp=1, llm_cp=2, microbatches=1),
           "tp2": dict(devices=3, llm_pp=1, llm_tp=2, microbatches=2),
           "vdp2pp2": dict(devices=4, llm_pp=2, microbatches=2, encoder_dp=2, llm_dp=1),
           "ep2dp2": dict(devices=4, llm_pp=1, microbatches=1, llm_ep=2),
           "vdp1dp2": dict(devices=3, llm_pp=1, microbatches=1, encoder_dp=1, llm_dp=2),
           "single": dict(devices=1, llm_pp=None, microbatches=1)}


def build_module(llm: str = "llama"):
    torch.manual_seed(0)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))}, tiny_language_model(llm))
    model.freeze(encoders=True, projectors=False, language_model=False)
    return lmm.MultimodalLightningModule(
        model, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5))


class Events(L.Callback):
    def __init__(self, cfg):
        self.cfg, self.losses = cfg, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        step, rank = trainer.global_step, trainer.global_rank
        for kind in ("kill", "hang", "raise"):
            event = self.cfg.get(kind)
            if event and event["rank"] == rank and event["step"] == step:
                if kind == "raise":
                    raise RuntimeError(f"injected failure on rank {rank} at step {step}")
                with open(os.path.join(self.cfg["pids"], "killed_at"), "w") as f:
                    f.write(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)


def save_weights(trainer, module, path: str) -> None:
    """The trained parameters this rank holds, whole (a DTensor's ``full_tensor`` is collective over its mesh)."""
    engine = getattr(trainer.strategy, "engine", None)
    whole = lambda p: p.full_tensor() if isinstance(p, DTensor) else p  # noqa: E731
    params = {n: whole(p.detach()).clone() for n, p in module.model.named_parameters()
              if p.requires_grad and (engine is None or n in engine.owned)}
    if engine is None:
        torch.save(params, path)
    else:
        torch.save(params, f"{path}.{trainer.global_rank}")


def main(cfg: dict):
    name = cfg["layout"].removesuffix("_fsdp").removesuffix("_sgo")
    sharding = {"_fsdp": "FULL_SHARD", "_sgo": "SHARD_GRAD_OP"}.get(cfg["layout"][len(name):], "NO_SHARD")
    layout = LAYOUTS[name]
    global_batch, samples = cfg.get("global_batch", GLOBAL_BATCH), cfg.get("num_samples", 16)
    callbacks = [Events(cfg)]
    if cfg.get("save_every"):
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=cfg["ckpt_dir"], filename="{step}",
                                                             every_n_train_steps=cfg["save_every"], save_top_k=-1))
    kw = dict(accelerator="cpu", max_steps=cfg["steps"], logger=False, enable_progress_bar=False,
              enable_model_summary=False, gradient_clip_val=0.5, callbacks=callbacks,
              enable_checkpointing=bool(cfg.get("save_every")))
    if layout["llm_pp"] is None:
        trainer = L.Trainer(devices=1, **kw)
        per_rank = global_batch
    else:
        cp, tp = layout.get("llm_cp", 1), layout.get("llm_tp", 1)
        strategy = lmm.MultimodalParallelStrategy(
            encoders={"vision": lmm.ParallelSpec(dp=layout.get("encoder_dp"))},
            language_model=lmm.ParallelSpec(pp=layout["llm_pp"], cp=cp, tp=tp, dp=layout.get("llm_dp"),
                                            ep=layout.get("llm_ep", 1)),
            num_microbatches=layout["microbatches"], cp_block_size=8, fault_timeout=cfg.get("fault_timeout", 60.0),
            batch_balancing=cfg.get("balancing"), sharding_strategy=sharding)
        trainer = L.Trainer(devices=layout["devices"], strategy=strategy, **kw)
        per_rank = global_batch // (layout.get("llm_dp") or layout["devices"] // (1 + layout["llm_pp"] * cp * tp))
    if cfg.get("pids"):
        with open(os.path.join(cfg["pids"], f"{trainer.global_rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    data = lmm.data.SyntheticMultimodalDataModule(num_samples=samples, batch_size=per_rank,
                                                  items_per_sample=tuple(cfg.get("items", (1, 2))))
    if layout["llm_pp"] is None:  # the same data order as Lightning's DistributedSampler under the strategy
        data.train_dataloader = lambda: DataLoader(
            data._dataset(samples, 0), batch_size=global_batch, collate_fn=data.collator(), drop_last=True,
            sampler=DistributedSampler(data._dataset(samples, 0), num_replicas=1, rank=0, shuffle=True, seed=0))
    module = build_module(cfg.get("llm", "llama"))
    trainer.fit(module, data, ckpt_path=cfg.get("resume"))
    if cfg.get("weights"):
        save_weights(trainer, module, cfg["weights"])
    if trainer.global_rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump(callbacks[0].losses, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(json.loads(sys.argv[1]))
