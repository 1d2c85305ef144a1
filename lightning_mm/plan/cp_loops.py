"""The context-parallel planner's loops, compiled with numba: the runs of the mask words, the block relations
derived from the runs, and LPT.

They are plain loops that numpy can only express as many passes and calls and Python can only run one element
at a time; planning a 1M-token row should take under a millisecond (it runs for every microbatch), so they are
compiled (``cache=True``: once per machine, then loaded from the cache). Imported lazily: importing
``lightning_mm`` does not load numba. The attention rule itself stays in ``masks.allowed``: the loops get it as
two word-by-word tables.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_CHUNK = 512  # tokens compared with the token before them (vectorised) before any run start is looked for
_SUBCHUNK = 32  # the same within a chunk that holds a change, before scanning token by token


@njit(inline="always")
def _chunk_changes(words, segments, lo, hi):
    """Nonzero iff a word or a segment id in ``[lo, hi)`` differs from the one at ``lo - 1``: one vectorised
    reduction reading each element once (as fast as reading the arrays)."""
    vw, aw = words[lo - 1], words[lo:hi]
    acc = 0
    if segments is None:
        for j in range(aw.size):
            acc |= aw[j] ^ vw
    else:
        vs, as_ = segments[lo - 1], segments[lo:hi]
        for j in range(aw.size):
            acc |= (aw[j] ^ vw) | (as_[j] ^ vs)
    return acc


@njit(cache=True, nogil=True)
def _run_starts(words, segments, row_len):
    """Indices where a run of one (row, segment, word) starts in the flat token arrays ``words`` and
    ``segments`` (same length, or ``None``); rows are ``row_len`` long. One pass over both arrays together;
    only chunks (and within them, subchunks) holding a change are scanned token by token, and the row starts
    are merged in afterwards (no division per token)."""
    n = words.size
    changes = np.empty(n, np.int64)  # uninitialised: only the pages written are touched
    k = 0
    for c in range(0, n, _CHUNK):
        hi = min(c + _CHUNK, n)
        lo = max(c, 1)
        if lo >= hi or _chunk_changes(words, segments, lo, hi) == 0:
            continue
        for c2 in range(lo, hi, _SUBCHUNK):  # where runs are short, most chunks hold a change
            hi2 = min(c2 + _SUBCHUNK, hi)
            if _chunk_changes(words, segments, c2, hi2) == 0:
                continue
            for i in range(c2, hi2):
                if words[i] != words[i - 1] or (segments is not None and segments[i] != segments[i - 1]):
                    changes[k] = i
                    k += 1
    rows = -(-n // row_len) if n else 0
    out = np.empty(k + rows, np.int64)
    m, j = 0, 0
    for r in range(rows):  # merge the row starts into the changes (both ascending)
        row_start = r * row_len
        while j < k and changes[j] < row_start:
            out[m] = changes[j]
            m += 1
            j += 1
        if j < k and changes[j] == row_start:
            j += 1
        out[m] = row_start
        m += 1
    while j < k:
        out[m] = changes[j]
        m += 1
        j += 1
    return out[:m]


@njit(cache=True, nogil=True)
def runs(words, segments, row_len, block):
    """The runs of flat ``[B * row_len]`` token arrays ``words`` and ``segments`` (``None``: one segment per
    row), padding (word 0) dropped, in token order: first and last token on a grid where rows are padded to whole
    blocks (so runs of different rows never share a block), the index of the run's word
    among ``distinct`` (the ascending distinct words), and the group (row, segment), as int64 arrays."""
    start = _run_starts(words, segments, row_len)
    stride = -(-row_len // block) * block
    r = 0
    for i in range(start.size):
        r += words[start[i]] != 0
    first, last = np.empty(r, np.int64), np.empty(r, np.int64)
    word, seg = np.empty(r, np.int64), np.empty(r, np.int64)
    k = 0
    for i in range(start.size):
        a = start[i]
        if words[a] == 0:
            continue
        row = a // row_len
        first[k] = a + row * (stride - row_len)
        last[k] = (start[i + 1] if i + 1 < start.size else words.size) - 1 + row * (stride - row_len)
        word[k] = words[a]
        seg[k] = 0 if segments is None else segments[a]
        k += 1
    distinct, segs = np.unique(word), np.unique(seg)
    widx, group = np.empty(r, np.int64), np.empty(r, np.int64)
    for k in range(r):
        widx[k] = np.searchsorted(distinct, word[k])
        group[k] = first[k] // stride * segs.size + np.searchsorted(segs, seg[k])
    return first, last, widx, group, distinct


@njit(cache=True, nogil=True)
def _descending(work):
    """Block order by work descending, ties by lower block: a counting sort when the works are small integers
    (block counts always are), else a stable merge sort."""
    n = work.size
    top = 0
    for i in range(n):
        top = max(top, work[i])
    if top > 4 * n + 1024:
        return np.argsort(-work, kind="mergesort")
    start = np.zeros(top + 2, np.int64)  # start[top - w]: first position of work w in descending order
    for i in range(n):
        start[top - work[i] + 1] += 1
    for v in range(1, top + 2):
        start[v] += start[v - 1]
    order = np.empty(n, np.int64)
    for i in range(n):
        v = top - work[i]
        order[start[v]] = i
        start[v] += 1
    return order


@njit(cache=True, nogil=True)
def lpt_owner(work, cp_size):
    """The owning rank of every block under LPT: blocks by work descending (ties: lower block first), each to the
    least-loaded rank (ties: fewer blocks, then lower rank). A binary heap of rank keys
    ``(load * (n + 1) + count) * cp + rank`` (the caller checks they fit in int64), with the ranks alongside
    (no division per block)."""
    n = work.size
    order = _descending(work)
    keys, ranks = np.arange(cp_size), np.arange(cp_size)  # all loads equal: rank order is a heap
    owner = np.empty(n, np.int64)
    for i in range(n):
        b = order[i]
        key, rank = keys[0], ranks[0]
        owner[b] = rank
        key += (work[b] * (n + 1) + 1) * cp_size
        p = 0
        while True:  # sift the root down
            c = 2 * p + 1
            if c >= cp_size:
                break
            if c + 1 < cp_size and keys[c + 1] < keys[c]:
                c += 1
            if keys[c] >= key:
                break
            keys[p], ranks[p] = keys[c], ranks[c]
            p = c
        keys[p], ranks[p] = key, rank
    return owner


@njit(cache=True, nogil=True)
def lpt_blocks(work, cp_size):
    """LPT's plan for the column sums of ``[B, n]`` work: the block indices grouped by owner (each group
    ascending) and where each group starts (``cp_size + 1``)."""
    owner = lpt_owner(work.sum(axis=0) if work.shape[0] > 1 else work[0], cp_size)
    start = np.zeros(cp_size + 1, np.int64)
    for b in range(owner.size):
        start[owner[b] + 1] += 1
    for r in range(cp_size):
        start[r + 1] += start[r]
    at = start[:-1].copy()
    blocks = np.empty(owner.size, np.int64)
    for b in range(owner.size):
        blocks[at[owner[b]]] = b
        at[owner[b]] += 1
    return blocks, start


# ----------------------------------------------------------------------------------------------------------
# Block relations from the runs. A run is a maximal stretch of one (row, segment, word), padding dropped, listed
# in token order with its first and last block on a grid where row r's blocks are r*nb .. r*nb+nb-1. Between two
# different blocks every key of the earlier precedes every query of the later, so whether a key block may be
# attended from a query block depends only on the runs in each and on which comes first: ``before[q, k]`` /
# ``after[q, k]`` say whether a query of word q may attend a key of word k before / after it (same segment).
# A block holding one run belongs to that run's *stretch*; a block where runs meet is *mixed*.
# ----------------------------------------------------------------------------------------------------------

@njit(inline="always")
def _allows(q, nq, c, tab, word, group):
    for i in range(nq):
        a = q[i]
        if group[a] == group[c] and tab[word[a], word[c]]:
            return True
    return False


@njit(cache=True, nogil=True)
def _key_intervals(q, nq, x, cands, lo, hi, fb, lb, word, group, before, after, out):
    """The key blocks that the query runs ``q[:nq]`` in block ``x`` may attend, other than ``x``: disjoint
    ascending intervals ``out[i] = (first, last)``, those before ``x`` then those after. ``cands[lo:hi]``: the
    candidate key runs in token order (so first and last blocks never decrease). Returns the two counts."""
    n, end = 0, -1
    for t in range(lo, hi):
        c = cands[t]
        if fb[c] >= x:
            break
        if _allows(q, nq, c, before, word, group):
            a, b = max(fb[c], end + 1), min(lb[c], x - 1)
            if a <= b:
                if n and out[n - 1, 1] == a - 1:
                    out[n - 1, 1] = b
                else:
                    out[n, 0], out[n, 1] = a, b
                    n += 1
                end = b
    m, end = n, x
    for t in range(lo, hi):
        c = cands[t]
        if lb[c] <= x:
            continue
        if _allows(q, nq, c, after, word, group):
            a, b = max(fb[c], end + 1), lb[c]
            if a <= b:
                if m > n and out[m - 1, 1] == a - 1:
                    out[m - 1, 1] = b
                else:
                    out[m, 0], out[m, 1] = a, b
                    m += 1
                end = b
    return n, m - n


@njit(cache=True, nogil=True)
def _query_sets(first, last, word, group, block, before, after):
    """Everything both block relations need: the runs' blocks, their groups in token order, and each mixed
    block's runs (``mixed``: block, first and last run index) with whether it holds an allowed pair itself."""
    r = first.size
    fb, lb = first // block, last // block
    ordered = True
    for i in range(1, r):
        ordered &= group[i - 1] <= group[i]
    order = np.arange(r) if ordered else np.argsort(group, kind="mergesort")  # runs of each group, in token order
    gfirst, glast = np.empty(r, np.int64), np.empty(r, np.int64)
    i = 0
    while i < r:
        j = i
        while j + 1 < r and group[order[j + 1]] == group[order[i]]:
            j += 1
        for t in range(i, j + 1):
            gfirst[order[t]], glast[order[t]] = i, j + 1
        i = j + 1
    mixed = np.empty((r, 4), np.int64)  # block, first run, last run + 1, diagonal allowed
    k = 0
    i = 0
    while i < r:
        j = i
        while j + 1 < r and fb[j + 1] == lb[j] and (j == i or fb[j] == lb[j]):
            j += 1  # runs i..j meet in block lb[i] (the inner ones lie inside it)
        if j > i:
            m = lb[i]
            diag = 0
            for a in range(i, j + 1):
                for c in range(i, j + 1):
                    if group[a] != group[c]:
                        continue
                    key_pos, query_pos = max(first[c], m * block), min(last[a], m * block + block - 1)
                    tab = before if key_pos <= query_pos else after
                    if tab[word[a], word[c]]:
                        diag = 1
            mixed[k, 0], mixed[k, 1], mixed[k, 2], mixed[k, 3] = m, i, j + 1, diag
            k += 1
            i = j
        else:
            i += 1
    return fb, lb, order, gfirst, glast, mixed[:k]


@njit(inline="always")
def _candidates(i, j, group, order, gfirst, glast, row_runs):
    """The key runs to look at for query runs ``i..j-1`` (consecutive): their group's runs, or, when they span
    several groups, the runs from the first to the last run of those groups in token order."""
    lo, hi, one = gfirst[i], glast[i], True
    for t in range(i + 1, j):
        if group[t] != group[i]:
            one = False
    if one:
        return order, lo, hi
    lo, hi = order[gfirst[i]], order[glast[i] - 1] + 1
    for t in range(i + 1, j):
        lo, hi = min(lo, order[gfirst[t]]), max(hi, order[glast[t] - 1] + 1)
    return row_runs, lo, hi


@njit(cache=True, nogil=True)
def _coverage(fb, lb, word, order, gfirst):
    """Each group's blocks as disjoint pieces in block order (``start``, ``end``, ``mask``: the words of the
    group's runs in those blocks; a block shared by two runs is a piece of its own), the pieces ``lo..hi-1`` of
    each run's group, the distinct masks, and ``length[p, d]``: the blocks of pieces before ``p`` with mask ``d``
    (prefix sums, so that counting a group's blocks whose words a query allows costs O(masks))."""
    r = fb.size
    start, end, mask = np.empty(2 * r + 1, np.int64), np.empty(2 * r + 1, np.int64), np.empty(2 * r + 1, np.int64)
    lo, hi = np.empty(r, np.int64), np.empty(r, np.int64)
    n = 0
    i = 0
    while i < r:
        first_piece = n
        j = i
        while True:
            run = order[j]
            f, bit = fb[run], np.int64(1) << word[run]
            if n > first_piece and end[n - 1] == f:  # shares its first block with the piece before
                if start[n - 1] == f:
                    mask[n - 1] |= bit
                else:
                    end[n - 1] -= 1
                    start[n], end[n], mask[n] = f, f, mask[n - 1] | bit
                    n += 1
                f += 1
            if f <= lb[run]:
                start[n], end[n], mask[n] = f, lb[run], bit
                n += 1
            if j + 1 == r or gfirst[order[j + 1]] != gfirst[run]:
                break
            j += 1
        for t in range(i, j + 1):
            lo[order[t]], hi[order[t]] = first_piece, n
        i = j + 1
    start, end, mask = start[:n].copy(), end[:n].copy(), mask[:n].copy()
    masks = np.unique(mask)
    length = np.zeros((n + 1, masks.size), np.int64)
    for p in range(n):
        length[p + 1] = length[p]
        length[p + 1, np.searchsorted(masks, mask[p])] += end[p] - start[p] + 1
    return start, end, mask, lo, hi, masks, length


@njit(inline="always")
def _covered(x, allow_before, allow_after, lo, hi, start, end, mask, masks, length):
    """Blocks before and after block ``x`` among the pieces ``lo..hi-1`` of a group whose words are allowed."""
    p = lo + np.searchsorted(end[lo:hi], x)  # the first piece ending at or after x
    q = p + 1 if p < hi and start[p] <= x else p  # the first piece starting after x
    before, after = 0, 0
    for d in range(masks.size):
        if masks[d] & allow_before:
            before += length[p, d] - length[lo, d]
        if masks[d] & allow_after:
            after += length[hi, d] - length[q, d]
    if q > p:  # piece p holds x: its blocks on either side
        if mask[p] & allow_before:
            before += x - start[p]
        if mask[p] & allow_after:
            after += end[p] - x
    return before + after


@njit(inline="always")
def _covered_below(y, allow, lo, hi, start, end, mask, masks, length):
    """Blocks before block ``y`` among the pieces ``lo..hi-1`` of a group whose words are allowed."""
    if lo >= hi or y <= start[lo]:
        return 0
    p = lo + np.searchsorted(end[lo:hi], y)  # the first piece ending at or after y
    n = 0
    for d in range(masks.size):
        if masks[d] & allow:
            n += length[p, d] - length[lo, d]
    if p < hi and start[p] < y and mask[p] & allow:
        n += y - start[p]
    return n


@njit(inline="always")
def _listed_below(y, buf, n):
    """Blocks before block ``y`` in the intervals ``buf[:n]``."""
    total = 0
    for t in range(n):
        total += max(0, min(buf[t, 1], y - 1) - buf[t, 0] + 1)
    return total


@njit(cache=True, nogil=True)
def block_work(first, last, word, group, num_blocks, nb, block, before, after, reach, weight):
    """Work of every query block (``num_blocks`` on the grid): key blocks holding at least one allowed pair,
    summed over sliding windows with ``weight[k]`` times the work under window ``k``: key blocks before the query
    block count only among the ``reach[k]`` blocks just before it (``reach[k] < 0``: no window).

    The blocks a query set may attend are its group's blocks whose runs' words its words allow, so with the
    group's pieces and their prefix sums per word mask (``_coverage``) a stretch or a mixed block costs O(masks)
    (a mixed block spanning several segments scans their runs instead). Along a stretch the work changes by a
    constant step: the block left behind counts if the run sees itself before, the next one drops if it sees
    itself after. A window removes the allowed key blocks more than ``reach`` blocks before the query block, one
    prefix count per block and window. More than 63 distinct words do not fit the masks: then every query set
    scans its runs."""
    r = first.size
    fb, lb, order, gfirst, glast, mixed = _query_sets(first, last, word, group, block, before, after)
    num_words = before.shape[0]
    masked = num_words <= 63
    allow_b, allow_a = np.zeros(num_words, np.int64), np.zeros(num_words, np.int64)
    for a in range(num_words if masked else 0):
        for w in range(num_words):
            allow_b[a] |= np.int64(before[a, w]) << w
            allow_a[a] |= np.int64(after[a, w]) << w
    if masked:
        start, end, mask, lo, hi, masks, length = _coverage(fb, lb, word, order, gfirst)
    else:
        start = end = mask = lo = hi = masks = np.zeros(0, np.int64)
        length = np.zeros((1, 0), np.int64)
    total_weight, windowed = 0, False
    for k in range(reach.size):
        total_weight += weight[k]
        windowed |= reach[k] >= 0 and weight[k] != 0
    row_runs = np.arange(r)
    out = np.zeros(num_blocks, np.int64)
    cut = np.zeros(num_blocks if windowed else 0, np.int64)  # weighted key blocks the windows remove
    buf = np.empty((2 * r + 2, 2), np.int64)
    q = np.empty(max(r, 1), np.int64)
    for a in range(r):
        x0 = fb[a] + (a > 0 and lb[a - 1] == fb[a])
        x1 = lb[a] - (a + 1 < r and fb[a + 1] == lb[a])
        if x0 > x1:
            continue
        nbf = 0
        if masked:
            base = _covered(x0, allow_b[word[a]], allow_a[word[a]], lo[a], hi[a], start, end, mask, masks, length)
        else:
            q[0] = a
            nbf, naf = _key_intervals(q, 1, x0, order, gfirst[a], glast[a], fb, lb, word, group, before, after, buf)
            base = 0
            for t in range(nbf + naf):
                base += buf[t, 1] - buf[t, 0] + 1
        self_before, self_after = before[word[a], word[a]], after[word[a], word[a]]
        step = np.int64(self_before) - np.int64(self_after)
        for x in range(x0, x1 + 1):
            out[x] = base + self_before + step * (x - x0)
        if not windowed:
            continue
        below_x0 = 0 if masked else _listed_below(x0, buf, nbf)
        for k in range(reach.size):
            if reach[k] < 0 or weight[k] == 0:
                continue
            for x in range(x0, x1 + 1):
                y = x - reach[k]
                if masked:
                    n = _covered_below(y, allow_b[word[a]], lo[a], hi[a], start, end, mask, masks, length)
                elif y <= x0:
                    n = _listed_below(y, buf, nbf)
                else:  # the run's own blocks lie between x0 and y
                    n = below_x0 + self_before * (y - x0)
                cut[x] += weight[k] * n
    for k in range(mixed.shape[0]):
        m, i, j = mixed[k, 0], mixed[k, 1], mixed[k, 2]
        one_group = True
        for t in range(i + 1, j):
            one_group &= group[t] == group[i]
        total = mixed[k, 3]
        ab, aa, nbf = 0, 0, 0
        if masked and one_group:
            for t in range(i, j):
                ab |= allow_b[word[t]]
                aa |= allow_a[word[t]]
            total += _covered(m, ab, aa, lo[i], hi[i], start, end, mask, masks, length)
        else:
            for t in range(i, j):
                q[t - i] = t
            cands, c0, c1 = _candidates(i, j, group, order, gfirst, glast, row_runs)
            nbf, naf = _key_intervals(q, j - i, m, cands, c0, c1, fb, lb, word, group, before, after, buf)
            for t in range(nbf + naf):
                total += buf[t, 1] - buf[t, 0] + 1
        out[m] = total
        if not windowed:
            continue
        for w in range(reach.size):
            if reach[w] < 0 or weight[w] == 0:
                continue
            if masked and one_group:
                cut[m] += weight[w] * _covered_below(m - reach[w], ab, lo[i], hi[i], start, end, mask, masks, length)
            else:
                cut[m] += weight[w] * _listed_below(m - reach[w], buf, nbf)
    if total_weight != 1 or windowed:
        for x in range(num_blocks):
            out[x] = total_weight * out[x] - (cut[x] if windowed else 0)
    return out


@njit(cache=True, nogil=True)
def block_pairs(first, last, word, group, num_blocks, nb, block, before, after):
    """Whether each query block may attend each key block of its row: bool ``[num_blocks, nb]`` (key blocks
    numbered within the row), by listing each query block's key intervals (O(runs of its segment) per block:
    for tests and inspection; ``block_work`` counts without listing)."""
    r = first.size
    fb, lb, order, gfirst, glast, mixed = _query_sets(first, last, word, group, block, before, after)
    row_runs = np.arange(r)
    out = np.zeros((num_blocks, nb), np.bool_)
    buf = np.empty((2 * r + 2, 2), np.int64)
    q = np.empty(max(r, 1), np.int64)
    for a in range(r):
        x0 = fb[a] + (a > 0 and lb[a - 1] == fb[a])
        x1 = lb[a] - (a + 1 < r and fb[a + 1] == lb[a])
        q[0] = a
        for x in range(x0, x1 + 1):
            n = _key_intervals(q, 1, x, order, gfirst[a], glast[a], fb, lb, word, group, before, after, buf)
            row0 = x // nb * nb
            for t in range(n[0] + n[1]):
                out[x, buf[t, 0] - row0:buf[t, 1] - row0 + 1] = True
            out[x, x - row0] = before[word[a], word[a]]
    for k in range(mixed.shape[0]):
        m, i, j = mixed[k, 0], mixed[k, 1], mixed[k, 2]
        for t in range(i, j):
            q[t - i] = t
        cands, lo, hi = _candidates(i, j, group, order, gfirst, glast, row_runs)
        n = _key_intervals(q, j - i, m, cands, lo, hi, fb, lb, word, group, before, after, buf)
        row0 = m // nb * nb
        for t in range(n[0] + n[1]):
            out[m, buf[t, 0] - row0:buf[t, 1] - row0 + 1] = True
        out[m, m - row0] = mixed[k, 3] == 1
    return out
