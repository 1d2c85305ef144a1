"""Tiled-image composites (LLaVA-NeXT, LLaVA-OneVision: AnyRes; InternVL: tiles) through
``MultimodalModel.from_pretrained`` against the HF composite class itself, and ``save_pretrained`` back.

Each folder is written by ``save_pretrained`` from a tiny random composite built from a config (nothing is
downloaded). Samples are what the family's own HF image processor returns for the sample's images (one placeholder
per image); the collator expands them (token counts from image sizes / tile counts) and pads. The batch holds two
rows with different numbers of images of different sizes (aspect ratios / tile counts) and right padding; loss,
logits and gradients must equal HF's model on HF's batch (the processor run on all the batch's images).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import lightning_mm as lmm
from tests.helpers.composite_case import run_case
from tests.test_hf_composites import assert_like_hf, save_hf

IMG, PAD, VID = 100, 0, 101
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
PINPOINTS = [[16, 32], [32, 16], [32, 32], [16, 48], [48, 16]]
CLASSES = {"llava_next": "LlavaNextForConditionalGeneration",
           "llava_onevision": "LlavaOnevisionForConditionalGeneration", "internvl": "InternVLForConditionalGeneration"}
KINDS = list(CLASSES)
# (width, height) per image; row 0 holds two images, row 1 one
SIZES = {"llava_next": [[(40, 20), (17, 33)], [(30, 30)]],
         "llava_onevision": [[(40, 20), (17, 33)], [(45, 16)]],
         "internvl": [[(40, 20), (16, 16)], [(20, 50)]]}


def tiny_composite(kind: str, **extra):
    import transformers as tf

    if kind == "llava_next":
        vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, image_size=16, patch_size=4)
        cfg = tf.LlavaNextConfig(vision_config=vision, text_config=dict(model_type="llama", **TEXT),
                                 image_token_id=IMG, image_grid_pinpoints=PINPOINTS, **extra)
        return tf.LlavaNextForConditionalGeneration(cfg)
    if kind == "llava_onevision":
        vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, image_size=16, patch_size=4)
        extra = {"vision_aspect_ratio": "anyres_max_1", **extra}  # interpolates the larger images' grids
        cfg = tf.LlavaOnevisionConfig(vision_config=vision, text_config=dict(model_type="qwen2", **TEXT),
                                      image_token_id=IMG, video_token_id=VID, image_grid_pinpoints=PINPOINTS, **extra)
        return tf.LlavaOnevisionForConditionalGeneration(cfg)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=[16, 16], patch_size=[4, 4])
    cfg = tf.InternVLConfig(vision_config=vision, text_config=dict(model_type="qwen2", **TEXT), image_token_id=IMG,
                            downsample_ratio=0.5, **extra)
    return tf.InternVLForConditionalGeneration(cfg)


def image_processor(kind: str):
    import transformers as tf

    if kind == "llava_next":
        return tf.LlavaNextImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                                          image_grid_pinpoints=PINPOINTS)
    if kind == "llava_onevision":
        return tf.LlavaOnevisionImageProcessor(size={"height": 16, "width": 16}, image_grid_pinpoints=PINPOINTS)
    return tf.GotOcr2ImageProcessor(size={"height": 16, "width": 16}, crop_to_patches=True, min_patches=1,
                                    max_patches=4)


def save_composite(kind: str, path, **extra) -> str:
    torch.manual_seed(0)
    return save_hf(tiny_composite(kind, **extra), kind, path)


def images(kind: str) -> list[list]:
    from PIL import Image

    rng = np.random.default_rng(0)
    return [[Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in row]
            for row in SIZES[kind]]


def encode(kind: str, proc, imgs: list) -> dict:
    """What the image processor returns for one sample's images (OneVision: one sample of several images)."""
    out = proc(images=[imgs] if kind == "llava_onevision" else imgs, return_tensors="pt")
    keep = ("pixel_values", "image_sizes", "batch_num_images", "num_patches")
    return {k: torch.as_tensor(v) for k, v in out.items() if k in keep}


def samples_for(kind: str) -> list[dict]:
    proc, rows = image_processor(kind), images(kind)
    g = torch.Generator().manual_seed(3)
    out = []
    for r, imgs in enumerate(rows):
        ids = torch.randint(1, 90, (4 + r,), generator=g).tolist()
        for _ in imgs:
            ids += [IMG] + torch.randint(1, 90, (3,), generator=g).tolist()
        out.append({"input_ids": torch.tensor(ids + [7, 8]), "vision": encode(kind, proc, imgs)})
    return out


def hf_inputs_for(kind: str, batch: dict) -> dict:
    """HF's batch: the processor on every image of the batch at once, the collated token rows."""
    proc, rows = image_processor(kind), images(kind)
    if kind == "llava_onevision":
        out = proc(images=rows, return_tensors="pt")
    else:
        out = proc(images=[img for row in rows for img in row], return_tensors="pt")
    kw = {k: out[k] for k in ("pixel_values", "image_sizes", "batch_num_images") if k in out}
    return dict(kw, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])


def load_hf(kind, path):
    import transformers

    return getattr(transformers, CLASSES[kind]).from_pretrained(path, attn_implementation="eager")


@pytest.mark.parametrize("kind", KINDS)
def test_loss_logits_gradients_and_round_trip_equal_hf(kind, tmp_path):
    folder = save_composite(kind, tmp_path / "src")
    ref = load_hf(kind, folder).train()
    model = lmm.MultimodalModel.from_pretrained(folder).train()
    spec = model.composite.spec
    videos = {"video": VID} if kind == "llava_onevision" else {}  # its videos run the same tower
    assert spec.class_name == CLASSES[kind] and model.placeholder_ids == {"vision": IMG, **videos}

    samples = samples_for(kind)
    batch = lmm.data.MultimodalCollator(model)(samples)
    hf_inputs = hf_inputs_for(kind, batch)
    # the token counts come from the processor's keys alone (sizes, tiles), before any encoder runs
    counts = [n for s in samples for n in model.encoders["vision"].num_tokens(s["vision"])]
    assert int((batch["input_ids"] == IMG).sum()) == sum(counts)
    if kind == "llava_onevision":  # a sample of several images: each its base tile and a newline, untiled
        base = (16 // 4) ** 2 + 1
        assert counts[:2] == [base, base] and counts[2] > base, counts
    else:
        assert len(set(counts)) == len(counts), counts  # every image its own count (sizes / tiles differ)
    assert batch["attention_mask"][1].sum() < batch["attention_mask"][0].sum()  # row 1 is padded

    assert_like_hf(model, ref, spec, batch, hf_inputs, logits_atol=1e-4)
    if kind != "internvl":
        assert "encoders.vision.projector.image_newline" in dict(model.named_parameters())

    # save_pretrained -> the HF class loads exactly the tensors it was built from, and the processor file
    out_dir = tmp_path / "out"
    model.save_pretrained(out_dir)
    assert (out_dir / "preprocessor_config.json").read_text() == json.dumps({"kind": kind})
    back = load_hf(kind, out_dir).state_dict()
    original = load_hf(kind, folder).state_dict()
    assert back.keys() == original.keys()
    for name, value in original.items():
        assert back[name].dtype == value.dtype and torch.equal(back[name], value), name
    again = lmm.MultimodalModel.from_pretrained(out_dir)
    for (n, a), (m, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert n == m and torch.equal(a, b), n


@pytest.mark.parametrize("kind", KINDS)
def test_generate_gives_hf_greedy_tokens(kind, tmp_path):
    """Greedy decoding from the collated prompts equals the HF class's own ``generate`` on the same prompts
    (left-padded, as batched HF decoding takes them)."""
    from lightning_mm.model.generation import left_align

    folder = save_composite(kind, tmp_path / "src")
    ref = load_hf(kind, folder).eval()
    model = lmm.MultimodalModel.from_pretrained(folder).eval()
    batch = lmm.data.MultimodalCollator(model)(samples_for(kind))
    hf_inputs = hf_inputs_for(kind, batch)
    ids, mask = left_align(batch["input_ids"], attention_mask=batch["attention_mask"])
    hf_inputs.update(input_ids=ids, attention_mask=mask)
    hf_inputs.pop("labels")
    with torch.no_grad():
        theirs = ref.generate(**hf_inputs, max_new_tokens=6, do_sample=False, pad_token_id=PAD)[:, ids.shape[1]:]
        ours = model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    assert torch.equal(ours, theirs), (ours, theirs)


def test_samples_whose_processor_outputs_do_not_match_their_placeholders_are_named(tmp_path):
    folder = save_composite("llava_next", tmp_path / "next")
    model = lmm.MultimodalModel.from_pretrained(folder)
    collate = lmm.data.MultimodalCollator(model)
    good, two = samples_for("llava_next")[1], samples_for("llava_next")[0]
    wrong = {"input_ids": two["input_ids"], "vision": good["vision"]}  # two placeholders, one image
    with pytest.raises(ValueError, match=r"sample 1 of the batch: modality 'vision': the sample has 2 placeholder "
                                         r"tokens .* but 1 items"):
        collate([good, wrong])
    v = two["vision"]
    torn = {"input_ids": two["input_ids"], "vision": {**v, "image_sizes": torch.cat([v["image_sizes"]] * 2)}}
    with pytest.raises(ValueError, match=r"sample 0 of the batch: .*placeholder tokens .* but 4 items"):
        collate([torn])
    torn = {"input_ids": good["input_ids"], "vision": {**v, "image_sizes": v["image_sizes"][:1]}}
    with pytest.raises(ValueError, match=r"sample 0 of the batch: LLaVA-NeXT: pixel_values \(2, \d+, 3, 16, 16\) "
                                         r"do not match image_sizes of 1 images"):
        collate([torn])

    folder = save_composite("internvl", tmp_path / "internvl")
    model = lmm.MultimodalModel.from_pretrained(folder)
    sample = samples_for("internvl")[0]
    tiles = sample["vision"]["num_patches"].tolist()
    bad = {**sample, "vision": {**sample["vision"], "num_patches": torch.tensor([tiles[0] + 1, tiles[1]])}}
    with pytest.raises(ValueError, match=rf"sample 0 of the batch: InternVL: num_patches \[{tiles[0] + 1}, "
                                         rf"{tiles[1]}\] add up to {sum(tiles) + 1} tiles but pixel_values holds "
                                         rf"{sum(tiles)}"):
        lmm.data.MultimodalCollator(model)([bad])

    folder = save_composite("llava_onevision", tmp_path / "ov")
    model = lmm.MultimodalModel.from_pretrained(folder)
    sample = samples_for("llava_onevision")[0]
    bad = {**sample, "vision": {**sample["vision"], "batch_num_images": torch.tensor([3])}}
    with pytest.raises(ValueError, match=r"sample 0 of the batch: LLaVA-OneVision: batch_num_images \[3\] add up "
                                         r"to 3 images but image_sizes holds 2"):
        lmm.data.MultimodalCollator(model)([bad])


@pytest.mark.parametrize("kind", KINDS)
def test_items_and_microbatches_cut_like_the_whole_batch(kind, tmp_path):
    """Any subset of items (encoder CP shards) encodes to those items' features of the whole batch (OneVision's
    per-sample tiling rule kept per item); microbatches of rows sum to the whole batch's loss."""
    from lightning_mm.data.microbatch import split_microbatches

    folder = save_composite(kind, tmp_path / "src")
    model = lmm.MultimodalModel.from_pretrained(folder)
    batch = lmm.data.MultimodalCollator(model)(samples_for(kind))
    enc, inputs = model.encoders["vision"], batch["vision"]
    counts = enc.num_tokens(inputs)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    with torch.no_grad():
        whole = enc(inputs)
        for items in ([2, 0], [1], [0, 1, 2]):
            part = enc.family.select_items(inputs, torch.tensor(items))
            assert enc.num_tokens(part) == [counts[i] for i in items]
            expected = torch.cat([whole[starts[i]:starts[i] + counts[i]] for i in items])
            torch.testing.assert_close(enc(part), expected, atol=1e-5, rtol=1e-5)
        # a rank with no item (encoder CP) projects an empty [0, output_dim] block
        assert enc.projector(torch.zeros(0, enc.output_dim)).shape == (0, model.hidden_size)
        full = model(**{k: v for k, v in batch.items() if k != "item_counts"})
        total = int((batch["labels"] != -100).sum())
        parts = [model(**{k: v for k, v in mb.items() if k != "item_counts"}, num_label_tokens=total).loss
                 for mb in split_microbatches(batch, 2, model)]
    torch.testing.assert_close(sum(parts), full.loss, atol=1e-5, rtol=1e-5)


def _run_case(case: dict, tmp_path, name: str):
    return run_case("tile_case.py", case, tmp_path, name)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_vision_pp1_llm_pp2_trains_like_one_process(kind, tmp_path):
    """Vision one stage, LLM two stages (3 gloo ranks, built lazily: each rank reads its stage), and two replicas of
    that (6 ranks): one process's losses and trained parameters."""
    folder = save_composite(kind, tmp_path / "src")
    ref_losses, ref_params = _run_case({"folder": folder, "kind": kind}, tmp_path, "single")
    assert len(ref_losses) == 3 and ref_losses[-1] < ref_losses[0]
    for name, case in (("pp2", {"llm_pp": 2, "lazy": True}), ("pp2_dp2", {"llm_pp": 2, "dp": 2})):
        losses, params = _run_case({"folder": folder, "kind": kind, **case}, tmp_path, name)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6, msg=name)
        assert set(params) == set(ref_params), name
        for n, p in ref_params.items():
            torch.testing.assert_close(params[n], p, rtol=1e-4, atol=1e-5, msg=f"{name}: {n}")


@pytest.mark.parametrize("kind", KINDS)
def test_sample_metadata_counts_tokens_from_image_headers(kind, tmp_path, monkeypatch):
    """``ConversationDataset.sample_metadata`` gives each image's token count from its header's size (no media
    decoded), equal to what the encoded sample holds."""
    from PIL import Image

    from lightning_mm.data import conversation
    from lightning_mm.data.metadata import metadata_of
    from test_conversation_data import conv, make_processor, write_data

    model = lmm.MultimodalModel.from_pretrained(save_composite(kind, tmp_path / "src"))
    proc_dir = make_processor(tmp_path / "proc")
    if kind == "internvl":  # its processor writes <img> ... </img> around each image's tokens
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(proc_dir)
        tok.add_special_tokens({"additional_special_tokens": ["<img>", "</img>"]})
        tok.save_pretrained(proc_dir)
    image_processor(kind).save_pretrained(proc_dir)
    sizes = [(40, 20), (17, 33), (45, 16)]
    files = [f"im{w}x{h}.png" for w, h in sizes]
    records = [{"image": files[:2], "conversations": conv("<image> and <image> what", "a")},
               {"image": files[2], "conversations": conv("<image> what is this", "a red square")}]
    path = write_data(tmp_path / "data", records)
    media = tmp_path / "data" / "media"
    for w, h in sizes:
        Image.new("RGB", (w, h), (1, 2, 3)).save(media / f"im{w}x{h}.png")
    ds = lmm.data.ConversationDataset(path, lmm.data.load_processor(proc_dir, model), media,
                                      cache_dir=str(tmp_path / "cache"))

    def no_decoding(*args):
        raise AssertionError("sample_metadata decoded a media file")

    with monkeypatch.context() as m:
        m.setattr(conversation, "_load_image", no_decoding)
        metas = [ds.sample_metadata(i) for i in range(len(ds))]
    assert metas == [metadata_of(ds[i], model) for i in range(len(ds))]
    emitted = [n for meta in metas for _, n in meta.items["vision"]]
    assert len(emitted) == 3 and len(set(emitted)) > 1, emitted
    if kind == "internvl":  # a tile: 4 tokens (downsample_ratio 0.5), the tower sees 16 patches + the class token
        assert all(seen == n // 4 * 17 for meta in metas for seen, n in meta.items["vision"])
        framed = ds[1]["item_ids"]["vision"][0].tolist()  # <img> tokens </img>, counted as text
        assert framed == tok.convert_tokens_to_ids(["<img>"]) + [IMG] * emitted[2] + tok.convert_tokens_to_ids(
            ["</img>"])
        assert metas[1].text_tokens == sum(1 for t in ds[1]["input_ids"].tolist() if t != IMG) + 2


@pytest.mark.parametrize("kind", KINDS)
def test_header_inputs_have_the_processors_shapes_and_index_tensors(kind):
    """The processor's output for images of the headers' sizes, without pixels: the same keys and shapes, the same
    ``image_sizes`` / ``batch_num_images`` / ``num_patches``."""
    from PIL import Image

    from lightning_mm.data.media_meta import image_inputs

    proc = image_processor(kind)
    sizes = [(40, 20), (17, 33), (45, 16), (16, 16), (20, 50), (70, 15)]
    got = image_inputs(proc, sizes)
    real = proc(images=[Image.new("RGB", s) for s in sizes], return_tensors="pt")
    keep = ("pixel_values", "image_sizes", "batch_num_images", "num_patches")
    assert set(got) == {k for k in real if k in keep}
    for key, value in got.items():
        assert tuple(value.shape) == tuple(torch.as_tensor(real[key]).shape), key
        if key != "pixel_values":
            assert torch.equal(value, torch.as_tensor(real[key]).long()), key


@pytest.mark.parametrize("kind", KINDS)
def test_lazy_build_on_meta_materialises_to_the_eager_model(kind, tmp_path):
    """Built on the meta device nothing is read (``image_newline`` included); ``materialise`` reads the folder's
    tensors, equal to the eager build."""
    from lightning_mm.model.loading import is_meta, materialise

    folder = save_composite(kind, tmp_path / "src")
    eager = lmm.MultimodalModel.from_pretrained(folder)
    with torch.device("meta"):
        lazy = lmm.MultimodalModel.from_pretrained(folder)
    assert is_meta(lazy)
    materialise(lazy, "cpu", seed=0)
    assert not is_meta(lazy)
    for (n, a), (m, b) in zip(lazy.state_dict().items(), eager.state_dict().items()):
        assert n == m and torch.equal(a, b), n


def test_internvl_images_are_tiled_as_its_hf_processor_tiles_them(tmp_path):
    """InternVL's HF processor calls its image processor with ``crop_to_patches=True`` (the image processor's own
    default is False): ``load_processor`` passes the same, and the header rule counts the same tiles."""
    from PIL import Image
    from transformers import InternVLProcessor

    from lightning_mm.data.conversation import processor_image_kwargs
    from lightning_mm.data.media_meta import image_inputs

    proc = image_processor("internvl")
    proc.crop_to_patches = False  # as InternVL folders save it
    hf = InternVLProcessor.__new__(InternVLProcessor)  # its class-level call arguments only
    kwargs = processor_image_kwargs(hf, proc)
    assert kwargs == {"crop_to_patches": True}
    assert processor_image_kwargs(hf, image_processor("internvl")) == {}  # already the image processor's own
    model = lmm.MultimodalModel.from_pretrained(save_composite("internvl", tmp_path / "src"))
    sizes = [(40, 20), (20, 50), (16, 16)]
    processor = lmm.data.MultimodalProcessor(model, tokenizer=None, processors={"vision": proc},
                                             processor_kwargs={"vision": kwargs})
    real = processor.encode_items("vision", [Image.new("RGB", s) for s in sizes])
    assert real["num_patches"].tolist()[:2] != [1, 1]  # tiled
    header = image_inputs(proc, sizes, processor.call_kwargs("vision"))
    assert torch.equal(header["num_patches"], real["num_patches"].long())
    assert header["pixel_values"].shape == real["pixel_values"].shape


def test_internvl_earlier_feature_layer_equals_hf(tmp_path):
    """``vision_feature_layer=-2``: HF takes that hidden state (no final norm); the tower is cut after it."""
    folder = save_composite("internvl", tmp_path / "src", vision_feature_layer=-2)
    ref = load_hf("internvl", folder)
    model = lmm.MultimodalModel.from_pretrained(folder)
    assert len(model.encoders["vision"].layers) == 1  # of 2
    batch = lmm.data.MultimodalCollator(model)(samples_for("internvl"))
    with torch.no_grad():
        out = model(**{k: v for k, v in batch.items() if k != "item_counts"})
        expected = ref(**hf_inputs_for("internvl", batch))
    keep = batch["attention_mask"].bool()
    torch.testing.assert_close(out.logits[keep], expected.logits[keep], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.loss, expected.loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_synthetic_data_and_the_planners_part_runners_take_tile_composites(kind, tmp_path):
    """The embedded synthetic data set makes tile inputs of random sizes; its batches run through the model and
    through the planner's per-part runners (profiling)."""
    from lightning_mm.planner.model_costs import part_runners

    model = lmm.MultimodalModel.from_pretrained(save_composite(kind, tmp_path / "src"))
    data = lmm.data.SyntheticMultimodalDataset(model, num_samples=4, items_per_sample=(1, 2))
    samples = [data[i] for i in range(4)]
    assert data.sample_metadata(0).items["vision"]
    batch = lmm.data.MultimodalCollator(model)(samples)
    with torch.no_grad():
        assert torch.isfinite(model(**{k: v for k, v in batch.items() if k != "item_counts"}).loss)
    runners = part_runners(model, batch)
    assert runners["vision"] and runners["language_model"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llava_next", "internvl"])
def test_vision_tp2_trains_like_one_process(kind, tmp_path):
    """The vision tower (CLIP's plan; InternViT's) split over 2 tensor-parallel ranks, the LLM on a third."""
    folder = save_composite(kind, tmp_path / "src")
    ref_losses, ref_params = _run_case({"folder": folder, "kind": kind}, tmp_path, "single")
    losses, params = _run_case({"folder": folder, "kind": kind, "vision_tp": 2}, tmp_path, "tp2")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert set(params) == set(ref_params)
    for n, p in ref_params.items():
        torch.testing.assert_close(params[n], p, rtol=1e-4, atol=1e-5, msg=n)


def test_onevision_videos_equal_hf_and_share_the_tower(tmp_path):
    """LLaVA-OneVision's videos (``pixel_values_videos``: frames through the same tower and projector, pooled, a
    newline after each video) in a batch of an image-and-video sample, a video sample and an image sample, collated
    from one placeholder per item: loss, logits and every gradient equal HF's."""
    kind = "llava_onevision"
    folder = save_composite(kind, tmp_path / "src")
    ref = load_hf(kind, folder).train()
    model = lmm.MultimodalModel.from_pretrained(folder).train()
    assert model.shared_encoders == {"video": "vision"} and model.placeholder_ids["video"] == VID
    proc, (first, third) = image_processor(kind), [row[:1] for row in images(kind)]
    g = torch.Generator().manual_seed(5)
    videos = [torch.randn(1, 2, 3, 16, 16, generator=g) for _ in range(2)]
    assert model.encoders["video"].num_tokens({"pixel_values_videos": videos[0]}) == [2 * 2 * 2 + 1]
    text = lambda n: torch.randint(1, 90, (n,), generator=g).tolist()  # noqa: E731
    samples = [{"input_ids": torch.tensor(text(3) + [IMG] + text(2) + [VID] + text(2)),
                "vision": encode(kind, proc, first), "video": {"pixel_values_videos": videos[0]}},
               {"input_ids": torch.tensor(text(4) + [VID] + text(3)), "video": {"pixel_values_videos": videos[1]}},
               {"input_ids": torch.tensor(text(2) + [IMG] + text(5)), "vision": encode(kind, proc, third)}]
    batch = lmm.data.MultimodalCollator(model)(samples)
    out = proc(images=[first, third], return_tensors="pt")
    hf_inputs = {k: out[k] for k in ("pixel_values", "image_sizes", "batch_num_images")}
    hf_inputs.update(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                     pixel_values_videos=torch.cat(videos))
    assert_like_hf(model, ref, model.composite.spec, batch, hf_inputs, logits_atol=1e-5)
