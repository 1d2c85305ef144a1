"""Sliding-window attention: the rule (``masks.in_window``, HF's ``sliding_window_overlay``), the reference backend,
the tile classes and the Triton kernels (interpreted on CPU) against a dense computation, and the block workload."""

from test_kernels import DEVICE, TOL, _inputs, _words, kernels  # noqa: I001  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402
import torch  # noqa: E402
from test_attention_reference import dense_attention, rand_qkv  # noqa: E402

from lightning_mm.attention import mask as masks  # noqa: E402
from lightning_mm.attention import bitfield_attention  # noqa: E402
from lightning_mm.attention.kernels import tiles  # noqa: E402
from lightning_mm.parallel import context as cp  # noqa: E402


def _dense_windowed(bam, seg, window, q_index=None):
    """``masks.allowed`` with the window, queries ``q_index`` (all by default) against every key: [B, Sq, Sk]."""
    pos = torch.arange(bam.shape[1]).expand_as(bam)
    qi = torch.arange(bam.shape[1]) if q_index is None else q_index
    return masks.allowed(bam[:, qi], bam, pos[:, qi], pos, None if seg is None else seg[:, qi], seg, window)


def test_window_is_hf_sliding_window_overlay_on_every_pair():
    from transformers.masking_utils import and_masks, causal_mask_function, or_masks, sliding_window_overlay

    # text, a 5-token image span (bidirectional), text; as Gemma 3's sliding layers:
    # AND(sliding_window_overlay, OR(causal, image block))
    modality = torch.tensor([0, 0, 1, 1, 1, 1, 1, 0, 0, 0])
    bam = masks.words_from_modalities(modality[None], 1, causal_modalities=False)
    text_causal = masks.words_from_modalities(modality[None] * 0, 1)  # for the image span: causal and same block
    window = 3
    got = masks.to_dense(bam, window=window)[0]
    is_image = modality == 1
    block = lambda b, h, q, k: is_image[q] & is_image[k]  # noqa: E731  (one image block)
    hf = and_masks(sliding_window_overlay(window), or_masks(causal_mask_function, block))
    t = torch.tensor
    want = torch.tensor([[bool(hf(t(0), t(0), t(q), t(k))) for k in range(10)] for q in range(10)])
    # bitfield words: image tokens see their own span only (not earlier text), so compare where the words
    # express HF's rule: text queries everywhere, image queries on image keys
    exp = want.clone()
    exp[is_image] &= is_image
    assert torch.equal(got, exp)
    assert got[6, 2] == False and got[4, 2] and got[2, 6]  # noqa: E712  one-sided: later image keys stay visible
    assert torch.equal(masks.to_dense(text_causal, window=window)[0],
                       torch.tensor([[0 <= q - k < window for k in range(10)] for q in range(10)]))


def test_bad_windows_are_named():
    bam, _ = masks.random_bam("ee", 16)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="sliding window"):
            masks.to_dense(bam, window=bad)


@pytest.mark.parametrize("layout", masks.LAYOUTS)
@pytest.mark.parametrize("window", [1, 5, 16])
def test_reference_matches_dense_sdpa_with_window(layout, window):
    bam, seg = masks.random_bam(layout, 37, num_encoders=2, batch=2, seed=window)
    bam[1, -5:] = 0
    q, k, v = rand_qkv(2, 4, 2, 37, 37, 8)
    out = bitfield_attention(q, k, v, bam, bam, q_segments=seg, k_segments=seg, window=window, backend="reference")
    ref = dense_attention(q, k, v, masks.to_dense(bam, seg, window))
    torch.testing.assert_close(out, ref)
    go = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)):
        torch.testing.assert_close(a, b)
    # a query subset with global positions (context parallelism) gives the same rows
    qi = torch.tensor([0, 3, 9, 20, 21, 36])
    pos = torch.arange(37).expand(2, 37)
    sub = bitfield_attention(q[:, :, qi], k, v, bam[:, qi], bam, q_segments=None if seg is None else seg[:, qi],
                             k_segments=seg, q_positions=pos[:, qi], k_positions=pos, window=window,
                             backend="reference")
    torch.testing.assert_close(sub, out[:, :, qi])


def _dense_classes(ok, tq, tk):
    b, sq, sk = ok.shape
    nq, nk = -(-sq // tq), -(-sk // tk)
    pad = torch.zeros(b, nq * tq, nk * tk, dtype=torch.bool)
    pad[:, :sq, :sk] = ok
    t = pad.view(b, nq, tq, nk, tk)
    return t.any(4).any(2), t.all(4).all(2)


@pytest.mark.parametrize("layout", masks.LAYOUTS)
@pytest.mark.parametrize("window", [1, 7, 40, 500])
def test_tile_classes_with_window_are_sound_and_skip_outside(layout, window):
    bam, seg = masks.random_bam(layout, 203, num_encoders=3, batch=2, seed=7, mean_item_tokens=24)
    bam[1, 150:] = 0
    pos = torch.arange(203).expand(2, 203)
    qi = torch.cat([torch.arange(32, 64), torch.arange(160, 203)])  # a CP-like query subset
    for q_index in (torch.arange(203), qi):
        args = (bam[:, q_index], bam, pos[:, q_index], pos, None if seg is None else seg[:, q_index], seg)
        got = tiles.tile_classes(*args, 16, 16, window=window)
        some, every = _dense_classes(masks.allowed(*args, window), 16, 16)
        assert torch.equal(got == tiles.FULL, every)  # full: every pair allowed (exact)
        assert not (some & (got == tiles.SKIP)).any()  # never skips a tile holding an allowed pair
        # tiles that lie entirely outside the window (all keys window or more before every query) are skipped
        qp = pos[:, q_index]
        q_first = torch.nn.functional.pad(qp, (0, -qp.shape[1] % 16), value=10 ** 6).view(2, -1, 16).amin(-1)
        k_last = torch.nn.functional.pad(pos, (0, -203 % 16), value=-1).view(2, -1, 16).amax(-1)
        outside = (q_first[:, :, None] - k_last[:, None, :]) >= window
        assert (got[outside] == tiles.SKIP).all()
        if q_index is not qi and layout == "ep":  # every group's positions contiguous within a tile: exact
            assert torch.equal(got != tiles.SKIP, some)


@pytest.mark.parametrize("layout,spans", [("ee", False), *(pytest.param(layout, False, marks=pytest.mark.slow)
                                                            for layout in masks.LAYOUTS if layout != "ee"),
                                          pytest.param("ee", True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("window", [3, pytest.param(24, marks=pytest.mark.slow)])
def test_kernels_match_dense_with_window(layout, window, spans):
    """With span words too (Gemma 3's local layers: the window cuts an image's bidirectional block as HF does)."""
    bam, seg = masks.random_bam(layout, 70, num_encoders=2, batch=2, seed=window, mean_item_tokens=12, spans=spans)
    bam[0, -6:] = 0
    q, k, v, dout = _inputs(2, 4, 2, 70, 70, 16, torch.float32, seed=window)
    pos = torch.arange(70).expand(2, 70)
    for q_index in (torch.arange(70), torch.cat([torch.arange(16, 32), torch.arange(48, 70)])):
        words = _words(bam, seg, q_index)
        qs = q[:, :, q_index].contiguous()
        got, ref = [], []
        for impl in ("triton", "dense"):
            qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (qs, k, v))
            if impl == "triton":
                out = kernels.bitfield_attention(qq, kk, vv, *words["bam"], **words["extra"], window=window)
            else:
                out = dense_attention(qq, kk, vv, _dense_windowed(bam, seg, window, q_index).to(DEVICE))
            out.backward(dout[:, :, :len(q_index)])
            (got if impl == "triton" else ref).extend([out.detach(), qq.grad, kk.grad, vv.grad])
        atol, gtol = TOL[torch.float32]
        for name, t, r in zip(("out", "dq", "dk", "dv"), got, ref):
            assert torch.isfinite(t).all(), name
            bound = atol if name == "out" else gtol * max(1.0, r.abs().max().item())
            assert (t - r).abs().max().item() <= bound, name
    del pos


def test_kernel_tile_maps_are_cached_per_window():
    bam, seg = masks.random_bam("ee", 48, num_encoders=2, batch=1, seed=2)
    q, k, v, _ = _inputs(1, 2, 2, 48, 48, 16, torch.float32, seed=0)
    words = _words(bam, seg)
    cache = {}
    outs = {w: kernels.bitfield_attention(q, k, v, *words["bam"], **words["extra"], window=w, cache=cache)
            for w in (None, 4, None, 4)}
    assert len(cache["tile_maps"]) == 2
    ref = bitfield_attention(q, k, v, *words["bam"], **words["extra"], window=4, backend="reference")
    torch.testing.assert_close(outs[4], ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("layout", masks.LAYOUTS)
def test_block_workload_counts_pairs_within_the_window(layout):
    bam, seg = masks.random_bam(layout, 300, num_encoders=2, batch=2, seed=5)
    full = masks.block_workload(bam, 16, seg)
    for window in (1, 20, 100, 10_000):
        pairs = masks.block_pairs(bam, 16, seg, window)
        some, _ = _dense_classes(_dense_windowed(bam, seg, window), 16, 16)
        assert (pairs >= some).all()  # counts every block pair holding an allowed pair within the window
        text = (bam & masks.CAUSAL) != 0
        if bool(text.all()):
            assert torch.equal(pairs, some)
        work = masks.block_workload(bam, 16, seg, window)
        assert torch.equal(work, pairs.sum(-1)) and (work <= full).all()
    assert torch.equal(masks.block_workload(bam, 16, seg, 10_000), full)
    mixed = masks.block_workload(bam, 16, seg, [None, 20, 20, 20])
    assert torch.equal(mixed, full + 3 * masks.block_workload(bam, 16, seg, 20))
    # the CP planner balances the windowed work: LPT over the per-layer sum
    plan = cp.distribute(bam, 2, "lpt", 16, seg, window=[None, 20, 20, 20])
    assert torch.equal(torch.cat(plan).sort().values, torch.arange(mixed.shape[-1]))
    assert all(torch.equal(a, b) for a, b in zip(plan, cp.lpt_assign(mixed.sum(0), 2)))
