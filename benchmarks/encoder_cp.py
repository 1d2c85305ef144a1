"""Encoder context parallelism: one step of a vision encoder on a microbatch of 8 images, cp 1 vs cp 2.

Two gloo processes on this machine; each step is the encoder part only: the rank's images (LPT shares of the
microbatch, as the runtime plans them) through a Qwen2-VL vision tower and its projector, the feature all-gather,
and the backward of a sum over the gathered features. cp 1 runs the same in one process. Median over --steps
after --warmup; writes benchmarks/results/encoder_cp_cpu.json and prints a table. On 2 CPU cores the two ranks
share the machine with nothing else, so the ratio is what splitting the images buys at best here.

    python benchmarks/encoder_cp.py [--steps 7] [--warmup 2] [--hidden 512] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _machine  # noqa: E402
import tables  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
SIDES = [(8, 8), (16, 16), (4, 8), (12, 12), (8, 16), (4, 4), (16, 8), (12, 4)]  # patch grids of 8 images


def build(hidden: int, layers: int):
    import lightning_mm as lmm
    from lightning_mm.model import tiny_encoder

    torch.manual_seed(0)
    enc = lmm.ModalityEncoder(tiny_encoder("qwen2_vl", embed_dim=hidden, hidden_size=hidden, depth=layers,
                                           num_heads=max(1, hidden // 64)))
    enc.attach(hidden)
    inputs = enc.family.random_inputs(enc.config, len(SIDES), generator=torch.Generator().manual_seed(0),
                                      grids=[(1, h, w) for h, w in SIDES])
    return enc, inputs


def step(enc, inputs, group, cp: int, rank: int) -> float:
    from lightning_mm.data.metadata import encoder_input_tokens
    from lightning_mm.parallel.encoder_cp import gather_items
    from lightning_mm.plan.items import gather_order, shard_items

    t0 = time.perf_counter()
    tokens = enc.num_tokens(inputs)
    work = [t * (t + 6 * enc.config.hidden_size) for t in (encoder_input_tokens(enc, n) for n in tokens)]
    shards = shard_items(work, cp)
    mine = enc.family.select_items(inputs, torch.tensor(shards[rank]))
    feats = enc(mine)
    if cp > 1:
        counts = [sum(tokens[i] for i in s) for s in shards]
        feats = gather_items(feats, counts, torch.tensor(gather_order(shards, tokens)), group)
    feats.float().square().mean().backward()
    if cp > 1:
        dist.barrier(group)
    return time.perf_counter() - t0


def worker(rank: int, cp: int, args, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    enc, inputs = build(args.hidden, args.layers)
    times = [step(enc, inputs, None, cp, rank) for _ in range(args.warmup + args.steps)][args.warmup:]
    if rank == 0:
        out[cp] = times
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    start = _machine.record()
    manager = mp.Manager()
    out = manager.dict()
    for i, cp in enumerate((1, 2)):
        mp.spawn(worker, args=(cp, args, 29650 + i, out), nprocs=cp, join=True)
    rows = {cp: statistics.median(out[cp]) for cp in (1, 2)}
    result = {"device": f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()}), gloo",
              "how": "measured", "images": SIDES, "hidden": args.hidden, "layers": args.layers,
              "step_s": {f"cp{cp}": t for cp, t in rows.items()}, "all_steps_s": {f"cp{cp}": list(out[cp]) for cp in (1, 2)},
              "speedup_cp2": rows[1] / rows[2], "machine": _machine.finish(start)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "encoder_cp_cpu.json").write_text(json.dumps(result, indent=1))
    print(f"encoder step on 8 images (measured, {result['device']}), median of {args.steps}:")
    print(f"{'cp':>4} {'step s':>8} {'vs cp 1':>8}")
    for cp, t in rows.items():
        print(f"{cp:>4} {t:8.3f} {rows[1] / t:8.2f}")
    tables.main(["--quiet"])


if __name__ == "__main__":
    main()
