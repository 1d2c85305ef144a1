"""flash-linear-attention's varlen kernels (the GDN layers' CUDA path) against our torch reference on packed rows.

The same checks run on CPU under Triton's interpreter (``tests/helpers/fla_interpret.py``: the two interpreter
gaps fla 0.6.0 hits, bridged for the test's duration) and natively on CUDA (``-m gpu``). They need ``fla``
importable: the ``[gpu]`` extra on a CUDA machine. On a CPU machine install it beside the project rather than into
it (``pip install --no-deps --target DIR fla-core==0.6.0 einops`` and ``PYTHONPATH=$PWD:DIR``): once ``fla`` is
importable, transformers' Qwen3.5 calls its kernels on every device, and the other tests' HF references on CPU fail.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("fla")

from helpers.fla_interpret import interpreted_fla, load_fla_interpreted  # noqa: E402

from lightning_mm.model import linear_attention as la  # noqa: E402

load_fla_interpreted()
ON_GPU = torch.cuda.is_available()
LENGTHS = (13, 3, 24)  # row 0: three samples packed; row 1: one sample of 13, then padding
SEQ = sum(LENGTHS)


@pytest.fixture(autouse=True)
def _interpreted(monkeypatch):
    """fla's kernels interpreted on CPU; on CUDA their fp32 dots in full fp32 (Triton's default there is tf32,
    which the comparisons' fp32 tolerances do not allow)."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    with interpreted_fla():
        yield


def _rows(device="cpu"):
    """Segment ids and mask words of the two rows (row 1's padding is a segment of its own, as the collator pads)."""
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])
    segments = torch.stack([segments, (torch.arange(SEQ) >= LENGTHS[0]).long()])
    bam = torch.ones(2, SEQ, dtype=torch.int64)
    bam[1, LENGTHS[0]:] = 0
    return segments.to(device), bam.to(device)


def _spans() -> list[tuple[int, int, int]]:
    starts = torch.tensor((0,) + LENGTHS).cumsum(0).tolist()
    return [(0, a, a + n) for a, n in zip(starts, LENGTHS)] + [(1, 0, LENGTHS[0])]


def _leaves(device):
    g = torch.Generator().manual_seed(0)
    t = dict(q=torch.randn(2, SEQ, 2, 16, generator=g), k=torch.randn(2, SEQ, 2, 16, generator=g),
             v=torch.randn(2, SEQ, 4, 16, generator=g), g=-torch.rand(2, SEQ, 4, generator=g) * 0.3,
             beta=torch.rand(2, SEQ, 4, generator=g), x=torch.randn(2, SEQ, 12, generator=g),
             w=torch.randn(12, 4, generator=g))
    return {k: v.to(device).requires_grad_(True) for k, v in t.items()}


def _run(kernel: str, device: str, segments=None):
    """Convolution (+ silu) and delta rule of the leaves over the rows, with the ``kernel``'s layout; the outputs
    and every leaf's gradient of a fixed weighted sum of the real tokens' outputs."""
    seg, bam = _rows(device)
    layout = la.segment_layout(bam, seg if segments is None else segments.to(device), la.CHUNK, kernel)
    assert layout.kernel == kernel
    t = _leaves(device)
    conv = la.conv_and_activation(t["x"], t["w"], None, "silu", layout)
    core = la.delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], layout)
    real = bam.ne(0).to(core.dtype)
    g = torch.Generator().manual_seed(1)
    wc, wd = torch.randn(conv.shape, generator=g).to(device), torch.randn(core.shape, generator=g).to(device)
    ((conv * wc).sum(-1) * real).sum().add(((core * wd).sum((-1, -2)) * real).sum()).backward()
    return conv, core, {k: v.grad for k, v in t.items()}


def _assert_fla_equals_torch(device: str):
    ref_conv, ref_core, ref_grads = _run("torch", "cpu")
    conv, core, grads = _run("fla", device)
    for r, a, e in _spans():
        torch.testing.assert_close(conv[r, a:e].cpu(), ref_conv[r, a:e], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(core[r, a:e].cpu(), ref_core[r, a:e], atol=2e-4, rtol=2e-4)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name].cpu(), grad, atol=5e-4, rtol=5e-4, msg=name)
    # the reset is visible: with one sample per row (no boundaries) the 2nd and 3rd samples' first tokens differ
    blind_conv, blind_core, _ = _run("fla", device, segments=torch.zeros(2, SEQ, dtype=torch.long))
    for r, a, _ in _spans()[1:3]:
        assert (blind_core[r, a:a + 2] - core[r, a:a + 2]).abs().max() > 1e-3
        assert (blind_conv[r, a:a + 2] - conv[r, a:a + 2]).abs().max() > 1e-3


@pytest.mark.slow  # 90 s interpreted on a loaded 2-core machine
@pytest.mark.skipif(ON_GPU, reason="the CUDA run is test_fla_varlen_kernels_equal_torch_reference_on_cuda")
def test_fla_varlen_kernels_equal_torch_reference_interpreted():
    """fla's varlen convolution and chunked delta rule (interpreted, CPU) over three samples packed in a row and one
    padded row equal our torch reference: outputs and every input's gradient; without the boundaries the later
    samples' first tokens differ."""
    _assert_fla_equals_torch("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_fla_varlen_kernels_equal_torch_reference_on_cuda():
    """The same on CUDA, natively: fla's kernels against the CPU reference."""
    _assert_fla_equals_torch("cuda")


def _gdn():
    """The CP tests' random Qwen3.5 GDN layer, with 16-wide heads."""
    from test_gdn_context_parallel import _gdn as random_gdn

    return random_gdn(2, 4, key_dim=16, value_dim=16)


def _layer(device: str, kernel: str | None):
    """The Qwen3.5 GDN layer's forward over the packed rows through its segment-aware ``forward`` (``kernel``
    None: the one ``gdn_kernel`` picks for the device) or ``gated_delta_net`` with a layout of ``kernel``; the
    output and every parameter's gradient."""
    gdn = _gdn().to(device)
    seg, bam = _rows(device)
    hidden = torch.randn(2, SEQ, 32, generator=torch.Generator().manual_seed(2)).to(device).requires_grad_(True)
    if kernel is None:
        cache = {}
        out = gdn(hidden, bam=bam, segment_ids=seg, attn_cache=cache)
        kernel = cache["gdn_layout"].kernel
    else:
        out = la.gated_delta_net(gdn, hidden, la.segment_layout(bam, seg, la.CHUNK, kernel))
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(device)
    (out * weights * bam.ne(0)[..., None]).sum().backward()
    grads = {n: p.grad.cpu() for n, p in gdn.named_parameters()}
    return out.detach().cpu(), grads | {"hidden": hidden.grad.cpu()}, kernel


def _assert_layer_like_reference(device: str, kernel: str | None):
    ref, ref_grads, ref_kernel = _layer("cpu", None)
    out, grads, used = _layer(device, kernel)
    assert (ref_kernel, used) == ("torch", "fla")
    for r, a, e in _spans():
        torch.testing.assert_close(out[r, a:e], ref[r, a:e], atol=1e-4, rtol=1e-4)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=5e-4, rtol=5e-4, msg=name)
    assert len(grads) == 10


@pytest.mark.slow  # 85 s interpreted on a loaded 2-core machine
@pytest.mark.skipif(ON_GPU, reason="the CUDA run is test_qwen3_5_gdn_layer_on_cuda_equals_cpu_reference")
def test_qwen3_5_gdn_layer_through_fla_equals_torch_reference_interpreted():
    """A whole Qwen3.5 GDN layer (HF's class, segment-aware) over the packed rows through fla's kernels
    (interpreted) equals the same layer through the torch path: output at every real token and every gradient."""
    _assert_layer_like_reference("cpu", "fla")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_qwen3_5_gdn_layer_on_cuda_equals_cpu_reference():
    """On CUDA the layer's own forward picks fla's kernels (``gdn_kernel``) and equals the CPU reference."""
    _assert_layer_like_reference("cuda", None)
