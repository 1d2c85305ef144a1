"""Backward kernels (FlashAttention-2 / FlexAttention style): delta, dk/dv per key tile, dq per query tile.

``delta_kernel`` computes ``Delta = rowsum(dO * O)`` once, before the two passes. Both passes recompute
probabilities from the saved base-2 log-sum-exp, ``p = 2^(s*log2e*scale - lse)``, and walk the sparse tile lists:
the dk/dv program of key tile j visits only the query tiles that attend j (the transposed class map) and loops
over the query heads of its KV head group (GQA), so dk/dv need no atomics; the dq program of query tile i visits
only the key tiles i attends. Each list holds the partial tiles first, then the full ones, so each pass runs a
masked loop (the rule evaluated per element) and an unmasked one (no mask work). Rows with no allowed key have
lse ``-inf``; it is replaced by ``+inf`` so their p is 0. Work items are ``(batch row, tile)`` pairs, heaviest first.
With ``ATOMIC_DQ`` the dk/dv pass also adds each tile's ``ds @ k`` into an fp32 dq buffer with atomic adds
(FlashAttention-2's CUDA backward: five products per tile instead of four plus the dq pass's three; the order of
the adds, so dq's last bits, vary from run to run), and the dq pass does not run.
"""

import triton
import triton.language as tl

from lightning_mm.attention.kernels.matmul import tile_dot
from lightning_mm.attention.kernels.rule import allowed_tile, load_key_tile, load_rows, load_tokens


@triton.jit
def delta_kernel(O, DO, Delta, stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos, Hq, Sq, D,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """``Delta[b, h, i] = sum_d O[b, h, i, d] * dO[b, h, i, d]`` in fp32, one program per (row block, b * Hq + h)."""
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // Hq, bh % Hq
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = offs_m < Sq
    mask = ok[:, None] & (offs_d < D)[None, :]
    o = load_rows(O + b * stride_ob + h * stride_oh, offs_m, stride_os, offs_d, mask).to(tl.float32)
    do = load_rows(DO + b * stride_dob + h * stride_doh, offs_m, stride_dos, offs_d, mask).to(tl.float32)
    tl.store(Delta + bh * Sq + offs_m, tl.sum(o * do, 1), mask=ok)


@triton.jit
def load_lse_delta(Lse, Delta, offs, ok):
    """Saved log-sum-exp (``-inf`` -> ``+inf`` so empty rows give p = 0) and ``rowsum(dO * O)`` of some rows."""
    lse = tl.load(Lse + offs, mask=ok, other=0.0)
    return tl.where(lse == float("-inf"), float("inf"), lse), tl.load(Delta + offs, mask=ok, other=0.0)


@triton.jit
def _query_tiles(dk, dv, k, v, kw, kp, ks, q_base, do_base, dq_base, QW, QP, QS, Lse, Delta, row_base, QIdx,
                 list_base, lo, hi, stride_qs, stride_dos, offs_d, d_ok, Sq, D, scale_log2, window,
                 MASKED: tl.constexpr, HAS_SEG: tl.constexpr, HAS_WINDOW: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_M: tl.constexpr):
    """dk, dv of one key tile accumulated over the query tiles ``QIdx[lo:hi]`` of one head (``MASKED``: partial
    tiles, the rule per element; otherwise full tiles, no mask work); with ``ATOMIC_DQ`` each tile's share of dq
    (unscaled, fp32) is added at ``dq_base``."""
    for it in range(lo, hi):
        qt = tl.load(QIdx + list_base + it)
        offs_m = qt * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < Sq
        q_mask = row_ok[:, None] & d_ok[None, :]
        q = load_rows(q_base, offs_m, stride_qs, offs_d, q_mask)
        do = load_rows(do_base, offs_m, stride_dos, offs_d, q_mask)
        lse, delta = load_lse_delta(Lse, Delta, row_base + offs_m, row_ok)
        p_t = tl.math.exp2(tile_dot(k, tl.trans(q), DOT_PRECISION, UPCAST_DOT) * scale_log2 - lse[None, :])
        if MASKED:
            qw, qp, qs = load_tokens(QW, QP, QS, offs_m, row_ok, HAS_SEG)
            ok_t = allowed_tile(qw[None, :], qp[None, :], qs[None, :], kw[:, None], kp[:, None], ks[:, None],
                                window, HAS_SEG, HAS_WINDOW)
            p_t = tl.where(ok_t, p_t, 0.0)
        dv += tile_dot(p_t.to(do.dtype), do, DOT_PRECISION, UPCAST_DOT)
        dp_t = tile_dot(v, tl.trans(do), DOT_PRECISION, UPCAST_DOT)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tile_dot(ds_t.to(q.dtype), q, DOT_PRECISION, UPCAST_DOT)
        if ATOMIC_DQ:
            dq = tile_dot(tl.trans(ds_t).to(k.dtype), k, DOT_PRECISION, UPCAST_DOT)
            tl.atomic_add(dq_base + offs_m[:, None] * D + offs_d[None, :], dq, mask=q_mask)
    return dk, dv


@triton.jit
def dkdv_kernel(
    Q, K, V, DO, DK, DV, DQ32, Lse, Delta, QW, KW, QP, KP, QS, KS,
    Items, QCount, QPartial, QIdx,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos,
    stride_dkb, stride_dkh, stride_dks,
    Hq, GROUPS, Sq, Sk, D, NQT, NKT, scale, scale_log2, window,
    HAS_SEG: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):
    item = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.load(Items + item * 2 + 0).to(tl.int64)
    kt = tl.load(Items + item * 2 + 1)
    count = tl.load(QCount + b * NKT + kt)
    n_partial = tl.load(QPartial + b * NKT + kt)
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
        dq_base = DQ32 + row_base * D  # [B, Hq, Sq, D] fp32, contiguous
        dk, dv = _query_tiles(dk, dv, k, v, kw, kp, ks, q_base, do_base, dq_base, QW + b * Sq, QP + b * Sq,
                              QS + b * Sq, Lse, Delta, row_base, QIdx, list_base, 0, n_partial, stride_qs,
                              stride_dos, offs_d, d_ok, Sq, D, scale_log2, window, True, HAS_SEG, HAS_WINDOW,
                              ATOMIC_DQ, DOT_PRECISION, UPCAST_DOT, BLOCK_M)
        dk, dv = _query_tiles(dk, dv, k, v, kw, kp, ks, q_base, do_base, dq_base, QW + b * Sq, QP + b * Sq,
                              QS + b * Sq, Lse, Delta, row_base, QIdx, list_base, n_partial, count, stride_qs,
                              stride_dos, offs_d, d_ok, Sq, D, scale_log2, window, False, HAS_SEG, HAS_WINDOW,
                              ATOMIC_DQ, DOT_PRECISION, UPCAST_DOT, BLOCK_M)
    out_off = b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :]
    tl.store(DK + out_off, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _key_tiles_dq(dq, q, do, lse, delta, qw, qp, qs, k_base, v_base, KW, KP, KS, KvIdx, list_base, lo, hi,
                  stride_ks, stride_vs, offs_d, d_ok, Sk, scale_log2, window,
                  MASKED: tl.constexpr, HAS_SEG: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_N: tl.constexpr):
    """dq of one query tile accumulated over the key tiles ``KvIdx[lo:hi]`` (``MASKED`` as in ``_query_tiles``)."""
    for it in range(lo, hi):
        offs_n, col_ok, k, v = load_key_tile(KvIdx, list_base + it, k_base, v_base, stride_ks, stride_vs, offs_d, d_ok,
                                             Sk, BLOCK_N)
        p = tl.math.exp2(tile_dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * scale_log2 - lse[:, None])
        if MASKED:
            kw, kp, ks = load_tokens(KW, KP, KS, offs_n, col_ok, HAS_SEG)
            ok = allowed_tile(qw[:, None], qp[:, None], qs[:, None], kw[None, :], kp[None, :], ks[None, :], window,
                              HAS_SEG, HAS_WINDOW)
            p = tl.where(ok, p, 0.0)
        dp = tile_dot(do, tl.trans(v), DOT_PRECISION, UPCAST_DOT)
        ds = p * (dp - delta[:, None])
        dq += tile_dot(ds.to(k.dtype), k, DOT_PRECISION, UPCAST_DOT)
    return dq


@triton.jit
def dq_kernel(
    Q, K, V, DO, DQ, Lse, Delta, QW, KW, QP, KP, QS, KS,
    Items, KvCount, KvPartial, KvIdx,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos,
    stride_dqb, stride_dqh, stride_dqs,
    Hq, GROUPS, Sq, Sk, D, NQT, NKT, scale, scale_log2, window,
    HAS_SEG: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    item = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(Items + item * 2 + 0).to(tl.int64)
    qt = tl.load(Items + item * 2 + 1)
    count = tl.load(KvCount + b * NQT + qt)
    n_partial = tl.load(KvPartial + b * NQT + qt)
    hk = h // GROUPS
    offs_m = qt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Sq
    d_ok = offs_d < D
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = load_rows(Q + b * stride_qb + h * stride_qh, offs_m, stride_qs, offs_d, q_mask)
    do = load_rows(DO + b * stride_dob + h * stride_doh, offs_m, stride_dos, offs_d, q_mask)
    lse, delta = load_lse_delta(Lse, Delta, (b * Hq + h) * Sq + offs_m, row_ok)
    qw, qp, qs = load_tokens(QW + b * Sq, QP + b * Sq, QS + b * Sq, offs_m, row_ok, HAS_SEG)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    list_base = (b * NQT + qt) * NKT
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq = _key_tiles_dq(dq, q, do, lse, delta, qw, qp, qs, k_base, v_base, KW + b * Sk, KP + b * Sk, KS + b * Sk,
                       KvIdx, list_base, 0, n_partial, stride_ks, stride_vs, offs_d, d_ok, Sk, scale_log2, window,
                       True, HAS_SEG, HAS_WINDOW, DOT_PRECISION, UPCAST_DOT, BLOCK_N)
    dq = _key_tiles_dq(dq, q, do, lse, delta, qw, qp, qs, k_base, v_base, KW + b * Sk, KP + b * Sk, KS + b * Sk,
                       KvIdx, list_base, n_partial, count, stride_ks, stride_vs, offs_d, d_ok, Sk, scale_log2,
                       window, False, HAS_SEG, HAS_WINDOW, DOT_PRECISION, UPCAST_DOT, BLOCK_N)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)
