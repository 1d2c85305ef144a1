"""Input checks shared by every bitfield attention backend (raised before any kernel or collective runs)."""

from __future__ import annotations

from lightning_mm import masks


def check_attention_inputs(q, k, v, q_bam, k_bam, q_segments=None, k_segments=None, q_positions=None,
                           k_positions=None) -> None:
    """q ``[B,Hq,Sq,D]``, k/v ``[B,Hkv,Sk,D]`` with Hq a multiple of Hkv; words, segments and positions one per
    token (``[B,Sq]`` / ``[B,Sk]``); segments for both sides or neither."""
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] \
            or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need q [B,Hq,Sq,D], k and v "
                         "[B,Hkv,Sk,D] of one shape, the same batch and head dim, and query heads a multiple of "
                         "key/value heads")
    b, sq, sk = q.shape[0], q.shape[2], k.shape[2]
    for name, t, s in (("q_bam", q_bam, sq), ("k_bam", k_bam, sk), ("q_positions", q_positions, sq),
                       ("k_positions", k_positions, sk)):
        if t is not None and tuple(t.shape) != (b, s):
            raise ValueError(f"{name} must be a [B, S] = ({b}, {s}) tensor, got {tuple(t.shape)}")
    masks.validate(q_bam, q_segments)
    masks.validate(k_bam, k_segments)
    if (q_segments is None) != (k_segments is None):
        raise ValueError("give segment ids for both queries and keys, or for neither")
