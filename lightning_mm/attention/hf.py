"""Plugs bitfield attention into transformers through AttentionInterface, so HF model code runs unchanged.

A model built with ``attn_implementation="bitfield"`` calls :func:`hf_bitfield_attention` in every attention
layer. The words, segments and token positions reach it as forward keyword arguments (``bam``,
``segment_ids``, ``token_index``), which transformers passes through to the attention function. A context
parallel group, when given as ``cp_group``, makes the layer gather keys and values across it.

A language model inside a ``MultimodalModel`` gets a private copy of its config whose implementation is
``"bitfield|<its own>"`` (:func:`attach`): a call that carries mask words (``bam=``, or the words of a
:func:`generation_words` scope) runs bitfield attention; a call without them runs the model's own implementation
(``sdpa``, ``eager``, ...) with transformers' own mask, exactly as before it was wrapped. The config object the
caller built the model from is never changed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
from contextvars import ContextVar

import torch

ATTENTION_NAME = "bitfield"
SEPARATOR = "|"  # "bitfield|sdpa": bitfield attention when a call carries words, else sdpa
_OWN_KWARGS = ("bam", "segment_ids", "token_index", "cp_group", "attn_cache")


def hf_bitfield_attention(module: torch.nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                          bam=None, segment_ids=None, token_index=None, cp_group=None, **kwargs):
    """AttentionInterface function: query ``[B,H,S,D]`` -> ``([B,S,H,D], None)``."""
    from lightning_mm.attention.dispatch import bitfield_attention

    q_positions = k_positions = token_index
    k_bam = bam
    if bam is None and _GENERATION.get() is not None:  # a KV-cached decoding step of MultimodalModel.generate
        bam, k_bam, q_positions, k_positions = _GENERATION.get().words(query.shape[0], query.shape[2], key.shape[2],
                                                                       query.device)
    if bam is None:
        raise ValueError("attention 'bitfield' needs the mask words: call the model with bam=<int64 [B,S]> "
                         "(lightning_mm.attention.mask builds them)")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{type(module).__name__} uses attention logit softcapping (Gemma 2), which bitfield "
                         "attention does not implement; set attn_logit_softcapping=None in the model config (Gemma 3 "
                         "has none), or train this model without bitfield attention")
    window = layer_window(module, kwargs)
    if window is None and _blocks_on_local_layers_only(module):
        bam, k_bam = _without_spans(bam), _without_spans(k_bam)
        kwargs["attn_cache"] = None  # the cached tile classes are those of the words with spans
    if dropout and module.training:
        raise ValueError("bitfield attention has no attention dropout; set attention_dropout=0 in the model config")
    if cp_group is not None:
        from lightning_mm.attention.context_parallel import context_parallel_attention
        from lightning_mm.attention.ulysses import ContextParallelGroups, ulysses_attention
        if isinstance(cp_group, ContextParallelGroups) and cp_group.mode != "allgather":  # Ulysses / hybrid
            out = ulysses_attention(query, key, value, bam, segment_ids, token_index, cp_group, scale=scaling,
                                    cache=kwargs.get("attn_cache"), window=window)
        else:
            group = cp_group.group if isinstance(cp_group, ContextParallelGroups) else cp_group
            out = context_parallel_attention(query, key, value, bam, segment_ids, token_index, group, scale=scaling,
                                             cache=kwargs.get("attn_cache"), window=window)
    else:
        out = bitfield_attention(query, key, value, bam, k_bam, q_segments=segment_ids, k_segments=segment_ids,
                                 q_positions=q_positions, k_positions=k_positions, scale=scaling,
                                 cache=kwargs.get("attn_cache"), window=window)
    return out.transpose(1, 2).contiguous(), None


def _blocks_on_local_layers_only(module: torch.nn.Module) -> bool:
    """Gemma 4's ``use_bidirectional_attention="vision"``: image blocks on local (sliding-window) layers only; its
    global layers are causal over every token."""
    return getattr(getattr(module, "config", None), "use_bidirectional_attention", None) == "vision"


def _without_spans(words):
    """The words with the SPAN bit cleared: a span's tokens become causal text (its id bits add no pair)."""
    from lightning_mm.attention.mask import SPAN

    return None if words is None else words & ~SPAN


def layer_window(module: torch.nn.Module, kwargs: dict) -> int | None:
    """The sliding window of one attention call, as transformers passes it: the ``sliding_window`` keyword (per
    layer: Gemma 2/3 and Qwen2/3 pass ``None`` on full-attention layers; Mistral and Phi-3 pass the config's),
    else the module's ``sliding_window`` attribute; ``None`` = full attention. A window of ``W`` tokens means
    transformers' ``sliding_window_overlay`` (``q_pos - k_pos < W``), see :func:`lightning_mm.attention.mask.in_window`.
    """
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    if window is None:
        return None
    if getattr(getattr(module, "config", None), "use_bidirectional_attention", False) in (True, "all"):
        # (Gemma 4's "vision": image blocks, as the composite's bitfield words give them)
        raise ValueError(f"{type(module).__name__} uses bidirectional attention (use_bidirectional_attention=True, "
                         "an embedding model), which the bitfield words do not express; set it to False, or give "
                         "every token a non-causal word of one modality and no sliding window")
    return int(window)


def register() -> None:
    """Register ``"bitfield"`` with transformers' attention interface, and ``"bitfield|<name>"`` for every
    implementation transformers knows now (others are registered when a model using them is attached)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTENTION_NAME, hf_bitfield_attention)
    for name in ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]:
        if not is_bitfield(name) and not name.startswith("paged|"):
            register_dispatch(name)


# ------------------------------------------------------------------ per-call dispatch
def is_bitfield(name) -> bool:
    """Whether an attention implementation name honours bitfield mask words."""
    return isinstance(name, str) and (name == ATTENTION_NAME or name.startswith(ATTENTION_NAME + SEPARATOR))


def fallback_of(name: str | None) -> str:
    """The implementation a call without mask words runs: ``"bitfield|sdpa"`` -> ``"sdpa"``; a plain name (or
    None, transformers' eager default) is its own."""
    if name is None:
        return "eager"
    return name.split(SEPARATOR, 1)[1] if is_bitfield(name) and SEPARATOR in name else name


def _fallback_function(module, fallback: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if fallback == "eager":  # each modeling file has its own eager function (Gemma2's applies softcapping)
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise ValueError(f"{type(module).__name__} has no eager_attention_forward in its modeling file; build the "
                             "model with attn_implementation='sdpa'")
        return fn
    return ALL_ATTENTION_FUNCTIONS[fallback]


def dispatching_attention(module, query, key, value, attention_mask, *args, fallback: str = "eager", **kwargs):
    """``"bitfield|<fallback>"``: bitfield attention when the call carries words, else ``fallback`` unchanged."""
    if kwargs.get("bam") is not None or _GENERATION.get() is not None:
        return hf_bitfield_attention(module, query, key, value, attention_mask, *args, **kwargs)
    for k in _OWN_KWARGS:
        kwargs.pop(k, None)
    return _fallback_function(module, fallback)(module, query, key, value, attention_mask, *args, **kwargs)


def register_dispatch(fallback: str) -> str:
    """Register ``"bitfield|<fallback>"`` (attention and, where transformers has one for ``fallback``, its mask
    function, so a call without words builds exactly the mask it built before); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if is_bitfield(fallback):
        raise ValueError(f"{fallback!r} is already a bitfield implementation")
    name = f"{ATTENTION_NAME}{SEPARATOR}{fallback}"
    if fallback != "eager" and fallback not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"attention implementation {fallback!r} is not registered with transformers")
    if name not in ALL_ATTENTION_FUNCTIONS:
        fn = functools.partial(dispatching_attention, fallback=fallback)
        functools.update_wrapper(fn, dispatching_attention)
        AttentionInterface.register(name, fn)
        if fallback in ALL_MASK_ATTENTION_FUNCTIONS:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[fallback])
    return name


def _config_tree(config) -> list:
    out, todo = [], [config]
    while todo:
        c = todo.pop()
        out.append(c)
        todo += [getattr(c, k) for k in getattr(c, "sub_configs", {}) if getattr(c, k, None) is not None]
    return out


def attach(model: torch.nn.Module, root: torch.nn.Module | None = None) -> str:
    """Give ``model`` (a HF model) a private copy of its config (every submodule that shared the config now
    shares the copy) whose implementation is ``"bitfield|<its own>"``; returns that name.

    ``root``: the outermost module to rebind (e.g. a PEFT wrapper around ``model``), default ``model``. The config
    object ``model`` was built from, and every other model built from it, are left as they were."""
    old = model.config
    new = copy.deepcopy(old)
    pairs = {id(a): b for a, b in zip(_config_tree(old), _config_tree(new))}
    for m in (root or model).modules():
        c = m.__dict__.get("config")
        if c is not None and id(c) in pairs:
            m.__dict__["config"] = pairs[id(c)]
    for c in _config_tree(new):
        current = c._attn_implementation
        c._attn_implementation_internal = current if is_bitfield(current) else register_dispatch(fallback_of(current))
    return new._attn_implementation


def check_honours_mask(model: torch.nn.Module) -> None:
    """Raise unless ``model``'s attention implementation honours bitfield words (a call would otherwise silently
    attend as plain causal attention, ignoring modality bits, segments and padding words)."""
    config = getattr(model, "config", None)
    name = getattr(config, "_attn_implementation", None)
    if config is not None and not is_bitfield(name):
        raise ValueError(f"the language model's attention implementation is {name!r}, which cannot honour the "
                         "bitfield mask (modality bits, packed segments, padding words) and would silently ignore "
                         "it; attach bitfield attention with lightning_mm.attention.attach(model.language_model) "
                         "(calls without mask words still run the model's own attention), or build the "
                         "MultimodalModel again without attn_implementation")


# ------------------------------------------------------------------ words while decoding with a KV cache
class GenerationWords:
    """The mask words of a generation: the prompt's ``[B, S0]``; every token generated after it is text (attends
    every earlier non-padding token). Keys are the cache's, in order (a full, unwindowed dynamic cache)."""

    def __init__(self, prompt_bam: torch.Tensor, text_word: int):
        self.prompt, self.text_word = prompt_bam, text_word
        self._last = None

    def words(self, batch: int, q_len: int, k_len: int, device):
        key = (batch, q_len, k_len)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        prompt = self.prompt.to(device)
        if batch != prompt.shape[0]:  # beams or num_return_sequences: rows repeated per prompt
            if batch % prompt.shape[0]:
                raise ValueError(f"generation batch {batch} is not a multiple of the prompt batch {prompt.shape[0]}")
            prompt = prompt.repeat_interleave(batch // prompt.shape[0], dim=0)
        s0 = prompt.shape[1]
        if k_len < s0 or q_len > k_len:
            raise ValueError(f"the KV cache holds {k_len} keys for {q_len} queries but the prompt has {s0} tokens: "
                             "generation needs a full dynamic cache (no sliding-window or static cache)")
        k_bam = torch.cat([prompt, prompt.new_full((batch, k_len - s0), self.text_word)], dim=1)
        k_pos = torch.arange(k_len, device=device).expand(batch, k_len)
        out = (k_bam[:, k_len - q_len:], k_bam, k_pos[:, k_len - q_len:], k_pos)
        self._last = (key, out)
        return out


_GENERATION: ContextVar[GenerationWords | None] = ContextVar("lightning_mm_generation_words", default=None)


@contextlib.contextmanager
def generation_words(prompt_bam: torch.Tensor, text_word: int):
    """Within this scope, attention calls without ``bam`` take the generation's words (prompt + generated)."""
    token = _GENERATION.set(GenerationWords(prompt_bam, text_word))
    try:
        yield
    finally:
        _GENERATION.reset(token)
