"""The mask rule of :func:`lightning_mm.masks.allowed`, evaluated on a tile in registers (Triton).

Arguments broadcast: query words/positions/segments shaped [M, 1] and key ones [1, N] give an [M, N] tile,
the transposed shapes give the [N, M] tile the dk/dv kernel needs.
"""

import triton
import triton.language as tl

CAUSAL_BIT = tl.constexpr(1 << 62)
MODALITY_MASK = tl.constexpr((1 << 62) - 1)


@triton.jit
def allowed_tile(qw, qp, qs, kw, kp, ks, HAS_SEG: tl.constexpr):
    """Boolean tile: query may attend key (words int64, positions int64, segments any int)."""
    q_mod = qw & MODALITY_MASK
    k_mod = kw & MODALITY_MASK
    is_causal = (qw & CAUSAL_BIT) != 0
    ok_causal = (kp <= qp) & ((q_mod & k_mod) != 0)
    ok_plain = q_mod == k_mod
    ok = tl.where(is_causal, ok_causal, ok_plain) & (qw != 0) & (kw != 0)
    if HAS_SEG:
        ok = ok & (qs == ks)
    return ok
