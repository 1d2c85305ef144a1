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

Memory is O(nq * Uq * nk * Uk) per chunk of query tiles, where U is the number of distinct groups per tile (a
handful for real layouts). Tokens past the end of the sequence count as padding (word 0), so a ragged last tile
is never "full" and the kernels mask it.
"""

from __future__ import annotations

import math

import torch

from lightning_mm.attention import mask as masks

SKIP, FULL, PARTIAL = 0, 1, 2
_PAIR_BUDGET = 1 << 24  # group pairs evaluated at once (bounds the temporary memory)


def _pad_to_tiles(x: torch.Tensor, tile: int) -> torch.Tensor:
    n = math.ceil(x.shape[-1] / tile) * tile
    return torch.nn.functional.pad(x, (0, n - x.shape[-1]))


def tile_summary(words: torch.Tensor, seg: torch.Tensor, pos: torch.Tensor, tile: int):
    """Distinct (word, segment) groups of each tile of one row: ``(word, seg, min_pos, max_pos, valid)``, each [n, U].

    ``valid`` marks real groups (the rest is padding of the [n, U] layout).
    """
    w, g, p = (_pad_to_tiles(t, tile) for t in (words, seg, pos))
    n = w.shape[0] // tile
    t_idx = torch.arange(n, device=w.device).repeat_interleave(tile)
    uniq, inv = torch.unique(torch.stack([t_idx, w, g], 1), dim=0, return_inverse=True)
    big = torch.iinfo(torch.int64).max
    pmin = torch.full((len(uniq),), big, dtype=torch.int64, device=w.device).scatter_reduce(0, inv, p, "amin")
    pmax = torch.full((len(uniq),), -big, dtype=torch.int64, device=w.device).scatter_reduce(0, inv, p, "amax")
    counts = torch.bincount(uniq[:, 0], minlength=n)
    width = int(counts.max())
    slot = torch.arange(len(uniq), device=w.device) - (torch.cumsum(counts, 0) - counts)[uniq[:, 0]]
    out = [torch.zeros(n, width, dtype=torch.int64, device=w.device) for _ in range(4)]
    for o, val in zip(out, (uniq[:, 1], uniq[:, 2], pmin, pmax)):
        o[uniq[:, 0], slot] = val
    valid = torch.zeros(n, width, dtype=torch.bool, device=w.device)
    valid[uniq[:, 0], slot] = True
    return (*out, valid)


def _row_classes(qs, ks, window: int | None = None) -> torch.Tensor:
    """Classes [nq, nk] of one row from the query and key tile summaries."""
    qw, qg, qmin, qmax, qv = qs
    kw, kg, kmin, kmax, kv = ks
    nq, uq = qw.shape
    nk, uk = kw.shape
    kw_f, kg_f, kmin_f, kmax_f, kv_f = (t.reshape(-1) for t in (kw, kg, kmin, kmax, kv))
    out = torch.empty(nq, nk, dtype=torch.int8, device=qw.device)
    step = max(1, _PAIR_BUDGET // max(1, uq * nk * uk))
    for a in range(0, nq, step):
        sl = slice(a, a + step)
        m = qw[sl].shape[0]
        qw_f, qg_f = qw[sl].reshape(-1), qg[sl].reshape(-1)
        some = masks.allowed(qw_f, kw_f, qmax[sl].reshape(-1), kmin_f, qg_f, kg_f)
        every = masks.allowed(qw_f, kw_f, qmin[sl].reshape(-1), kmax_f, qg_f, kg_f)
        if window is not None:
            some &= masks.in_window(qmin[sl].reshape(-1, 1), kmax_f.reshape(1, -1), window)
            every &= masks.in_window(qmax[sl].reshape(-1, 1), kmin_f.reshape(1, -1), window)
        present = qv[sl].reshape(-1, 1) & kv_f.reshape(1, -1)
        some = (some & present).view(m, uq, nk, uk).any(3).any(1)
        every = (every | ~present).view(m, uq, nk, uk).all(3).all(1)
        out[sl] = torch.where(every, FULL, torch.where(some, PARTIAL, SKIP)).to(torch.int8)
    return out


def tile_classes(q_words, k_words, q_pos, k_pos, q_seg, k_seg, tile_q: int, tile_k: int,
                 window: int | None = None) -> torch.Tensor:
    """int8 ``[B, ceil(Sq/tile_q), ceil(Sk/tile_k)]``: SKIP (0), FULL (1) or PARTIAL (2) for each tile pair;
    ``window``: a sliding window in tokens (None = none)."""
    if q_seg is None:
        q_seg, k_seg = torch.zeros_like(q_words), torch.zeros_like(k_words)
    rows = []
    for b in range(q_words.shape[0]):
        qs = tile_summary(q_words[b], q_seg[b].long(), q_pos[b].long(), tile_q)
        ks = tile_summary(k_words[b], k_seg[b].long(), k_pos[b].long(), tile_k)
        rows.append(_row_classes(qs, ks, window))
    return torch.stack(rows)


def tile_lists(classes: torch.Tensor):
    """Sparse form of a class map [B, n, m] along its last axis: (count [B,n], index [B,n,m], class [B,n,m]).

    For each row tile, the non-skipped column tiles come first in ascending order; the rest is unused.
    This is the table the kernels walk, so skipped tiles cost nothing.
    """
    keep = classes != SKIP
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)
    count = keep.sum(-1).to(torch.int32)
    return count.contiguous(), order.to(torch.int32).contiguous(), classes.gather(-1, order).to(torch.int32).contiguous()
