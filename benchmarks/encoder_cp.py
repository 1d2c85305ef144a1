"""Encoder context parallelism: one vision-encoder step on 8 images, cp 1 vs cp 2 (docs/context_parallel.md)."""

import statistics

import torch
import torch.distributed as dist

import harness
import lightning_mm as lmm
from lightning_mm.data.metadata import encoder_input_tokens
from lightning_mm.model import tiny_encoder
from lightning_mm.parallel.encoder_cp import gather_items
from lightning_mm.plan.items import gather_order, shard_items

SIDES = [(8, 8), (16, 16), (4, 8), (12, 12), (8, 16), (4, 4), (16, 8), (12, 4)]  # patch grids of 8 images


def worker(rank: int, cp: int, args: dict) -> list[float]:
    """Seconds of each timed step (forward, gather, backward) of this rank's LPT share of the images."""
    torch.manual_seed(0)
    enc = lmm.ModalityEncoder(tiny_encoder("qwen2_vl", embed_dim=args["hidden"], hidden_size=args["hidden"],
                                           depth=args["layers"], num_heads=max(1, args["hidden"] // 64)))
    enc.attach(args["hidden"])
    inputs = enc.family.random_inputs(enc.config, len(SIDES), generator=torch.Generator().manual_seed(0),
                                      grids=[(1, h, w) for h, w in SIDES])

    def step():
        tokens = enc.num_tokens(inputs)
        work = [t * (t + 6 * enc.config.hidden_size) for t in (encoder_input_tokens(enc, n) for n in tokens)]
        shards = shard_items(work, cp)
        feats = enc(enc.family.select_items(inputs, torch.tensor(shards[rank])))
        if cp > 1:
            counts = [sum(tokens[i] for i in s) for s in shards]
            feats = gather_items(feats, counts, torch.tensor(gather_order(shards, tokens)), None)
        feats.float().square().mean().backward()
        if cp > 1:
            dist.barrier()

    return harness.repeat(step, args["warmup"] + args["steps"])[0][args["warmup"]:]


def main(argv=None) -> None:
    args = harness.cli(__doc__, argv, steps=7, warmup=2, hidden=512, layers=8)
    start = harness.record()
    times = {cp: harness.spawn(worker, cp, vars(args))[0] for cp in (1, 2)}
    medians = {cp: statistics.median(t) for cp, t in times.items()}
    harness.write(harness.RESULTS / "encoder_cp_cpu.json", {
        "device": f"CPU ({start['cores']} cores, {start['cpu']}), gloo",
        "how": "measured", "images": SIDES, "hidden": args.hidden, "layers": args.layers,
        "step_s": {f"cp{cp}": t for cp, t in medians.items()}, "all_steps_s": {f"cp{cp}": t for cp, t in times.items()},
        "speedup_cp2": medians[1] / medians[2]}, start)


if __name__ == "__main__":
    main()
