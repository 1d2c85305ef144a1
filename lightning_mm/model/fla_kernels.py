"""flash-linear-attention's Triton kernels (``fla-core``, the ``[gpu]`` extra) for the Gated DeltaNet layers over
packed rows: the varlen convolution and chunked gated delta rule, one kernel call for every sample of a microbatch.

The rows ``[B, S, ...]`` are flattened to one sequence ``[1, B * S, ...]`` and ``cu_seqlens`` (each sample's start
in it, every row's start included; the ``SegmentLayout`` computes it once per microbatch) makes each kernel start
its recurrent state and convolution window afresh at every sample. The kernels take ``cu_seqlens_cpu`` too (the
same offsets, on the host), so they need no host read of their own to lay out their chunks.
"""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether flash-linear-attention (the ``fla`` package) can be imported."""
    return importlib.util.find_spec("fla") is not None


def varlen_delta_rule(query, key, value, g, beta, cu_seqlens, cu_seqlens_cpu) -> torch.Tensor:
    """fla's ``chunk_gated_delta_rule`` (q/k l2-normalised in the kernel, no initial state) over rows ``[B, S,
    heads, dim]`` (``g``, ``beta``: ``[B, S, heads]``) whose samples start at ``cu_seqlens`` of the flattened rows;
    each value head reads key head ``h * Hk // Hv`` (as transformers repeats them). Returns ``[B, S, Hv, Dv]``."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    b, s = value.shape[:2]
    flat = [t.reshape(1, b * s, *t.shape[2:]) for t in (query, key, value, g, beta)]
    out, _ = chunk_gated_delta_rule(*flat, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
                                    cu_seqlens_cpu=cu_seqlens_cpu)
    return out.reshape(b, s, *out.shape[2:]).to(value.dtype)


def varlen_causal_conv(x, weight, bias, activation: str | None, cu_seqlens, cu_seqlens_cpu) -> torch.Tensor:
    """fla's depthwise ``causal_conv1d`` (``x`` ``[B, S, C]``, ``weight`` ``[C, K]``) with each sample's window
    starting at its own first token (``cu_seqlens``); ``activation`` (``silu`` / ``swish`` or None) fused."""
    from fla.modules.causal_conv1d import causal_conv1d

    b, s, c = x.shape
    out, _ = causal_conv1d(x.reshape(1, b * s, c), weight, bias, activation=activation, backend="triton",
                           cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    return out.reshape(b, s, c)


__all__ = ["available", "varlen_causal_conv", "varlen_delta_rule"]
