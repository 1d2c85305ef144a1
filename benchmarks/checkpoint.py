"""Checkpoint size and save/load time (ours vs Lightning's FSDP sharded checkpoint), and fault-to-exit time.

Same model, same 4 CPU processes (gloo), one training step, then ``trainer.save_checkpoint`` and the strategy's
``load_checkpoint`` timed on rank 0 between barriers (median of ``--repeats``). Ours: vision 1 stage + LLM 1 stage,
dp 2, trainable projector + LLM (frozen encoder not written). FSDP: ``FSDPStrategy(state_dict_type="sharded")``
(DCP too), full sharding, ``use_orig_params`` (the model is partly frozen), frozen parameters written.

Faults: a 4-process run loses one rank after step 3 (SIGKILL, or SIGSTOP = a frozen rank whose sockets stay open,
like a lost node); we time from the fault to every other process gone, with the watchdog
(``fault_timeout``) and without it (``fault_timeout=None``; process-group timeout ``--pg-timeout``).

    python benchmarks/checkpoint.py [--hidden 256] [--layers 4] [--repeats 3] [--pg-timeout 60]
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine  # noqa: E402
import tables  # noqa: E402

HERE = Path(__file__).resolve()


def build(hidden: int, layers: int, fsdp: bool = False):
    import torch

    import lightning_mm as lmm
    from lightning_mm.model import tiny_encoder, tiny_language_model

    torch.manual_seed(0)
    llm = tiny_language_model("llama", hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                              vocab_size=4096)
    model = lmm.MultimodalModel({"vision": lmm.ModalityEncoder(tiny_encoder("siglip"))}, llm)
    model.freeze(encoders=True, projectors=False, language_model=False)
    cls = FSDPModule if fsdp else lmm.MultimodalLightningModule
    return cls(model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))


def _fsdp_module():
    import lightning_mm as lmm

    class FSDPModule(lmm.MultimodalLightningModule):
        """The same module, each LLM layer and then the whole model wrapped by FSDP2 ``fully_shard``."""

        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.llm_layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    return FSDPModule


class _Lazy:
    def __call__(self, *a, **k):
        return _fsdp_module()(*a, **k)


FSDPModule = _Lazy()


def dir_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


# ------------------------------------------------------------------------------------------------ worker modes
def worker_checkpoint(args) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist

    import lightning_mm as lmm

    torch.set_num_threads(1)
    if args.mode == "ours":
        strategy = lmm.MultimodalParallelStrategy(encoders={"vision": lmm.ParallelSpec()},
                                                  language_model=lmm.ParallelSpec(), num_microbatches=1)
        per_rank = 2
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        # Lightning's FSDPStrategy (FSDP1) refuses CPU; its ModelParallelStrategy runs torch's FSDP2 (fully_shard)
        # on a CPU mesh and checkpoints through DCP, the same machinery as ours.
        strategy = ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1)
        per_rank = 1
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = build(args.hidden, args.layers, fsdp=args.mode == "fsdp")
    data = lmm.data.SyntheticMultimodalDataModule(num_samples=16, batch_size=per_rank)
    trainer.fit(module, data)
    saves, loads = [], []
    for i in range(args.repeats):
        path = os.path.join(args.dir, f"{args.mode}-{i}.ckpt")
        dist.barrier()
        t0 = time.perf_counter()
        trainer.save_checkpoint(path)
        dist.barrier()
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        trainer.strategy.load_checkpoint(path)
        dist.barrier()
        loads.append(time.perf_counter() - t0)
    if trainer.global_rank == 0:
        result = {"save_s": statistics.median(saves), "load_s": statistics.median(loads),
                  "bytes": dir_bytes(os.path.join(args.dir, f"{args.mode}-0.ckpt")),
                  "trainable_params": sum(p.numel() for p in module.model.parameters() if p.requires_grad)}
        Path(args.out).write_text(json.dumps(result))


def worker_fault(args) -> None:
    import lightning as L
    import torch

    import lightning_mm as lmm

    torch.set_num_threads(1)

    class Fault(L.Callback):
        def on_train_batch_end(self, trainer, *a):
            with open(os.path.join(args.dir, f"{trainer.global_rank}.pid"), "w") as f:
                f.write(str(os.getpid()))
            if trainer.global_step == 3 and trainer.global_rank == args.rank:
                Path(args.dir, "fault_at").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)

    strategy = lmm.MultimodalParallelStrategy(encoders={"vision": lmm.ParallelSpec()},
                                              language_model=lmm.ParallelSpec(), num_microbatches=1,
                                              fault_timeout=args.fault_timeout,
                                              timeout=timedelta(seconds=args.pg_timeout))
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=8, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Fault()])
    trainer.fit(build(args.hidden, args.layers), lmm.data.SyntheticMultimodalDataModule(num_samples=32, batch_size=2))


# ------------------------------------------------------------------------------------------------ driver
def launch(extra: list[str], timeout: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE), *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] not in ("Z", "X")
    except FileNotFoundError:
        return False


def time_fault(args, fault: str, rank: int, fault_timeout) -> float | None:
    d = tempfile.mkdtemp(prefix="lmm-fault-")
    extra = ["--worker", "fault", "--dir", d, "--fault", fault, "--rank", str(rank), "--hidden", str(args.hidden),
             "--layers", str(args.layers), "--pg-timeout", str(args.pg_timeout)]
    if fault_timeout is not None:
        extra += ["--fault-timeout", str(fault_timeout)]
    proc = launch(extra, 600)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=["checkpoint", "fault"])
    ap.add_argument("--mode", choices=["ours", "fsdp"])
    ap.add_argument("--dir"), ap.add_argument("--out")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fault", choices=["kill", "hang"])
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--fault-timeout", type=float, default=None)
    ap.add_argument("--pg-timeout", type=float, default=60.0)
    ap.add_argument("--results", default=str(HERE.parent / "results"))
    args = ap.parse_args()
    start = _machine.record()
    if args.worker == "checkpoint":
        return worker_checkpoint(args)
    if args.worker == "fault":
        return worker_fault(args)

    rows = {}
    for mode in ("ours", "fsdp"):
        d = tempfile.mkdtemp(prefix=f"lmm-ckpt-{mode}-")
        out = os.path.join(d, "result.json")
        proc = launch(["--worker", "checkpoint", "--mode", mode, "--dir", d, "--out", out, "--hidden",
                       str(args.hidden), "--layers", str(args.layers), "--repeats", str(args.repeats)], 900)
        _, err = proc.communicate(timeout=900)
        if proc.returncode:
            raise RuntimeError(f"{mode} failed:\n{err[-3000:]}")
        rows[mode] = json.loads(Path(out).read_text())
    faults = {
        "kill rank 1, watchdog 5 s": time_fault(args, "kill", 1, 5.0),
        "kill rank 1, no watchdog": time_fault(args, "kill", 1, None),
        "freeze rank 1, watchdog 5 s": time_fault(args, "hang", 1, 5.0),
        "freeze rank 1, no watchdog": time_fault(args, "hang", 1, None),
    }
    result = {"model": {"hidden": args.hidden, "layers": args.layers, "devices": 4, "backend": "gloo (CPU)"},
              "checkpoint": rows, "fault_to_exit_s": faults, "pg_timeout_s": args.pg_timeout,
              "machine": _machine.finish(start)}
    Path(args.results).mkdir(parents=True, exist_ok=True)
    Path(args.results, "checkpoint.json").write_text(json.dumps(result, indent=1))
    tables.main(["--quiet"])
    o, f = rows["ours"], rows["fsdp"]
    print(f"{'':12}{'ours':>12}{'FSDP':>12}{'ours/FSDP':>12}")
    print(f"{'size (MB)':12}{o['bytes'] / 1e6:12.2f}{f['bytes'] / 1e6:12.2f}{o['bytes'] / f['bytes']:12.2f}")
    for k, label in (("save_s", "save (s)"), ("load_s", "load (s)")):
        print(f"{label:12}{o[k]:12.3f}{f[k]:12.3f}{o[k] / f[k]:12.2f}")
    print(f"\nfault -> every other process gone (s), process-group timeout {args.pg_timeout:g} s:")
    for k, v in faults.items():
        print(f"  {k:30}{'> limit (hang)' if v is None else f'{v:8.2f}'}")


if __name__ == "__main__":
    main()
