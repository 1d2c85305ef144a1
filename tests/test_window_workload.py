"""The windowed block workload (``masks.block_workload(..., window=)``, computed in ``planning_loops.block_work``
without listing block pairs) equals the brute-force reference's block pairs cut by the window band, summed."""

import numpy as np
import pytest
import torch

from helpers import block_workload_reference as ref
from lightning_mm.attention import mask as masks
from lightning_mm.parallel import context as cp


def _expected(bam, block, seg, window):
    """The reference: block pairs (no window) AND the window band, summed over key blocks (and layers)."""
    if window is None:
        return ref.block_workload(bam, block, seg)
    if not isinstance(window, int):
        return sum(_expected(bam, block, seg, w) for w in window)
    nb = -(-bam.shape[-1] // block)
    return (ref.block_pairs(bam, block, seg) & masks.window_band(nb, block, window, bam.shape[-1])).sum(-1)


def _windows(rng, block, seq):
    return sorted({1, 2, block, block + 1, 2 * block - 1, int(rng.integers(1, seq + 1)), seq, 2 * seq})


@pytest.mark.parametrize("layout", masks.LAYOUTS)
def test_windowed_workload_matches_reference(layout):
    """Random EP/EE/MP masks (modality spans of 1..60 tokens, 1-3 encoders, causal modality words, 1-2 rows,
    packed segments) at block sizes 1..32, windows from one token to past the row."""
    for trial in range(40):
        rng = np.random.default_rng(1000 * masks.LAYOUTS.index(layout) + trial)
        seq, block = int(rng.integers(10, 360)), int(rng.choice([1, 2, 3, 8, 16, 32]))
        encoders = int(rng.integers(1, 4))
        bam, seg = masks.random_bam(layout, seq, num_encoders=encoders, batch=int(rng.integers(1, 3)), seed=trial,
                                    mean_item_tokens=int(rng.integers(1, 61)))
        if trial % 4 == 1:  # some modality tokens causal (the text word)
            bam = torch.where(bam == masks.modality_bit(1), torch.full_like(bam, masks.text_word(encoders)), bam)
        if seg is None and trial % 3 == 0:  # segments cutting through the spans
            seg = torch.from_numpy(rng.integers(0, 2, bam.shape).cumsum(-1) // 11).to(torch.int16)
        for window in _windows(rng, block, seq):
            got = masks.block_workload(bam, block, seg, window)
            assert torch.equal(got, _expected(bam, block, seg, window)), (trial, seq, block, window)
        layers = [None, 3, 3, block + 2, None, seq]
        assert torch.equal(masks.block_workload(bam, block, seg, layers), _expected(bam, block, seg, layers)), trial


def test_windowed_workload_with_more_words_than_masks_hold():
    """More than 63 distinct words (the loop scans runs instead of using word masks) and several segments."""
    for trial in range(12):
        rng = np.random.default_rng(trial)
        pool = set()
        while len(pool) < (70 if trial % 2 else 8):
            pool.add(int(rng.integers(1, 256)) | (masks.CAUSAL if rng.random() < 0.5 else 0))
        pool = np.array(sorted(pool) + [0], dtype=np.int64)
        seq, block = int(rng.integers(40, 400)), int(rng.choice([1, 3, 8, 16]))
        spans = [np.full(int(rng.integers(1, 12)), rng.choice(pool)) for _ in range(seq)]
        row = torch.from_numpy(np.concatenate(spans)[:seq])
        bam = torch.stack([row, row.roll(7)])
        seg = None if trial % 3 == 0 else torch.from_numpy(rng.integers(0, 2, bam.shape).cumsum(-1) // 9)
        for window in _windows(rng, block, seq):
            got = masks.block_workload(bam, block, seg, window)
            assert torch.equal(got, _expected(bam, block, seg, window)), (trial, seq, block, window)


def test_windowed_plan_is_lpt_of_the_windowed_work():
    bam, seg = masks.random_bam("mp", 2048, num_encoders=2, batch=2, seed=3, mean_item_tokens=40)
    layers = [100, 100, 100, 100, 100, None]
    work = _expected(bam, 16, seg, layers)
    plan = cp.distribute(bam, 4, "lpt", 16, seg, window=layers)
    assert all(torch.equal(a, b) for a, b in zip(plan, ref.lpt_assign(work.sum(0), 4)))


def test_bad_windows_in_the_workload_are_named():
    bam, _ = masks.random_bam("ee", 64, seed=0)
    for bad in (0, -3, 2.5, True, [None, 0], []):
        with pytest.raises(ValueError, match="window"):
            masks.block_workload(bam, 16, window=bad)
