"""The planner's encoder cost per item (``metadata.encoder_positions``) counts the positions the tower's layers
really see: an AnyRes image's tiles (the base image included) x a tile's positions, an InternVL image's tiles x a
tile's positions, a video's t*h*w patches; checked against the towers themselves on the processors' real inputs."""

from __future__ import annotations

import pytest
import torch

import lightning_mm as lmm
from lightning_mm.data.cp_plans import EncoderItems, make_cp_plans
from lightning_mm.data.metadata import encoder_input_tokens, encoder_positions, metadata_of
from lightning_mm.plan.items import item_work, shard_items
from lightning_mm.planner.data_stats import microbatch_items
from lightning_mm.planner.workload import WorkloadModel
from tests.test_tile_composites import KINDS, samples_for, save_composite
from tests.test_video_models import mixed_batch


def _seen(enc, inputs) -> list[int]:
    """Per item, the positions the tower's first layer gets (each item encoded alone; ``[..., S, d]`` or
    ``[S, d]`` hidden states)."""
    seen = []
    hook = enc.layers[0].register_forward_pre_hook(lambda _, args: seen.append(args[0].numel() // args[0].shape[-1]))
    try:
        with torch.no_grad():
            for i in range(enc.family.num_items(inputs)):
                enc(enc.family.select_items(inputs, torch.tensor([i])))
    finally:
        hook.remove()
    return seen


@pytest.mark.parametrize("kind", KINDS)
def test_tiled_images_count_the_positions_their_tower_runs(kind, tmp_path):
    model = lmm.MultimodalModel.from_pretrained(save_composite(kind, tmp_path / "src"))
    samples = samples_for(kind)
    batch = lmm.data.MultimodalCollator(model)(samples)
    enc, inputs = model.encoders["vision"], batch["vision"]
    positions, emitted = encoder_positions(enc, inputs), enc.num_tokens(inputs)
    assert positions == _seen(enc, inputs), (positions, emitted)
    if kind == "internvl":  # the pixel shuffle folds 4 positions into a token; the class token is dropped
        assert all(p > 4 * n for p, n in zip(positions, emitted))
    else:  # packing unpads the tile grid: fewer tokens emitted than run (or a newline more for an untiled image)
        assert any(p > n for p, n in zip(positions, emitted)) and positions != emitted
        assert positions != [encoder_input_tokens(enc, n) for n in emitted]
    # every planner reads the same count: sample metadata, the data statistics, encoder CP's shards
    per_sample = [p for s in samples for p, _ in metadata_of(s, model).items["vision"]]
    assert per_sample == positions
    workload = WorkloadModel.from_model(model)
    assert [t for t, _, _ in microbatch_items(model, workload, batch)["vision"]] == positions
    planner = EncoderItems.of(enc, 2)
    shards, tokens = planner.plan(inputs)
    assert tokens == emitted and shards == shard_items(item_work(positions, planner.width), 2)
    plans = make_cp_plans(batch, 1, {"vision": planner})
    assert plans.items["vision"] == [(shards, tokens)]


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_videos_count_their_t_h_w_patches(kind, tmp_path):
    from tests.test_hf_composites import save_composite as save_mrope

    model = lmm.MultimodalModel.from_pretrained(save_mrope(kind, tmp_path / "src"))
    batch, _ = mixed_batch(kind)
    for name in ("vision", "video"):
        enc, inputs = model.encoders[name], batch[name]
        grids = inputs["video_grid_thw" if name == "video" else "image_grid_thw"].tolist()
        positions = encoder_positions(enc, inputs)
        assert positions == [t * h * w for t, h, w in grids] == _seen(enc, inputs)
        assert positions == [encoder_input_tokens(enc, n) for n in enc.num_tokens(inputs)]
    # encoder CP spreads a video's temporal patches: each piece runs h*w patches
    planner = EncoderItems.of(model.encoders["video"], 2)
    shards, tokens = planner.plan(batch["video"])
    pieces = [h * w for t, h, w in batch["video"]["video_grid_thw"].tolist() for _ in range(t)]
    assert tokens == [p // 4 for p in pieces] and shards == shard_items(item_work(pieces, planner.width), 2)
