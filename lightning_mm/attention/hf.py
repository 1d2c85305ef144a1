"""Plugs bitfield attention into transformers through AttentionInterface, so HF model code runs unchanged.

A model built with ``attn_implementation="bitfield"`` calls :func:`hf_bitfield_attention` in every attention
layer. The words, segments and token positions reach it as forward keyword arguments (``bam``,
``segment_ids``, ``token_index``), which transformers passes through to the attention function. A context
parallel group, when given as ``cp_group``, makes the layer gather keys and values across it.
"""

from __future__ import annotations

import torch

ATTENTION_NAME = "bitfield"


def hf_bitfield_attention(module: torch.nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                          bam=None, segment_ids=None, token_index=None, cp_group=None, **kwargs):
    """AttentionInterface function: query ``[B,H,S,D]`` -> ``([B,S,H,D], None)``."""
    from lightning_mm.attention import bitfield_attention

    if bam is None:
        raise ValueError("attention 'bitfield' needs the mask words: call the model with bam=<int64 [B,S]> "
                         "(lightning_mm.masks builds them)")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{type(module).__name__} uses attention logit softcapping, which bitfield attention does "
                         "not implement; set attn_logit_softcapping=None in the model config")
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if window is not None:  # only then is the sequence length read on the host
        seq_len = query.shape[2] if token_index is None else int(token_index.max()) + 1
        if window < seq_len:
            raise ValueError(f"{type(module).__name__} uses a sliding window of {window} tokens, shorter than the "
                             f"sequence ({seq_len}); bitfield attention attends the whole allowed context. "
                             "Set sliding_window=None (or >= the sequence length) in the model config")
    if dropout and module.training:
        raise ValueError("bitfield attention has no attention dropout; set attention_dropout=0 in the model config")
    if cp_group is not None:
        from lightning_mm.attention.context_parallel import context_parallel_attention
        out = context_parallel_attention(query, key, value, bam, segment_ids, token_index, cp_group, scale=scaling,
                                         cache=kwargs.get("cp_cache"))
    else:
        out = bitfield_attention(query, key, value, bam, bam, q_segments=segment_ids, k_segments=segment_ids,
                                 q_positions=token_index, k_positions=token_index, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"bitfield"`` with transformers' attention (and attention-mask) interfaces."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, hf_bitfield_attention)
