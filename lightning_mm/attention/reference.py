"""Exact bitfield attention in plain PyTorch, chunked over queries: memory O(chunk * Sk), forward and backward.

The backward recomputes each chunk's probabilities from the saved log-sum-exp (as FlashAttention does), so
nothing of size Sq * Sk is kept between forward and backward. Internally fp32 (fp64 for fp64 inputs); rows with no allowed key
output zeros.
"""

from __future__ import annotations

import torch

from lightning_mm.attention import mask as masks

DEFAULT_CHUNK = 1024


def _scores(q, k, qw, kw, qp, kp, qs, ks, scale, window=None):
    """Masked scores of one query chunk: q [B,H,c,D] fp32, k [B,H,Sk,D] -> [B,H,c,Sk] and the mask [B,1,c,Sk]."""
    ok = masks.allowed(qw, kw, qp, kp, qs, ks, window).unsqueeze(1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s.masked_fill(~ok, float("-inf")), ok


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand_kv(x, groups):
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class _ReferenceAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, qw, kw, qp, kp, qs, ks, scale, chunk, window):
        groups, dt = q.shape[1] // k.shape[1], _compute_dtype(q.dtype)
        kf, vf = _expand_kv(k.to(dt), groups), _expand_kv(v.to(dt), groups)
        out = torch.empty(q.shape, dtype=dt, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=dt, device=q.device)
        for a in range(0, q.shape[2], chunk):
            sl = slice(a, a + chunk)
            s, _ = _scores(q[:, :, sl].to(dt), kf, qw[:, sl], kw, qp[:, sl], kp,
                           None if qs is None else qs[:, sl], ks, scale, window)
            m = s.amax(-1, keepdim=True).clamp_min(-1e30)  # finite for fully masked rows
            p = torch.exp(s - m)
            denom = p.sum(-1, keepdim=True)
            out[:, :, sl] = torch.matmul(p / denom.clamp_min(1e-30), vf)
            lse[:, :, sl] = (m + torch.log(denom)).squeeze(-1)  # -inf where no key is allowed
        ctx.save_for_backward(q, k, v, out, lse, qw, kw, qp, kp, qs, ks)
        ctx.scale, ctx.chunk, ctx.groups, ctx.window = scale, chunk, groups, window
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, qw, kw, qp, kp, qs, ks = ctx.saved_tensors
        scale, chunk, groups = ctx.scale, ctx.chunk, ctx.groups
        dt = out.dtype
        kf, vf = _expand_kv(k.to(dt), groups), _expand_kv(v.to(dt), groups)
        dout = dout.to(dt)
        dq = torch.empty(q.shape, dtype=dt, device=q.device)
        dk = torch.zeros(kf.shape, dtype=dt, device=q.device)
        dv = torch.zeros_like(dk)
        for a in range(0, q.shape[2], chunk):
            sl = slice(a, a + chunk)
            qc = q[:, :, sl].to(dt)
            s, _ = _scores(qc, kf, qw[:, sl], kw, qp[:, sl], kp, None if qs is None else qs[:, sl], ks, scale,
                           ctx.window)
            p = torch.exp(s - lse[:, :, sl].unsqueeze(-1).clamp_min(-1e30))  # masked -> exp(-inf) = 0
            do = dout[:, :, sl]
            dv += torch.matmul(p.transpose(-1, -2), do)
            dp = torch.matmul(do, vf.transpose(-1, -2))
            delta = (do * out[:, :, sl]).sum(-1, keepdim=True)
            ds = p * (dp - delta) * scale
            dq[:, :, sl] = torch.matmul(ds, kf)
            dk += torch.matmul(ds.transpose(-1, -2), qc)
        if groups > 1:
            b, h, sk, d = dk.shape
            dk = dk.view(b, h // groups, groups, sk, d).sum(2)
            dv = dv.view(b, h // groups, groups, sk, d).sum(2)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 9


def reference_attention(q, k, v, q_bam, k_bam, q_segments=None, k_segments=None, q_positions=None,
                        k_positions=None, scale=None, chunk: int = DEFAULT_CHUNK, window: int | None = None):
    """Exact bitfield attention; see :func:`lightning_mm.attention.bitfield_attention` for the arguments."""
    masks.check_window(window)
    return _ReferenceAttention.apply(q, k, v, q_bam, k_bam, q_positions, k_positions, q_segments, k_segments,
                                     scale, chunk, window)
