"""The mask rule of :func:`lightning_mm.attention.mask.allowed`, evaluated on a tile in registers (Triton).

Arguments broadcast: query words/positions/segments shaped [M, 1] and key ones [1, N] give an [M, N] tile,
the transposed shapes give the [N, M] tile the dk/dv kernel needs.
"""

import triton
import triton.language as tl

CAUSAL_BIT = tl.constexpr(1 << 62)
SPAN_BIT = tl.constexpr(1 << 61)
MODALITY_MASK = tl.constexpr((1 << 61) - 1)


@triton.jit
def allowed_tile(qw, qp, qs, kw, kp, ks, window, HAS_SEG: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Boolean tile: query may attend key (words int64, positions int64, segments any int); with ``HAS_WINDOW``
    also ``qp - kp < window`` for every pair (``masks.in_window``)."""
    q_mod = qw & MODALITY_MASK
    k_mod = kw & MODALITY_MASK
    is_causal = (qw & CAUSAL_BIT) != 0
    ok_plain = q_mod == k_mod
    ok_causal = ((kp <= qp) & ((q_mod & k_mod) != 0)) | (((qw & SPAN_BIT) != 0) & ok_plain)
    ok = tl.where(is_causal, ok_causal, ok_plain) & (qw != 0) & (kw != 0)
    if HAS_SEG:
        ok = ok & (qs == ks)
    if HAS_WINDOW:
        ok = ok & ((qp - kp) < window)
    return ok


@triton.jit
def load_tokens(W, P, S, offs, ok, HAS_SEG: tl.constexpr):
    """Words, positions and segments of the tokens ``offs`` of one row (``W/P/S`` point at the row's start);
    without segments the words stand in for them (the rule then ignores them)."""
    w = tl.load(W + offs, mask=ok, other=0)
    p = tl.load(P + offs, mask=ok, other=0)
    if HAS_SEG:
        s = tl.load(S + offs, mask=ok, other=0)
    else:
        s = w
    return w, p, s


@triton.jit
def load_rows(base, offs, stride, offs_d, mask):
    """A ``[len(offs), BLOCK_D]`` tile of a ``[..., S, D]`` tensor whose head starts at ``base``."""
    return tl.load(base + offs[:, None] * stride + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def load_key_tile(KvIdx, at, k_base, v_base, stride_ks, stride_vs, offs_d, d_ok, Sk, BLOCK_N: tl.constexpr):
    """The key tile listed at ``KvIdx + at``: its token offsets, which of them lie in the sequence, its K and V."""
    offs_n = tl.load(KvIdx + at) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < Sk
    kv_mask = col_ok[:, None] & d_ok[None, :]
    return (offs_n, col_ok, load_rows(k_base, offs_n, stride_ks, offs_d, kv_mask),
            load_rows(v_base, offs_n, stride_vs, offs_d, kv_mask))


@triton.jit
def finish_softmax(acc, l_i, m_i):
    """Output and base-2 log-sum-exp of an online softmax; rows that saw no allowed key give 0 and -inf."""
    live = l_i > 0
    o = acc / tl.where(live, l_i, 1.0)[:, None]
    lse = tl.where(live, m_i + tl.math.log2(tl.where(live, l_i, 1.0)), float("-inf"))
    return o, lse
