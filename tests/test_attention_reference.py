"""The reference bitfield attention equals SDPA with the dense mask, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

from lightning_mm.attention import mask as masks
from lightning_mm.attention import bitfield_attention
from lightning_mm.attention.reference import reference_attention


def dense_attention(q, k, v, allowed, scale=None):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=scale)
    return torch.nan_to_num(out) * allowed.any(-1)[:, None, :, None]  # SDPA gives NaN on empty rows


def rand_qkv(b, hq, hkv, sq, sk, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_()
    return mk(b, hq, sq, d), mk(b, hkv, sk, d), mk(b, hkv, sk, d)


@pytest.mark.parametrize("layout", masks.LAYOUTS)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
def test_matches_dense_sdpa_forward_and_backward(layout, hq, hkv):
    bam, seg = masks.random_bam(layout, 37, num_encoders=2, batch=2, seed=hq + hkv)
    bam[1, -5:] = 0  # padding rows: zeros, not NaN
    q, k, v = rand_qkv(2, hq, hkv, 37, 37, 8)
    out = bitfield_attention(q, k, v, bam, bam, q_segments=seg, k_segments=seg)
    ref = dense_attention(q, k, v, masks.to_dense(bam, seg))
    torch.testing.assert_close(out, ref)
    assert torch.equal(out[1, :, -5:], torch.zeros_like(out[1, :, -5:]))
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), go)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)
        assert torch.isfinite(a).all()


def test_chunking_is_exact_and_queries_may_be_a_subset():
    bam, _ = masks.random_bam("ee", 40, num_encoders=2, batch=1, seed=3)
    q, k, v = rand_qkv(1, 2, 2, 40, 40, 8, seed=1)
    full = reference_attention(q, k, v, bam, bam, q_positions=torch.arange(40)[None], k_positions=torch.arange(40)[None],
                               scale=8 ** -0.5, chunk=7)
    idx = torch.tensor([[3, 17, 18, 39]])  # context parallelism: local queries with their global positions
    sub = bitfield_attention(q[:, :, idx[0]], k, v, bam[:, idx[0]], bam, q_positions=idx)
    torch.testing.assert_close(sub, full[:, :, idx[0]])
    dense = dense_attention(q, k, v, masks.to_dense(bam))
    torch.testing.assert_close(full, dense)


def test_low_precision_matches_fp32_reference():
    bam, seg = masks.random_bam("mp", 33, batch=1, seed=5)
    q, k, v = rand_qkv(1, 4, 2, 33, 33, 16, dtype=torch.float32)
    ref = dense_attention(q, k, v, masks.to_dense(bam, seg))
    for dtype, tol in [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)]:
        out = bitfield_attention(q.to(dtype), k.to(dtype), v.to(dtype), bam, bam, q_segments=seg, k_segments=seg)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_bad_shapes_are_named():
    q, k, v = rand_qkv(1, 3, 2, 8, 8, 4)
    bam = torch.full((1, 8), masks.text_word(0))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        bitfield_attention(q, k, v, bam, bam)
    q, k, v = rand_qkv(1, 2, 2, 8, 8, 4)
    with pytest.raises(ValueError, match="q_bam"):
        bitfield_attention(q, k, v, bam[:, :5], bam)
    with pytest.raises(ValueError, match="unknown attention backend"):
        bitfield_attention(q, k, v, bam, bam, backend="cuda")
