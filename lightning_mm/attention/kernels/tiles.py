"""Tile classification: for every (query tile, key tile) pair, is it skipped, full or partial?

The classes come from per-tile summaries of the words, never from an [Sq, Sk] mask. A tile is summarised by
its distinct (word, segment) groups and the min and max position of each group. Within one group the mask rule
depends on position only through ``j <= i``, so

* some pair of two tiles is allowed iff some group pair is allowed at (query max position, key min position);
* every pair is allowed iff every group pair is allowed at (query min position, key max position).

Both are evaluated with :func:`lightning_mm.attention.mask.allowed` on the summaries, so the classes are exact and use
the one implementation of the rule. A sliding window (``masks.in_window``: ``q_pos - k_pos < window``) adds
a condition on the closest pair for "some" (query min position, key max position) and on the farthest pair for
"every" (query max position, key min position): tiles entirely outside the window are skipped, tiles it cuts
are partial and the kernels apply the window per element. With a window, "some" is exact when each group's
positions are contiguous; a group with gaps (a text group split by an image, CP's scattered query blocks) can
make a tile partial although none of its pairs is allowed, which costs time, never correctness.

The summaries have a fixed width U (``GROUPS_PER_TILE``), so classification is a fixed sequence of device ops
with no host read (once per microbatch, cached by the caller). A tile with more than U groups (many tiny packed
samples) is classified from its bounds instead: partial if the segment ranges overlap and the window reaches,
else skipped, which costs time, never correctness. Memory is O(B * nq * U * nk * U) per chunk of query tiles.
Tokens past the end of the sequence count as padding (word 0), so a ragged last tile
is never "full" and the kernels mask it.
"""

from __future__ import annotations

import math

import torch

from lightning_mm.attention import mask as masks

SKIP, FULL, PARTIAL = 0, 1, 2
GROUPS_PER_TILE = 8  # groups summarised per tile; a tile with more is classified from its bounds (see below)
_PAIR_BUDGET = 1 << 24  # group pairs evaluated at once (bounds the temporary memory)


def _pad_to_tiles(x: torch.Tensor, tile: int) -> torch.Tensor:
    n = math.ceil(x.shape[-1] / tile) * tile
    return torch.nn.functional.pad(x, (0, n - x.shape[-1]))


def _scatter(shape, slot, values, reduce: str, fill: int) -> torch.Tensor:
    out = torch.full(shape, fill, dtype=torch.int64, device=slot.device)
    return out.scatter_reduce(-1, slot, values, reduce)


def tile_summary(words: torch.Tensor, seg: torch.Tensor, pos: torch.Tensor, tile: int,
                 width: int = GROUPS_PER_TILE):
    """Distinct (word, segment) groups of each tile of ``[B, S]`` rows: ``(word, seg, min_pos, max_pos, valid)``,
    each ``[B, n, width]``, then ``bounds`` ``[B, n, 4]`` (min/max position, min/max segment of the tile) and
    ``overflow`` ``[B, n]`` (the tile has more than ``width`` groups; only its bounds are then exact).

    Device-only and of fixed shape (no ``torch.unique``, no host reads): the tokens of each tile are sorted by
    (word, segment) and a group starts wherever either changes.
    """
    w, g, p = (_pad_to_tiles(t, tile) for t in (words, seg, pos))
    b, n = w.shape[0], w.shape[-1] // tile
    w, g, p = (t.reshape(b, n, tile) for t in (w, g, p))
    g, order = torch.sort(g, dim=-1, stable=True)
    w, p = w.gather(-1, order), p.gather(-1, order)
    w, order = torch.sort(w, dim=-1, stable=True)
    g, p = g.gather(-1, order), p.gather(-1, order)
    start = torch.ones_like(w, dtype=torch.bool)
    start[..., 1:] = (w[..., 1:] != w[..., :-1]) | (g[..., 1:] != g[..., :-1])
    group = start.to(torch.int64).cumsum(-1) - 1
    slot = group.clamp(max=width)  # slot ``width`` gathers the groups past the summary
    shape = (b, n, width + 1)
    big = torch.iinfo(torch.int64).max
    out = [_scatter(shape, slot, w, "amax", 0), _scatter(shape, slot, g, "amax", 0),
           _scatter(shape, slot, p, "amin", big), _scatter(shape, slot, p, "amax", -big)]
    valid = torch.arange(width, device=w.device) <= group[..., -1:]
    bounds = torch.stack([p.amin(-1), p.amax(-1), g.amin(-1), g.amax(-1)], -1)
    return (*(o[..., :width] for o in out), valid, bounds, group[..., -1] >= width)


def _bounds_classes(qb, kb, q_over, k_over, window: int | None) -> torch.Tensor:
    """PARTIAL where a tile with too many groups may have an allowed pair by its bounds (segment ranges overlap,
    window reached), SKIP where it cannot, for the pairs involving such a tile; -1 elsewhere."""
    q_b, k_b = qb.unsqueeze(2), kb.unsqueeze(1)  # [B, m, 1, 4], [B, 1, nk, 4]
    some = (q_b[..., 2] <= k_b[..., 3]) & (k_b[..., 2] <= q_b[..., 3])
    if window is not None:
        some &= masks.in_window(q_b[..., 0], k_b[..., 1], window)
    over = q_over.unsqueeze(2) | k_over.unsqueeze(1)
    return torch.where(over, torch.where(some, PARTIAL, SKIP), -1)


def _classes(qs, ks, window: int | None = None) -> torch.Tensor:
    """Classes [B, nq, nk] from the query and key tile summaries."""
    qw, qg, qmin, qmax, qv, qb, q_over = qs
    kw, kg, kmin, kmax, kv, kb, k_over = ks
    b, nq, uq = qw.shape
    nk, uk = kw.shape[1:]
    kw_f, kg_f, kmin_f, kmax_f, kv_f = (t.reshape(b, -1) for t in (kw, kg, kmin, kmax, kv))
    out = torch.empty(b, nq, nk, dtype=torch.int8, device=qw.device)
    step = max(1, _PAIR_BUDGET // max(1, b * uq * nk * uk))
    for a in range(0, nq, step):  # bounded by the shapes: no host read
        sl = slice(a, a + step)
        m = qw[:, sl].shape[1]
        qw_f, qg_f = qw[:, sl].reshape(b, -1), qg[:, sl].reshape(b, -1)
        some = masks.allowed(qw_f, kw_f, qmax[:, sl].reshape(b, -1), kmin_f, qg_f, kg_f)
        every = masks.allowed(qw_f, kw_f, qmin[:, sl].reshape(b, -1), kmax_f, qg_f, kg_f)
        if window is not None:
            some &= masks.in_window(qmin[:, sl].reshape(b, -1, 1), kmax_f.unsqueeze(1), window)
            every &= masks.in_window(qmax[:, sl].reshape(b, -1, 1), kmin_f.unsqueeze(1), window)
        present = qv[:, sl].reshape(b, -1, 1) & kv_f.unsqueeze(1)
        some = (some & present).view(b, m, uq, nk, uk).any(4).any(2)
        every = (every | ~present).view(b, m, uq, nk, uk).all(4).all(2)
        exact = torch.where(every, FULL, torch.where(some, PARTIAL, SKIP))
        coarse = _bounds_classes(qb[:, sl], kb, q_over[:, sl], k_over, window)
        out[:, sl] = torch.where(coarse >= 0, coarse, exact).to(torch.int8)
    return out


def tile_classes(q_words, k_words, q_pos, k_pos, q_seg, k_seg, tile_q: int, tile_k: int,
                 window: int | None = None) -> torch.Tensor:
    """int8 ``[B, ceil(Sq/tile_q), ceil(Sk/tile_k)]``: SKIP (0), FULL (1) or PARTIAL (2) for each tile pair;
    ``window``: a sliding window in tokens (None = none). Runs on the words' device with no host read."""
    if q_seg is None:
        q_seg, k_seg = torch.zeros_like(q_words), torch.zeros_like(k_words)
    qs = tile_summary(q_words, q_seg.long(), q_pos.long(), tile_q)
    ks = tile_summary(k_words, k_seg.long(), k_pos.long(), tile_k)
    return _classes(qs, ks, window)


def tile_lists(classes: torch.Tensor):
    """Sparse form of a class map [B, n, m] along its last axis: (count [B,n], partial [B,n], index [B,n,m]).

    For each row tile, the partial column tiles come first, then the full ones (each in ascending order); the
    first ``partial`` entries take the masked path of the kernels, the next ``count - partial`` the unmasked one,
    and skipped tiles are never visited. Device-only: a stable sort, no host read.
    """
    order = torch.argsort(PARTIAL - classes, dim=-1, stable=True)  # PARTIAL (0), FULL (1), SKIP (2)
    count = (classes != SKIP).sum(-1).to(torch.int32)
    partial = (classes == PARTIAL).sum(-1).to(torch.int32)
    return count.contiguous(), partial.contiguous(), order.to(torch.int32).contiguous()
