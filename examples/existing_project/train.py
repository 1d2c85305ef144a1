"""An existing Lightning project: a HF VLM in a plain LightningModule, trained with Lightning's own strategy.

Nothing here depends on lightning-mm except the two lines marked ``lightning-mm``: the packing collate function
and the ``ContextParallel`` callback. The model is a tiny random LLaVA built from a config (nothing downloads);
swap in ``LlavaForConditionalGeneration.from_pretrained(...)`` and your processor's outputs for a real run.

    python examples/existing_project/train.py                        # DDP on 2 CPU processes, padded batches
    python examples/existing_project/train.py --cp 2 --devices 4     # + packing and context parallelism (dp 2 x cp 2)
    python examples/existing_project/train.py --cp 2 --devices 4 --fsdp2   # the same under ModelParallelStrategy
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import transformers as tf
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.utils.data import DataLoader

IMAGE = 100  # the image placeholder id of the tiny config


def build_model() -> tf.LlavaForConditionalGeneration:
    torch.manual_seed(0)
    text = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=32, patch_size=8)
    return tf.LlavaForConditionalGeneration(tf.LlavaConfig(vision_config=vision, text_config=text,
                                                           image_token_id=IMAGE, vision_feature_layer=-1))


def processed_samples(n: int) -> list[dict]:
    """What a LLaVA processor returns for one conversation: input_ids with each image expanded to its 16
    placeholder tokens, and the image's pixel_values."""
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        images = i % 3
        ids = torch.randint(1, 90, (4 + i % 7,), generator=g).tolist()
        for _ in range(images):
            ids += [IMAGE] * 16 + torch.randint(1, 90, (3,), generator=g).tolist()
        sample = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        if images:
            sample["pixel_values"] = torch.randn(images, 3, 32, 32, generator=g)
        out.append(sample)
    return out


def pad_collate(samples: list[dict]) -> dict:
    """The project's own collate function: right padding, labels = ids without placeholders and padding."""
    length = max(s["input_ids"].shape[1] for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(samples):
        ids[r, :s["input_ids"].shape[1]] = s["input_ids"][0]
        mask[r, :s["input_ids"].shape[1]] = 1
    batch = {"input_ids": ids, "attention_mask": mask,
             "labels": ids.masked_fill((ids == IMAGE) | (mask == 0), -100)}
    pixels = [s["pixel_values"] for s in samples if "pixel_values" in s]
    if pixels:
        batch["pixel_values"] = torch.cat(pixels)
    return batch


class VLM(L.LightningModule):
    """The project's LightningModule: it knows nothing of lightning-mm."""

    def __init__(self, fsdp2: bool = False):
        super().__init__()
        self.fsdp2 = fsdp2
        self.model = None if fsdp2 else build_model()

    def configure_model(self):  # ModelParallelStrategy: build, then FSDP2 over the data-parallel mesh
        if self.model is not None:
            return
        from torch.distributed.fsdp import fully_shard

        self.model = build_model()
        for layer in self.model.model.language_model.layers:
            fully_shard(layer, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--cp", type=int, default=0, help="context-parallel size (0: the project as it was)")
    parser.add_argument("--fsdp2", action="store_true", help="ModelParallelStrategy (FSDP2) instead of DDP")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=128, help="tokens per packed row")
    args = parser.parse_args(argv)

    module = VLM(fsdp2=args.fsdp2)
    collate, callbacks = pad_collate, []
    if args.cp:
        from lightning_mm.trainer.callbacks import ContextParallel
        from lightning_mm.data import PackingCollator

        collate = PackingCollator(build_model().config, args.max_length)   # lightning-mm: packed rows
        callbacks = [ContextParallel(cp_size=args.cp, block_size=16)]        # lightning-mm: LPT context parallelism
    strategy = (ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
                if args.fsdp2 else DDPStrategy(find_unused_parameters=True))
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                        callbacks=callbacks, logger=False, enable_checkpointing=False, log_every_n_steps=1)
    loader = DataLoader(processed_samples(64), batch_size=8, collate_fn=collate)
    trainer.fit(module, loader)
    if trainer.global_rank == 0:
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    main()
