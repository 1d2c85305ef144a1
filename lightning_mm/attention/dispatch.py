"""``bitfield_attention``: the one entry point, dispatching to the reference backend or the Triton kernels."""

from __future__ import annotations

import torch

from lightning_mm.attention.reference import reference_attention
from lightning_mm.attention.mask import check_attention_inputs, check_window

BACKENDS = ("auto", "reference", "triton")


def _triton_available(q: torch.Tensor) -> bool:
    if not q.is_cuda:
        return False
    try:
        import triton  # noqa: F401
        from lightning_mm.attention.kernels.attention import MAX_HEAD_DIM
    except ImportError:
        return False
    return 16 <= q.shape[-1] <= MAX_HEAD_DIM  # tiny test models' head dims take the reference


def _positions(b: int, s: int, device, cache: dict | None) -> torch.Tensor:
    """``arange(s)`` per row; one tensor per cache, so that the calls sharing a cache share it."""
    if cache is None:
        return torch.arange(s, device=device).expand(b, s)
    key = ("positions", b, s, device)
    if key not in cache:
        cache[key] = torch.arange(s, device=device).expand(b, s)
    return cache[key]


def bitfield_attention(q, k, v, q_bam, k_bam, *, q_segments=None, k_segments=None, q_positions=None,
                       k_positions=None, scale=None, backend: str = "auto", cache: dict | None = None,
                       window: int | None = None) -> torch.Tensor:
    """Attention of q ``[B,Hq,Sq,D]`` over k, v ``[B,Hkv,Sk,D]`` (GQA) under the bitfield mask.

    ``q_bam``/``k_bam`` are the words of the query and key tokens ``[B,Sq]``/``[B,Sk]``; segments separate
    packed samples; positions are the tokens' indices in the full sequence (default ``arange``), which is what
    makes the causal rule exact when queries are a subset (context parallelism). Rows with no allowed key
    output zeros. ``backend="auto"`` takes the Triton kernel on CUDA for head dims 16..256 and the reference
    elsewhere. Under autocast the Triton kernels take q, k, v in the autocast dtype, as SDPA does (rotary embeddings
    leave q and k in fp32 beside a bf16 v). ``cache``: a dict shared by the calls whose mask tensors are the same
    objects (the layers of one microbatch), so that the kernels classify the tiles once, not in every layer.
    ``window``: a sliding window of that many tokens (a key ``window`` or more positions before the query is not
    attended, :func:`lightning_mm.attention.mask.in_window`), None = none.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    check_attention_inputs(q, k, v, q_bam, k_bam, q_segments, k_segments, q_positions, k_positions, cache)
    check_window(window)
    b, sq, sk, d = q.shape[0], q.shape[2], k.shape[2], q.shape[3]
    if q_positions is None:
        q_positions = _positions(b, sq, q.device, cache)
    if k_positions is None:
        k_positions = _positions(b, sk, q.device, cache)
    scale = d ** -0.5 if scale is None else scale
    if backend == "triton" or (backend == "auto" and _triton_available(q)):
        from lightning_mm.attention.kernels import bitfield_attention as triton_attention
        if torch.is_autocast_enabled(q.device.type):
            dtype = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        return triton_attention(q, k, v, q_bam, k_bam, q_segments=q_segments, k_segments=k_segments,
                                q_positions=q_positions, k_positions=k_positions, scale=scale, cache=cache,
                                window=window)
    return reference_attention(q, k, v, q_bam, k_bam, q_segments, k_segments, q_positions, k_positions, scale,
                               window=window)


__all__ = ["bitfield_attention", "BACKENDS"]
