"""``bitfield_attention``: the one entry point, dispatching to the reference backend or the Triton kernels."""

from __future__ import annotations

import torch

from lightning_mm.attention.reference import reference_attention
from lightning_mm.masks import check_attention_inputs

BACKENDS = ("auto", "reference", "triton")


def _triton_available(q: torch.Tensor) -> bool:
    if not q.is_cuda:
        return False
    try:
        import triton  # noqa: F401
        from lightning_mm.kernels import bitfield_attention as _  # noqa: F401
    except ImportError:
        return False
    return True


def bitfield_attention(q, k, v, q_bam, k_bam, *, q_segments=None, k_segments=None, q_positions=None,
                       k_positions=None, scale=None, backend: str = "auto") -> torch.Tensor:
    """Attention of q ``[B,Hq,Sq,D]`` over k, v ``[B,Hkv,Sk,D]`` (GQA) under the bitfield mask.

    ``q_bam``/``k_bam`` are the words of the query and key tokens ``[B,Sq]``/``[B,Sk]``; segments separate
    packed samples; positions are the tokens' indices in the full sequence (default ``arange``), which is what
    makes the causal rule exact when queries are a subset (context parallelism). Rows with no allowed key
    output zeros. ``backend="auto"`` takes the Triton kernel on CUDA and the reference elsewhere.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    check_attention_inputs(q, k, v, q_bam, k_bam, q_segments, k_segments, q_positions, k_positions)
    b, sq, sk, d = q.shape[0], q.shape[2], k.shape[2], q.shape[3]
    if q_positions is None:
        q_positions = torch.arange(sq, device=q.device).expand(b, sq)
    if k_positions is None:
        k_positions = torch.arange(sk, device=q.device).expand(b, sk)
    scale = d ** -0.5 if scale is None else scale
    if backend == "triton" or (backend == "auto" and _triton_available(q)):
        from lightning_mm.kernels import bitfield_attention as triton_attention
        return triton_attention(q, k, v, q_bam, k_bam, q_segments=q_segments, k_segments=k_segments,
                                q_positions=q_positions, k_positions=k_positions, scale=scale)
    return reference_attention(q, k, v, q_bam, k_bam, q_segments, k_segments, q_positions, k_positions, scale)


__all__ = ["bitfield_attention", "BACKENDS"]
