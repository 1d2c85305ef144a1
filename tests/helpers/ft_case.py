"""One replica group of a fault-tolerant run (torchft), or the uninterrupted one-process reference.

``python ft_case.py '<json>'`` with keys: mode ("group" or "reference"), lighthouse ("host:port"), group (replica
group id), groups (num_replica_groups), steps, out (folder: ``params_<group>_<rank>.pt``, ``result_<group>.json``),
devices (ranks of the group, default 2: the LLM in 2 pipeline stages, the encoder with the first), num_nodes
(default 1), precision (the Trainer's; the reference autocasts alike for "bf16-mixed"), kill ({"group": g, "rank": r, "step": s, "where": "batch_end" | "backward"}: SIGKILL that rank in its
first launch, after step s or inside step s before the cross-group reduction; "agent": true kills its torchrun
agent too, a node lost for good), pp (LLM stages, default 2), templates (a templates file), elastic (the node
count comes from torchrun's world size),
timeout (s), global_batch (FaultTolerance's: the groups may differ in layout), wait_rejoin (the surviving group waits 2 steps after the kill until the lost group restarted, so it
rejoins before the run ends), ft (false: no fault tolerance, e.g. one group over two nodes), save_every (steps:
ModelCheckpoint into ckpt_dir), resume ("last": a torchrun restart resumes from ckpt_dir's latest checkpoint with
``trainer.fit(ckpt_path=...)``; a path, "{group}" filled in: every launch resumes from it), llm (the LLM's
ParallelSpec fields, default ``{"pp": pp}``), vision (the encoder's), moe (an MoE LLM kind, e.g. "qwen3_moe",
instead of llama), lora (LoRA adapters on q_proj and v_proj), train_encoder (the vision tower trained too),
data (more SyntheticMultimodalDataModule arguments:
layout "mp" + seq_len packs rows, items_per_sample), strategy (more strategy arguments, e.g.
activation_checkpointing), accumulate (accumulate_grad_batches; the reference accumulates alike), pace ({"until":
marker, "after": step, "seconds": s, "max": s}: from that step on,
this group sleeps ``seconds`` after each step until the marker file exists, at most ``max`` in all: slower steps,
never a blocked peer). Every group's rank 0 writes ``world_<group>_<world size>`` after its first step, appends
``<step> <time> <restart>`` to ``steps_<group>.log`` at each batch end and writes ``result_<group>.json`` (without
fault tolerance: steps and timings only) and ``healed_<group>`` once it healed. Under ``lightning-mm agent``:
group null (the agent's ``LMM_REPLICA_GROUP``), kill a list of kills, each of a group's rank or of a "node" (its
LMM_AGENT_NODE; with "agent": true the lightning-mm agent dies too), wait_for ({"step": s, "marker": name or
names, "max": s}: wait after step s until those marker files exist; pace's "until" may be a list too; a marker
may be a glob pattern), hold ({"if": marker, "until": marker(s), "max": s}: a process that starts while the "if"
marker exists waits before its first step until the "until" markers exist),
quorum_timeout (s). The
reference reads the data settings a group wrote (``data.json``) and trains one process on the same global batches.
"""

import glob
import json
import os
import signal
import sys
import time

import lightning as L
import torch

import lightning_mm as lmm
from lightning_mm.fault_tolerance import global_batch_indices
from lightning_mm.model import tiny_encoder, tiny_language_model

NUM_SAMPLES, BATCH = 48, 2  # per-replica batch 2: a global batch of 2 x groups
STARTED = time.time()  # the imports done


def process_created() -> float | None:
    """When this process was created (Linux: its start in clock ticks after boot, 10 ms resolution), so that a
    restart's time splits into the launcher's part and the imports."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def build_module(cfg=None):
    cfg = cfg or {}
    torch.manual_seed(0)
    lm = tiny_language_model(cfg.get("moe") or "llama")
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))}, lm)
    model.freeze(encoders=not cfg.get("train_encoder"), projectors=False, language_model=False)
    if cfg.get("lora"):  # random A and B: every adapter gets a gradient from the first step
        model.add_lora(["q_proj", "v_proj"], r=4, alpha=8, init_lora_weights=False)
    return lmm.MultimodalLightningModule(
        model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5))


def _markers(out: str, names) -> bool:
    """Whether the marker file ``names`` (or every one of a list; a name may be a glob pattern) exists in ``out``."""
    return all(glob.glob(os.path.join(out, n)) for n in ([names] if isinstance(names, str) else names))


class Events(L.Callback):
    def __init__(self, cfg):
        self.cfg, self.steps = cfg, []

    def _kill(self, trainer, where):
        kills = self.cfg.get("kill")
        for kill in kills if isinstance(kills, list) else [kills]:
            here = (os.environ.get("LMM_AGENT_NODE") == kill["node"] if kill and "node" in kill else
                    kill and kill["group"] == self.cfg["group"] and kill["rank"] == trainer.global_rank)
            if (here and kill["where"] == where and kill["step"] == trainer.global_step
                    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
                with open(os.path.join(self.cfg["out"], "killed_at"), "w") as f:
                    f.write(str(time.time()))
                if kill.get("agent"):  # the whole node: its agents first, so that nothing restarts this rank
                    if os.environ.get("LMM_AGENT_PID"):  # lightning-mm agent around torchrun
                        os.kill(int(os.environ["LMM_AGENT_PID"]), signal.SIGKILL)
                    os.kill(os.getppid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)

    def on_after_backward(self, trainer, pl_module):
        self._kill(trainer, "backward")

    def on_train_start(self, trainer, pl_module):
        self.train_start, self.paced = time.time(), 0.0
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            open(os.path.join(self.cfg["out"], f"restarted_{self.cfg['group']}"), "w").close()
        hold = self.cfg.get("hold")
        if hold and _markers(self.cfg["out"], hold["if"]):
            deadline = time.time() + hold["max"]
            while not _markers(self.cfg["out"], hold["until"]) and time.time() < deadline:
                time.sleep(0.2)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append((trainer.global_step, time.time()))
        if trainer.global_rank == 0 and len(self.steps) == 1:  # joined a quorum (healed if behind) and trained
            open(os.path.join(self.cfg["out"], f"world_{self.cfg['group']}_{trainer.world_size}"), "w").close()
        if trainer.global_rank == 0:
            with open(os.path.join(self.cfg["out"], f"steps_{self.cfg['group']}.log"), "a") as f:
                f.write(f"{trainer.global_step} {self.steps[-1][1]:.6f} "
                        f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}\n")
        ft = getattr(trainer.strategy, "ft", None)
        if trainer.global_rank == 0 and ft is not None and ft.stats.get("healed_steps"):
            open(os.path.join(self.cfg["out"], f"healed_{self.cfg['group']}"), "w").close()
        self._kill(trainer, "batch_end")
        pace = self.cfg.get("pace")
        if pace and trainer.global_step >= pace["after"] and self.paced < pace["max"] \
                and not _markers(self.cfg["out"], pace["until"]):
            time.sleep(pace["seconds"])
            self.paced += pace["seconds"]
        wait = self.cfg.get("wait_for")  # {"step": s, "marker": name, "max": seconds}
        if wait and trainer.global_step == wait["step"]:
            deadline = time.time() + wait["max"]
            while not _markers(self.cfg["out"], wait["marker"]) and time.time() < deadline:
                time.sleep(0.2)
        kill = self.cfg.get("kill")
        if self.cfg.get("wait_rejoin") and isinstance(kill, dict) and self.cfg["group"] != kill["group"] \
                and trainer.global_step == kill["step"] + 2:  # the lost group can rejoin before the run ends
            # (up to 600 s: on a loaded 2-core machine a restarted rank's imports alone took 181 s)
            marker, deadline = os.path.join(self.cfg["out"], f"restarted_{kill['group']}"), time.time() + 600
            while not os.path.exists(marker) and time.time() < deadline:
                time.sleep(0.2)


def group(cfg):
    if cfg.get("group") is None:  # started by lightning-mm agent: the group it assigned
        cfg["group"] = int(os.environ["LMM_REPLICA_GROUP"])
    ft = None if cfg.get("ft") is False else lmm.FaultTolerance(lighthouse=cfg["lighthouse"], replica_group=cfg["group"], num_replica_groups=cfg["groups"],
                            min_replicas=1, timeout=cfg.get("timeout", 10.0),
                            quorum_timeout=cfg.get("quorum_timeout", 60.0), connect_timeout=5.0,
                            hostname="127.0.0.1", global_batch=cfg.get("global_batch"),
                            templates=cfg.get("templates"))
    strategy = lmm.MultimodalParallelStrategy(
        encoders={"vision": lmm.ParallelSpec(**cfg.get("vision", {}))},
        language_model=lmm.ParallelSpec(**cfg.get("llm", {"pp": cfg.get("pp", 2)})), fault_tolerance=ft,
        **{"encoder_placement": "replicated", "num_microbatches": 2, "process_group_backend": "gloo",
           "fault_timeout": cfg.get("fault_timeout", 20.0), **cfg.get("strategy", {})})
    events = Events(cfg)
    callbacks = [events]
    if cfg.get("save_every"):
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=cfg["ckpt_dir"].format(group=cfg["group"]),
                                                             filename="{step}",
                                                             every_n_train_steps=cfg["save_every"], save_top_k=-1))
    ckpt_path = None
    if cfg.get("resume") not in (None, "last"):
        ckpt_path = cfg["resume"].format(group=cfg["group"])
    elif cfg.get("resume") == "last" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        saved = glob.glob(os.path.join(cfg["ckpt_dir"], "step=*.ckpt"))
        ckpt_path = max(saved, key=lambda p: int(p.rsplit("=", 1)[1].split(".")[0])) if saved else None
    num_nodes = cfg.get("num_nodes", 1)
    if cfg.get("elastic"):  # torchrun --nnodes MIN:MAX: the nodes of this (re)start
        num_nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
    trainer = L.Trainer(accelerator="cpu", devices=cfg.get("devices", 2), num_nodes=num_nodes,
                        strategy=strategy, max_steps=cfg["steps"], logger=L.pytorch.loggers.CSVLogger(
                            os.path.join(cfg["out"], f"logs_{cfg['group']}")), enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=bool(cfg.get("save_every")),
                        callbacks=callbacks, accumulate_grad_batches=cfg.get("accumulate", 1),
                        precision=cfg.get("precision", "32-true"))
    module = build_module(cfg)
    data = lmm.data.SyntheticMultimodalDataModule(**{"num_samples": NUM_SAMPLES, "batch_size": BATCH,
                                                     **cfg.get("data", {})})
    fit_start = time.time()
    trainer.fit(module, data, ckpt_path=ckpt_path)
    rank, g = trainer.global_rank, cfg["group"]
    from torch.distributed.tensor import DTensor  # expert-parallel weights: gathered on every rank alike

    torch.save({n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                for n, p in module.model.named_parameters() if p.requires_grad and n in strategy.engine.owned},
               os.path.join(cfg["out"], f"params_{g}_{rank}.pt"))
    timing = {"created": process_created(), "started": STARTED, "fit_start": fit_start,
              "train_start": getattr(events, "train_start", None),
              "resumed_from": ckpt_path}
    if rank == 0 and ft is None:  # Lightning's DistributedSampler (dp 1 here): the same order as the global sampler
        with open(os.path.join(cfg["out"], "data.json"), "w") as f:
            json.dump({"num_samples": NUM_SAMPLES, "global_batch": BATCH * strategy.layout.dp, "shuffle": True,
                       "seed": 0}, f)
        with open(os.path.join(cfg["out"], f"result_{g}.json"), "w") as f:
            json.dump({"steps": events.steps, "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                       "global_step": trainer.global_step, **timing}, f)
        return
    if rank == 0:
        d = strategy.ft.data
        with open(os.path.join(cfg["out"], "data.json"), "w") as f:
            json.dump({k: d[k] for k in ("num_samples", "global_batch", "shuffle", "seed")}, f)
        with open(os.path.join(cfg["out"], f"result_{g}.json"), "w") as f:
            json.dump({"events": strategy.ft.events, "stats": strategy.ft.stats, "steps": events.steps,
                       "shares": strategy.ft.shares,
                       "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                       "global_step": trainer.global_step, "world_size": trainer.world_size, **timing}, f)


def reference(cfg):
    with open(os.path.join(cfg["out"], "data.json")) as f:
        d = json.load(f)
    module = build_module(cfg)
    model = module.model
    data = lmm.data.SyntheticMultimodalDataModule(model=model, **{"num_samples": NUM_SAMPLES, "batch_size": BATCH,
                                                                  **cfg.get("data", {})})
    dataset, collate = data._dataset(d["num_samples"], 0), data.collator()
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    k = cfg.get("accumulate", 1)
    for step in range(cfg["steps"]):
        for j in range(k):  # Lightning's accumulation in one process: each batch's mean loss, divided by k
            idx = global_batch_indices(step * k + j, d["num_samples"], d["global_batch"], d["shuffle"], d["seed"])
            batch = collate([dataset[i] for i in idx])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.get("precision") == "bf16-mixed"):
                loss = model(**batch).loss
            (loss / k).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    torch.save({n: p.detach() for n, p in model.named_parameters() if p.requires_grad},
               os.path.join(cfg["out"], "reference.pt"))


if __name__ == "__main__":
    torch.set_num_threads(1)
    cfg = json.loads(sys.argv[1])
    (reference if cfg["mode"] == "reference" else group)(cfg)
