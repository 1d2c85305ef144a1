"""The ContextParallel callback's image split: a cp 2 step with every image on every rank vs each rank its LPT
share (``shard_images``), against cp 1 (docs/existing_project.md).
"""

import os
import statistics
import time

import lightning as L
import torch
import transformers as tf
from lightning.pytorch.callbacks import LambdaCallback
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

import harness
from lightning_mm.attention import use_bitfield_attention
from lightning_mm.data import PackingCollator
from lightning_mm.trainer.callbacks import ContextParallel

IMAGE = 100  # the image placeholder id of the config
VARIANTS = [("cp 1", 1, True), ("cp 2, images on every rank", 2, False), ("cp 2, images split", 2, True)]


def build_model(spec: dict):
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


class VLM(L.LightningModule):
    def __init__(self, spec: dict):
        super().__init__()
        self.model = build_model(spec)
        self.model.model.vision_tower.requires_grad_(not spec["frozen_vision"])
        if spec["cp"] == 1:  # packed rows need it (the callback puts it on under CP)
            use_bitfield_attention(self.model)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def worker(spec: dict, result: str) -> None:
    """One Trainer.fit of a variant; rank 0 writes its step times."""
    torch.set_num_threads(1)
    cp, starts, times = spec["cp"], [], []
    timer = LambdaCallback(on_train_batch_start=lambda *_: starts.append(time.perf_counter()),
                           on_train_batch_end=lambda *_: times.append(time.perf_counter() - starts[-1]))
    callbacks = [timer] + ([ContextParallel(cp, block_size=32, shard_images=spec["shard_images"])] if cp > 1 else [])
    per_batch = spec["images"] // 2
    data = samples(per_batch * (spec["steps"] + spec["warmup"]), spec["image_size"])
    row = per_batch * data[0]["input_ids"].shape[1]  # one row holds the batch, no padding
    loader = DataLoader(data, batch_size=per_batch, collate_fn=PackingCollator(build_model(spec).config, row))
    trainer = L.Trainer(accelerator="cpu", devices=cp, max_steps=spec["steps"] + spec["warmup"], callbacks=callbacks,
                        strategy=DDPStrategy(process_group_backend="gloo", find_unused_parameters=True),
                        **harness.QUIET)
    trainer.fit(VLM(spec), loader)
    harness.save(result, {"step_s": times}, trainer)


def main(argv=None) -> None:
    args = harness.cli(__doc__, argv, steps=6, warmup=2, images=(16, "images per batch (two per sample)"),
                       image_size=(32, "pixels per side (a multiple of 8)"), vision_width=512, vision_layers=8,
                       worker=True)
    if args.worker:
        return worker(args.worker, args.result)
    start = harness.record()
    settings = {k: v for k, v in vars(args).items() if k not in ("worker", "result")}
    os.environ["PYTHONWARNINGS"] = "ignore"
    rows = []
    for frozen in (True, False):
        for name, cp, shard in VARIANTS:
            spec = dict(cp=cp, shard_images=shard, frozen_vision=frozen, **settings)
            times = harness.launch(__file__, spec, 3600, name)["step_s"][args.warmup:]
            rows.append(dict(variant=name, vision="frozen" if frozen else "trained", cp=cp, shard_images=shard,
                             step_s_median=statistics.median(times), step_s=times))
    harness.write(harness.RESULTS / "callback_images_cpu.json", dict(
        device=f"CPU ({start['cpu']}, {start['cores']} cores), gloo", load_average=os.getloadavg()[0],
        args=settings, rows=rows), start)


if __name__ == "__main__":
    main()
