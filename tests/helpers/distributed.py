"""Run a function on N gloo CPU processes and collect what each rank returns."""

from __future__ import annotations

import os
import pickle
import random
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999), from which the OS hands out the ports of every
    outgoing and gloo connection: a rendezvous port picked there (as ``bind(0)`` does) can be taken by another
    socket between the pick and the store's bind (EADDRINUSE)."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def _worker(rank, world, port, fn, args, out_dir):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result = None
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001  (reported to the parent)
        result = ("error", traceback.format_exc())
    finally:
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world: int, *args, timeout: float = 240):
    """``fn(rank, world, *args)`` on ``world`` processes; returns the list of results, raising any rank's error."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, out_dir)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        results, errors = [], []
        for r in range(world):
            path = os.path.join(out_dir, f"{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r} died without a result (exit code {procs[r].exitcode})")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {r} failed:\n{value}")
            results.append(value)
        if errors:  # the root cause first: peers of a failed rank only see closed connections
            errors.sort(key=lambda e: "Connection closed" in e or "died without" in e)
            raise RuntimeError("\n".join(errors))
        return results
