"""Real inputs -> samples: a tokenizer plus one HF processor per modality (image processor, feature extractor,
``VideoProcessor``).

``MultimodalProcessor(model, tokenizer, processors={"vision": image_processor}, markers={"vision": "<image>"})``
turns ``text`` with one marker per item and the raw items (``vision=[img, ...]``) into the sample form the
``MultimodalCollator`` expands (one placeholder token per item, labels, encoder inputs), so placeholders,
labels, words and packing come from the same code for real and synthetic data. For a composite whose HF
processor or chat template writes text around or inside each item (Qwen-VL's vision start/end, Qwen3-VL's frame
timestamps, Gemma 3's start/end of image, InternVL's ``<img>``, Qwen2-Audio's start/end of audio), the sample
also holds each item's whole expansion (``item_ids``, ``lightning_mm.data.item_text``).
"""

from __future__ import annotations

import torch

from lightning_mm.data.item_text import item_text, items_ids
from lightning_mm.data.video import Video, VideoProcessor


class MultimodalProcessor:
    def __init__(self, model, tokenizer, processors: dict, markers: dict[str, str] | None = None,
                 processor_kwargs: dict[str, dict] | None = None):
        unknown = set(processors) - set(model.encoders)
        if unknown:
            raise ValueError(f"processors for unknown modalities {sorted(unknown)}; encoders: {list(model.encoders)}")
        self.model, self.tokenizer, self.processors = model, tokenizer, processors
        self.markers = markers or {name: f"<{name}>" for name in processors}
        self.kwargs = processor_kwargs or {}
        self._item_text: dict | None = None  # per modality, built at first use (encoding needs no tokenizer)

    def call_kwargs(self, name: str) -> dict:
        """The keyword arguments modality ``name``'s processor is called with. A feature extractor whose config
        asks for an attention mask (Qwen2-Audio's) is asked explicitly: called without it, Whisper's extractor
        returns the padding's sample-level mask instead of the frame-level one the encoder counts tokens from."""
        kw = dict(self.kwargs.get(name, {}))
        proc = self.processors[name]
        if hasattr(proc, "hop_length") and getattr(proc, "return_attention_mask", False):
            kw.setdefault("return_attention_mask", True)
        return kw

    def encode_items(self, name: str, items: list) -> dict:
        """The encoder inputs of modality ``name`` for raw ``items`` (PIL images / arrays, 1-D waveforms, videos:
        ``Video``s or frame arrays ``[T, H, W, 3]``)."""
        proc = self.processors[name]
        if isinstance(proc, VideoProcessor):  # pixel_values_videos, video_grid_thw (, second_per_grid_ts)
            return proc(items)
        kw = {"return_tensors": "pt", **self.call_kwargs(name)}
        out = proc(images=items, **kw) if hasattr(proc, "image_mean") else proc(items, **kw)
        keep = {"pixel_values", "image_grid_thw", "input_features", "feature_attention_mask",
                "image_sizes", "batch_num_images", "num_patches"}  # AnyRes sizes, OneVision / InternVL tiles
        if "input_features" in out and "attention_mask" in out:  # a feature extractor's frame mask (asked for with
            out["feature_attention_mask"] = out["attention_mask"]  # return_attention_mask): Qwen2-Audio's clip lengths
        return {k: v for k, v in out.items() if k in keep}

    @property
    def item_text(self) -> dict:
        """Each modality's ``ItemText`` (None: its family writes nothing around its items)."""
        if self._item_text is None:
            self._item_text = {name: item_text(self.model, self.tokenizer, name) for name in self.model.encoders}
        return self._item_text

    def item_ids(self, name: str, inputs: dict, metadatas: list | None = None) -> list[torch.Tensor] | None:
        """Each item's expansion (text and placeholder ids, ``item_text``) for modality ``name``'s encoder
        ``inputs``; ``metadatas``: the videos' sampled ``VideoMetadata`` (Qwen3-VL's timestamps). None when the
        family writes no text around its items."""
        rule = self.item_text.get(name)
        if rule is None:
            return None
        enc = self.model.encoders[name]
        tps = getattr(getattr(self.processors.get(name), "processor", None), "temporal_patch_size", 1)
        return items_ids(rule, self.model.placeholder_ids[name], enc.num_tokens(inputs), metadatas, tps)

    @staticmethod
    def video_metadata(items: list) -> list:
        """The sampled ``VideoMetadata`` of each video (frame arrays: every frame, the frame rate unknown, as HF's
        processors take them)."""
        from transformers.video_utils import VideoMetadata

        return [v.metadata if isinstance(v, Video) else
                VideoMetadata(total_num_frames=len(v), frames_indices=list(range(len(v)))) for v in items]

    def tokenize(self, text: str) -> tuple[list[int], dict[str, int]]:
        """Token ids of ``text`` with one placeholder id per marker, and the number of markers per modality. The
        plain text a family writes just outside each item (``ItemText.text_before`` / ``text_after``) is joined to
        the neighbouring text before tokenizing, as HF's processor does."""
        ids = []
        pattern = sorted(self.markers.items(), key=lambda kv: -len(kv[1]))
        rest, counts = text, {name: 0 for name in self.markers}
        while rest:
            hits = [(rest.find(m), name, m) for name, m in pattern if m in rest]
            if not hits:
                ids += self.tokenizer(rest, add_special_tokens=False)["input_ids"]
                break
            at, name, marker = min(hits)
            rule = self.item_text.get(name)
            before = rest[:at] + (rule.text_before if rule else "")
            if before:
                ids += self.tokenizer(before, add_special_tokens=False)["input_ids"]
            ids.append(self.model.placeholder_ids[name])
            counts[name] += 1
            rest = (rule.text_after if rule else "") + rest[at + len(marker):]
        return ids, counts

    def __call__(self, text: str, train_on_prompt: bool = True, **items: list) -> dict:
        """One sample: ``text`` holds one marker per item of each modality, in order."""
        sample = {}
        ids, counts = self.tokenize(text)
        for name, n in counts.items():
            given = len(items.get(name, []))
            if n != given:
                raise ValueError(f"modality {name!r}: the text has {n} {self.markers[name]!r} markers but {given} "
                                 "items were given; put one marker per image/clip")
            if n:
                sample[name] = self.encode_items(name, list(items[name]))
                videos = isinstance(self.processors.get(name), VideoProcessor)
                expanded = self.item_ids(name, sample[name], self.video_metadata(items[name]) if videos else None)
                if expanded is not None:
                    sample.setdefault("item_ids", {})[name] = expanded
        sample["input_ids"] = torch.tensor(ids, dtype=torch.long)
        return sample
