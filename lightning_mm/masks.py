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

import math

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


def _block_summary(words, seg, pos, block_size, reduce_max):
    """Distinct (word, segment) per block with the max (queries) or min (keys) position of each.

    Returns tensors [nb, U] padded with word 0. One allowed (query, key) pair exists between two
    blocks iff one exists between their summaries, because within a (word, segment) group the rule
    only depends on position through ``j <= i``.
    """
    s = words.shape[-1]
    nb = math.ceil(s / block_size)
    pad = nb * block_size - s
    w = torch.nn.functional.pad(words, (0, pad))
    g = torch.nn.functional.pad(seg, (0, pad))
    p = torch.nn.functional.pad(pos, (0, pad))
    blk = torch.arange(nb, device=words.device).repeat_interleave(block_size)
    keys = torch.stack([blk, w, g], 1)
    uniq, inv = torch.unique(keys, dim=0, return_inverse=True)
    fill = torch.full((len(uniq),), -1 if reduce_max else torch.iinfo(torch.int64).max, dtype=torch.int64,
                      device=words.device)
    agg = fill.scatter_reduce(0, inv, p, "amax" if reduce_max else "amin")
    counts = torch.bincount(uniq[:, 0], minlength=nb)
    width = int(counts.max())
    slot = torch.arange(len(uniq), device=words.device) - torch.cumsum(counts, 0).sub(counts)[uniq[:, 0]]
    out_w = torch.zeros(nb, width, dtype=torch.int64, device=words.device)
    out_g = torch.zeros_like(out_w)
    out_p = torch.zeros_like(out_w)
    out_w[uniq[:, 0], slot] = uniq[:, 1]
    out_g[uniq[:, 0], slot] = uniq[:, 2]
    out_p[uniq[:, 0], slot] = agg
    return out_w, out_g, out_p


def block_pairs(bam: torch.Tensor, block_size: int = 128, segment_ids: torch.Tensor | None = None,
                chunk: int = 256) -> torch.Tensor:
    """bool ``[B, nq, nk]``: whether a query block and a key block hold at least one allowed pair."""
    validate(bam, segment_ids)
    if bam.dim() == 1:
        return block_pairs(bam[None], block_size, None if segment_ids is None else segment_ids[None], chunk)[0]
    b, s = bam.shape
    seg = torch.zeros_like(bam) if segment_ids is None else segment_ids.to(torch.int64)
    pos = torch.arange(s, device=bam.device)
    nb = math.ceil(s / block_size)
    out = torch.zeros(b, nb, nb, dtype=torch.bool, device=bam.device)
    for r in range(b):
        qw, qg, qp = _block_summary(bam[r], seg[r], pos, block_size, reduce_max=True)
        kw, kg, kp = _block_summary(bam[r], seg[r], pos, block_size, reduce_max=False)
        kw_f, kg_f, kp_f = kw.reshape(-1), kg.reshape(-1), kp.reshape(-1)
        for start in range(0, nb, chunk):
            ok = allowed(qw[start:start + chunk].reshape(-1), kw_f, qp[start:start + chunk].reshape(-1), kp_f,
                         qg[start:start + chunk].reshape(-1), kg_f)
            nq = min(chunk, nb - start)
            out[r, start:start + nq] = ok.view(nq, qw.shape[1], nb, kw.shape[1]).any(3).any(1)
    return out


def block_workload(bam: torch.Tensor, block_size: int = 128, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Work of each query block: the number of key blocks with at least one allowed pair (W_b), ``[B, nb]``."""
    return block_pairs(bam, block_size, segment_ids).sum(-1)


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
