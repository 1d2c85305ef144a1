"""The bitfield attention mask (BAM): one int64 word per token instead of an [S, S] mask.

Bits 0..60 are modality bits (bit 0 = text, bit k = the k-th encoder of ``MultimodalModel.encoders``; the bits
above the last encoder's are free for span ids), bit 61 is SPAN, bit 62 is CAUSAL, bit 63 is always 0 and word 0 is
padding. Query i may attend key j iff both words are non-zero, both tokens share a segment, and

* CAUSAL in w_i:     j <= i and (w_i & w_j & MODALITY_BITS) != 0,
                     or SPAN in w_i and (w_i & MODALITY_BITS) == (w_j & MODALITY_BITS)
* CAUSAL not in w_i: (w_i & MODALITY_BITS) == (w_j & MODALITY_BITS)

SPAN words (:func:`span_word`) give causal tokens that also see the later tokens of their own span (an item whose
tokens carry the same span id in the free bits): Gemma 3's images, bidirectional within each image and causal
otherwise.

An optional sliding window of ``W`` tokens (a per-layer property of the model, e.g. Gemma's local layers)
additionally requires ``pos_i - pos_j < W`` for every pair, causal or not (:func:`in_window`).

``allowed`` is the single implementation of that rule; everything else (dense masks, block workloads,
the reference attention) calls it.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

MAX_ENCODERS = 60
TEXT = 1
CAUSAL = 1 << 62
SPAN = 1 << 61
MODALITY_BITS = SPAN - 1
_SIGN_BIT = -(1 << 63)  # bit 63 as a signed int64

LAYOUTS = ("ep", "ee", "mp")


def modality_bit(k: int) -> int:
    """The bit of modality ``k``: 0 is text, 1..60 the encoders in order."""
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


def span_word(k: int, num_encoders: int, span: int) -> int:
    """Word of a token of encoder ``k`` in span ``span`` (>= 1; one id per item of a row): the text word (causal,
    sees every earlier token) that also sees the later tokens of the same span. The span id sits in the bits above
    the encoders' (``60 - num_encoders`` of them)."""
    check_num_encoders(num_encoders)
    if not 1 <= k <= num_encoders:
        raise ValueError(f"encoder index {k} is not in 1..{num_encoders}")
    limit = 1 << (MAX_ENCODERS - num_encoders)
    if not 1 <= span < limit:
        raise ValueError(f"span id {span} is not in 1..{limit - 1}: a row of {num_encoders} encoders has room for "
                         f"{limit - 1} spans")
    return _span_words(num_encoders, span)


def _span_words(num_encoders: int, span):
    """The span word(s) of span id(s) ``span`` (an int or a tensor): the rule of :func:`span_word`, unchecked."""
    return text_word(num_encoders) | SPAN | span << (num_encoders + 1)


def segment_dtype(num_segments: int) -> torch.dtype:
    """The dtype for per-token segment ids ``0..num_segments`` (padding included): int16 where they fit, else
    int32. CP planning reads them once per token and microbatch, so fewer bytes plan faster; the attention
    converts them to int64 once per microbatch."""
    return torch.int16 if num_segments <= torch.iinfo(torch.int16).max else torch.int32


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
                         "(build words with lightning_mm.attention.mask.text_word / modality_word)")
    if segment_ids is not None and segment_ids.shape != bam.shape:
        raise ValueError(f"segment_ids has shape {tuple(segment_ids.shape)} but bam has {tuple(bam.shape)}; "
                         "give one segment id per token")


def check_attention_inputs(q, k, v, q_bam, k_bam, q_segments=None, k_segments=None, q_positions=None,
                           k_positions=None, cache: dict | None = None) -> None:
    """q ``[B,Hq,Sq,D]``, k/v ``[B,Hkv,Sk,D]`` with Hq a multiple of Hkv; words, segments and positions one per
    token (``[B,Sq]`` / ``[B,Sk]``); segments for both sides or neither.

    Reading the words' values waits for the device; with a ``cache`` shared by the layers of a microbatch, each
    words tensor is read once, not in every layer."""
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
    checked = [] if cache is None else cache.setdefault("checked_words", [])
    for bam, segments in ((q_bam, q_segments), (k_bam, k_segments)):
        if not any(bam is t for t in checked):
            validate(bam, segments)
            checked.append(bam)
    if (q_segments is None) != (k_segments is None):
        raise ValueError("give segment ids for both queries and keys, or for neither")


def check_window(window: int | None) -> None:
    """``None`` (no window) or a positive int number of tokens."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding window must be None (no window) or a positive number of tokens, got {window!r}")


def in_window(q_pos, k_pos, window: int | None):
    """The sliding-window part of the rule: ``q_pos - k_pos < window`` (True everywhere when ``window`` is None).

    This is transformers' ``sliding_window_overlay`` (``kv_idx > q_idx - sliding_window``), and like it the
    window is one-sided and applies to every pair, not only causal ones: HF's Gemma 3 computes its local layers'
    mask as ``AND(sliding_window_overlay, OR(causal, image blocks))``, so a bidirectional token still sees the
    later tokens of its span, but no token sees a key ``window`` or more positions before it. Broadcasts.
    """
    if window is None:
        return True
    return (q_pos - k_pos) < window


def allowed(q_words: torch.Tensor, k_words: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
            q_seg: torch.Tensor | None = None, k_seg: torch.Tensor | None = None,
            window: int | None = None) -> torch.Tensor:
    """The mask rule, broadcast: ``[..., Sq]`` queries against ``[..., Sk]`` keys -> bool ``[..., Sq, Sk]``.

    ``window``: a sliding window of that many tokens (:func:`in_window`), None = none."""
    qw, kw = q_words.unsqueeze(-1), k_words.unsqueeze(-2)
    q_mod, k_mod = qw & MODALITY_BITS, kw & MODALITY_BITS
    causal = (qw & CAUSAL) != 0
    qp, kp = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
    same = q_mod == k_mod
    ok_causal = ((kp <= qp) & ((q_mod & k_mod) != 0)) | (((qw & SPAN) != 0) & same)
    ok = torch.where(causal, ok_causal, same) & (qw != 0) & (kw != 0)
    if window is not None:
        ok &= in_window(qp, kp, window)
    if q_seg is not None:
        ok &= q_seg.unsqueeze(-1) == k_seg.unsqueeze(-2)
    return ok


def to_dense(bam: torch.Tensor, segment_ids: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """The full boolean mask ``[B, S, S]`` (True = may attend). O(S^2): for tests and small inputs."""
    validate(bam, segment_ids)
    check_window(window)
    pos = torch.arange(bam.shape[-1], device=bam.device).expand_as(bam)
    return allowed(bam, bam, pos, pos, segment_ids, segment_ids, window)


@functools.lru_cache(maxsize=256)
def _word_tables(words: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``allowed`` between every pair of the distinct ``words`` of one segment: bool ``[W, W]`` tables (query
    word, key word) for a key at or before the query and for a key after it. The rule stays in ``allowed``."""
    w = torch.tensor(words, dtype=torch.int64)
    one, zero = torch.ones_like(w), torch.zeros_like(w)
    return allowed(w, w, one, zero).numpy(), allowed(w, w, zero, one).numpy()


def _runs(bam: torch.Tensor, segment_ids: torch.Tensor | None, block_size: int):
    """The runs of a ``[B,S]`` batch for the compiled block relations (``planning_loops.runs``), the block
    counts, and the tables of ``allowed`` between the runs' distinct words. Finding the runs is the only
    per-token work; the rest is O(runs)."""
    from lightning_mm.plan.cp_loops import runs  # compiled on first use

    b, s = bam.shape
    w = bam.detach().cpu().contiguous().numpy().reshape(-1)
    g = None if segment_ids is None else segment_ids.detach().cpu().contiguous().numpy().reshape(-1)
    first, last, widx, group, words = runs(w, g, s, block_size)
    if words.size and words[0] < 0:  # every word is some run's word
        validate(bam)  # raises the bit-63 error
    before, after = _word_tables(tuple(words.tolist()))
    nb = -(-s // block_size)
    return first, last, widx, group, b * nb, nb, before, after


def _as_batch(bam, segment_ids):
    """``validate`` without its O(S) pass: ``_runs`` checks bit 63 on the run words instead."""
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


def window_band(num_blocks: int, block_size: int, window: int, seq_len: int | None = None) -> torch.Tensor:
    """bool ``[nb, nb]``: whether some token of query block ``a`` and some token of key block ``c`` are within
    ``window`` (:func:`in_window`; blocks are contiguous runs of positions, the last one may be short)."""
    check_window(window)
    seq_len = num_blocks * block_size if seq_len is None else seq_len
    first = torch.arange(num_blocks) * block_size
    last = torch.clamp(first + block_size - 1, max=seq_len - 1)
    return in_window(first.unsqueeze(-1), last.unsqueeze(0), window)  # the closest pair: q first, k last


def block_pairs(bam: torch.Tensor, block_size: int = 128, segment_ids: torch.Tensor | None = None,
                window: int | None = None) -> torch.Tensor:
    """bool ``[B, nq, nk]``: whether a query block and a key block hold at least one allowed pair.

    Exact (equal to reducing ``to_dense`` over blocks) without materialising token pairs. A 1-D ``bam`` gives
    ``[nq, nk]``. With a sliding ``window`` a pair of blocks counts when it holds an allowed pair and some of its
    token pairs lie within the window (:func:`window_band`): block-granular, so it can count a block whose
    allowed pairs all lie outside the window while other pairs lie inside (a superset of ``to_dense(window=)``
    reduced over blocks, equal to it for causal text).
    """
    from lightning_mm.plan import cp_loops as loops

    _check_block_size(block_size)
    check_window(window)
    bam2, seg2, squeeze = _as_batch(bam, segment_ids)
    first, last, word, group, num_blocks, nb, before, after = _runs(bam2, seg2, block_size)
    res = torch.from_numpy(loops.block_pairs(first, last, word, group, num_blocks, nb, block_size, before, after))
    res = res.reshape(bam2.shape[0], nb, nb)
    if window is not None:
        res &= window_band(nb, block_size, window, bam2.shape[-1])
    res = res.to(bam.device)
    return res[0] if squeeze else res


def _window_reach(window, block_size: int, nb: int) -> tuple[np.ndarray, np.ndarray]:
    """The windows of ``block_workload`` as the compiled loop takes them: per distinct reach (how many key blocks
    before a query block some pair of theirs is within the window, :func:`window_band`; -1 = unlimited), the
    number of layers with it."""
    if window is None or not hasattr(window, "__iter__"):
        windows = [window]  # check_window names a bad one
    else:
        windows = list(window)
        if not windows:
            raise ValueError("window: give None, a number of tokens, or a non-empty list with one entry per layer")
    counts: dict[int, int] = {}
    for w in windows:
        check_window(w)
        # block x's first token and block x - d's last one are (d - 1) * b + 1 apart: within w iff d*b <= w+b-2
        reach = -1 if w is None else (w + block_size - 2) // block_size
        reach = -1 if reach >= nb - 1 else reach  # reaches the row's first block from every block
        counts[reach] = counts.get(reach, 0) + 1
    return np.array(list(counts), np.int64), np.array(list(counts.values()), np.int64)


def _block_workload(bam: torch.Tensor, segment_ids: torch.Tensor | None, block_size: int,
                    window=None) -> np.ndarray:
    """``block_workload`` of a ``[B,S]`` batch as a numpy ``[B, nb]`` array."""
    from lightning_mm.plan import cp_loops as loops

    nb = -(-bam.shape[-1] // block_size)
    reach, weight = _window_reach(window, block_size, nb)
    first, last, word, group, num_blocks, nb, before, after = _runs(bam, segment_ids, block_size)
    work = loops.block_work(first, last, word, group, num_blocks, nb, block_size, before, after, reach, weight)
    return work.reshape(bam.shape[0], nb)


def block_workload(bam: torch.Tensor, block_size: int = 128, segment_ids: torch.Tensor | None = None,
                   window=None) -> torch.Tensor:
    """Work of each query block: the number of key blocks with at least one allowed pair (W_b), ``[B, nb]``.

    Exact, from the runs of the words: one compiled pass over the words (and the segment ids), the rest
    O(runs x distinct word masks + blocks) (``planning_loops.block_work``). A 1-D ``bam`` gives ``[nb]``.

    ``window``: None (no window), a sliding window in tokens (the key blocks of :func:`block_pairs` with that
    window), or one entry per layer (``None`` or tokens, e.g. ``families.layer_windows`` of a Gemma 3 model): then
    the sum over the layers of their work, since each layer does its own attention (integer, as LPT's keys need;
    divide by the layer count for the mean). A window adds O(blocks x distinct windows x masks), not O(nb^2).
    """
    _check_block_size(block_size)
    bam2, seg2, squeeze = _as_batch(bam, segment_ids)
    res = torch.from_numpy(_block_workload(bam2, seg2, block_size, window)).to(bam.device)
    return res[0] if squeeze else res


# ----------------------------------------------------------------------------------------------------------
# Layout builders. A layout is a per-token modality index (-1 padding, 0 text, k encoder k) plus segment ids;
# ``words_from_modalities`` turns it into words.
# ----------------------------------------------------------------------------------------------------------

def item_spans(token_modality: torch.Tensor) -> torch.Tensor:
    """Per token: the 1-based index, within its row, of the run of modality tokens it is in (0 for text and
    padding). A run is a maximal stretch of tokens of one encoder, which is how HF's Gemma 3 tells its images
    apart (``token_type_ids`` groups)."""
    item = token_modality > 0
    prev = torch.nn.functional.pad(token_modality[..., :-1], (1, 0), value=-2)
    starts = item & (token_modality != prev)
    return torch.where(item, torch.cumsum(starts.long(), -1), 0)


def words_from_modalities(token_modality: torch.Tensor, num_encoders: int,
                          causal_modalities: bool | set[int] = False, spans: bool = False) -> torch.Tensor:
    """Words for a per-token modality index tensor (-1 padding, 0 text, k>=1 encoder k). ``spans``: every item
    (run of modality tokens, :func:`item_spans`) gets its own :func:`span_word`: causal, and bidirectional within
    the item (Gemma 3)."""
    check_num_encoders(num_encoders)
    if token_modality.numel() and int(token_modality.max()) > num_encoders:
        raise ValueError(f"token modality index {int(token_modality.max())} exceeds num_encoders={num_encoders}")
    table = torch.zeros(num_encoders + 2, dtype=torch.int64)  # index 0 = padding, 1 = text, k+1 = encoder k
    table[1] = text_word(num_encoders)
    for k in range(1, num_encoders + 1):
        causal = causal_modalities if isinstance(causal_modalities, bool) else k in causal_modalities
        table[k + 1] = modality_word(k, num_encoders, causal)
    words = table.to(token_modality.device)[token_modality.long() + 1]
    if not spans:
        return words
    span = item_spans(token_modality)
    if span.numel() and int(span.max()) >= 1 << (MAX_ENCODERS - num_encoders):
        span_word(1, num_encoders, int(span.max()))  # raises, naming the limit
    return torch.where(span > 0, _span_words(num_encoders, span), words)


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
    dtype = segment_dtype(len(samples))
    segs = torch.cat([torch.full((len(s),), i, dtype=dtype) for i, s in enumerate(samples)]
                     + [torch.full((seq_len - total,), len(samples), dtype=dtype)])
    return mods, segs


def random_bam(layout: str, seq_len: int, num_encoders: int = 2, batch: int = 1, seed: int = 0,
               mean_item_tokens: int | None = None, spans: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Random words of an EP/EE/MP layout filling ``seq_len`` (seeded): ``(bam [B,S], segment_ids or None)``.

    About half of the tokens are modality tokens, in items of ``mean_item_tokens`` (default seq_len/8); with
    ``spans`` each item gets a span word (causal, bidirectional within the item: Gemma 3's images).
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
    bam = words_from_modalities(torch.stack(rows), num_encoders, spans=spans)
    return bam, (torch.stack(segs) if layout == "mp" else None)
