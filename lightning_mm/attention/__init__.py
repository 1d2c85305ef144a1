"""Bitfield attention: one entry point, several backends, registered with transformers' AttentionInterface."""

from __future__ import annotations

import torch

from lightning_mm import masks
from lightning_mm.attention.reference import reference_attention

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
    b, hq, sq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or hq % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need k == v in shape, the same "
                         "batch and head dim, and query heads a multiple of key/value heads")
    sk = k.shape[2]
    if q_bam.shape != (b, sq) or k_bam.shape != (b, sk):
        raise ValueError(f"q_bam {tuple(q_bam.shape)} / k_bam {tuple(k_bam.shape)} must be [B,Sq]=({b},{sq}) / "
                         f"[B,Sk]=({b},{sk})")
    masks.validate(q_bam, q_segments)
    masks.validate(k_bam, k_segments)
    if (q_segments is None) != (k_segments is None):
        raise ValueError("give segment ids for both queries and keys, or for neither")
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


from lightning_mm.attention.hf import ATTENTION_NAME, register  # noqa: E402

register()

__all__ = ["bitfield_attention", "reference_attention", "ATTENTION_NAME", "register", "BACKENDS"]
