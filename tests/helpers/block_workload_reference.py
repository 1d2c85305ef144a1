"""The block workload and LPT as they were before the run-length rewrite, kept only as a test reference.

``block_workload``/``block_pairs`` compare per-block class summaries (exact, O(S) numpy passes plus
O(qsets x blocks)); ``lpt_assign`` is one heap operation per block. Tests check that the library's faster
versions give exactly the same numbers and plans.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from lightning_mm.attention.mask import _as_batch, _check_block_size, allowed, validate


def _check_cp(num_blocks, cp_size):
    if num_blocks < cp_size:
        raise ValueError("sequence shorter than cp_size blocks")


def _allowed_np(qw, kw, qp, kp, qs, ks) -> np.ndarray:
    """``allowed`` on small numpy arrays (broadcast like ``allowed``); the rule stays in one place."""
    t = torch.from_numpy
    return allowed(t(np.ascontiguousarray(qw)), t(np.ascontiguousarray(kw)), t(np.ascontiguousarray(qp)),
                   t(np.ascontiguousarray(kp)), t(np.ascontiguousarray(qs)), t(np.ascontiguousarray(ks))).numpy()


def _block_summary(bam: torch.Tensor, segment_ids: torch.Tensor | None, block_size: int) -> dict:
    """Compress a batch of words into what decides block-level attention, in O(S) numpy passes.

    The rows are padded to whole blocks and laid end to end. A *run* is a maximal stretch of tokens with one
    (row, segment, word); a *class* is a distinct (row, segment, word); a *piece* is a run cut at block edges.
    Between two different blocks the rule only depends on the classes present and on which block comes first
    (every key of an earlier block precedes every query of a later one), so per query block we need the set
    of its classes (its *qset*); only the diagonal block needs positions (min/max of each piece).
    """
    b, s = bam.shape
    nb = -(-s // block_size)
    sp = nb * block_size
    words = bam.detach().cpu().numpy()
    segs = None if segment_ids is None else segment_ids.detach().cpu().to(torch.int64).numpy()
    if sp != s:
        words = np.pad(words, ((0, 0), (0, sp - s)))
        segs = None if segs is None else np.pad(segs, ((0, 0), (0, sp - s)))
    w = words.reshape(-1)
    change = w[1:] != w[:-1]
    if segs is not None:
        g = segs.reshape(-1)
        change |= g[1:] != g[:-1]
    change[sp - 1::sp] = True  # a run never crosses a row end
    run_start = np.concatenate(([0], np.flatnonzero(change) + 1))
    run_end = np.append(run_start[1:], w.size)
    run_row = run_start // sp
    run_seg = np.zeros_like(run_start) if segs is None else g[run_start]
    run_word = w[run_start]
    if run_word.size and run_word.min() < 0:  # every word is some run's word
        validate(bam)  # raises the bit-63 error
    cls_key, run_class = np.unique(np.stack([run_row, run_seg, run_word], 1), axis=0, return_inverse=True)
    run_class = run_class.reshape(-1)
    seg_key = np.concatenate(([0], np.cumsum(np.any(cls_key[1:, :2] != cls_key[:-1, :2], axis=1))))
    cls_word = cls_key[:, 2]

    first_blk, last_blk = run_start // block_size, (run_end - 1) // block_size
    n_pieces = last_blk - first_blk + 1
    piece_run = np.repeat(np.arange(len(run_start)), n_pieces)
    offsets = np.cumsum(n_pieces) - n_pieces
    piece_block = first_blk[piece_run] + np.arange(piece_run.size) - offsets[piece_run]
    piece_class = run_class[piece_run]
    piece_min = np.maximum(run_start[piece_run], piece_block * block_size)
    piece_max = np.minimum(run_end[piece_run] - 1, piece_block * block_size + block_size - 1)
    return dict(rows=b, nb=nb, cls_word=cls_word, seg_key=seg_key, piece_block=piece_block,
                piece_class=piece_class, piece_min=piece_min, piece_max=piece_max,
                block_first_piece=np.searchsorted(piece_block, np.arange(b * nb)))


def _block_relations(bam: torch.Tensor, segment_ids: torch.Tensor | None, block_size: int):
    """Per query block: its qset id, the key-block hit tables of each qset, and the diagonal verdict.

    ``hit_before[d, kb]``: a query block with qset ``d`` has an allowed pair in key block ``kb`` if ``kb``
    comes before it; ``hit_after`` likewise if ``kb`` comes after. Blocks are flattened over rows (classes of
    different rows never match, so rows cannot mix).
    """
    sm = _block_summary(bam, segment_ids, block_size)
    cw, sk = sm["cls_word"], sm["seg_key"]
    num_cls, num_blocks = len(cw), sm["rows"] * sm["nb"]
    one, zero = np.ones_like(cw), np.zeros_like(cw)
    before = _allowed_np(cw, cw, one, zero, sk, sk)  # [C query class, C key class], key block earlier
    after = _allowed_np(cw, cw, zero, one, sk, sk)
    self_ok = np.diagonal(_allowed_np(cw, cw, zero, zero, sk, sk)).copy()

    pb, pc, first = sm["piece_block"], sm["piece_class"], sm["block_first_piece"]
    per_block = np.diff(np.append(first, pb.size))
    qset = pc[first].copy()  # uniform blocks: the qset is the one class
    diag = self_ok[qset]
    members = np.eye(num_cls, dtype=bool)
    multi = np.flatnonzero(per_block > 1)
    if multi.size:
        in_multi = per_block[pb] > 1
        mb, mc = pb[in_multi], pc[in_multi]
        pairs = np.unique(mb * num_cls + mc)
        pblk, pcls = pairs // num_cls, pairs % num_cls
        width = int(np.bincount(pblk).max())
        slot = np.arange(pairs.size) - np.searchsorted(pblk, pblk)
        row_of = np.searchsorted(multi, pblk)
        sets = np.full((multi.size, width), -1, dtype=np.int64)
        sets[row_of, slot] = pcls
        uniq_sets, set_id = np.unique(sets, axis=0, return_inverse=True)
        qset[multi] = num_cls + set_id.reshape(-1)
        extra = np.zeros((len(uniq_sets), num_cls), dtype=bool)
        r, c = np.nonzero(uniq_sets >= 0)
        extra[r, uniq_sets[r, c]] = True
        members = np.concatenate([members, extra])
        diag[multi] = _diagonal_multi(sm, multi, per_block)
    hits = []
    for rel in (before, after):
        demand = (members.astype(np.int32) @ rel.astype(np.int32)) > 0  # [D, C]
        hit = demand[:, pc[first]]  # the first piece of every block ...
        for k in range(1, int(per_block.max())):  # ... OR the k-th piece of blocks holding several
            blocks = np.flatnonzero(per_block > k)
            hit[:, blocks] |= demand[:, pc[first[blocks] + k]]
        hits.append(hit)
    return sm, qset, hits[0], hits[1], diag


def _diagonal_multi(sm: dict, multi: np.ndarray, per_block: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """Exact diagonal verdict of blocks holding several pieces: any (query piece, key piece) pair allowed."""
    first, cw, sk = sm["block_first_piece"], sm["cls_word"], sm["seg_key"]
    width = int(per_block[multi].max())
    out = np.zeros(multi.size, dtype=bool)
    for a in range(0, multi.size, chunk):
        blocks = multi[a:a + chunk]
        idx = first[blocks, None] + np.arange(width)
        valid = np.arange(width) < per_block[blocks, None]
        idx = np.where(valid, idx, 0)
        cls = sm["piece_class"][idx]
        word = np.where(valid, cw[cls], 0)  # word 0 = padding: never allowed
        seg = sk[cls]
        ok = _allowed_np(word, word, sm["piece_max"][idx], sm["piece_min"][idx], seg, seg)
        out[a:a + chunk] = ok.any(axis=(1, 2))
    return out


def block_pairs(bam: torch.Tensor, block_size: int = 128, segment_ids: torch.Tensor | None = None,
                chunk: int = 256) -> torch.Tensor:
    """bool ``[B, nq, nk]``: whether a query block and a key block hold at least one allowed pair.

    Exact (equal to reducing ``to_dense`` over blocks) without materialising token pairs; ``chunk`` query
    blocks are expanded at a time. A 1-D ``bam`` gives ``[nq, nk]``.
    """
    _check_block_size(block_size)
    bam2, seg2, squeeze = _as_batch(bam, segment_ids)
    sm, qset, hit_before, hit_after, diag = _block_relations(bam2, seg2, block_size)
    b, nb = sm["rows"], sm["nb"]
    out = np.zeros((b, nb, nb), dtype=bool)
    kb = np.arange(nb)
    for r in range(b):
        for a in range(0, nb, chunk):
            qb = np.arange(a, min(a + chunk, nb))
            d = qset[r * nb + qb]
            hb, ha = hit_before[d][:, r * nb:(r + 1) * nb], hit_after[d][:, r * nb:(r + 1) * nb]
            rel = np.where(kb[None] < qb[:, None], hb, ha & (kb[None] > qb[:, None]))
            rel[np.arange(qb.size), qb] = diag[r * nb + qb]
            out[r, a:a + qb.size] = rel
    res = torch.from_numpy(out).to(bam.device)
    return res[0] if squeeze else res


def block_workload(bam: torch.Tensor, block_size: int = 128, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Work of each query block: the number of key blocks with at least one allowed pair (W_b), ``[B, nb]``.

    O(S) passes over the words plus O(qsets x blocks) on block summaries, so a 1M-token row at block 128
    takes about a millisecond; a 1-D ``bam`` gives ``[nb]``.
    """
    _check_block_size(block_size)
    bam2, seg2, squeeze = _as_batch(bam, segment_ids)
    sm, qset, hit_before, hit_after, diag = _block_relations(bam2, seg2, block_size)
    n = qset.size
    idx = np.arange(n)
    # flattened over rows is fine: a qset only hits key blocks of its own row
    cum_before = np.cumsum(hit_before, axis=1, dtype=np.int32)
    cum_after = np.cumsum(hit_after, axis=1, dtype=np.int32)
    earlier = np.where(idx > 0, cum_before[qset, np.maximum(idx - 1, 0)], 0)
    later = cum_after[qset, -1] - cum_after[qset, idx]
    work = (earlier.astype(np.int64) + later + diag).reshape(sm["rows"], sm["nb"])
    res = torch.from_numpy(work).to(bam.device)
    return res[0] if squeeze else res


def lpt_assign(work: torch.Tensor, cp_size: int) -> list[torch.Tensor]:
    """Longest-processing-time-first: blocks by work descending (ties: lower block first), each to the least
    loaded rank (ties: the rank with fewer blocks, then the lower rank). Makespan <= sum/cp + max (Graham).

    The tie rule on block counts spreads zero-work blocks (padding) evenly, so every rank gets a block when
    there are at least ``cp_size`` of them. One C-level heap operation per block on packed integer keys
    ``(load * (n+1) + count) * cp + rank``: 8k blocks take about a millisecond.
    """
    work = torch.as_tensor(work).reshape(-1).to(torch.int64).cpu().numpy()
    n = work.size
    _check_cp(n, cp_size)
    if n and work.min() < 0:
        raise ValueError("block work must be non-negative")
    order = np.argsort(-work, kind="stable")
    increments = ((work[order] * (n + 1) + 1) * cp_size).tolist()
    heap, replace = list(range(cp_size)), heapq.heapreplace
    keys = [replace(heap, heap[0] + inc) for inc in increments]  # heapreplace returns the popped (least) key
    owner = np.empty(n, dtype=np.int64)
    owner[order] = np.array(keys, dtype=np.int64) % cp_size
    return _plan_from_owner(owner, cp_size)


def _plan_from_owner(owner: np.ndarray, cp_size: int) -> list[torch.Tensor]:
    """Block indices grouped by owner rank, each group ascending (a stable sort keeps block order)."""
    blocks = np.argsort(owner, kind="stable")
    counts = np.bincount(owner, minlength=cp_size)
    return [torch.from_numpy(part) for part in np.split(blocks, np.cumsum(counts)[:-1])]


