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
    pick = random.SystemRandom()  # not the global generator: a test that seeds it would repeat the ports
    for _ in range(200):
        port = pick.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def _worker(rank, world, port, fn, args, out_dir, environment):
    torch.set_num_threads(1)
    os.environ.clear()  # the test's environment now, not the one the fork server started with
    os.environ.update(environment, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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


def _context():
    """Ranks fork from a server that has imported torch, Lightning and transformers once (``forkserver`` with a
    preload): a spawned rank spends 8-10 s of CPU importing them (Lightning pulls in torchmetrics, scipy and sympy),
    which made up most of a 4-rank test's time on 2 cores. Each rank still starts from a fresh fork of a process that
    has run nothing but those imports, and imports ``lightning_mm`` and the test module itself, so module state
    and environment reads stay per test."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "lightning", "transformers"])
    return ctx


def run_distributed(fn, world: int, *args, timeout: float = 240):
    """``fn(rank, world, *args)`` on ``world`` processes; returns the list of results, raising any rank's error."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = _context()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, out_dir, dict(os.environ)))
                 for r in range(world)]
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
