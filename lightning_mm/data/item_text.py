"""The text a composite family's HF processor and chat template write around, and inside, each image, video or clip.

A sample holds one placeholder per item; the collator expands it to the item's feature tokens. HF's pipeline
also writes text there: the chat template wraps a Qwen-VL item in ``<|vision_start|>`` / ``<|vision_end|>``,
a Qwen2-Audio clip in ``<|audio_bos|>`` / ``<|audio_eos|>``, a Qwen3-Omni clip in ``<|audio_start|>`` /
``<|audio_end|>`` (its images and videos as Qwen-VL's, a video's tokens in one run); Gemma 3's processor writes
``"\\n\\n<start_of_image>"`` ... ``"<end_of_image>\\n\\n"``, InternVL's ``<img>`` ... ``</img>``, and Qwen3-VL's
lays a video out frame by frame, each temporal patch after its timestamp (``"<1.5 seconds>"``) between its own
start and end tokens. :class:`ItemText` is that rule per family, giving each item's whole expansion
(``item_ids``: text ids and the placeholder id at the feature positions), which the collator writes in place of
the placeholder. Families with nothing to add (LLaVA, LLaVA-NeXT, LLaVA-OneVision, models built from parts) get
none; a label a chat template writes before an item ("Audio 1: ") is not written.

Token ids of special tokens come from the checkpoint's config (the ids the model was trained with) or, where the
config has none (InternVL, Qwen2-Audio), from the tokenizer. Plain text inside an item (Qwen3-VL's timestamps,
between special tokens) is tokenized on its own; plain text just outside one (Gemma's blank lines) is tokenized
with its neighbours, so a tokenizer merges across it as HF's processor does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

QWEN_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
PER_FRAME_TIMESTAMPS = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")  # Qwen3.5's processor is Qwen3-VL's


@dataclass(frozen=True)
class ItemText:
    """``before`` + the item's tokens + ``after``; with ``timestamps``, the tokens are laid out per temporal patch,
    each as ``tokenize("<{t:.1f} seconds>") + frame_before + tokens + frame_after`` (Qwen3-VL's videos).
    ``text_before`` / ``text_after``: plain text written just outside the item, tokenized together with the
    neighbouring text (``MultimodalProcessor.tokenize``), as HF's processor tokenizes the whole expanded text: a
    tokenizer merges Gemma's blank line with a newline before the image into one token."""

    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()
    frame_before: tuple[int, ...] = ()
    frame_after: tuple[int, ...] = ()
    timestamps: bool = False
    tokenize: Callable[[str], list[int]] | None = None
    text_before: str = ""
    text_after: str = ""

    def ids(self, placeholder: int, tokens: int, seconds: list[float] | None = None) -> list[int]:
        """The expansion of one item of ``tokens`` feature tokens; ``seconds``: a video's time of each temporal
        patch (its length divides ``tokens``)."""
        if not self.timestamps or seconds is None:
            return [*self.before, *[placeholder] * tokens, *self.after]
        if not seconds or tokens % len(seconds):
            raise ValueError(f"a video of {tokens} tokens cannot be laid out over {len(seconds)} temporal patches")
        per_frame, body = tokens // len(seconds), []
        for t in seconds:
            body += [*self.tokenize(f"<{t:.1f} seconds>"), *self.frame_before, *[placeholder] * per_frame,
                     *self.frame_after]
        return [*self.before, *body, *self.after]


def patch_seconds(frames_indices, fps: float, temporal_patch_size: int) -> list[float]:
    """The time of each temporal patch of a video sampled at ``frames_indices`` of a ``fps`` stream: its frames'
    mean (the last frame repeated to fill the last patch), as Qwen3-VL's processor computes it."""
    idx = [int(i) for i in frames_indices]
    idx += [idx[-1]] * (-len(idx) % temporal_patch_size)
    return [(idx[i] + idx[i + temporal_patch_size - 1]) / 2 / fps for i in range(0, len(idx), temporal_patch_size)]


def _special(tokenizer, token: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == tokenizer.unk_token_id:
        raise ValueError(f"the tokenizer has no {token!r} token, which this model's processor writes around each "
                         "item; use the checkpoint's own tokenizer")
    return tid


def _config_or_token(config, tokenizer, name: str, token: str) -> int:
    """The config's ``<name>_token_id``, else the tokenizer's id of ``token``."""
    tid = getattr(config, f"{name}_token_id", None)
    return tid if tid is not None else _special(tokenizer, token)


def item_text(model, tokenizer, name: str) -> ItemText | None:
    """The rule of modality ``name`` of ``model`` (a composite from ``from_pretrained``), None where its HF processor
    writes nothing besides the item's tokens."""
    composite = getattr(model, "composite", None)
    if composite is None or name not in model.encoders:
        return None
    kind, config = composite.spec.model_type, composite.config

    def tokenize(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    if kind in QWEN_VL:
        start, end = (config.vision_start_token_id,), (config.vision_end_token_id,)
        video = name != composite.spec.modality and kind in PER_FRAME_TIMESTAMPS
        return ItemText(start, end, *((start, end, True, tokenize) if video else ()))
    if kind == "gemma3":
        return ItemText((config.boi_token_index,), (config.eoi_token_index,), text_before="\n\n", text_after="\n\n")
    if kind == "internvl":
        return ItemText((_special(tokenizer, "<img>"),), (_special(tokenizer, "</img>"),))
    if kind == "qwen3_omni_moe_thinker":  # its chat template's start/end of vision and of audio around each item
        if name in model.encoders and model.encoders[name].family.input_key == "input_features":
            return ItemText((_config_or_token(config, tokenizer, "audio_start", "<|audio_start|>"),),
                            (_config_or_token(config, tokenizer, "audio_end", "<|audio_end|>"),))
        return ItemText((_config_or_token(config, tokenizer, "vision_start", "<|vision_start|>"),),
                        (_config_or_token(config, tokenizer, "vision_end", "<|vision_end|>"),))
    if kind == "qwen2_audio":  # its chat template's start/end of audio (the "Audio N: " label is the template's)
        return ItemText((_special(tokenizer, "<|audio_bos|>"),), (_special(tokenizer, "<|audio_eos|>"),))
    return None


def items_ids(rule: ItemText | None, placeholder: int, tokens: list[int], metadatas: list | None = None,
              temporal_patch_size: int = 1) -> list[torch.Tensor] | None:
    """Each item's expansion (``ItemText.ids``) as a tensor, None without a rule. ``metadatas``: the videos'
    sampled ``VideoMetadata`` (``frames_indices``, ``fps``), for timestamps."""
    if rule is None:
        return None
    out = []
    for i, n in enumerate(tokens):
        seconds = None
        if rule.timestamps:
            meta = metadatas[i]
            fps = meta.fps or 24.0  # an unknown frame rate: HF's processor assumes 24 too
            seconds = patch_seconds(meta.frames_indices, fps, temporal_patch_size)
        out.append(torch.tensor(rule.ids(placeholder, n, seconds), dtype=torch.long))
    return out
