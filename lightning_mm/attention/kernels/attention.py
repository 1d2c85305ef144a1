"""The differentiable Triton bitfield attention: validation, tile maps, launches and the autograd Function."""

from __future__ import annotations

import math

import torch
import triton

from lightning_mm.attention.mask import check_attention_inputs, check_window
from lightning_mm.attention.kernels import split, tiles
from lightning_mm.attention.kernels.backward import delta_kernel, dkdv_kernel, dq_kernel
from lightning_mm.attention.kernels.launch_config import KernelConfig, default_config, interpreting, num_sms
from lightning_mm.attention.kernels.forward import forward_kernel, merge_kernel

LOG2E = 1.4426950408889634
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def _check_inputs(q, k, v, q_bam, k_bam, q_segments, k_segments, q_positions, k_positions, cache=None):
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype}: the Triton kernels take one of {DTYPES} "
                        "for all three; cast them to the same dtype")
    check_attention_inputs(q, k, v, q_bam, k_bam, q_segments, k_segments, q_positions, k_positions, cache)
    if q_positions is None or k_positions is None:
        raise ValueError("the Triton kernels need q_positions and k_positions (global token indices [B, S]); "
                         "call lightning_mm.attention.bitfield_attention, which defaults them")
    d = q.shape[3]
    if not 16 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} is not supported by the Triton kernels (16..{MAX_HEAD_DIM}); "
                         "use backend='reference'")
    devices = {t.device for t in (q, k, v, q_bam, k_bam, q_positions, k_positions) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if not q.is_cuda and not interpreting():
        raise RuntimeError("the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
                           "imported to run them on the CPU interpreter; otherwise use backend='reference'")


def _int64(t):
    return None if t is None else t.to(torch.int64).contiguous()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Last dim contiguous (the kernels index it with stride 1)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _dot_flags(q) -> dict:
    """fp32 products in full precision (no tf32); bf16 upcast only under the interpreter (see matmul.py)."""
    return dict(DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                UPCAST_DOT=bool(not q.is_cuda and q.dtype == torch.bfloat16))


def _window_arg(maps) -> int:
    """The window as the kernels' int argument (unused without ``HAS_WINDOW``), clamped to int32."""
    return 0 if maps.window is None else min(maps.window, 2 ** 31 - 1)


def launch(kernel, grid, *args, **meta):
    """Every kernel launch goes through here (one place to observe them; tests count host reads around it)."""
    kernel[grid](*args, **meta)


class TileMaps:
    """The tile tables of one mask, built on its device once per microbatch with no host read: forward/dq lists
    over key tiles and dk/dv lists over query tiles (each ``(count, partial, index)``, see ``tiles.tile_lists``),
    the backward work items, and the forward work items per split length."""

    def __init__(self, words, cfg: KernelConfig, window: int | None = None):
        qw, kw, qp, kp, qs, ks = words
        self.window = window
        fwd = tiles.tile_classes(qw, kw, qp, kp, qs, ks, cfg.fwd_m, cfg.fwd_n, window)
        self.fwd = tiles.tile_lists(fwd)
        dq = fwd if (cfg.dq_m, cfg.dq_n) == (cfg.fwd_m, cfg.fwd_n) else \
            tiles.tile_classes(qw, kw, qp, kp, qs, ks, cfg.dq_m, cfg.dq_n, window)
        self.dq = self.fwd if dq is fwd else tiles.tile_lists(dq)
        kv = dq if (cfg.dkdv_m, cfg.dkdv_n) == (cfg.dq_m, cfg.dq_n) else \
            tiles.tile_classes(qw, kw, qp, kp, qs, ks, cfg.dkdv_m, cfg.dkdv_n, window)
        self.dkdv = tiles.tile_lists(kv.transpose(1, 2).contiguous())
        self.dq_items, self.dkdv_items = split.list_items(self.dq[0]), split.list_items(self.dkdv[0])
        self._forward_items = {}

    def forward_items(self, chunk: int):
        """``split.forward_items`` of the forward lists for a split length, built once per length."""
        if chunk not in self._forward_items:
            self._forward_items[chunk] = split.forward_items(self.fwd[0], chunk, self.fwd[2].shape[2])
        return self._forward_items[chunk]


def attention_forward(q, k, v, words, maps: TileMaps, scale: float, cfg: KernelConfig, kv_split: int | None):
    """Output [B,Hq,Sq,D] (q's dtype) and base-2 lse [B,Hq,Sq] fp32."""
    qw, kw, qp, kp, qs, ks = words
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    _, kv_partial, kv_idx = maps.fwd
    nqt, nkt = kv_idx.shape[1], kv_idx.shape[2]
    chunk = split.auto_chunk(b * nqt, nkt, hq, num_sms(q.device), cfg.min_split_tiles) if kv_split is None \
        else kv_split
    items, merges, n_slots = maps.forward_items(chunk)
    block_d = max(16, triton.next_power_of_2(d))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    part_o = torch.empty((max(n_slots, 1), hq, cfg.fwd_m, block_d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((max(n_slots, 1), hq, cfg.fwd_m), dtype=torch.float32, device=q.device)
    has_seg = qs is not None
    launch(
        forward_kernel, (items.shape[0], hq),
        q, k, v, qw, kw, qp, kp, qs if has_seg else qw, ks if has_seg else kw, out, lse, part_o, part_lse,
        items, kv_idx, kv_partial,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        hq, hq // hkv, sq, sk, d, nqt, nkt, scale * LOG2E, _window_arg(maps),
        HAS_SEG=has_seg, HAS_WINDOW=maps.window is not None, **_dot_flags(q),
        BLOCK_M=cfg.fwd_m, BLOCK_N=cfg.fwd_n, BLOCK_D=block_d, num_warps=cfg.fwd_warps, num_stages=cfg.stages)
    if merges.shape[0]:
        launch(
            merge_kernel, (merges.shape[0], hq), out, lse, part_o, part_lse, merges,
            out.stride(0), out.stride(1), out.stride(2), hq, sq, d,
            BLOCK_M=cfg.fwd_m, BLOCK_D=block_d, num_warps=4)
    return out, lse


def attention_backward(q, k, v, out, lse, dout, words, maps: TileMaps, scale: float, cfg: KernelConfig):
    """dq, dk, dv in the dtypes of q, k, v."""
    qw, kw, qp, kp, qs, ks = words
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    dout = _rows(dout)
    block_d = max(16, triton.next_power_of_2(d))
    delta = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    launch(delta_kernel, (triton.cdiv(sq, 64), b * hq), out, dout, delta, out.stride(0), out.stride(1),
           out.stride(2), dout.stride(0), dout.stride(1), dout.stride(2), hq, sq, d, BLOCK_M=64, BLOCK_D=block_d,
           num_warps=4)
    has_seg = qs is not None
    seg_q, seg_k = (qs, ks) if has_seg else (qw, kw)
    common = dict(HAS_SEG=has_seg, HAS_WINDOW=maps.window is not None, **_dot_flags(q), BLOCK_D=block_d,
                  num_warps=cfg.bwd_warps, num_stages=cfg.stages)

    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    dq32 = torch.zeros((b, hq, sq, d), dtype=torch.float32, device=q.device) if cfg.dq_atomic else delta
    q_count, q_partial, q_idx = maps.dkdv
    launch(
        dkdv_kernel, (maps.dkdv_items.shape[0], hkv),
        q, k, v, dout, dk, dv, dq32, lse, delta, qw, kw, qp, kp, seg_q, seg_k, maps.dkdv_items, q_count, q_partial,
        q_idx,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        hq, hq // hkv, sq, sk, d, q_idx.shape[2], q_idx.shape[1], scale, scale * LOG2E, _window_arg(maps),
        BLOCK_M=cfg.dkdv_m, BLOCK_N=cfg.dkdv_n, ATOMIC_DQ=cfg.dq_atomic, **common)
    if cfg.dq_atomic:
        return (dq32 * scale).to(q.dtype), dk, dv

    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    kv_count, kv_partial, kv_idx = maps.dq
    launch(
        dq_kernel, (maps.dq_items.shape[0], hq),
        q, k, v, dout, dq, lse, delta, qw, kw, qp, kp, seg_q, seg_k, maps.dq_items, kv_count, kv_partial, kv_idx,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        hq, hq // hkv, sq, sk, d, kv_idx.shape[1], kv_idx.shape[2], scale, scale * LOG2E, _window_arg(maps),
        BLOCK_M=cfg.dq_m, BLOCK_N=cfg.dq_n, **common)
    return dq, dk, dv


def tile_maps(words, originals, cfg: KernelConfig, cache: dict | None, window: int | None = None) -> TileMaps:
    """The tile maps of ``words``, reused from ``cache`` when an earlier call had the same mask tensors, kernel
    config and window (Gemma's local and global layers share a cache and keep one map each).

    Classifying the tiles costs many small launches (no host read), more than the attention itself at short
    sequence lengths, and every layer of a microbatch has the same mask. The cache holds the tensors it
    compared, so none of them can be freed and its memory reused while the entry lives.
    """
    if cache is None:
        return TileMaps(words, cfg, window)
    entries = cache.setdefault("tile_maps", [])
    for held, held_key, maps in entries:
        if held_key == (cfg, window) and len(held) == len(originals) \
                and all(a is b for a, b in zip(held, originals)):
            return maps
    maps = TileMaps(words, cfg, window)
    entries.append((originals, (cfg, window), maps))
    return maps


class _BitfieldAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, qw, kw, qp, kp, qs, ks, scale, cfg, kv_split, maps):
        words = (qw, kw, qp, kp, qs, ks)
        out, lse = attention_forward(q, k, v, words, maps, scale, cfg, kv_split)
        ctx.save_for_backward(q, k, v, out, lse, qw, kw, qp, kp, qs, ks)
        ctx.maps, ctx.scale, ctx.cfg = maps, scale, cfg
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, qw, kw, qp, kp, qs, ks = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, out, lse, dout, (qw, kw, qp, kp, qs, ks), ctx.maps, ctx.scale,
                                        ctx.cfg)
        return (dq, dk, dv) + (None,) * 10


def bitfield_attention(q, k, v, q_bam, k_bam, *, q_segments=None, k_segments=None, q_positions=None,
                       k_positions=None, scale=None, kv_split: int | None = None,
                       config: KernelConfig | None = None, cache: dict | None = None,
                       window: int | None = None) -> torch.Tensor:
    """Bitfield attention with the Triton kernels: q [B,Hq,Sq,D], k/v [B,Hkv,Sk,D] -> [B,Hq,Sq,D].

    Same semantics as :func:`lightning_mm.attention.bitfield_attention` (the mask rule of
    :func:`lightning_mm.attention.mask.allowed`; rows with no allowed key give zeros and zero gradients).
    ``kv_split``: key tiles per split-KV piece, ``None`` = chosen from the block workload, ``0`` = never split.
    ``config``: tile sizes (default from the device and head dim). ``cache``: a dict shared by calls with the same
    mask tensors (the layers of one microbatch): their tiles are classified once (:func:`tile_maps`).
    ``window``: a sliding window in tokens (``masks.in_window``), None = none: tiles outside it are skipped.
    """
    b, sq, sk = q.shape[0], q.shape[2], k.shape[2]
    originals = (q_bam, k_bam, q_positions, k_positions, q_segments, k_segments)  # the cache compares what was given
    if q_positions is None:
        q_positions = torch.arange(sq, device=q.device).expand(b, sq)
    if k_positions is None:
        k_positions = torch.arange(sk, device=q.device).expand(b, sk)
    _check_inputs(q, k, v, q_bam, k_bam, q_segments, k_segments, q_positions, k_positions, cache)
    if kv_split is not None and kv_split < 0:
        raise ValueError(f"kv_split={kv_split}: give None (automatic), 0 (off) or a positive number of key tiles")
    check_window(window)
    cfg = config or default_config(q)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    words = (_int64(q_bam), _int64(k_bam), _int64(q_positions), _int64(k_positions), _int64(q_segments),
             _int64(k_segments))
    maps = tile_maps(words, originals, cfg, cache, window)
    return _BitfieldAttention.apply(_rows(q), _rows(k), _rows(v), *words, scale, cfg, kv_split, maps)
