"""The ContextParallel callback's image split: one training step with every image encoded on every CP rank vs
each rank encoding its LPT share (``shard_images``).

A plain LightningModule around a random LLaVA (nothing downloads) whose vision tower is the heavy part (CLIP,
``--vision-layers`` layers of width ``--vision-width`` on ``--image-size`` square images, patch 8) and whose LLM
is small (its attention runs dense on CPU, so the rows stay short); batches of ``--images`` images (two per
sample) packed into one row. The vision tower is frozen (LLaVA's second stage: the projector and the LLM train)
and, separately, trained. Each variant is a real ``Trainer.fit``
under Lightning's ``DDPStrategy`` on gloo: "cp 1" (one process, no callback), "cp 2, images on every rank"
(``shard_images=False``) and "cp 2, images split" (the default). A step's time is rank 0's wall time from
``on_train_batch_start`` to ``on_train_batch_end``; the table gives the median after ``--warmup`` steps. On this
2-core machine the two CP ranks share the cores with nothing else, so the ratio is what the split buys here;
with a trained tower, DDP's all-reduce of its gradients over gloo is part of every cp 2 step.
Writes benchmarks/results/callback_images_cpu.json.

    python benchmarks/callback_images.py [--steps 6] [--warmup 2] [--images 16] [--image-size 32]
                                         [--vision-width 512] [--vision-layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _machine  # noqa: E402
import tables  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
IMAGE = 100  # the image placeholder id of the config
VARIANTS = [("cp 1", 1, True), ("cp 2, images on every rank", 2, False), ("cp 2, images split", 2, True)]


def build_model(spec: dict):
    import transformers as tf

    torch.manual_seed(0)
    text = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    width = spec["vision_width"]
    vision = dict(model_type="clip_vision_model", hidden_size=width, intermediate_size=4 * width,
                  num_hidden_layers=spec["vision_layers"], num_attention_heads=max(1, width // 64),
                  image_size=spec["image_size"], patch_size=8)
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE, vision_feature_layer=-1)
    config._attn_implementation = "eager"
    return tf.LlavaForConditionalGeneration(config)


def samples(n: int, size: int) -> list[dict]:
    """Processor-like samples of two ``size`` x ``size`` images each ((size / 8)^2 placeholder tokens per image,
    CLS dropped) and some text."""
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(1, 90, (8,), generator=g).tolist()
        for _ in range(2):
            ids += [IMAGE] * (size // 8) ** 2 + torch.randint(1, 90, (4,), generator=g).tolist()
        out.append({"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                    "pixel_values": torch.randn(2, 3, size, size, generator=g)})
    return out


def child(spec: dict) -> None:
    """One Trainer.fit of a variant; rank 0 writes its step times to ``spec["out"]``."""
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader

    from lightning_mm.attention import use_bitfield_attention
    from lightning_mm.trainer.callbacks import ContextParallel
    from lightning_mm.data import PackingCollator

    torch.set_num_threads(1)
    times: list[float] = []

    class StepTimer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            times.append(time.perf_counter() - self.start)

    class VLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build_model(spec)
            self.model.model.vision_tower.requires_grad_(not spec["frozen_vision"])
            if cp == 1:  # packed rows need it (the callback puts it on under CP)
                use_bitfield_attention(self.model)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    cp = spec["cp"]
    callbacks = [StepTimer()]
    if cp > 1:
        callbacks.append(ContextParallel(cp, block_size=32, shard_images=spec["shard_images"]))
    per_batch = spec["images"] // 2
    data = samples(per_batch * (spec["steps"] + spec["warmup"]), spec["image_size"])
    row = per_batch * data[0]["input_ids"].shape[1]  # one row holds the batch, no padding
    loader = DataLoader(data, batch_size=per_batch, collate_fn=PackingCollator(build_model(spec).config, row))
    trainer = L.Trainer(accelerator="cpu", devices=cp, strategy=DDPStrategy(process_group_backend="gloo",
                                                                           find_unused_parameters=True),
                        max_steps=spec["steps"] + spec["warmup"], callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(VLM(), loader)
    if trainer.global_rank == 0:
        pathlib.Path(spec["out"]).write_text(json.dumps(times))


def run_variant(name: str, cp: int, shard: bool, frozen: bool, args, tmp: pathlib.Path) -> dict:
    out = tmp / f"{name.replace(' ', '_').replace(',', '')}_{frozen}.json"
    spec = dict(cp=cp, shard_images=shard, frozen_vision=frozen, images=args.images, steps=args.steps,
                warmup=args.warmup, image_size=args.image_size, vision_width=args.vision_width,
                vision_layers=args.vision_layers, out=str(out))
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    times = json.loads(out.read_text())[args.warmup:]
    return dict(variant=name, vision="frozen" if frozen else "trained", cp=cp, shard_images=shard,
                step_s_median=statistics.median(times), step_s=times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--images", type=int, default=16, help="images per batch (two per sample)")
    parser.add_argument("--image-size", type=int, default=32, help="pixels per side (a multiple of 8)")
    parser.add_argument("--vision-width", type=int, default=512)
    parser.add_argument("--vision-layers", type=int, default=8)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    start = _machine.record()
    if args.child:
        child(json.loads(args.child))
        return
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_variant(name, cp, shard, frozen, args, pathlib.Path(tmp))
                for frozen in (True, False) for name, cp, shard in VARIANTS]
    print(f"\nContextParallel image split: one step, {args.images} images of {(args.image_size // 8) ** 2} tokens, "
          f"CLIP {args.vision_layers}x{args.vision_width}, gloo on {os.cpu_count()} CPU cores (median of "
          f"{args.steps} steps)")
    print(f"{'vision tower':13} {'variant':28} {'step s':>8} {'vs cp 1':>8} {'vs every rank':>14}")
    for i, r in enumerate(rows):
        base, whole = rows[i - i % 3]["step_s_median"], rows[i - i % 3 + 1]["step_s_median"]
        print(f"{r['vision']:13} {r['variant']:28} {r['step_s_median']:8.3f} {base / r['step_s_median']:7.2f}x "
              f"{whole / r['step_s_median']:13.2f}x")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "callback_images_cpu.json"
    path.write_text(json.dumps(dict(device=f"CPU ({platform.processor() or platform.machine()}, "
                                           f"{os.cpu_count()} cores), gloo", load_average=os.getloadavg()[0],
                                    args=vars(args), rows=rows, machine=_machine.finish(start)), indent=2))
    print(f"wrote {path}")
    tables.main(["--quiet"])


if __name__ == "__main__":
    main()
