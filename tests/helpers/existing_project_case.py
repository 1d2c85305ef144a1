"""A Lightning project written without lightning-mm: a tiny HF VLM (LLaVA or Qwen2-VL, built from a config:
nothing downloads) in its own LightningModule whose ``training_step`` returns ``outputs.loss``, trained with
Lightning's own ``DDPStrategy`` or ``ModelParallelStrategy`` (FSDP2), with or without the ``ContextParallel``
callback. Also the sample builders the one-process tests use.

``python existing_project_case.py '<json>' <out_dir>`` writes ``<out_dir>/result.json`` (rank 0: per-step losses,
the callback's work per CP rank) and ``<out_dir>/params_<rank>.pt`` (full parameters, gathered under FSDP2).
Batches are packed rows (``PackingCollator``); without the callback the module calls ``use_bitfield_attention``
itself. JSON keys: ``kind`` ("llava" | "qwen2_vl"), ``strategy`` ("ddp" | "fsdp2"), ``devices``, ``cp`` (0: no
callback), ``steps``, ``max_length``, ``distribution``, ``block_size``, ``gather_logits`` (the module computes
its own cross-entropy over ``outputs.logits``), ``mode``, ``ulysses``, ``shard_images``, ``n_images`` (images per
sample, one entry per sample). Rank 0 also writes the attention modes the Ulysses calls ran and, per step, the
images each CP rank encoded.
"""

from __future__ import annotations

import json
import os
import sys

import torch

IMG, VID, VSTART, VEND, PAD = 100, 101, 102, 103, 0
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
QWEN_GRIDS = [(1, 4, 4), (1, 8, 4), (1, 4, 8)]
PATCH_DIM = 3 * 2 * 4 * 4


def tiny_model(kind: str, seed: int = 0):
    """A tiny random HF composite (fp32, eager attention, no dropout), every tensor distinct."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "llava":
        vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, image_size=16, patch_size=8)
        cfg = tf.LlavaConfig(vision_config=vision, text_config=dict(model_type="llama", **TEXT), image_token_id=IMG,
                             vision_feature_layer=-1)  # every vision layer trains (DDP: no unused parameters)
        cls = tf.LlavaForConditionalGeneration
    elif kind == "qwen2_vl":
        text = dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
        vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, patch_size=4, spatial_merge_size=2,
                      temporal_patch_size=2, in_channels=3)
        cfg = tf.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=VID,
                               vision_start_token_id=VSTART, vision_end_token_id=VEND, tie_word_embeddings=False)
        cls = tf.Qwen2VLForConditionalGeneration
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "eager"
    model = cls(cfg)
    with torch.no_grad():  # HF initialises some parts to constants: make every tensor distinct
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def image_tokens(kind: str, k: int) -> int:
    if kind == "llava":
        return 4  # (16 / 8) ** 2 patches, CLS dropped
    t, h, w = QWEN_GRIDS[k % len(QWEN_GRIDS)]
    return t * h * w // 4


def sample(kind: str, i: int, n_images: int | None = None) -> dict:
    """One processor-like output: text, then per image [VSTART, IMG * tokens, VEND] and text; lengths vary."""
    g = torch.Generator().manual_seed(1000 + i)
    n_images = i % 3 if n_images is None else n_images
    ids = torch.randint(1, 90, (2 + i % 4,), generator=g).tolist()
    grids = []
    for k in range(n_images):
        ids += [VSTART] + [IMG] * image_tokens(kind, i + k) + [VEND]
        ids += torch.randint(1, 90, (1 + k,), generator=g).tolist()
        grids.append(QWEN_GRIDS[(i + k) % len(QWEN_GRIDS)])
    ids += torch.randint(1, 90, (3 + i % 2,), generator=g).tolist()
    out = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    if n_images:
        if kind == "llava":
            out["pixel_values"] = torch.randn(n_images, 3, 16, 16, generator=g)
        else:
            out["pixel_values"] = torch.randn(sum(t * h * w for t, h, w in grids), PATCH_DIM, generator=g)
            out["image_grid_thw"] = torch.tensor(grids)
    return out


def unpacked_inputs(kind: str, s: dict) -> dict:
    """The HF call of one sample alone (labels = ids with placeholders ignored; Qwen2-VL's mm_token_type_ids)."""
    ids = s["input_ids"]
    out = dict(s, labels=ids.masked_fill(ids == IMG, -100))
    if kind == "qwen2_vl":
        out["mm_token_type_ids"] = (ids == IMG).int()
    return out


# ------------------------------------------------------------------------------------------- the Lightning run
def main(spec: str, out: str):
    import lightning as L
    from torch.utils.data import DataLoader

    case = json.loads(spec)
    torch.set_num_threads(1)
    kind, cp, steps = case.get("kind", "llava"), case.get("cp", 0), case.get("steps", 2)
    gather = case.get("gather_logits", False)
    max_length = case.get("max_length", 40)

    class Module(L.LightningModule):
        """What a user writes without lightning-mm (use_bitfield_attention aside: packed rows need it)."""

        def __init__(self):
            super().__init__()
            self.model = None if case["strategy"] == "fsdp2" else tiny_model(kind)
            if self.model is not None and not cp:
                from lightning_mm.attention import use_bitfield_attention
                use_bitfield_attention(self.model)

        def configure_model(self):
            if self.model is not None:
                return
            from torch.distributed.fsdp import fully_shard

            self.model = tiny_model(kind)
            if not cp:
                from lightning_mm.attention import use_bitfield_attention
                use_bitfield_attention(self.model)
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.language_model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, batch_idx):
            outputs = self.model(**batch)
            if cp:
                image_shards.append(callbacks[0].last_image_shards)
            if gather:  # the module's own cross-entropy over the logits
                logits, labels = outputs.logits[:, :-1], batch["labels"][:, 1:]
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                         labels.reshape(-1), ignore_index=-100)
            else:
                loss = outputs.loss
            self.log("train_loss", loss, sync_dist=True)
            losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    from lightning_mm.data import PackingCollator

    losses: list[float] = []
    image_shards: list = []  # the images each CP rank encoded, per step (None: every rank encoded all)
    n_images = case.get("n_images") or [None] * case.get("num_samples", 16)
    samples = [sample(kind, i, n) for i, n in enumerate(n_images)]
    config = tiny_model(kind).config
    collate = PackingCollator(config, max_length, num_rows=case.get("rows"))
    callbacks = []
    attention_modes: list[str] = []  # the CP mode each Ulysses attention call ran
    if case.get("mode", "allgather") != "allgather":
        from lightning_mm.attention import ulysses

        run = ulysses.ulysses_attention

        def counted(*args, **kwargs):
            attention_modes.append(args[6].mode)
            return run(*args, **kwargs)

        ulysses.ulysses_attention = counted
    if cp:
        from lightning_mm.trainer.callbacks import ContextParallel

        callbacks.append(ContextParallel(cp, distribution=case.get("distribution", "lpt"),
                                         block_size=case.get("block_size", 8), gather_logits=gather,
                                         mode=case.get("mode", "allgather"), ulysses=case.get("ulysses"),
                                         shard_images=case.get("shard_images", True)))
    if case["strategy"] == "ddp":
        from lightning.pytorch.strategies import DDPStrategy
        strategy = DDPStrategy(process_group_backend="gloo", find_unused_parameters=True)  # CLIP post_layernorm
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy
        strategy = ModelParallelStrategy(data_parallel_size=case["devices"], tensor_parallel_size=1,
                                         process_group_backend="gloo")
    trainer = L.Trainer(accelerator="cpu", devices=case["devices"], strategy=strategy, max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks)
    module = Module()
    loader = DataLoader(samples, batch_size=case.get("batch_size", 4), shuffle=False, collate_fn=collate)
    trainer.fit(module, loader)
    state = module.model.state_dict()
    full = {}
    for n, p in state.items():
        full[n] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
    torch.save(full, os.path.join(out, f"params_{trainer.global_rank}.pt"))
    if trainer.global_rank == 0:
        result = {"train": losses}
        if cp:
            result["work"] = callbacks[0].last_work
            result["attention_modes"] = sorted(set(attention_modes))
            result["image_shards"] = image_shards
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
