"""Forward kernels: FlashAttention-2 style tiles over a sparse list of key tiles, split-KV pieces, and the merge.

One program = one work item (batch row, query tile, a range of its key-tile list) x one query head. It keeps
the online softmax in base 2 (``exp2`` with the scale folded into ``log2(e) * scale``) and writes either the
final output and log-sum-exp, or, for a piece of a split query tile, a normalised fp32 partial output and its
log-sum-exp for :func:`merge_kernel`. Each tile's list holds its partial key tiles first, then its full ones, so
the program runs two branch-free loops (FlexAttention's split into masked and full blocks): the first evaluates
the rule in registers, the second has no mask work.
Rows with no allowed key end with ``l = 0``: output 0 and lse ``-inf``.
"""

import triton
import triton.language as tl

from lightning_mm.attention.kernels.matmul import tile_dot
from lightning_mm.attention.kernels.rule import allowed_tile, finish_softmax, load_key_tile, load_rows, load_tokens

@triton.jit
def _key_tiles(acc, m_i, l_i, q, qw, qp, qs, k_base, v_base, KW, KP, KS, KvIdx, list_base, lo, hi,
               stride_ks, stride_vs, offs_d, d_ok, Sk, scale_log2, window,
               MASKED: tl.constexpr, HAS_SEG: tl.constexpr, HAS_WINDOW: tl.constexpr,
               DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax over the key tiles ``KvIdx[lo:hi]``: with ``MASKED`` (partial tiles) the rule is evaluated
    per element, without it (full tiles) the loop has no mask work at all."""
    for it in range(lo, hi):
        offs_n, col_ok, k, v = load_key_tile(KvIdx, list_base + it, k_base, v_base, stride_ks, stride_vs, offs_d, d_ok,
                                             Sk, BLOCK_N)
        s = tile_dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * scale_log2
        if MASKED:
            kw, kp, ks = load_tokens(KW, KP, KS, offs_n, col_ok, HAS_SEG)
            ok = allowed_tile(qw[:, None], qp[:, None], qs[:, None], kw[None, :], kp[None, :], ks[None, :], window,
                              HAS_SEG, HAS_WINDOW)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def forward_kernel(
    Q, K, V, QW, KW, QP, KP, QS, KS, Out, Lse, PartO, PartLse,
    Items, KvIdx, KvPartial,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
    Hq, GROUPS, Sq, Sk, D, NQT, NKT, scale_log2, window,
    HAS_SEG: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One work item x one query head: the partial key tiles of its range (masked), then the full ones."""
    item = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(Items + item * 5 + 0).to(tl.int64)
    qt = tl.load(Items + item * 5 + 1)
    start = tl.load(Items + item * 5 + 2)
    end = tl.load(Items + item * 5 + 3)
    slot = tl.load(Items + item * 5 + 4)
    hk = h // GROUPS
    n_partial = tl.load(KvPartial + b * NQT + qt)

    offs_m = qt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Sq
    d_ok = offs_d < D
    q = load_rows(Q + b * stride_qb + h * stride_qh, offs_m, stride_qs, offs_d, row_ok[:, None] & d_ok[None, :])
    qw, qp, qs = load_tokens(QW + b * Sq, QP + b * Sq, QS + b * Sq, offs_m, row_ok, HAS_SEG)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    list_base = (b * NQT + qt) * NKT

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, m_i, l_i = _key_tiles(acc, m_i, l_i, q, qw, qp, qs, k_base, v_base, KW + b * Sk, KP + b * Sk, KS + b * Sk,
                               KvIdx, list_base, start, tl.minimum(end, n_partial), stride_ks, stride_vs, offs_d,
                               d_ok, Sk, scale_log2, window, True, HAS_SEG, HAS_WINDOW, DOT_PRECISION, UPCAST_DOT,
                               BLOCK_N)
    acc, m_i, l_i = _key_tiles(acc, m_i, l_i, q, qw, qp, qs, k_base, v_base, KW + b * Sk, KP + b * Sk, KS + b * Sk,
                               KvIdx, list_base, tl.maximum(start, n_partial), end, stride_ks, stride_vs, offs_d,
                               d_ok, Sk, scale_log2, window, False, HAS_SEG, HAS_WINDOW, DOT_PRECISION, UPCAST_DOT,
                               BLOCK_N)

    o, lse = finish_softmax(acc, l_i, m_i)
    o_mask = row_ok[:, None] & d_ok[None, :]
    if slot == -1:
        tl.store(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
                 o.to(Out.dtype.element_ty), mask=o_mask)
        tl.store(Lse + (b * Hq + h) * Sq + offs_m, lse, mask=row_ok)
    elif slot >= 0:
        piece = (slot.to(tl.int64) * Hq + h) * BLOCK_M
        rows = tl.arange(0, BLOCK_M)
        tl.store(PartO + (piece + rows[:, None]) * BLOCK_D + offs_d[None, :], o, mask=o_mask)
        tl.store(PartLse + piece + rows, lse)


@triton.jit
def merge_kernel(
    Out, Lse, PartO, PartLse, Merges,
    stride_ob, stride_oh, stride_os, Hq, Sq, D,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Combine the split pieces of one query tile: ``lse = log2 sum 2^lse_p``, ``o = sum 2^(lse_p - lse) o_p``
    (one program per query tile; tiles of a single piece store nothing)."""
    idx = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(Merges + idx * 4 + 0).to(tl.int64)
    qt = tl.load(Merges + idx * 4 + 1)
    first = tl.load(Merges + idx * 4 + 2)
    count = tl.load(Merges + idx * 4 + 3)
    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_m = qt * BLOCK_M + rows
    row_ok = offs_m < Sq
    d_ok = offs_d < D

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first64 = first.to(tl.int64)
    for j in range(0, count):
        piece = ((first64 + j) * Hq + h) * BLOCK_M
        lse_p = tl.load(PartLse + piece + rows)
        o_p = tl.load(PartO + (piece + rows[:, None]) * BLOCK_D + offs_d[None, :],
                      mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_new = tl.maximum(m_i, lse_p)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        w = tl.math.exp2(lse_p - m_safe)
        l_i = l_i * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o_p
        m_i = m_new
    o, lse = finish_softmax(acc, l_i, m_i)
    if count > 1:  # a tile of one piece was written by its forward item
        tl.store(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
                 o.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(Lse + (b * Hq + h) * Sq + offs_m, lse, mask=row_ok)
