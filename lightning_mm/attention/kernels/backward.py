"""Backward kernels (FlashAttention-2 style, no atomics): dk/dv per key tile, dq per query tile.

Both recompute probabilities from the saved base-2 log-sum-exp, ``p = 2^(s*log2e*scale - lse)``, and walk the
sparse tile lists: the dk/dv program of key tile j visits only the query tiles that attend j (the transposed
class map) and loops over the query heads of its KV head group (GQA), so dk/dv need no atomics. ``Delta`` is
``rowsum(dO * O)``. Rows with no allowed key have lse ``-inf``; it is replaced by ``+inf`` so their p is 0.
Work items are ``(batch row, tile, list length)`` triples, heaviest first.
"""

import triton
import triton.language as tl

from lightning_mm.attention.kernels.matmul import tile_dot
from lightning_mm.attention.kernels.rule import allowed_tile, finish_softmax, load_rows, load_tokens

PARTIAL_TILE = tl.constexpr(2)


@triton.jit
def load_lse_delta(Lse, Delta, offs, ok):
    """Saved log-sum-exp (``-inf`` -> ``+inf`` so empty rows give p = 0) and ``rowsum(dO * O)`` of some rows."""
    lse = tl.load(Lse + offs, mask=ok, other=0.0)
    return tl.where(lse == float("-inf"), float("inf"), lse), tl.load(Delta + offs, mask=ok, other=0.0)


@triton.jit
def dkdv_kernel(
    Q, K, V, DO, DK, DV, Lse, Delta, QW, KW, QP, KP, QS, KS,
    Items, QIdx, QCls,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos,
    stride_dkb, stride_dkh, stride_dks,
    Hq, GROUPS, Sq, Sk, D, NQT, NKT, scale, scale_log2, window,
    HAS_SEG: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    item = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.load(Items + item * 3 + 0).to(tl.int64)
    kt = tl.load(Items + item * 3 + 1)
    count = tl.load(Items + item * 3 + 2)
    offs_n = kt * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < Sk
    d_ok = offs_d < D
    kv_mask = col_ok[:, None] & d_ok[None, :]
    k = load_rows(K + b * stride_kb + hk * stride_kh, offs_n, stride_ks, offs_d, kv_mask)
    v = load_rows(V + b * stride_vb + hk * stride_vh, offs_n, stride_vs, offs_d, kv_mask)
    kw, kp, ks = load_tokens(KW + b * Sk, KP + b * Sk, KS + b * Sk, offs_n, col_ok, HAS_SEG)
    list_base = (b * NKT + kt) * NQT
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(0, GROUPS):
        h = hk * GROUPS + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        row_base = (b * Hq + h) * Sq
        for it in range(0, count):
            qt = tl.load(QIdx + list_base + it)
            cls = tl.load(QCls + list_base + it)
            offs_m = qt * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = offs_m < Sq
            q_mask = row_ok[:, None] & d_ok[None, :]
            q = load_rows(q_base, offs_m, stride_qs, offs_d, q_mask)
            do = load_rows(do_base, offs_m, stride_dos, offs_d, q_mask)
            lse, delta = load_lse_delta(Lse, Delta, row_base + offs_m, row_ok)
            s_t = tile_dot(k, tl.trans(q), DOT_PRECISION, UPCAST_DOT) * scale_log2  # [N, M]
            p_t = tl.math.exp2(s_t - lse[None, :])
            if cls == PARTIAL_TILE:
                qw, qp, qs = load_tokens(QW + b * Sq, QP + b * Sq, QS + b * Sq, offs_m, row_ok, HAS_SEG)
                ok_t = allowed_tile(qw[None, :], qp[None, :], qs[None, :], kw[:, None], kp[:, None], ks[:, None],
                                    window, HAS_SEG, HAS_WINDOW)
                p_t = tl.where(ok_t, p_t, 0.0)
            dv += tile_dot(p_t.to(do.dtype), do, DOT_PRECISION, UPCAST_DOT)
            dp_t = tile_dot(v, tl.trans(do), DOT_PRECISION, UPCAST_DOT)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tile_dot(ds_t.to(q.dtype), q, DOT_PRECISION, UPCAST_DOT)
    out_off = b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :]
    tl.store(DK + out_off, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def dq_kernel(
    Q, K, V, DO, DQ, Lse, Delta, QW, KW, QP, KP, QS, KS,
    Items, KvIdx, KvCls,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos,
    stride_dqb, stride_dqh, stride_dqs,
    Hq, GROUPS, Sq, Sk, D, NQT, NKT, scale, scale_log2, window,
    HAS_SEG: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    item = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(Items + item * 3 + 0).to(tl.int64)
    qt = tl.load(Items + item * 3 + 1)
    count = tl.load(Items + item * 3 + 2)
    hk = h // GROUPS
    offs_m = qt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Sq
    d_ok = offs_d < D
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = load_rows(Q + b * stride_qb + h * stride_qh, offs_m, stride_qs, offs_d, q_mask)
    do = load_rows(DO + b * stride_dob + h * stride_doh, offs_m, stride_dos, offs_d, q_mask)
    row_base = (b * Hq + h) * Sq
    lse, delta = load_lse_delta(Lse, Delta, row_base + offs_m, row_ok)
    qw, qp, qs = load_tokens(QW + b * Sq, QP + b * Sq, QS + b * Sq, offs_m, row_ok, HAS_SEG)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    list_base = (b * NQT + qt) * NKT
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for it in range(0, count):
        kt = tl.load(KvIdx + list_base + it)
        cls = tl.load(KvCls + list_base + it)
        offs_n = kt * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = offs_n < Sk
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = load_rows(k_base, offs_n, stride_ks, offs_d, kv_mask)
        v = load_rows(v_base, offs_n, stride_vs, offs_d, kv_mask)
        s = tile_dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * scale_log2
        p = tl.math.exp2(s - lse[:, None])
        if cls == PARTIAL_TILE:
            kw, kp, ks = load_tokens(KW + b * Sk, KP + b * Sk, KS + b * Sk, offs_n, col_ok, HAS_SEG)
            ok = allowed_tile(qw[:, None], qp[:, None], qs[:, None], kw[None, :], kp[None, :], ks[None, :], window,
                              HAS_SEG, HAS_WINDOW)
            p = tl.where(ok, p, 0.0)
        dp = tile_dot(do, tl.trans(v), DOT_PRECISION, UPCAST_DOT)
        ds = p * (dp - delta[:, None])
        dq += tile_dot(ds.to(k.dtype), k, DOT_PRECISION, UPCAST_DOT)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)
