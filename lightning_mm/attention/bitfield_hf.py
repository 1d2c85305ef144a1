"""Bitfield attention on a plain transformers model (LLaVA, Qwen2-VL, any HF causal LM), driven by its own inputs.

:func:`use_bitfield_attention` leaves the model's code and call signature alone. It gives the text decoder (the
module holding the decoder ``layers``) a private config whose attention implementation is ``"bitfield|<own>"``
(:func:`lightning_mm.attention.hf.attach`), and adds two forward hooks:

* on the model the user calls: the mask words of the call are taken from ``bam=`` / ``segment_ids=`` when given
  (they are removed from the call, so the vision tower never sees them), else derived from the HF inputs
  (:func:`hf_words`): ``attention_mask`` 0 is padding, packed samples are separated by ``segment_ids`` or by the
  restarts of ``position_ids``, and the placeholder ids of the config (image/video/audio) mark modality tokens;
* on the text decoder: the words reach every attention layer as keyword arguments.

A call with a KV cache (``generate``) runs the model's own attention unchanged. An *extension* (the
:class:`lightning_mm.callbacks.ContextParallel` callback) may shard the decoder's inputs and replace the loss.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from lightning_mm.attention import mask as masks

ADAPTER_ATTR = "_lightning_mm_bitfield"
MODALITY_ATTENTION = ("causal", "bidirectional")
# modalities in bit order (bit 1, 2, 3) and the config attributes naming their placeholder token
MODALITY_TOKENS = (("image", ("image_token_id", "image_token_index")),
                   ("video", ("video_token_id", "video_token_index")),
                   ("audio", ("audio_token_id", "audio_token_index")))
_CACHE_KEYS = ("past_key_values", "cache")


class UnsupportedModelError(ValueError):
    """The model's attention cannot be replaced by bitfield attention."""


def modality_token_ids(config) -> dict[str, int]:
    """``{modality: placeholder token id}`` of a HF config (LLaVA ``image_token_id``, Qwen2-VL image and video,
    Qwen2-Audio ``audio_token_id``); empty for a text-only model."""
    out = {}
    for name, attrs in MODALITY_TOKENS:
        for attr in attrs:
            value = getattr(config, attr, None)
            if isinstance(value, int) and value >= 0:
                out[name] = value
                break
    return out


def segments_from_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Packed-sample ids ``[B,S]`` from positions that restart at 0 for every sample (``[B,S]``, or M-RoPE
    ``[3|4,B,S]``: a token whose components are all 0); None when no row restarts."""
    zero = position_ids == 0
    if position_ids.dim() == 3:
        zero = zero.all(0)
    starts = zero.clone()
    starts[:, 0] = False
    if not bool(starts.any()):
        return None
    return starts.long().cumsum(1)


def hf_words(config, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None,
             modality_attention: str = "causal") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The bitfield words ``[B,S]`` (and segment ids or None) of a HF model call.

    ``modality_attention="causal"`` (default) gives every token the text word: exactly the model's own causal
    attention (LLaVA and Qwen2-VL were trained so), restricted to its packed sample and without padding.
    ``"bidirectional"`` gives the placeholder tokens of each modality of the config their own bit, so an image's
    tokens attend each other in both directions (and text attends them causally)."""
    if modality_attention not in MODALITY_ATTENTION:
        raise ValueError(f"modality_attention={modality_attention!r}: choose one of {MODALITY_ATTENTION}")
    if input_ids is None or input_ids.dim() != 2:
        raise ValueError("bitfield attention derives the mask words from input_ids [B,S]: call the model with "
                         "input_ids (not only inputs_embeds), or pass bam=<int64 [B,S]> yourself "
                         "(lightning_mm.attention.mask builds them)")
    ids = modality_token_ids(config)
    bits = {name: 1 << (k + 1) for k, (name, _) in enumerate(MODALITY_TOKENS) if name in ids}
    text = masks.CAUSAL | masks.TEXT | sum(bits.values())
    bam = torch.full(input_ids.shape, text, dtype=torch.int64, device=input_ids.device)
    if modality_attention == "bidirectional":
        for name, bit in bits.items():
            bam = torch.where(input_ids == ids[name], torch.full_like(bam, bit), bam)
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                             f"{tuple(input_ids.shape)}; bitfield attention needs a [B,S] padding mask (1 = token)")
        bam = bam.masked_fill(attention_mask == 0, 0)
    if segment_ids is None and position_ids is not None:
        segment_ids = segments_from_positions(position_ids)
    if segment_ids is not None and segment_ids.shape != input_ids.shape:
        raise ValueError(f"segment_ids has shape {tuple(segment_ids.shape)}, input_ids {tuple(input_ids.shape)}; "
                         "give one packed-sample id per token")
    return bam, segment_ids


def _is_hf_model(m) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(m, PreTrainedModel)


def find_decoder(model: nn.Module) -> nn.Module:
    """The text decoder of a HF model: the module whose ``layers`` are the decoder layers (``LlamaModel``,
    ``Qwen2VLTextModel``, ...). Raises :class:`UnsupportedModelError` with the fix."""
    name = type(model).__name__
    if not _is_hf_model(model):
        raise UnsupportedModelError(f"{name} is not a transformers PreTrainedModel; bitfield attention replaces the "
                                    "attention of HF models through transformers' AttentionInterface. Pass the HF "
                                    "model (e.g. LlavaForConditionalGeneration), or build a lightning_mm."
                                    "MultimodalModel")

    def is_decoder(m):
        return (_is_hf_model(m) and isinstance(getattr(m, "layers", None), nn.ModuleList)
                and getattr(m, "embed_tokens", None) is not None)

    found = []
    try:
        first = model.get_decoder()
        while first is not None and not is_decoder(first) and hasattr(first, "get_decoder") \
                and first.get_decoder() is not first:
            first = first.get_decoder()
        if first is not None and is_decoder(first):
            found = [first]
    except (AttributeError, NotImplementedError, ValueError):
        pass
    if not found:
        found = [m for m in model.modules() if is_decoder(m)]
    if len(found) != 1:
        raise UnsupportedModelError(
            f"cannot find the text decoder of {name}: bitfield attention needs exactly one HF decoder module with "
            f"`layers` and `embed_tokens` (found {len(found)}). Supported: causal LMs (Llama, Qwen2, Mistral, ...) and "
            "composites built on them (LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen2-Audio); encoder-decoder models are not")
    decoder = found[0]
    if not getattr(type(decoder), "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{type(decoder).__name__} does not route its attention through transformers' AttentionInterface "
            "(_supports_attention_backend is False), so bitfield attention cannot replace it. Use a model family "
            "that does (Llama, Qwen2, Mistral, Gemma, LLaVA, Qwen2-VL, ...)")
    return decoder


def _positional_names(module: nn.Module) -> list[str]:
    params = inspect.signature(module.forward).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _as_kwargs(module, args, kwargs) -> dict:
    if not args:
        return dict(kwargs)
    names = _positional_names(module)
    if len(args) > len(names):
        raise TypeError(f"{type(module).__name__}.forward got {len(args)} positional arguments")
    return {**dict(zip(names, args)), **kwargs}


class BitfieldAdapter:
    """The hooks :func:`use_bitfield_attention` installs (one per model; see the module docstring).

    ``extension``: an object with ``top(module, kwargs, call)``, ``decoder(module, kwargs, call)`` and
    ``output(module, kwargs, output, call)`` (each returns what it was given, changed) consulted on every call
    while ``extension.active(module)`` is true; ``call`` is the dict of the call's words (``bam``,
    ``segment_ids``)."""

    def __init__(self, model: nn.Module, modality_attention: str = "causal"):
        if modality_attention not in MODALITY_ATTENTION:
            raise ValueError(f"modality_attention={modality_attention!r}: choose one of {MODALITY_ATTENTION}")
        from lightning_mm.attention.hf import attach

        self.model, self.decoder = model, find_decoder(model)
        self.modality_attention = modality_attention
        self.config = model.config
        attach(self.decoder)
        self.extension = None
        self._call: dict | None = None
        self._handles = [model.register_forward_pre_hook(self._top_pre, with_kwargs=True),
                         self.decoder.register_forward_pre_hook(self._decoder_pre, with_kwargs=True),
                         model.register_forward_hook(self._top_post, with_kwargs=True, always_call=True)]

    def remove(self) -> None:
        """Remove the hooks (the decoder keeps its bitfield-dispatching config: calls without words run its own
        attention)."""
        for h in self._handles:
            h.remove()
        self.model.__dict__.pop(ADAPTER_ATTR, None)

    def _extension(self, module):
        ext = self.extension
        return ext if ext is not None and ext.active(module) else None

    def _top_pre(self, module, args, kwargs):
        kwargs = _as_kwargs(module, args, kwargs)
        bam, segs = kwargs.pop("bam", None), kwargs.pop("segment_ids", None)
        if any(kwargs.get(k) is not None for k in _CACHE_KEYS):  # generation with a KV cache: the model's own
            self._call = None
            return (), kwargs
        if bam is None:
            bam, segs = hf_words(self.config, kwargs.get("input_ids"), kwargs.get("attention_mask"),
                                 kwargs.get("position_ids"), segs, self.modality_attention)
        else:
            masks.validate(bam, segs)
        self._call = {"bam": bam, "segment_ids": segs}
        ext = self._extension(module)
        if ext is not None:
            kwargs = ext.top(module, kwargs, self._call)
        return (), kwargs

    def _decoder_pre(self, module, args, kwargs):
        call = self._call
        if call is None:
            return None
        kwargs = _as_kwargs(module, args, kwargs)
        ext = self._extension(self.model)
        if ext is not None:
            return (), ext.decoder(module, kwargs, call)
        kwargs.setdefault("bam", call["bam"])
        kwargs.setdefault("segment_ids", call["segment_ids"])
        return (), kwargs

    def _top_post(self, module, args, kwargs, output):
        call, self._call = self._call, None
        ext = self._extension(module)
        if call is not None and ext is not None:
            return ext.output(module, kwargs, output, call)
        return None


def use_bitfield_attention(model: nn.Module, modality_attention: str = "causal") -> nn.Module:
    """Run ``model`` (a HF model) with bitfield attention: packed samples (``segment_ids``, or ``position_ids``
    restarting at 0) never attend across each other, padding attends nothing, and with
    ``modality_attention="bidirectional"`` an image's (video's, audio clip's) tokens attend each other in both
    directions. Returns ``model`` (hooks added once; calling again returns it unchanged).

    Inputs are the model's own (``input_ids``, ``attention_mask``, ``position_ids``, ``pixel_values``,
    ``labels``, ...) plus optionally ``segment_ids`` and ``bam`` (explicit words, ``lightning_mm.attention.mask``);
    :func:`lightning_mm.data.pack_multimodal` builds packed rows. Raises :class:`UnsupportedModelError` for a
    model whose attention cannot be replaced."""
    adapter = model.__dict__.get(ADAPTER_ATTR)
    if adapter is not None:
        if adapter.modality_attention != modality_attention:
            raise ValueError(f"bitfield attention is already on this model with modality_attention="
                             f"{adapter.modality_attention!r}; remove it first (bitfield_adapter(model).remove())")
        return model
    model.__dict__[ADAPTER_ATTR] = BitfieldAdapter(model, modality_attention)
    return model


def bitfield_adapter(model: nn.Module) -> BitfieldAdapter | None:
    """The adapter :func:`use_bitfield_attention` installed on ``model``, or None."""
    return model.__dict__.get(ADAPTER_ATTR)


__all__ = ["use_bitfield_attention", "bitfield_adapter", "hf_words", "find_decoder", "modality_token_ids",
           "segments_from_positions", "BitfieldAdapter", "UnsupportedModelError"]
