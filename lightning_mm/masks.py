"""The bitfield attention mask (BAM): one int64 word per token instead of an [S, S] mask.

Bits 0..61 are modality bits (bit 0 = text, bit k = the k-th encoder of ``MultimodalModel.encoders``),
bit 62 is CAUSAL, bit 63 is always 0 and word 0 is padding. Query i may attend key j iff both words are
non-zero, both tokens share a segment, and

* CAUSAL in w_i:     j <= i and (w_i & w_j & MODALITY_BITS) != 0
* CAUSAL not in w_i: (w_i & MODALITY_BITS) == (w_j & MODALITY_BITS)

``allowed`` is the single implementation of that rule; everything else (dense masks, block workloads,
the reference attention) calls it.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

MAX_ENCODERS = 61
TEXT = 1
CAUSAL = 1 << 62
MODALITY_BITS = CAUSAL - 1
_SIGN_BIT = -(1 << 63)  # bit 63 as a signed int64

LAYOUTS = ("ep", "ee", "mp")


def modality_bit(k: int) -> int:
    """The bit of modality ``k``: 0 is text, 1..61 the encoders in order."""
    if not 0 <= k <= MAX_ENCODERS:
        raise ValueError(f"modality index {k} is out of range: the mask has bits for text (0) and at most "
                         f"{MAX_ENCODERS} encoders (1..{MAX_ENCODERS}); use fewer encoders")
    return 1 << k


def text_word(num_encoders: int) -> int:
    """The default text word: causal, sees text and every encoder's tokens."""
    check_num_encoders(num_encoders)
    return CAUSAL | TEXT | sum(1 << k for k in range(1, num_encoders + 1))


def modality_word(k: int, num_encoders: int, causal: bool = False) -> int:
    """Word of a token of encoder ``k`` (1-based): its own bit (bidirectional), or the text word if causal."""
    check_num_encoders(num_encoders)
    if not 1 <= k <= num_encoders:
        raise ValueError(f"encoder index {k} is not in 1..{num_encoders}")
    return text_word(num_encoders) if causal else modality_bit(k)


def check_num_encoders(num_encoders: int) -> None:
    if num_encoders > MAX_ENCODERS:
        raise ValueError(f"{num_encoders} encoders do not fit the attention mask: it has bits for at most "
                         f"{MAX_ENCODERS} encoders; merge modalities into fewer encoders")


def validate(bam: torch.Tensor, segment_ids: torch.Tensor | None = None) -> None:
    """Raise a clear error for words that break the format or segment ids that do not match them."""
    if bam.dtype != torch.int64:
        raise TypeError(f"bam must be int64 (one word per token), got {bam.dtype}")
    if bool((bam < 0).any()):
        raise ValueError("bam has words with bit 63 set; bit 63 is reserved and must be 0 "
                         "(build words with lightning_mm.masks.text_word / modality_word)")
    if segment_ids is not None and segment_ids.shape != bam.shape:
        raise ValueError(f"segment_ids has shape {tuple(segment_ids.shape)} but bam has {tuple(bam.shape)}; "
                         "give one segment id per token")


def check_attention_inputs(q, k, v, q_bam, k_bam, q_segments=None, k_segments=None, q_positions=None,
                           k_positions=None) -> None:
    """q ``[B,Hq,Sq,D]``, k/v ``[B,Hkv,Sk,D]`` with Hq a multiple of Hkv; words, segments and positions one per
    token (``[B,Sq]`` / ``[B,Sk]``); segments for both sides or neither."""
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] \
            or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need q [B,Hq,Sq,D], k and v "
                         "[B,Hkv,Sk,D] of one shape, the same batch and head dim, and query heads a multiple of "
                         "key/value heads")
    b, sq, sk = q.shape[0], q.shape[2], k.shape[2]
    for name, t, s in (("q_bam", q_bam, sq), ("k_bam", k_bam, sk), ("q_positions", q_positions, sq),
                       ("k_positions", k_positions, sk)):
        if t is not None and tuple(t.shape) != (b, s):
            raise ValueError(f"{name} must be a [B, S] = ({b}, {s}) tensor, got {tuple(t.shape)}")
    validate(q_bam, q_segments)
    validate(k_bam, k_segments)
    if (q_segments is None) != (k_segments is None):
        raise ValueError("give segment ids for both queries and keys, or for neither")


def allowed(q_words: torch.Tensor, k_words: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
            q_seg: torch.Tensor | None = None, k_seg: torch.Tensor | None = None) -> torch.Tensor:
    """The mask rule, broadcast: ``[..., Sq]`` queries against ``[..., Sk]`` keys -> bool ``[..., Sq, Sk]``."""
    qw, kw = q_words.unsqueeze(-1), k_words.unsqueeze(-2)
    q_mod, k_mod = qw & MODALITY_BITS, kw & MODALITY_BITS
    causal = (qw & CAUSAL) != 0
    ok_causal = (k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)) & ((q_mod & k_mod) != 0)
    ok = torch.where(causal, ok_causal, q_mod == k_mod) & (qw != 0) & (kw != 0)
    if q_seg is not None:
        ok &= q_seg.unsqueeze(-1) == k_seg.unsqueeze(-2)
    return ok


def to_dense(bam: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The full boolean mask ``[B, S, S]`` (True = may attend). O(S^2): for tests and small inputs."""
    validate(bam, segment_ids)
    pos = torch.arange(bam.shape[-1], device=bam.device).expand_as(bam)
    return allowed(bam, bam, pos, pos, segment_ids, segment_ids)


@functools.lru_cache(maxsize=256)
def _word_tables(words: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``allowed`` between every pair of the distinct ``words`` of one segment: bool ``[W, W]`` tables (query
    word, key word) for a key at or before the query and for a key after it. The rule stays in ``allowed``."""
    w = torch.tensor(words, dtype=torch.int64)
    one, zero = torch.ones_like(w), torch.zeros_like(w)
    return allowed(w, w, one, zero).numpy(), allowed(w, w, zero, one).numpy()


def _run_starts(w: np.ndarray, g: np.ndarray | None, row_len: int) -> np.ndarray:
    """Indices where a run of one (row, segment, word) starts in the flat token array: one comparison pass per
    array (the only per-token work), then only the 8-token words of the change mask holding a change are read."""
    n = w.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    change = np.empty(-(-n // 8) * 8, dtype=bool)  # change[i]: token i starts a run
    change[0] = True
    np.not_equal(w[1:], w[:-1], out=change[1:n])
    change[n:] = False
    if g is not None:
        seg_change = np.empty_like(change)
        np.not_equal(g[1:], g[:-1], out=seg_change[1:n])
        seg_change[0] = False
        seg_change[n:] = False
        np.bitwise_or(change.view(np.uint64), seg_change.view(np.uint64), out=change.view(np.uint64))
    change[row_len:n:row_len] = True  # a run never crosses a row end
    hot = np.flatnonzero(change.view(np.uint64) != 0)
    sub, bit = np.nonzero(change.reshape(-1, 8)[hot])
    return hot[sub] * 8 + bit


def _distinct(x: np.ndarray) -> np.ndarray:
    """Sorted distinct values (``np.unique`` without its overhead on small arrays)."""
    x = np.sort(x)
    keep = np.ones(x.size, dtype=bool)
    keep[1:] = x[1:] != x[:-1]
    return x[keep]


def _dense_ids(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct values and the index of each entry's value among them."""
    values = _distinct(x)
    return values, np.searchsorted(values, x)


def _spread(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])`` without a Python loop."""
    ends = np.cumsum(counts)
    return np.repeat(starts - (ends - counts), counts) + np.arange(int(ends[-1]) if ends.size else 0)


class _Blocks:
    """What decides block-level attention, from the runs of the words.

    Rows are padded to whole blocks and laid end to end (token ``p`` of row ``r`` at ``r * nb * block + p``), so
    runs of different rows never share a block. A *run* is a maximal stretch of one (row, segment, word); finding
    them is the only per-token work (one comparison pass over the words, one over the segment ids). Padding runs
    (word 0) are dropped: they attend to nothing and nothing attends to them. A block is *mixed* when two runs
    meet in it; every run of a mixed block starts or ends there, so there are fewer mixed blocks than runs. The
    other blocks of a run are its *stretch*: blocks holding that run alone.

    Between two different blocks every key of the earlier precedes every query of the later, so the rule only
    depends on the words, on the segments and on which block comes first. A *query set* (a stretch's run, or
    the runs of a mixed block) may attend the union of the block ranges of the runs of its segment whose word
    one of its words allows (``before``: key block earlier, ``after``: later); only the diagonal block needs
    positions. Everything after the comparison passes is O(runs + blocks).
    """

    def __init__(self, bam: torch.Tensor, segment_ids: torch.Tensor | None, block_size: int):
        b, s = bam.shape
        nb = -(-s // block_size)
        self.rows, self.nb, self.block, self.num_blocks = b, nb, block_size, b * nb
        w = bam.detach().cpu().contiguous().numpy().reshape(-1)
        g = None if segment_ids is None else segment_ids.detach().cpu().to(torch.int64).contiguous().numpy().reshape(-1)
        start = _run_starts(w, g, s)
        end = np.append(start[1:], w.size) - 1  # inclusive
        word = w[start]
        if word.size and word.min() < 0:  # every word is some run's word
            validate(bam)  # raises the bit-63 error
        keep = np.flatnonzero(word)
        start, end, word = start[keep], end[keep], word[keep]
        seg = None if g is None else g[start]
        if b > 1:
            row = start // s
            start, end = start + row * (nb * block_size - s), end + row * (nb * block_size - s)
            seg = row if seg is None else row * (len(_distinct(seg)) + 1) + _dense_ids(seg)[1]  # (row, segment)
        self.first, self.last = start, end  # token range of each run on the padded grid
        self.fb, self.lb = start // block_size, end // block_size
        words, self.widx = _dense_ids(word)
        self.before_tab, self.after_tab = _word_tables(tuple(words.tolist()))
        self.num_runs = r = start.size
        # the group (segment of a row) of every run, and each group's runs in token order
        self.group = np.zeros(r, dtype=np.int64) if seg is None else _dense_ids(seg)[1]
        gsize = np.bincount(self.group)
        self.by_group = np.argsort(self.group, kind="stable")
        self.gstart, self.gsize = np.cumsum(gsize) - gsize, gsize
        # mixed blocks with their pieces (runs starting or ending there), listed in run order and within a run
        # first block before last block, hence sorted by block
        shared_first, shared_last = np.zeros(r, dtype=bool), np.zeros(r, dtype=bool)
        shared_first[1:] = shared_last[:-1] = self.lb[:-1] == self.fb[1:]
        tail = shared_last & ~(shared_first & (self.lb == self.fb))  # a run inside one block is one piece
        is_piece = np.stack([shared_first, tail], 1).reshape(-1)
        piece_blk = np.stack([self.fb, self.lb], 1).reshape(-1)[is_piece]
        self.piece_run = np.flatnonzero(is_piece) // 2
        new = np.ones(piece_blk.size, dtype=bool)
        new[1:] = piece_blk[1:] != piece_blk[:-1]
        self.mixed, self.piece_m = piece_blk[new], np.cumsum(new) - 1
        self.x0, self.x1 = self.fb + shared_first, self.lb - shared_last
        self.stretch = np.flatnonzero(self.x0 <= self.x1)
        # query sets: one per stretch (its run), then one per mixed block (its pieces' runs)
        ns = self.stretch.size
        self.num_q = ns + self.mixed.size
        self.q_member = np.concatenate([np.arange(ns), ns + self.piece_m])
        self.r_member = np.concatenate([self.stretch, self.piece_run])

    def attended(self):
        """The blocks each query set may attend, as disjoint intervals ``(q', lo, length)`` sorted by (q', lo):
        ``q' = q`` for key blocks earlier than the query block (``before``), ``q' = num_q + q`` for later ones."""
        grp = self.group[self.r_member]
        n = self.gsize[grp]
        q = np.repeat(self.q_member, n)
        mem = np.repeat(self.widx[self.r_member], n)
        key = self.by_group[_spread(self.gstart[grp], n)]
        wk = self.widx[key]
        ok_b, ok_a = self.before_tab[mem, wk], self.after_tab[mem, wk]
        r = max(self.num_runs, 1)
        code = _distinct(np.concatenate([q[ok_b] * r + key[ok_b], (q[ok_a] + self.num_q) * r + key[ok_a]]))
        qq, kk = code // r, code % r  # sorted by (q', run); runs are in token order
        fb, lb = self.fb[kk], self.lb[kk]
        prev = np.empty_like(lb)
        prev[:1] = -1
        prev[1:] = np.where(qq[1:] == qq[:-1], lb[:-1], -1)  # lb grows along the runs of one q'
        lo = np.maximum(fb, prev + 1)
        return qq, lo, np.maximum(lb - lo + 1, 0)

    def diagonal(self) -> np.ndarray:
        """Per query set, whether its own block holds an allowed pair. A run sees itself at equal positions; a
        mixed block needs a (query piece, key piece) pair allowed with the query at its last token in the block
        and the key at its first (the best case for the causal rule)."""
        words = self.widx[self.stretch]
        pr, pm, bs = self.piece_run, self.piece_m, self.block
        cnt = np.bincount(pm, minlength=self.mixed.size)
        a = np.repeat(np.arange(pr.size), cnt[pm])
        k = _spread((np.cumsum(cnt) - cnt)[pm], cnt[pm])
        ra, rk, blk = pr[a], pr[k], self.mixed[pm[a]]
        key_pos = np.maximum(self.first[rk], blk * bs)
        query_pos = np.minimum(self.last[ra], blk * bs + bs - 1)
        wa, wk = self.widx[ra], self.widx[rk]
        ok = np.where(key_pos <= query_pos, self.before_tab[wa, wk], self.after_tab[wa, wk])
        ok &= self.group[ra] == self.group[rk]
        mixed = np.bincount(pm[a], weights=ok, minlength=self.mixed.size) > 0
        return np.concatenate([self.before_tab[words, words], mixed])

    def segments(self):
        """The block ranges of the query sets: first block and length of every stretch, then the mixed blocks."""
        x0 = self.x0[self.stretch]
        length = np.concatenate([self.x1[self.stretch] - x0 + 1, np.ones_like(self.mixed)])
        return np.concatenate([x0, self.mixed]), length


def _as_batch(bam, segment_ids):
    """``validate`` without its O(S) pass: ``_Blocks`` checks bit 63 on the run words instead."""
    if not isinstance(bam, torch.Tensor) or bam.dtype != torch.int64:
        raise TypeError(f"bam must be an int64 tensor (one word per token), got {getattr(bam, 'dtype', type(bam))}")
    if segment_ids is not None and segment_ids.shape != bam.shape:
        validate(bam, segment_ids)  # raises the shape error
    if bam.dim() == 1:
        return bam[None], None if segment_ids is None else segment_ids[None], True
    if bam.dim() != 2:
        raise ValueError(f"bam must be [S] or [B,S], got shape {tuple(bam.shape)}")
    return bam, segment_ids, False


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def block_pairs(bam: torch.Tensor, block_size: int = 128, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """bool ``[B, nq, nk]``: whether a query block and a key block hold at least one allowed pair.

    Exact (equal to reducing ``to_dense`` over blocks) without materialising token pairs. A 1-D ``bam`` gives
    ``[nq, nk]``.
    """
    _check_block_size(block_size)
    bam2, seg2, squeeze = _as_batch(bam, segment_ids)
    bl = _Blocks(bam2, seg2, block_size)
    nbk, nb = bl.num_blocks, bl.nb
    qq, lo, ln = bl.attended()
    d = np.zeros((2 * bl.num_q, nbk + 1), dtype=np.int64)
    np.add.at(d, (qq, lo), 1)
    np.add.at(d, (qq, lo + ln), -1)
    hit = np.cumsum(d, axis=1)[:, :nbk] > 0
    hits = hit[:bl.num_q], hit[bl.num_q:]  # key block earlier, later
    start, length = bl.segments()
    qid = np.full(nbk, -1)
    qid[_spread(start, length)] = np.repeat(np.arange(bl.num_q), length)
    diag = bl.diagonal()
    out = np.zeros((bl.rows, nb, nb), dtype=bool)
    kb = np.arange(nb)
    earlier = kb[None] < kb[:, None]
    for r in range(bl.rows):
        blocks = np.arange(r * nb, (r + 1) * nb)
        has = qid[blocks] >= 0
        q = qid[blocks][has]
        rel = np.where(earlier[has], hits[0][q][:, blocks], hits[1][q][:, blocks] & (kb[None] > kb[has][:, None]))
        rel[np.arange(q.size), kb[has]] = diag[q]
        out[r, has] = rel
    res = torch.from_numpy(out).to(bam.device)
    return res[0] if squeeze else res


def _block_workload(bam: torch.Tensor, segment_ids: torch.Tensor | None, block_size: int) -> np.ndarray:
    """``block_workload`` of a ``[B,S]`` batch as a numpy ``[B, nb]`` array."""
    bl = _Blocks(bam, segment_ids, block_size)
    qq, lo, ln = bl.attended()
    start, length = bl.segments()  # the first block of each query set, and how many blocks it spans
    # attended blocks before and after the first block x of each query set, plus its own block
    later = qq >= bl.num_q
    q = qq - later * bl.num_q
    x = start[q]
    count = np.minimum(np.maximum(np.where(later, lo + ln - 1 - x, x - lo), 0), ln)
    work = np.bincount(q, weights=count, minlength=bl.num_q).astype(np.int64) + bl.diagonal()
    # one step along a stretch adds the block left behind if the run sees itself before, and drops the next
    # block if it sees itself after
    wr = bl.widx[bl.stretch]
    slope = np.zeros(bl.num_q, dtype=np.int64)
    slope[:wr.size] = bl.before_tab[wr, wr].astype(np.int64) - bl.after_tab[wr, wr]
    out = np.zeros(bl.num_blocks, dtype=np.int64)
    idx = _spread(start, length)
    out[idx] = np.repeat(work - slope * start, length) + np.repeat(slope, length) * idx
    return out.reshape(bl.rows, bl.nb)


def block_workload(bam: torch.Tensor, block_size: int = 128, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Work of each query block: the number of key blocks with at least one allowed pair (W_b), ``[B, nb]``.

    Exact, from the runs of the words: one comparison pass over the words (and one over the segment ids), the
    rest O(runs + blocks); a 1M-token row at block 128 takes well under a millisecond. A 1-D ``bam`` gives ``[nb]``.
    """
    _check_block_size(block_size)
    bam2, seg2, squeeze = _as_batch(bam, segment_ids)
    res = torch.from_numpy(_block_workload(bam2, seg2, block_size)).to(bam.device)
    return res[0] if squeeze else res


# ----------------------------------------------------------------------------------------------------------
# Layout builders. A layout is a per-token modality index (-1 padding, 0 text, k encoder k) plus segment ids;
# ``words_from_modalities`` turns it into words.
# ----------------------------------------------------------------------------------------------------------

def words_from_modalities(token_modality: torch.Tensor, num_encoders: int,
                          causal_modalities: bool | set[int] = False) -> torch.Tensor:
    """Words for a per-token modality index tensor (-1 padding, 0 text, k>=1 encoder k)."""
    check_num_encoders(num_encoders)
    if token_modality.numel() and int(token_modality.max()) > num_encoders:
        raise ValueError(f"token modality index {int(token_modality.max())} exceeds num_encoders={num_encoders}")
    table = torch.zeros(num_encoders + 2, dtype=torch.int64)  # index 0 = padding, 1 = text, k+1 = encoder k
    table[1] = text_word(num_encoders)
    for k in range(1, num_encoders + 1):
        causal = causal_modalities if isinstance(causal_modalities, bool) else k in causal_modalities
        table[k + 1] = modality_word(k, num_encoders, causal)
    return table.to(token_modality.device)[token_modality.long() + 1]


def layout_ep(items: list[tuple[int, int]], text_len: int) -> torch.Tensor:
    """Encoder outputs prepended: ``items`` = [(modality, num_tokens), ...] first, then text."""
    parts = [torch.full((n,), m, dtype=torch.int64) for m, n in items]
    return torch.cat(parts + [torch.zeros(text_len, dtype=torch.int64)])


def layout_ee(items: list[tuple[int, int]], text_len: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Encoder outputs embedded in the text at random positions (in item order)."""
    cuts = torch.sort(torch.randint(0, text_len + 1, (len(items),), generator=generator)).values.tolist()
    parts, prev = [], 0
    for (m, n), c in zip(items, cuts):
        parts += [torch.zeros(c - prev, dtype=torch.int64), torch.full((n,), m, dtype=torch.int64)]
        prev = c
    parts.append(torch.zeros(text_len - prev, dtype=torch.int64))
    return torch.cat(parts)


def layout_mp(samples: list[torch.Tensor], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal packing: several samples' modality indices in one row, each its own segment, padded."""
    total = sum(len(s) for s in samples)
    if total > seq_len:
        raise ValueError(f"packed samples hold {total} tokens, more than seq_len={seq_len}")
    mods = torch.cat(samples + [torch.full((seq_len - total,), -1, dtype=torch.int64)])
    segs = torch.cat([torch.full((len(s),), i, dtype=torch.int64) for i, s in enumerate(samples)]
                     + [torch.full((seq_len - total,), len(samples), dtype=torch.int64)])
    return mods, segs


def random_bam(layout: str, seq_len: int, num_encoders: int = 2, batch: int = 1, seed: int = 0,
               mean_item_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Random words of an EP/EE/MP layout filling ``seq_len`` (seeded): ``(bam [B,S], segment_ids or None)``.

    About half of the tokens are modality tokens, in items of ``mean_item_tokens`` (default seq_len/8).
    Used by tests and benchmarks of the kernels and the CP distributions.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    g = torch.Generator().manual_seed(seed)
    item = mean_item_tokens or max(1, seq_len // 8)

    def sample(length):
        budget, items = length // 2, []
        while budget > 0:
            n = min(budget, int(torch.randint(max(1, item // 2), item + item // 2 + 1, (1,), generator=g)))
            items.append((int(torch.randint(1, num_encoders + 1, (1,), generator=g)), n))
            budget -= n
        text = length - sum(n for _, n in items)
        return layout_ep(items, text) if layout == "ep" else layout_ee(items, text, g)

    rows, segs = [], []
    for _ in range(batch):
        if layout == "mp":
            lengths, left = [], seq_len
            while left > 0:
                n = min(left, int(torch.randint(max(2, seq_len // 6), max(3, seq_len // 2), (1,), generator=g)))
                lengths.append(n)
                left -= n
            mods, seg = layout_mp([sample(n) for n in lengths], seq_len)
            segs.append(seg)
        else:
            mods = sample(seq_len)
        rows.append(mods)
    bam = words_from_modalities(torch.stack(rows), num_encoders)
    return bam, (torch.stack(segs) if layout == "mp" else None)
