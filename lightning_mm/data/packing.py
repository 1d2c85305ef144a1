"""Multimodal packing of HF processor outputs, for existing projects that train a plain HF model.

:func:`pack_multimodal` takes per-sample processor outputs (what ``processor(text=..., images=...)`` returns for
one conversation: LLaVA-like ``pixel_values [n_images, C, H, W]``, or Qwen2-VL-like ``pixel_values
[n_patches, D]`` with ``image_grid_thw [n_images, 3]``) and packs them first-fit into rows of ``max_length``
tokens. The batch is what the HF model takes, plus the packing:

* ``input_ids``, ``attention_mask`` (0 on padding), ``labels`` ``[R, L]``: the sample's ``labels`` or its
  ``input_ids``, ``-100`` on placeholders, padding and every sample's first token (never predicted from the
  previous sample);
* ``position_ids``: restarting at 0 in every sample, ``[R, L]``; for Qwen2-VL M-RoPE ``[3, R, L]`` computed per
  sample (exactly ``get_rope_index`` of the sample alone);
* ``segment_ids`` ``[R, L]`` and the bitfield words ``bam`` ``[R, L]``
  (:func:`lightning_mm.attention.bitfield_hf.hf_words`);
* the media tensors concatenated in the order their placeholders appear in the packed rows
  (``pixel_values``, ``image_grid_thw``, ...), and ``mm_token_type_ids`` for Qwen2-VL.

The model must run bitfield attention (:func:`lightning_mm.attention.use_bitfield_attention`, or the
:class:`lightning_mm.callbacks.ContextParallel` callback) so that packed samples never attend each other.
"""

from __future__ import annotations

import torch

from lightning_mm.data.video import VIDEO_KEYS
from lightning_mm.loss import IGNORE_INDEX

SEQUENCE_KEYS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "token_type_ids", "position_ids")
ITEM_KEYS = ("pixel_values", "image_grid_thw", "image_sizes")  # one entry (or patch run) per image, in order
MROPE_TYPES = ("qwen2_vl", "qwen2_5_vl")


def _flat(t, name: str) -> torch.Tensor:
    t = torch.as_tensor(t)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise ValueError(f"sample {name} must be one sequence ([S] or [1, S]), got shape {tuple(t.shape)}; give "
                         "pack_multimodal one processor output per sample")
    return t.long()


def _is_mrope(config) -> bool:
    return getattr(config, "model_type", None) in MROPE_TYPES or \
        getattr(getattr(config, "text_config", None), "model_type", None) in MROPE_TYPES


def _sample(s, index: int, config, image_id) -> dict:
    if not hasattr(s, "keys") or "input_ids" not in s:
        raise ValueError(f"sample {index} has no input_ids: give pack_multimodal the processor outputs (dicts with "
                         "input_ids, and pixel_values/image_grid_thw for images)")
    for key in s.keys():
        if key in VIDEO_KEYS:
            raise ValueError(f"sample {index} has {key}: packing videos is not supported; pack image and text "
                             "samples, and batch video samples unpacked (one per row)")
        if key not in SEQUENCE_KEYS and key not in ITEM_KEYS and key not in ("segment_ids", "bam"):
            raise ValueError(f"sample {index} has {key!r}, which pack_multimodal does not know how to pack; it packs "
                             f"{SEQUENCE_KEYS[:3]} and the image tensors {ITEM_KEYS}. Drop the key or pack yourself")
    ids = _flat(s["input_ids"], "input_ids")
    keep = torch.ones_like(ids, dtype=torch.bool)
    if s.get("attention_mask") is not None:
        keep = _flat(s["attention_mask"], "attention_mask").bool()
    labels = ids.clone() if s.get("labels") is None else _flat(s["labels"], "labels")
    if labels.shape != ids.shape:
        raise ValueError(f"sample {index}: labels {tuple(labels.shape)} and input_ids {tuple(ids.shape)} differ")
    ids, labels = ids[keep], labels[keep]
    if image_id is not None:
        labels = labels.masked_fill(ids == image_id, IGNORE_INDEX)
    items = {k: torch.as_tensor(s[k]) for k in ITEM_KEYS if s.get(k) is not None}
    if _is_mrope(config) and "pixel_values" in items and "image_grid_thw" not in items:
        raise ValueError(f"sample {index} has pixel_values but no image_grid_thw: Qwen2-VL packing needs each "
                         "image's grid (the processor returns it)")
    return {"input_ids": ids, "labels": labels, "items": items}


def _mrope_positions(config, ids: torch.Tensor, grids: torch.Tensor | None) -> torch.Tensor:
    """``[3, S]`` M-RoPE positions of one sample (Qwen2-VL's ``get_rope_index`` on that sample alone)."""
    from lightning_mm.model.composites import MRopeItems, MRopePositions

    vision = getattr(config, "vision_config", None)
    merge = getattr(vision, "spatial_merge_size", None)
    if merge is None:
        raise ValueError("Qwen2-VL packing needs config.vision_config.spatial_merge_size")
    fn = MRopePositions((MRopeItems("vision", config.image_token_id),), merge)
    inputs = {} if grids is None else {"vision": {"image_grid_thw": grids.reshape(-1, 3)}}
    return fn(ids[None], inputs)[0].T


def pack_multimodal(samples: list, max_length: int, config, *, pad_token_id: int | None = None,
                    modality_attention: str = "causal", num_rows: int | None = None) -> dict:
    """Pack HF processor outputs (one dict per sample) first-fit into rows of ``max_length`` tokens (see the
    module docstring for the batch). ``config``: the HF model's config (placeholder ids, M-RoPE for Qwen2-VL).
    ``modality_attention``: the words' rule for placeholder tokens (``"causal"``: the model's own attention;
    ``"bidirectional"``). ``num_rows``: pad the batch with empty rows to this many (a fixed batch shape);
    raises if the samples need more. A sample longer than ``max_length`` raises (nothing is truncated)."""
    from lightning_mm.attention.bitfield_hf import hf_words, modality_token_ids

    if not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    if not samples:
        raise ValueError("pack_multimodal got no samples")
    image_id = modality_token_ids(config).get("image")
    parsed = [_sample(s, i, config, image_id) for i, s in enumerate(samples)]
    rows, fill = [], []
    for i, p in enumerate(parsed):
        n = len(p["input_ids"])
        if n > max_length:
            raise ValueError(f"sample {i} has {n} tokens, more than max_length={max_length}; raise max_length "
                             "(packing never truncates: it would cut an image's placeholder tokens)")
        for r, used in enumerate(fill):
            if used + n <= max_length:
                rows[r].append(p)
                fill[r] += n
                break
        else:
            rows.append([p])
            fill.append(n)
    if num_rows is not None:
        if len(rows) > num_rows:
            raise ValueError(f"the samples need {len(rows)} rows of {max_length} tokens, more than num_rows={num_rows}")
        rows += [[] for _ in range(num_rows - len(rows))]
    mrope = _is_mrope(config)
    if pad_token_id is None:
        pad_token_id = getattr(config, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = getattr(getattr(config, "text_config", None), "pad_token_id", None) or 0
    b, length = len(rows), max_length
    ids = torch.full((b, length), pad_token_id, dtype=torch.long)
    labels = torch.full((b, length), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros(b, length, dtype=torch.long)
    segs = torch.zeros(b, length, dtype=torch.long)
    pos = torch.zeros((3, b, length) if mrope else (b, length), dtype=torch.long)
    items: dict[str, list] = {}
    for r, row in enumerate(rows):
        at = 0
        for s, p in enumerate(row):
            n = len(p["input_ids"])
            ids[r, at:at + n] = p["input_ids"]
            lab = p["labels"].clone()
            lab[0] = IGNORE_INDEX
            labels[r, at:at + n] = lab
            attention[r, at:at + n] = 1
            segs[r, at:at + n] = s
            if mrope:
                pos[:, r, at:at + n] = _mrope_positions(config, p["input_ids"], p["items"].get("image_grid_thw"))
            else:
                pos[r, at:at + n] = torch.arange(n)
            for k, v in p["items"].items():
                items.setdefault(k, []).append(v)
            at += n
        segs[r, at:] = len(row)  # padding: its own segment (its words are 0 anyway)
    batch = {"input_ids": ids, "attention_mask": attention, "labels": labels, "position_ids": pos,
             "segment_ids": segs}
    batch["bam"], _ = hf_words(config, ids, attention, None, segs, modality_attention)
    for k, v in items.items():
        batch[k] = torch.cat(v)
    if mrope:
        mm = torch.zeros_like(ids)
        if image_id is not None:
            mm = mm.masked_fill(ids == image_id, 1)
        batch["mm_token_type_ids"] = mm
    return batch


class PackingCollator:
    """``collate_fn`` for a ``DataLoader`` of HF processor outputs: ``pack_multimodal(samples, max_length,
    config, **options)``."""

    def __init__(self, config, max_length: int, **options):
        self.config, self.max_length, self.options = config, max_length, options

    def __call__(self, samples: list) -> dict:
        return pack_multimodal(samples, self.max_length, self.config, **self.options)


__all__ = ["pack_multimodal", "PackingCollator"]
