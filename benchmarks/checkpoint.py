"""Checkpoint size and save/load time (ours vs Lightning's FSDP2 sharded checkpoint), and fault-to-exit time.

Setting and results: docs/checkpoints.md, "Benchmark".
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import harness


def build(hidden: int, layers: int, fsdp: bool = False):
    import torch

    import lightning_mm as lmm
    from lightning_mm.model import tiny_encoder, tiny_language_model

    class FSDPModule(lmm.MultimodalLightningModule):
        def configure_model(self):  # each LLM layer, then the whole model, wrapped by FSDP2's fully_shard
            from torch.distributed.fsdp import fully_shard

            for module in [*self.model.llm_layers, self.model]:
                fully_shard(module, mesh=self.device_mesh["data_parallel"])

    torch.manual_seed(0)
    llm = tiny_language_model("llama", hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                              vocab_size=4096)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))}, llm)
    model.freeze(encoders=True, projectors=False, language_model=False)
    cls = FSDPModule if fsdp else lmm.MultimodalLightningModule
    return cls(model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))


def worker(cfg: dict, result: str | None) -> None:
    """4 CPU ranks: ``part`` "checkpoint" trains one step, then times save and load; "fault" trains until rank
    ``cfg["rank"]`` kills or freezes itself after step 3."""
    import lightning as L
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy

    import lightning_mm as lmm

    torch.set_num_threads(1)
    fault, fsdp = cfg["part"] == "fault", cfg.get("mode") == "fsdp"

    class Fault(L.Callback):
        def on_train_batch_end(self, trainer, *a):
            Path(cfg["dir"], f"{trainer.global_rank}.pid").write_text(str(os.getpid()))
            if trainer.global_step == 3 and trainer.global_rank == cfg["rank"]:
                Path(cfg["dir"], "fault_at").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL if cfg["fault"] == "kill" else signal.SIGSTOP)

    if fsdp:  # Lightning's ModelParallelStrategy: torch's FSDP2 (fully_shard) on a CPU mesh, checkpoints through DCP
        strategy = ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1)
    else:
        watchdog = {}
        if fault:
            watchdog = dict(fault_timeout=cfg["fault_timeout"], timeout=timedelta(seconds=cfg["pg_timeout"]))
        strategy = lmm.MultimodalParallelStrategy(encoders={"vision": lmm.ParallelSpec()},
                                                  language_model=lmm.ParallelSpec(), num_microbatches=1, **watchdog)
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=8 if fault else 1,
                        callbacks=[Fault()] if fault else None, **harness.QUIET)
    module = build(cfg["hidden"], cfg["layers"], fsdp)
    trainer.fit(module, lmm.data.SyntheticMultimodalDataModule(num_samples=32 if fault else 16,
                                                               batch_size=1 if fsdp else 2))
    if fault:
        return

    def path(i: int) -> str:
        return os.path.join(cfg["dir"], f"{cfg['mode']}-{i}.ckpt")

    saves, loads = [], []
    for i in range(cfg["repeats"]):  # each load reads the checkpoint just saved
        saves += harness.timed(lambda _: trainer.save_checkpoint(path(i)), 1, 0)[0]
        loads += harness.timed(lambda _: trainer.strategy.load_checkpoint(path(i)), 1, 0)[0]
    ckpt = Path(path(0))  # a file (ours) or a folder of shards (DCP)
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) if ckpt.is_dir() else ckpt.stat().st_size
    harness.save(result, {"save_s": statistics.median(saves), "load_s": statistics.median(loads), "bytes": size,
                          "trainable_params": sum(p.numel() for p in module.model.parameters() if p.requires_grad)},
                 trainer)


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] not in ("Z", "X")
    except FileNotFoundError:
        return False


def time_fault(args, fault: str, rank: int, fault_timeout) -> float | None:
    """Seconds from the fault of ``rank`` until every other rank has exited (None: not within the pg timeout
    + 120 s)."""
    d = tempfile.mkdtemp(prefix="lmm-fault-")
    cfg = dict(part="fault", dir=d, fault=fault, rank=rank, hidden=args.hidden, layers=args.layers,
               pg_timeout=args.pg_timeout, fault_timeout=fault_timeout)
    proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(cfg)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    threading.Thread(target=proc.communicate, daemon=True).start()
    while not os.path.exists(os.path.join(d, "fault_at")) and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.2)
    at = float(Path(d, "fault_at").read_text())
    pids = {r: int(Path(d, f"{r}.pid").read_text()) for r in range(4)}
    limit = time.time() + args.pg_timeout + 120
    while any(alive(p) for r, p in pids.items() if r != rank) and time.time() < limit:
        time.sleep(0.05)
    gone = time.time() - at
    for p in pids.values():
        if alive(p):
            os.kill(p, signal.SIGKILL)
    return round(gone, 2) if gone < args.pg_timeout + 120 else None


def main(argv=None) -> None:
    args = harness.cli(__doc__, argv, hidden=256, layers=4, repeats=3, pg_timeout=60.0, worker=True)
    if args.worker:
        return worker(args.worker, args.result)
    start = harness.record()
    rows = {mode: harness.launch(__file__, dict(part="checkpoint", mode=mode, hidden=args.hidden, layers=args.layers,
                                                dir=tempfile.mkdtemp(prefix=f"lmm-ckpt-{mode}-"),
                                                repeats=args.repeats), 900, mode) for mode in ("ours", "fsdp")}
    faults = {f"{'kill' if fault == 'kill' else 'freeze'} rank 1, {'watchdog 5 s' if t else 'no watchdog'}":
              time_fault(args, fault, 1, t) for fault in ("kill", "hang") for t in (5.0, None)}
    harness.write(harness.RESULTS / "checkpoint.json", {
        "model": {"hidden": args.hidden, "layers": args.layers, "devices": 4, "backend": "gloo (CPU)"},
        "checkpoint": rows, "fault_to_exit_s": faults, "pg_timeout_s": args.pg_timeout}, start)


if __name__ == "__main__":
    main()
