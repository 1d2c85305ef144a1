"""Conversation data with video: PyAV headers and decoding, frame sampling by fps within max_frames / max_pixels,
the Qwen2-VL video processor's outputs, header-only token counts, and bad video files named with their record.

Videos are written here with PyAV (random RGB frames); the processor folder is built from configs."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen2VLImageProcessor

av = pytest.importorskip("av")

import lightning_mm as lmm
from lightning_mm.data import BadRecordError, ConversationDataModule, MultimodalCollator
from lightning_mm.data import video as video_mod
from lightning_mm.data.metadata import metadata_of
from lightning_mm.data.video import (Qwen2VLVideoProcessorPil, VideoOptions, VideoProcessor, frame_indices,
                                     read_header)
from lightning_mm.model import tiny_encoder, tiny_language_model
from tests.test_conversation_data import conv, make_processor, write_data

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None
VIDEO_CONFIG = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 4, "merge_size": 2,
                "temporal_patch_size": 2, "size": {"shortest_edge": 16 * 16, "longest_edge": 48 * 64}}
CODEC = "libx264" if "libx264" in av.codecs_available else "mpeg4"


def write_video(path: Path, frames: int = 10, height: int = 32, width: int = 48, rate: int = 5,
                codec: str = "mpeg4", seed: int = 0, same: bool = False) -> Path:
    """A video of random RGB frames (``same``: one frame repeated), written with PyAV."""
    rng = np.random.default_rng(seed)
    first = (rng.random((height, width, 3)) * 255).astype(np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            img = first if same else (rng.random((height, width, 3)) * 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def all_frames(path: Path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def video_model(seed: int = 0):
    """A Qwen2-VL tower read as images ("vision") and as videos ("video"): one tower and projector, shared."""
    families = pytest.importorskip("lightning_mm.model.families")
    if not hasattr(families, "VideoInputs"):
        pytest.skip("the model has no video modality yet")
    torch.manual_seed(seed)
    tower, llm = tiny_encoder("qwen2_vl"), tiny_language_model("llama", vocab_size=64)
    vision = lmm.ModalityEncoder(tower, projector=torch.nn.Linear(tower.config.hidden_size, llm.config.hidden_size))
    video = lmm.ModalityEncoder(tower, projector=vision.projector)
    video.family = families.VideoInputs(vision.family)
    return lmm.MultimodalModel({"vision": vision, "video": video}, llm)


def video_processor_folder(folder: Path, processor_class: str | None = None, **video_config) -> Path:
    """Tokenizer + Qwen2-VL image processor + video processor config (written as JSON: transformers' video
    processor classes need torchvision to be built)."""
    make_processor(folder)
    Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16,
                          max_pixels=32 * 32).save_pretrained(folder)
    (folder / "video_preprocessor_config.json").write_text(json.dumps({**VIDEO_CONFIG, **video_config}))
    if processor_class:
        (folder / "processor_config.json").write_text(json.dumps({"processor_class": processor_class}))
    return folder


def write_videos(media: Path) -> None:
    media.mkdir(parents=True, exist_ok=True)
    write_video(media / "clip.mp4")                                              # 2 s at 5 fps, 48x32
    write_video(media / "long.mkv", frames=30, height=40, width=40, rate=10, codec=CODEC, seed=1)  # 3 s
    write_video(media / "wide.mp4", frames=7, height=16, width=96, rate=7, seed=2)  # 1 s, 6:1
    (media / "broken.mp4").write_bytes(np.random.default_rng(0).bytes(2000))


MIXED = [
    {"id": "image", "image": "red.png", "conversations": conv("<image> what is this", "a red square")},
    {"id": "video", "video": "clip.mp4", "conversations": conv("<video> what is this", "a blue circle")},
    {"id": "both", "image": "blue.png", "video": ["long.mkv", "wide.mp4"],
     "conversations": conv("<video> and <image> then <video> what is this", "a red square", "say more", "no")},
    {"id": "no marker", "video": "wide.mp4", "conversations": conv("what is this", "a square")},
]


def dataset(tmp_path, records, proc_dir, model=None, **kw):
    root = tmp_path / f"data{len(list(tmp_path.glob('data*')))}"
    path = write_data(root, records)
    write_videos(root / "media")
    kw.setdefault("shuffle", False)
    dm = ConversationDataModule(str(path), str(root / "media"), str(proc_dir), model=model or video_model(),
                                batch_size=len(records), cache_dir=str(tmp_path / "cache"), **kw)
    dm.setup("fit")
    return dm


# ------------------------------------------------------------------------------------------ headers and sampling
def test_header_and_frame_indices_by_fps_within_max_frames(tmp_path):
    for name, codec in (("a.mp4", "mpeg4"), ("b.mkv", CODEC)):
        meta = read_header(write_video(tmp_path / name, codec=codec))
        assert (meta.total_num_frames, meta.fps, meta.width, meta.height, meta.duration) == (10, 5.0, 48, 32, 2.0)
    assert frame_indices(meta, fps=2, max_frames=32).tolist() == [0, 2, 5, 7]  # 2 s x 2 fps, evenly
    assert frame_indices(meta, fps=2, max_frames=3).tolist() == [0, 3, 6]     # capped, still over the whole video
    assert frame_indices(meta, fps=0.1, max_frames=32).tolist() == [0]        # at least one frame
    assert frame_indices(meta, fps=50, max_frames=32).tolist() == list(range(10))  # never more than the video has
    with pytest.raises(ValueError, match="unknown video options \\['frames'\\]"):
        VideoOptions.of({"frames": 8})
    with pytest.raises(ValueError, match="max_frames >= 1"):
        VideoOptions.of({"max_frames": 0})


def test_read_decodes_the_sampled_frames(tmp_path):
    path = write_video(tmp_path / "v.mp4", frames=12, rate=6)
    proc = VideoProcessor(Qwen2VLVideoProcessorPil(VIDEO_CONFIG), {"fps": 1.5, "max_frames": 32})
    video = proc.read(path)
    assert video.metadata.frames_indices.tolist() == [0, 4, 8]
    np.testing.assert_array_equal(video.frames, all_frames(path)[[0, 4, 8]])
    assert video.metadata.sampled_fps == pytest.approx(1.5)


# ------------------------------------------------------------------------------------------ the video processor
def test_pil_video_processor_is_qwen2_vl_image_processing_per_frame(tmp_path):
    """A video of one repeated frame: every temporal patch of it is what HF's image processor makes of that frame
    (which repeats a single image over the temporal patch); the grid is HF's video grid."""
    path = write_video(tmp_path / "same.mp4", frames=4, height=30, width=50, same=True)
    frames = all_frames(path)
    out = Qwen2VLVideoProcessorPil(VIDEO_CONFIG)([frames])
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

    rh, rw = smart_resize(30, 50, factor=8, min_pixels=16 * 16, max_pixels=48 * 64)
    assert out["video_grid_thw"].tolist() == [[2, rh // 4, rw // 4]]
    image = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16,
                                     max_pixels=48 * 64)(images=[frames[0]], return_tensors="pt")
    assert out["pixel_values_videos"].shape == (2 * image["pixel_values"].shape[0], 3 * 2 * 4 * 4)
    for t in range(2):  # each frame decodes to the same pixels (one repeated frame, the same codec state)
        chunk = out["pixel_values_videos"][t * (rh // 4) * (rw // 4):(t + 1) * (rh // 4) * (rw // 4)]
        assert torch.allclose(chunk, image["pixel_values"], atol=2 / 255 / 0.26)  # a codec step of difference


def test_pil_video_processor_pads_time_and_lays_out_patches_as_hf():
    """Three distinct frames: padded with the last to 4 (temporal patch 2); each temporal patch holds its two
    frames' patches along its temporal axis, in HF's (t, h-blocks, w-blocks, merge, merge) order."""
    rng = np.random.default_rng(0)
    frames = (rng.random((3, 16, 16, 3)) * 255).astype(np.uint8)
    proc = Qwen2VLVideoProcessorPil({**VIDEO_CONFIG, "do_resize": False, "do_normalize": False,
                                     "rescale_factor": 1.0})
    out = proc([frames])
    assert out["video_grid_thw"].tolist() == [[2, 4, 4]]
    # HF's Qwen2VLVideoProcessor.patchify, written out on [1, T, C, H, W]
    x = torch.from_numpy(np.concatenate([frames, frames[-1:]])).permute(0, 3, 1, 2).float()[None]
    ref = x.view(1, 2, 2, 3, 2, 2, 4, 2, 2, 4).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9).reshape(32, 96)
    torch.testing.assert_close(out["pixel_values_videos"], ref, rtol=0, atol=0)


@pytest.mark.skipif(not HAS_TORCHVISION, reason="transformers' video processors need torchvision")
def test_video_processor_outputs_equal_hf_video_processor(tmp_path):
    from transformers import Qwen2VLVideoProcessor

    hf = Qwen2VLVideoProcessor(**{k: v for k, v in VIDEO_CONFIG.items() if k != "video_processor_type"})
    for path in (write_video(tmp_path / "a.mp4"), write_video(tmp_path / "b.mp4", frames=7, height=16, width=96)):
        for proc in (VideoProcessor(hf, {"fps": 3}), VideoProcessor(Qwen2VLVideoProcessorPil(VIDEO_CONFIG),
                                                                    {"fps": 3})):
            video = proc.read(path)
            ours = proc([video])
            ref = hf(videos=[video.frames], do_sample_frames=False, return_tensors="pt")
            assert ours["video_grid_thw"].tolist() == ref["video_grid_thw"].tolist()
            assert ours["pixel_values_videos"].shape == ref["pixel_values_videos"].shape
            if proc.processor is hf:
                torch.testing.assert_close(ours["pixel_values_videos"], ref["pixel_values_videos"])


def test_max_pixels_narrows_the_processors_budget_and_seconds_per_grid(tmp_path):
    path = write_video(tmp_path / "v.mp4", frames=10, height=64, width=96, rate=5)
    wide = VideoProcessor(Qwen2VLVideoProcessorPil(VIDEO_CONFIG), {"fps": 2})([VideoProcessor(
        Qwen2VLVideoProcessorPil(VIDEO_CONFIG), {"fps": 2}).read(path)])
    small = VideoProcessor(Qwen2VLVideoProcessorPil(VIDEO_CONFIG), {"fps": 2, "max_pixels": 24 * 32},
                           seconds_per_grid=True)
    out = small([small.read(path)])
    (t, h, w), = out["video_grid_thw"].tolist()
    assert (h * 4) * (w * 4) <= 24 * 32 < wide["video_grid_thw"][0, 1:].prod() * 16
    assert t == 2 and out["pixel_values_videos"].shape[0] == t * h * w
    assert out["second_per_grid_ts"].tolist() == [pytest.approx(2 / 2.0)]  # temporal patch 2 / 2 sampled fps


# ------------------------------------------------------------------------------------------ conversation data
@pytest.fixture(scope="module")
def video_proc_dir(tmp_path_factory):
    return video_processor_folder(tmp_path_factory.mktemp("video_processor"))


def test_conversations_mixing_images_and_videos(tmp_path, video_proc_dir):
    dm = dataset(tmp_path, MIXED, video_proc_dir, video={"fps": 2, "max_frames": 4})
    ds, model = dm.train_dataset, dm.model
    img, vid = model.placeholder_ids["vision"], model.placeholder_ids["video"]
    media = Path(dm.hparams.media_root)
    samples = [ds[i] for i in range(len(MIXED))]
    assert "video" not in samples[0] and samples[0]["vision"]["image_grid_thw"].shape == (1, 3)
    for s, placeholders in zip(samples, ([img], [vid], [vid, img, vid], [vid])):
        ids = s["input_ids"].tolist()
        assert [t for t in ids if t in (img, vid)] == placeholders  # one placeholder per item, in order
    proc = ds.processor.processors["video"]
    for s, files in ((samples[1], ["clip.mp4"]), (samples[2], ["long.mkv", "wide.mp4"]), (samples[3], ["wide.mp4"])):
        assert set(s["video"]) == {"pixel_values_videos", "video_grid_thw"}
        ref = proc([proc.read(media / f) for f in files])  # the same frames through the processor directly
        torch.testing.assert_close(s["video"]["pixel_values_videos"], ref["pixel_values_videos"], rtol=0, atol=0)
        assert s["video"]["video_grid_thw"].tolist() == ref["video_grid_thw"].tolist()
    assert samples[2]["video"]["video_grid_thw"][0, 0] == 2  # 3 s x 2 fps = 6 frames, capped at 4: 2 patches
    batch = MultimodalCollator(model)(samples)
    for name, pid in (("vision", img), ("video", vid)):
        tokens = sum(sum(model.encoders[name].num_tokens(s[name])) for s in samples if name in s)
        assert int((batch["input_ids"] == pid).sum()) == tokens


def test_qwen2_5_vl_folder_adds_seconds_per_grid(tmp_path):
    proc_dir = video_processor_folder(tmp_path / "proc", processor_class="Qwen2_5_VLProcessor")
    dm = dataset(tmp_path, MIXED[1:2], proc_dir, video={"fps": 2})
    s = dm.train_dataset[0]
    assert s["video"]["second_per_grid_ts"].tolist() == [pytest.approx(1.0)]  # 4 of 10 frames at 5 fps: 2 fps
    assert dm.train_dataset.sample_metadata(0) == metadata_of(s, dm.model)


@pytest.mark.parametrize("options", [{"fps": 2, "max_frames": 4}, {"fps": 10, "max_frames": 32},
                                     {"fps": 1, "max_pixels": 20 * 20}, {"fps": 3, "max_frames": 5}])
def test_sample_metadata_counts_the_tokens_of_the_decoded_sample_from_headers(tmp_path, video_proc_dir, options,
                                                                             monkeypatch):
    dm = dataset(tmp_path, MIXED, video_proc_dir, video=options)
    ds, model = dm.train_dataset, dm.model
    with monkeypatch.context() as m:  # headers only: decoding a frame fails the test
        m.setattr(video_mod, "decode_frames", lambda *a: pytest.fail("sample_metadata decoded frames"))
        metas = [ds.sample_metadata(i) for i in range(len(ds))]
    for i, meta in enumerate(metas):
        assert meta == metadata_of(ds[i], model)
        assert meta.llm_tokens == len(MultimodalCollator(model)([ds[i]])["input_ids"][0])


def test_missing_and_broken_videos_are_named_with_their_record(tmp_path, video_proc_dir):
    records = MIXED[:2] + [{"id": "gone", "video": "gone.mp4", "conversations": conv("<video> what", "a square")}]
    with pytest.raises(BadRecordError, match=r"record 2 of .*train.json: media file .*gone.mp4 not found"):
        dataset(tmp_path, records, video_proc_dir)  # the scan at setup, as for images
    ds = dataset(tmp_path, records, video_proc_dir, scan=False).train_dataset
    with pytest.raises(BadRecordError, match=r"record 2 of .*train.json: media file .*gone.mp4 not found"):
        ds[2]
    records[2]["video"] = "broken.mp4"
    ds = dataset(tmp_path, records, video_proc_dir).train_dataset  # exists: found bad only when loaded
    with pytest.raises(BadRecordError, match=r"record 2 of .*train.json: cannot read video file .*broken.mp4 "
                                             r"\(InvalidDataError"):
        ds[2]
    with pytest.raises(BadRecordError, match=r"record 2 of .*: cannot read the video header of .*broken.mp4"):
        ds.sample_metadata(2)
    skip = dataset(tmp_path, records, video_proc_dir, on_bad_record="skip").train_dataset
    assert skip[2]["input_ids"].tolist() == skip[0]["input_ids"].tolist() and skip.num_bad_records == 1


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_vl_composite_takes_the_samples(tmp_path, kind):
    """A Qwen-VL composite folder: videos take its ``video_token_id`` placeholder, the mixed batch (Qwen2.5-VL's
    seconds per grid included) runs forward and backward, and the metadata counts its expanded lengths."""
    from tests.test_hf_composites import save_composite

    model = lmm.MultimodalModel.from_pretrained(save_composite(kind, tmp_path / kind))
    if "video" not in model.encoders:
        pytest.skip("the composite has no video modality yet")
    assert model.placeholder_ids["video"] == model_config_video_token(tmp_path / kind)
    proc_dir = video_processor_folder(tmp_path / "proc", "Qwen2_5_VLProcessor" if kind == "qwen2_5_vl" else None)
    ds = dataset(tmp_path, MIXED, proc_dir, model=model, video={"fps": 2, "max_frames": 4}).train_dataset
    samples = [ds[i] for i in range(len(ds))]
    assert ("second_per_grid_ts" in samples[1]["video"]) == (kind == "qwen2_5_vl")
    loss = model(**MultimodalCollator(model)(samples)).loss
    loss.backward()
    assert torch.isfinite(loss)
    for i, s in enumerate(samples):
        assert ds.sample_metadata(i).llm_tokens == len(MultimodalCollator(model)([s])["input_ids"][0])


def model_config_video_token(folder: Path) -> int:
    return json.loads((folder / "config.json").read_text())["video_token_id"]


# ------------------------------------------------------------------------------------------ LLaVA-OneVision videos
def test_onevision_video_processor_is_clip_image_processing_per_frame(tmp_path):
    """Every frame resized, rescaled and normalised as HF's CLIP image processor does to one image (the same
    transforms LlavaOnevisionVideoProcessor applies), stacked ``[videos, frames, C, H, W]``; exactly ``max_frames``
    frames per video, repeated for a short one."""
    from transformers import CLIPImageProcessor

    from lightning_mm.data.video import OneVisionVideoProcessorPil, fixed_frame_indices

    config = {"video_processor_type": "LlavaOnevisionVideoProcessor", "size": {"height": 16, "width": 16}}
    proc = VideoProcessor(OneVisionVideoProcessorPil(config), {"max_frames": 4})
    assert proc.fixed_frames
    long, short = write_video(tmp_path / "long.mp4"), write_video(tmp_path / "short.mp4", frames=3, seed=1)
    videos = [proc.read(long), proc.read(short)]
    assert [v.metadata.frames_indices.tolist() for v in videos] == [[0, 3, 6, 9], [0, 1, 1, 2]]
    np.testing.assert_array_equal(videos[1].frames, all_frames(short)[[0, 1, 1, 2]])
    out = proc(videos)["pixel_values_videos"]
    assert out.shape == (2, 4, 3, 16, 16)
    clip = CLIPImageProcessor(size={"height": 16, "width": 16}, do_center_crop=False, resample=3)
    ref = clip(images=list(videos[0].frames), return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(out[0], ref, rtol=0, atol=1e-5)
    assert fixed_frame_indices(read_header(long), 1).tolist() == [0]
    with pytest.raises(ValueError, match="videos of \\[3, 4\\] frames in one call"):
        OneVisionVideoProcessorPil(config)([videos[0].frames, videos[0].frames[:3]])


def test_onevision_conversation_with_videos_equals_hf(tmp_path):
    """A LLaVA-OneVision folder's conversation data with an image and videos decoded (no torchvision: the numpy
    processor): counted from headers as encoded, and the model's loss on the batch equals HF's."""
    from PIL import Image

    from tests.test_hf_composites import assert_like_hf
    from tests.test_tile_composites import VID, image_processor, load_hf, save_composite

    folder = save_composite("llava_onevision", tmp_path / "model")
    proc_dir = make_processor(tmp_path / "processor")
    image_processor("llava_onevision").save_pretrained(proc_dir)
    (proc_dir / "video_preprocessor_config.json").write_text(json.dumps(
        {"video_processor_type": "LlavaOnevisionVideoProcessor", "size": {"height": 16, "width": 16}}))
    root = tmp_path / "data"
    write_videos(root / "media")
    Image.fromarray((np.random.default_rng(2).random((20, 40, 3)) * 255).astype(np.uint8)).save(
        root / "media" / "a.png")
    records = [{"image": "a.png", "video": "clip.mp4", "conversations": conv("<image> <video> what is this", "a")},
               {"video": "wide.mp4", "conversations": conv("<video> what is this", "a red square")}]
    model = lmm.MultimodalModel.from_pretrained(folder).train()
    dm = ConversationDataModule(str(write_data(root, records)), str(root / "media"), str(proc_dir), model=model,
                                batch_size=2, shuffle=False, cache_dir=str(tmp_path / "cache"),
                                video={"max_frames": 3})
    dm.setup("fit")
    samples = [dm.train_dataset[i] for i in range(2)]
    assert [dm.train_dataset.sample_metadata(i) for i in range(2)] == [metadata_of(s, model) for s in samples]
    batch = dm.collator()(samples)
    assert batch["video"]["pixel_values_videos"].shape == (2, 3, 3, 16, 16)
    assert (batch["input_ids"] == VID).sum() == 2 * (3 * 2 * 2 + 1)  # frames x pooled 2 x 2, a newline each
    hf_inputs = {**batch["vision"], "pixel_values_videos": batch["video"]["pixel_values_videos"],
                 "input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                 "labels": batch["labels"]}
    assert_like_hf(model, load_hf("llava_onevision", folder).train(), model.composite.spec, batch, hf_inputs,
                   logits_atol=1e-5)
