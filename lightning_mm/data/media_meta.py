"""Encoder inputs known from media headers: what a processor will make of an image or a clip, without its pixels
or samples.

``image_size`` reads an image's (width, height) from its header (``PIL.Image.open`` decodes nothing until the
pixels are asked for); ``audio_length`` reads a clip's frame count and rate (``soundfile.info``) and gives its
length after the resampling ``ConversationDataset`` applies. ``image_inputs`` / ``audio_inputs`` turn those into
the encoder inputs the processor would return, with the pixel / feature tensors on the meta device (shapes only)
and the small index tensors (``image_grid_thw``, ``feature_attention_mask``) real, so that the encoder's own
``num_tokens`` counts exactly as it does on the real inputs:

- fixed-size image processors (CLIP, SigLIP, LLaVA: a center crop, or a resize to a fixed height and width):
  ``[N, 3, H, W]``;
- Qwen2-VL-like processors: transformers' ``smart_resize`` with the processor's min/max pixels (``size``'s
  ``shortest_edge`` / ``longest_edge``), factor patch size x merge size, then a ``[1, h/p, w/p]`` grid;
- tiling processors (LLaVA-NeXT, LLaVA-OneVision, InternVL's GotOcr2): ``lightning_mm.model.tiled_images.header_inputs``;
- Whisper feature extractors (also Qwen2-Audio's): padded or cut to ``n_samples``, ``n_samples // hop_length``
  frames, and the attention mask the call returns (frame-level when asked for with ``return_attention_mask``,
  else the padding's sample-level mask when the extractor's config returns one).

Videos have their own header rules beside their decoding (``lightning_mm.data.video``: PyAV's stream header,
the same frame sampling, Qwen2-VL's video ``smart_resize``). Any other processor, or call arguments these rules
do not cover, return None: the caller then runs the processor
on blank media of the header's size (exact, since shapes never depend on pixel values, but it does the resize).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

FIXED_SIZE_IMAGE_PROCESSORS = ("CLIPImageProcessor", "SiglipImageProcessor", "LlavaImageProcessor",
                               "Gemma3ImageProcessor")
QWEN2_VL_IMAGE_PROCESSORS = ("Qwen2VLImageProcessor",)
WHISPER_FEATURE_EXTRACTORS = ("WhisperFeatureExtractor",)
AUDIO_CALL_KEYS = {"sampling_rate", "return_attention_mask", "do_normalize"}


def base_name(proc) -> str:
    """The processor's class name without the backend suffix (``Qwen2VLImageProcessorPil`` -> ``...Processor``)."""
    name = type(proc).__name__
    for suffix in ("Pil", "Fast"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def image_size(file: Path) -> tuple[int, int]:
    """(width, height) from the header: the size ``_load_image`` then converts to RGB."""
    from PIL import Image

    with Image.open(file) as img:
        return img.size


def resampled_length(frames: int, rate: int, sampling_rate: int) -> int:
    """Samples after resampling ``frames`` at ``rate`` to ``sampling_rate``, as ``_load_audio`` does it (scipy's
    ``resample_poly``: ceil(frames x up / down); without scipy, linear interpolation: int(frames x sr / rate))."""
    if rate == sampling_rate:
        return frames
    try:
        import scipy.signal  # noqa: F401  (the same choice as _load_audio)
    except ImportError:
        return int(frames * sampling_rate / rate)
    g = math.gcd(int(rate), int(sampling_rate))
    up, down = sampling_rate // g, rate // g
    return -(-frames * up // down)


def audio_length(file: Path, sampling_rate: int) -> int:
    """A clip's length in samples at ``sampling_rate`` (mono), from the header."""
    import soundfile

    info = soundfile.info(str(file))
    return resampled_length(int(info.frames), int(info.samplerate), int(sampling_rate))


def _meta(*shape) -> torch.Tensor:
    return torch.empty(shape, device="meta")


def _size(size, key):
    if size is None:
        return None
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


def image_inputs(proc, sizes: list[tuple[int, int]], kwargs: dict | None = None) -> dict | None:
    """The inputs ``proc(images=...)`` returns for images of ``sizes`` ((width, height) each), pixel tensors on
    the meta device; None when the rules do not cover ``proc`` or ``kwargs``."""
    from lightning_mm.model.tiled_images import header_inputs

    tiled = header_inputs(base_name(proc), proc, sizes, kwargs) if sizes else None  # AnyRes, InternVL tiles
    if tiled is not None:
        return tiled
    if kwargs or not sizes:
        return None
    name = base_name(proc)
    if name in QWEN2_VL_IMAGE_PROCESSORS:
        try:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
        except ImportError:  # transformers without the PIL backend module
            from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        if not getattr(proc, "do_resize", True):
            return None
        size = getattr(proc, "size", None)
        lo = _size(size, "shortest_edge") or getattr(proc, "min_pixels", None)
        hi = _size(size, "longest_edge") or getattr(proc, "max_pixels", None)
        p, m, t = proc.patch_size, proc.merge_size, proc.temporal_patch_size
        if not (lo and hi):
            return None
        grids = []
        for w, h in sizes:
            rh, rw = smart_resize(h, w, factor=p * m, min_pixels=lo, max_pixels=hi)
            grids.append([1, rh // p, rw // p])
        patches = sum(gh * gw for _, gh, gw in grids)
        return {"pixel_values": _meta(patches, 3 * t * p * p), "image_grid_thw": torch.tensor(grids, dtype=torch.long)}
    if name in FIXED_SIZE_IMAGE_PROCESSORS:
        if getattr(proc, "do_pan_and_scan", False):  # Gemma 3's extra crops depend on the image: not a header rule
            return None
        crop, size = getattr(proc, "crop_size", None), getattr(proc, "size", None)
        if getattr(proc, "do_center_crop", False) and _size(crop, "height") and _size(crop, "width"):
            out = (_size(crop, "height"), _size(crop, "width"))  # a center crop pads smaller images
        elif getattr(proc, "do_resize", False) and _size(size, "height") and _size(size, "width"):
            out = (_size(size, "height"), _size(size, "width"))
        else:  # a shortest-edge resize without a crop, padding to square, no resize: the image's own shape
            return None
        return {"pixel_values": _meta(len(sizes), 3, *out)}
    return None


def audio_inputs(proc, lengths: list[int], kwargs: dict | None = None) -> dict | None:
    """The inputs ``proc(clips, **kwargs)`` returns (with ``MultimodalProcessor``'s ``feature_attention_mask``) for
    clips of ``lengths`` samples, features on the meta device; None when the rules do not cover it."""
    kwargs = {k: v for k, v in (kwargs or {}).items() if k != "return_tensors"}
    if base_name(proc) not in WHISPER_FEATURE_EXTRACTORS or set(kwargs) - AUDIO_CALL_KEYS or not lengths:
        return None
    padded, hop = int(proc.n_samples), int(proc.hop_length)
    frames = padded // hop  # the STFT's padded // hop + 1 frames, the last dropped
    asked = kwargs.get("return_attention_mask")
    pad_mask = asked or kwargs.get("do_normalize")  # WhisperFeatureExtractor.__call__'s own expression
    pad_mask = pad_mask if pad_mask is not None else getattr(proc, "return_attention_mask", False)
    out = {"input_features": _meta(len(lengths), int(proc.feature_size), frames)}
    if asked:  # the sample mask every hop_length samples, trimmed to the frames
        real = [min(frames, -(-min(n, padded) // hop)) for n in lengths]
        width = frames
    elif pad_mask:  # the padding's sample-level mask, returned as it is
        real, width = [min(n, padded) for n in lengths], padded
    else:
        return out
    mask = (torch.arange(width)[None, :] < torch.tensor(real)[:, None]).to(torch.int32)
    out["feature_attention_mask"] = mask
    return out


def blank_image(size: tuple[int, int]):
    """A black RGB image of (width, height): what a processor makes of it has the real image's shapes."""
    from PIL import Image

    return Image.new("RGB", size)


def blank_audio(length: int) -> np.ndarray:
    return np.zeros(length, dtype=np.float32)
