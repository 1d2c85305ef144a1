"""Videos for conversation data: header, frame sampling, decoding and the family's video processor.

A video becomes frames in three steps, each shared by the sample (``VideoProcessor.read`` + ``__call__``) and by
its metadata (``VideoProcessor.header_inputs``), so both count the same tokens:

- ``read_header``: frame count, frame rate, width and height from the container's stream header (PyAV; no frame
  is decoded);
- ``frame_indices``: ``fps`` frames per second of the video's duration, at most ``max_frames``, spread evenly
  (transformers' ``default_sample_indices_fn``);
- ``decode_frames``: those frames, RGB, through transformers' ``load_video`` with its PyAV backend.

The frames then go through the family's HF video processor (``Qwen2VLVideoProcessor`` for Qwen2-VL and
Qwen2.5-VL), which resizes them (``max_pixels`` narrows its own pixel budget, so frames are resized once), and
Qwen2.5-VL's seconds per temporal patch (``second_per_grid_ts``) are added as its HF processor adds them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers.video_utils import VideoMetadata

QWEN2_VL_VIDEO_PROCESSORS = ("Qwen2VLVideoProcessor",)  # also Qwen2.5-VL's video processor
SECONDS_PER_GRID_PROCESSORS = ("Qwen2_5_VLProcessor",)  # HF processors that add ``second_per_grid_ts``
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


@dataclass(frozen=True)
class VideoOptions:
    """How a video is sampled: ``fps`` frames per second of its duration, at most ``max_frames`` (spread evenly
    over the whole video), each frame at most ``max_pixels`` pixels (None: the video processor's own limit)."""

    fps: float = 2.0
    max_frames: int = 32
    max_pixels: int | None = None

    @classmethod
    def of(cls, options) -> "VideoOptions":
        """Options from None, a dict (``{"fps": 2, "max_frames": 32, "max_pixels": 200704}``) or VideoOptions."""
        if isinstance(options, cls):
            return options
        options = dict(options or {})
        unknown = set(options) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown video options {sorted(unknown)}; known: fps, max_frames, max_pixels")
        opts = cls(**options)
        if not opts.fps > 0 or int(opts.max_frames) < 1 or (opts.max_pixels is not None and opts.max_pixels < 1):
            raise ValueError(f"video options need fps > 0, max_frames >= 1 and max_pixels >= 1 (or None), got {opts}")
        return opts


@dataclass
class Video:
    """Decoded frames (``[T, H, W, 3]`` uint8, RGB) and transformers' ``VideoMetadata`` (with ``frames_indices``)."""

    frames: np.ndarray
    metadata: object


# ------------------------------------------------------------------------------------------ header and sampling
def read_header(file) -> VideoMetadata:
    """transformers' ``VideoMetadata`` of ``file`` from its first video stream's header, no frame decoded.

    Our own because transformers' readers decode as they read. A container that does not store its frame count
    (``nb_frames``: WebM, some MKV) gets it from its duration times its frame rate."""
    import av
    from transformers.video_utils import VideoMetadata

    with av.open(str(file)) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.guessed_rate or 0)
        frames = int(stream.frames or 0)
        if not frames:
            seconds = (float(stream.duration * stream.time_base) if stream.duration is not None
                       else (container.duration or 0) / av.time_base)
            frames = int(round(seconds * rate))
        width, height = stream.codec_context.width, stream.codec_context.height
    if frames < 1 or not rate or not width or not height:
        raise ValueError(f"its header gives {frames} frames at {rate} fps, {width}x{height}")
    return VideoMetadata(total_num_frames=frames, fps=rate, width=width, height=height, duration=frames / rate,
                         video_backend="pyav")


def frame_indices(metadata, fps: float, max_frames: int) -> np.ndarray:
    """Indices of the frames to decode: ``fps`` per second of the duration (at least one), at most ``max_frames``,
    evenly spread (transformers' ``default_sample_indices_fn`` with that many frames)."""
    from transformers.video_utils import default_sample_indices_fn

    wanted = max(1, int(metadata.total_num_frames / metadata.fps * fps))
    return default_sample_indices_fn(metadata, num_frames=min(wanted, int(max_frames), metadata.total_num_frames))


def fixed_frame_indices(metadata, num_frames: int) -> np.ndarray:
    """Exactly ``num_frames`` indices spread evenly over the whole video, frames repeated when it has fewer (for a
    family whose inputs stack the videos of a batch frame by frame: LLaVA-OneVision's)."""
    return np.linspace(0, metadata.total_num_frames - 1, int(num_frames)).round().astype(int)


def decode_frames(file, metadata, indices: np.ndarray) -> Video:
    """The frames ``indices`` of ``file`` (``metadata`` from ``read_header``; an index may repeat) through
    transformers' ``load_video`` (PyAV backend); raises when the stream holds fewer frames than its header says."""
    from transformers.video_utils import load_video

    unique, where = np.unique(indices, return_inverse=True)
    frames, meta = load_video(str(file), backend="pyav", sample_indices_fn=lambda **_: unique)
    if len(frames) != len(unique):
        raise ValueError(f"decoded {len(frames)} of the {len(unique)} frames sampled (header: "
                         f"{metadata.total_num_frames} frames)")
    meta.total_num_frames, meta.fps, meta.duration = metadata.total_num_frames, metadata.fps, metadata.duration
    meta.frames_indices = np.asarray(indices)
    return Video(np.asarray(frames)[where], meta)


def fit_pixels(height: int, width: int, max_pixels: int | None) -> tuple[int, int]:
    """(height, width) scaled to at most ``max_pixels`` pixels, aspect kept (unchanged when already under)."""
    if max_pixels is None or height * width <= max_pixels:
        return height, width
    scale = math.sqrt(max_pixels / (height * width))
    return max(1, int(height * scale)), max(1, int(width * scale))


# ------------------------------------------------------------------------------------------ Qwen2-VL's rules
def _smart_resize():
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    except ImportError:  # transformers without the PIL backend module
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
    return smart_resize


def _get(size, key):
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


def qwen2_vl_pixels(proc, max_pixels: int | None) -> tuple[int, int]:
    """(min, max) pixels of a frame for a Qwen2-VL video processor: its ``size``, the max narrowed to
    ``max_pixels``."""
    lo, hi = _get(proc.size, "shortest_edge"), _get(proc.size, "longest_edge")
    if max_pixels is not None:
        hi = min(hi, max_pixels)
        lo = min(lo, hi)
    return lo, hi


def qwen2_vl_frame_size(proc, height: int, width: int, num_frames: int, size: dict) -> tuple[int, int]:
    """The size ``Qwen2VLVideoProcessor.resize`` gives ``num_frames`` frames of (height, width) under ``size``
    (``shortest_edge`` / ``longest_edge`` pixels), its ``cap_pixels_per_frame`` share of ``max_video_tokens``
    included."""
    factor = proc.patch_size * proc.merge_size
    lo, hi = size["shortest_edge"], size["longest_edge"]
    if getattr(proc, "cap_pixels_per_frame", None):
        total = int(proc.max_video_tokens * factor * factor * 0.9)
        hi = max(min(hi, total * proc.temporal_patch_size // num_frames), int(lo * 1.05))
    return _smart_resize()(height, width, factor=factor, min_pixels=lo, max_pixels=hi)


def qwen3_vl_frame_size(proc, height: int, width: int, num_frames: int, size: dict) -> tuple[int, int]:
    """The size ``Qwen3VLVideoProcessor.resize`` gives ``num_frames`` frames of (height, width): its own
    ``smart_resize`` over the whole clip (``longest_edge`` bounds frames x pixels), its ``cap_pixels_per_frame``
    included. A clip of fewer frames than a temporal patch is sized as one patch (HF refuses it; its frames are
    repeated to a whole patch anyway)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    factor, tps = proc.patch_size * proc.merge_size, proc.temporal_patch_size
    frames = max(num_frames, tps)
    hi = size["longest_edge"]
    if getattr(proc, "cap_pixels_per_frame", None):
        hi = max(min(proc.max_video_tokens * factor * factor, size["longest_edge"] // frames),
                 int(size["shortest_edge"] * 1.05)) * frames
    return smart_resize(num_frames=frames, height=height, width=width, factor=factor, temporal_factor=tps,
                        min_pixels=size["shortest_edge"], max_pixels=hi)


class Qwen2VLVideoFrameDefaults:
    """``Qwen2VLVideoProcessor``'s class defaults (read here: that class cannot be imported without torchvision)."""

    size = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}
    do_resize, resample, do_rescale, rescale_factor, do_normalize = True, 3, True, 1 / 255, True
    image_mean, image_std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    do_convert_rgb, patch_size, temporal_patch_size, merge_size = True, 14, 2, 2
    cap_pixels_per_frame, max_video_tokens = None, 128000


def _frame_processor(**kwargs):
    """HF's ``Qwen2VLImageProcessorPil`` resizing every image to ``target`` (the video's frame size) instead of
    its own smart_resize of each image."""
    from transformers.image_processing_backends import PilBackend
    from transformers.image_utils import SizeDict
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class FrameProcessor(Qwen2VLImageProcessorPil):
        target = None

        def resize(self, image, size, resample, factor=None, **kw):
            h, w = self.target
            return PilBackend.resize(self, image, SizeDict(height=h, width=w), resample=resample)

    return FrameProcessor(**kwargs)


class Qwen3VLVideoFrameDefaults(Qwen2VLVideoFrameDefaults):
    """``Qwen3VLVideoProcessor``'s class defaults."""

    size = {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}
    image_mean, image_std, patch_size, max_video_tokens = [0.5, 0.5, 0.5], [0.5, 0.5, 0.5], 16, 768


class Qwen2VLVideoProcessorPil:
    """Qwen2-VL's video processor on transformers' PIL image backend, for environments without torchvision.

    transformers ships its video processors for the torchvision backend only, and torchvision has no build for
    the CPU wheel of torch this project installs. This one reads the same ``video_preprocessor_config.json`` and
    does what ``Qwen2VLVideoProcessor`` does to already sampled frames: the same frame size
    (``qwen2_vl_frame_size``), every frame resized, rescaled and normalised by HF's ``Qwen2VLImageProcessorPil``,
    the last frame repeated up to a multiple of ``temporal_patch_size``, and the same patch layout. Shapes and
    grids equal HF's; pixel values differ from torchvision's resize as HF's own PIL and torchvision image
    backends differ."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]
    defaults = Qwen2VLVideoFrameDefaults
    frame_size = qwen2_vl_frame_size
    IMAGE_KEYS = ("do_resize", "resample", "do_rescale", "rescale_factor", "do_normalize", "image_mean",
                  "image_std", "do_convert_rgb", "patch_size", "temporal_patch_size", "merge_size")

    def __init__(self, config: dict):
        cfg = dict(config)
        size = dict(cfg.get("size") or self.defaults.size)
        if cfg.get("min_pixels") is not None:
            size["shortest_edge"] = cfg["min_pixels"]
        if cfg.get("max_pixels") is not None:
            size["longest_edge"] = cfg["max_pixels"]
        self.size = size
        for key in dir(self.defaults):
            if not key.startswith("_") and key != "size":
                default = getattr(self.defaults, key)
                setattr(self, key, cfg.get(key, default))
        self.frames = _frame_processor(size=size, **{k: getattr(self, k) for k in self.IMAGE_KEYS})

    @classmethod
    def from_pretrained(cls, folder):
        return cls(json.loads((Path(folder) / "video_preprocessor_config.json").read_text()))

    def __call__(self, videos, size: dict | None = None, return_tensors="pt", **_) -> dict:
        size, tps, p = dict(size or self.size), self.temporal_patch_size, self.patch_size
        patches, grids = [], []
        for video in videos:
            video = np.asarray(video)
            t, h, w = video.shape[:3]
            self.frames.target = self.frame_size(h, w, t, size) if self.do_resize else (h, w)
            gh, gw = self.frames.target[0] // p, self.frames.target[1] // p
            out = self.frames(images=list(video), return_tensors="np")
            # each frame's patches, its copy along the temporal patch axis dropped
            per_frame = out["pixel_values"].reshape(t, gh * gw, 3, tps, p, p)[:, :, :, 0]
            if pad := -t % tps:
                per_frame = np.concatenate([per_frame, np.repeat(per_frame[-1:], pad, 0)])
            grouped = per_frame.reshape(-1, tps, gh * gw, 3, p, p).transpose(0, 2, 3, 1, 4, 5)
            patches.append(grouped.reshape(-1, 3 * tps * p * p))
            grids.append([(t + pad) // tps, gh, gw])
        return {"pixel_values_videos": torch.from_numpy(np.ascontiguousarray(np.concatenate(patches))).float(),
                "video_grid_thw": torch.tensor(grids, dtype=torch.long)}


class Qwen3VLVideoProcessorPil(Qwen2VLVideoProcessorPil):
    """Qwen3-VL's video processor on transformers' PIL image backend (see ``Qwen2VLVideoProcessorPil``): its
    defaults and its frame size (``qwen3_vl_frame_size``); the patch layout is Qwen2-VL's."""

    defaults = Qwen3VLVideoFrameDefaults
    frame_size = qwen3_vl_frame_size


class OneVisionVideoProcessorPil:
    """LLaVA-OneVision's video processor on transformers' numpy image transforms, for environments without
    torchvision (see ``Qwen2VLVideoProcessorPil``): every frame resized to ``size`` (PIL, its ``resample``),
    rescaled and normalised as ``LlavaOnevisionVideoProcessor`` does, returned as ``pixel_values_videos [videos,
    frames, C, H, W]`` (the videos of one call have the same frame count)."""

    model_input_names = ["pixel_values_videos"]

    def __init__(self, config: dict):
        from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

        cfg = dict(config)
        self.size = dict(cfg.get("size") or {"height": 384, "width": 384})
        self.resample = cfg.get("resample", 3)
        self.do_resize, self.do_rescale = cfg.get("do_resize", True), cfg.get("do_rescale", True)
        self.do_normalize, self.rescale_factor = cfg.get("do_normalize", True), cfg.get("rescale_factor", 1 / 255)
        self.image_mean = cfg.get("image_mean", list(OPENAI_CLIP_MEAN))
        self.image_std = cfg.get("image_std", list(OPENAI_CLIP_STD))

    def frame(self, frame: np.ndarray) -> np.ndarray:
        from transformers.image_transforms import normalize, rescale, resize
        from transformers.image_utils import ChannelDimension, PILImageResampling

        x = np.asarray(frame)
        if self.do_resize:
            x = resize(x, (self.size["height"], self.size["width"]), resample=PILImageResampling(self.resample),
                       input_data_format=ChannelDimension.LAST)
        x = x.astype(np.float32)
        if self.do_rescale:
            x = rescale(x, self.rescale_factor, input_data_format=ChannelDimension.LAST)
        if self.do_normalize:
            x = normalize(x, self.image_mean, self.image_std, input_data_format=ChannelDimension.LAST)
        return x.transpose(2, 0, 1)

    def __call__(self, videos, return_tensors="pt", **_) -> dict:
        clips = [np.stack([self.frame(f) for f in np.asarray(v)]) for v in videos]
        if len({c.shape for c in clips}) > 1:
            raise ValueError(f"videos of {sorted({len(c) for c in clips})} frames in one call: LLaVA-OneVision stacks "
                             "a batch's videos frame by frame; sample the same number of frames from each")
        return {"pixel_values_videos": torch.from_numpy(np.ascontiguousarray(np.stack(clips))).float()}


FIXED_FRAME_PROCESSORS = ("LlavaOnevisionVideoProcessor", "OneVisionVideoProcessor")


def base_name(proc) -> str:
    name = type(proc).__name__
    return name[: -len("Pil")] if name.endswith("Pil") else name


def load_video_processor(folder, fallback_config: dict | None = None):
    """The HF video processor saved in ``folder`` (``AutoVideoProcessor``), or, without torchvision, a
    ``Qwen2VLVideoProcessorPil`` for a Qwen2-VL / Qwen2.5-VL config; ``fallback_config`` is used when the folder
    has no ``video_preprocessor_config.json`` (older Qwen2-VL folders: the image processor's config)."""
    folder = Path(folder)
    file = folder / "video_preprocessor_config.json"
    config = json.loads(file.read_text()) if file.is_file() else fallback_config
    if config is None:
        raise FileNotFoundError(f"no video processor in {folder}: save the family's video processor there "
                                "(e.g. Qwen2VLVideoProcessor(...).save_pretrained)")
    try:
        from transformers import AutoVideoProcessor

        if file.is_file():
            return AutoVideoProcessor.from_pretrained(folder)
        from transformers import Qwen2VLVideoProcessor

        return Qwen2VLVideoProcessor(**{k: v for k, v in config.items() if not k.endswith("_type")})
    except ImportError as err:  # transformers' video processors need torchvision
        kind = config.get("video_processor_type") or config.get("image_processor_type") or ""
        if kind.startswith("Qwen3VL"):
            return Qwen3VLVideoProcessorPil(config)
        if kind.startswith("LlavaOnevision"):
            return OneVisionVideoProcessorPil(config)
        if not kind.startswith(("Qwen2VL", "Qwen2_5_VL")):
            raise ImportError(f"the video processor {kind or '?'} of {folder} needs torchvision ({err}); install "
                              "torchvision matching torch") from err
        return Qwen2VLVideoProcessorPil(config)


# ------------------------------------------------------------------------------------------ the modality
class VideoProcessor:
    """A family's video processor with the sampling ``options``: files -> frames (``read``), frames -> the HF
    processor's outputs (``__call__``), headers -> the same outputs' shapes (``header_inputs``).

    ``seconds_per_grid``: add ``second_per_grid_ts`` (``temporal_patch_size / sampled fps`` per video), as
    Qwen2.5-VL's HF processor does."""

    def __init__(self, processor, options=None, seconds_per_grid: bool = False):
        self.processor, self.options, self.seconds_per_grid = processor, VideoOptions.of(options), seconds_per_grid
        self.qwen2_vl = base_name(processor) in QWEN2_VL_VIDEO_PROCESSORS
        self.fixed_frames = base_name(processor) in FIXED_FRAME_PROCESSORS

    def indices(self, metadata) -> np.ndarray:
        """The frames sampled from a video: by ``fps`` within ``max_frames``, or exactly ``max_frames`` for a
        family that stacks a batch's videos frame by frame (``fixed_frame_indices``)."""
        if self.fixed_frames:
            return fixed_frame_indices(metadata, self.options.max_frames)
        return frame_indices(metadata, self.options.fps, self.options.max_frames)

    def call_kwargs(self) -> dict:
        """What the HF video processor is called with: frames already sampled, and ``max_pixels`` as its size."""
        kw = {"return_tensors": "pt", "do_sample_frames": False}
        if self.qwen2_vl and self.options.max_pixels is not None:
            lo, hi = qwen2_vl_pixels(self.processor, self.options.max_pixels)
            kw["size"] = {"shortest_edge": lo, "longest_edge": hi}
        return kw

    def frame_size(self, metadata) -> tuple[int, int]:
        """(height, width) of the frames handed to the HF processor: decoded, or, for processors without a pixel
        budget of their own, scaled down to ``max_pixels``."""
        h, w = metadata.height, metadata.width
        return (h, w) if self.qwen2_vl else fit_pixels(h, w, self.options.max_pixels)

    def read(self, file) -> Video:
        """The sampled frames of ``file``."""
        meta = read_header(file)
        video = decode_frames(file, meta, self.indices(meta))
        h, w = self.frame_size(meta)
        if (h, w) != video.frames.shape[1:3]:
            from PIL import Image

            video.frames = np.stack([np.asarray(Image.fromarray(f).resize((w, h), Image.BICUBIC))
                                     for f in video.frames])
        return video

    def seconds(self, metadatas) -> torch.Tensor:
        """Seconds per temporal patch of each video, ``temporal_patch_size / sampled_fps`` (Qwen2.5-VL's)."""
        tps = self.processor.temporal_patch_size
        return torch.tensor([tps / m.sampled_fps for m in metadatas])

    def __call__(self, videos: list) -> dict:
        """The HF processor's outputs for ``videos`` (``Video``s, or frame arrays ``[T, H, W, 3]``)."""
        frames = [v.frames if isinstance(v, Video) else np.asarray(v) for v in videos]
        out = self.processor(videos=frames, **self.call_kwargs())
        out = {k: v for k, v in out.items() if k in VIDEO_KEYS}
        if self.seconds_per_grid:
            from transformers.video_utils import VideoMetadata

            out["second_per_grid_ts"] = self.seconds([v.metadata if isinstance(v, Video) else
                                                      VideoMetadata(total_num_frames=len(v)) for v in videos])
        return out

    def sampled(self, metadata):
        """``metadata`` with the frames this processor's options sample (``frames_indices``)."""
        from transformers.video_utils import VideoMetadata

        meta = VideoMetadata(**{f.name: getattr(metadata, f.name) for f in fields(metadata)})
        meta.frames_indices = self.indices(meta)
        return meta

    def header_inputs(self, metadatas: list, blank: bool = False) -> dict:
        """What ``__call__`` returns for videos with these headers (``read_header``): for Qwen2-VL's processor
        the grids by its rules and the pixels on the meta device; otherwise, or with ``blank=True``, it runs on
        black frames of the same count and size (exact: shapes never depend on pixel values)."""
        metas = [self.sampled(m) for m in metadatas]
        if self.qwen2_vl and not blank:
            p, tps, grids = self.processor.patch_size, self.processor.temporal_patch_size, []
            size = self.call_kwargs().get("size") or {"shortest_edge": _get(self.processor.size, "shortest_edge"),
                                                       "longest_edge": _get(self.processor.size, "longest_edge")}
            for m in metas:
                t = len(m.frames_indices)
                rh, rw = qwen2_vl_frame_size(self.processor, m.height, m.width, t, size)
                grids.append([-(-t // tps), rh // p, rw // p])
            patches = sum(t * h * w for t, h, w in grids)
            out = {"pixel_values_videos": torch.empty(patches, 3 * tps * p * p, device="meta"),
                   "video_grid_thw": torch.tensor(grids, dtype=torch.long)}
            if self.seconds_per_grid:
                out["second_per_grid_ts"] = self.seconds(metas)
            return out
        blanks = [Video(np.zeros((len(m.frames_indices), *self.frame_size(m), 3), np.uint8), m) for m in metas]
        return self(blanks)
