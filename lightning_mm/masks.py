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


def _as_batch(bam, segment_ids):
    """``validate`` without its O(S) pass: ``_block_summary`` checks bit 63 on the run words instead."""
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
