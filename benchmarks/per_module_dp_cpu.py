"""Per-module data parallelism measured on CPU processes: one degree for every module vs a degree per module, with
a heavy vision encoder, on the same number of gloo processes and the same global batches.

Model: a trainable tiny SigLIP made heavy (``--encoder-layers`` layers of width ``--encoder-hidden``, 49 tokens per
112-pixel image, ``--image-size``) + MLP projector + a trainable 2-layer Llama (width 64): the encoder does most of
the work, as with a 0.6B tower on high-resolution images in front of a small LLM. Data: the synthetic data set,
2-4 images per sample, ``--batch`` samples per global batch in ``--microbatches`` microbatches. Layouts
(``--world`` ranks):

- ``uniform``: vision 1 rank + LLM 1 rank per replica, dp = world / 2 (every module at one degree);
- ``per-module``: vision dp = world - 1 + LLM dp 1 (the encoder gets the ranks its work needs).

Each layout runs ``--warmup`` untimed and ``--steps`` timed training steps through ``PipelineEngine`` (what the
strategy drives each step: the 1F1B schedule, feature routing between replicas, gradient sums, an SGD update) on
its own processes with one torch thread each. Reported per layout: the median step (barrier to barrier, rank 0's
clock), and the busiest rank's CPU seconds per step (process time: its own work, robust to the other processes
sharing the machine's cores; on a cluster, where each rank has its own device, the step follows the busiest rank).
On a 2-core machine 4 processes share 2 cores, so wall times show contention as much as the split of work.

    python benchmarks/per_module_dp_cpu.py [--world 4] [--batch 12] [--microbatches 2] [--steps 4] [--warmup 1]

Writes benchmarks/results/per_module_dp_cpu.json, prints a table and rewrites the table docs/per_module_dp.md quotes
from it (benchmarks/tables.py).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import _machine  # benchmarks/_machine.py: the machine record
import tables  # benchmarks/tables.py: the figures docs quote

RESULTS = pathlib.Path(__file__).parent / "results"


def build_model(args):
    import lightning_mm as lmm
    from lightning_mm.model import tiny_encoder, tiny_language_model

    torch.manual_seed(0)
    vision = tiny_encoder("siglip", hidden_size=args.encoder_hidden, intermediate_size=4 * args.encoder_hidden,
                          num_hidden_layers=args.encoder_layers, num_attention_heads=4, image_size=args.image_size,
                          patch_size=16)
    return lmm.MultimodalModel({"vision": lmm.ModalityEncoder(vision, projector="mlp")},
                               tiny_language_model("llama", num_hidden_layers=2))


def layouts(world: int) -> dict[str, tuple[dict, dict]]:
    """name -> (vision spec kwargs, LLM spec kwargs)."""
    if world % 2:
        raise ValueError(f"--world {world}: the uniform layout needs an even number of ranks")
    return {"uniform": ({}, {}), "per-module": ({"dp": world - 1}, {"dp": 1})}


def _worker(rank, world, name, args, rendezvous, out):
    import lightning_mm as lmm
    from lightning_mm.data.microbatch import split_microbatches
    from lightning_mm.parallel.engine import PipelineEngine
    from lightning_mm.plan.layout import ParallelSpec, build_layout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        model = build_model(args)
        vision, llm = layouts(world)[name]
        layout = build_layout({"vision": ParallelSpec(**vision)}, ParallelSpec(**llm), world, "parallel", ["vision"])
        engine = PipelineEngine(model, layout, rank, args.microbatches)
        data = lmm.data.SyntheticMultimodalDataset(model, num_samples=args.batch * (args.steps + args.warmup),
                                                   items_per_sample=(2, 4), seed=1)
        collate = lmm.data.MultimodalCollator(model)
        params = engine.trainable_parameters()
        opt = torch.optim.SGD(params, lr=1e-3) if params else None
        walls, cpus = [], []
        for step in range(args.warmup + args.steps):
            batch = collate([data[step * args.batch + i] for i in range(args.batch)])
            mine = split_microbatches(batch, layout.num_groups, model)[layout.group_of(rank)]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            engine.run(mine)
            engine.sync_gradients()
            if opt:
                opt.step()
                opt.zero_grad()
            c1 = time.process_time()
            dist.barrier()
            if step >= args.warmup:
                walls.append(time.perf_counter() - t0)
                cpus.append(c1 - c0)
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"rank": rank, "stage": engine.stage, "dp": engine.coord.dp, "wall": walls, "cpu": cpus}, f)
    finally:
        dist.destroy_process_group()


def run_layout(name: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        mp.spawn(_worker, args=(args.world, name, args, os.path.join(tmp, "rendezvous"), out), nprocs=args.world)
        ranks = [json.load(open(f"{out}.{r}")) for r in range(args.world)]
    steps = len(ranks[0]["wall"])
    busiest = [max(r["cpu"][s] for r in ranks) for s in range(steps)]
    return {"layout": name, "step_s": statistics.median(ranks[0]["wall"]),
            "busiest_cpu_s": statistics.median(busiest),
            "cpu_s_per_rank": {f"{r['stage']}/dp{r['dp']}": statistics.median(r["cpu"]) for r in ranks}}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--encoder-layers", type=int, default=6)
    parser.add_argument("--encoder-hidden", type=int, default=384)
    parser.add_argument("--image-size", type=int, default=112)
    args = parser.parse_args(argv)
    start = _machine.record()
    rows = [run_layout(name, args) for name in layouts(args.world)]
    base = rows[0]
    for row in rows:
        row["step_speedup"] = base["step_s"] / row["step_s"]
        row["busiest_cpu_speedup"] = base["busiest_cpu_s"] / row["busiest_cpu_s"]
    result = {"what": "uniform vs per-module data parallelism, measured on CPU processes (gloo)",
              "settings": vars(args), "rows": rows, "machine": _machine.finish(start)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "per_module_dp_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'layout':<12} {'step (s)':>9} {'busiest rank CPU (s)':>21} {'step x':>7} {'busiest CPU x':>14}")
    for row in rows:
        print(f"{row['layout']:<12} {row['step_s']:>9.3f} {row['busiest_cpu_s']:>21.3f} {row['step_speedup']:>7.2f} "
              f"{row['busiest_cpu_speedup']:>14.2f}")
    tables.main(["--quiet"])
    return result


if __name__ == "__main__":
    main()
