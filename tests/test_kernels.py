"""Triton bitfield attention kernels against the reference backend.

On a machine without CUDA the kernels run under Triton's CPU interpreter: ``TRITON_INTERPRET=1`` must be set
before the kernels are decorated, so it is set here before anything imports ``lightning_mm.attention.kernels`` (and the
kernel modules are reloaded if another test imported them first). On CUDA the same tests run natively.
"""

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")


def _load_kernels():
    """Import the kernels so that they run interpreted on CPU even if triton was imported before this module.

    ``triton.jit`` picks interpreter or compiler when a function is decorated, and triton's own library
    functions (``tl.zeros``, ``tl.sum``) are decorated when triton is imported, which ``import lightning_mm``
    already does. So when an earlier test module imported triton natively, its Python modules (not the C
    extension) and the kernel modules are imported again, now with ``TRITON_INTERPRET=1``.
    """
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    if not ON_GPU and not isinstance(standard.zeros, InterpretedFunction):
        for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
            if not name.startswith("triton._C"):
                del sys.modules[name]
        for name in [m for m in sys.modules if m.startswith("lightning_mm.attention.kernels")]:
            del sys.modules[name]
        import triton.language.standard as standard  # noqa: F811
        from triton.runtime.interpreter import InterpretedFunction  # noqa: F811
        assert isinstance(standard.zeros, InterpretedFunction), "TRITON_INTERPRET=1 did not take effect"
    import lightning_mm.attention.kernels as kernels_pkg

    return kernels_pkg


kernels = _load_kernels()
from lightning_mm.attention import mask as masks  # noqa: E402
from lightning_mm.attention import bitfield_attention  # noqa: E402
from lightning_mm.attention.kernels import split, tiles  # noqa: E402
from tests.helpers.host_reads import HostReads  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
ROOT = Path(__file__).resolve().parents[1]
# (forward atol, gradient error relative to the gradient's max magnitude)
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 1e-2), torch.bfloat16: (3e-2, 4e-2)}


def _inputs(b, hq, hkv, sq, sk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g).to(DEVICE, dtype)
               for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
    dout = torch.randn(b, hq, sq, d, generator=g).to(DEVICE, dtype)
    return q, k, v, dout


def _run(backend, q, k, v, dout, words, **kw):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = bitfield_attention(q, k, v, *words["bam"], backend=backend, **words["extra"], **kw) if backend == "reference" \
        else kernels.bitfield_attention(q, k, v, *words["bam"], **words["extra"], **kw)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _compare(q, k, v, dout, words, kv_split=None, **kw):
    ref = _run("reference", q, k, v, dout, words)
    got = _run("triton", q, k, v, dout, words, kv_split=kv_split, **kw)
    atol, gtol = TOL[q.dtype]
    for name, r, t in zip(("out", "dq", "dk", "dv"), ref, got):
        assert t.dtype == r.dtype and t.shape == r.shape, name
        assert torch.isfinite(t).all(), f"{name} has NaN/inf"
        err = (t.float() - r.float()).abs().max().item()
        bound = atol if name == "out" else gtol * max(1.0, r.float().abs().max().item())
        assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"
    return ref, got


def _words(bam, seg=None, q_index=None):
    """Query/key words of a full sequence, or of the query subset ``q_index`` (context parallel) with positions."""
    b, s = bam.shape
    pos = torch.arange(s).expand(b, s)
    qi = torch.arange(s) if q_index is None else q_index
    extra = dict(q_positions=pos[:, qi].to(DEVICE), k_positions=pos.to(DEVICE))
    if seg is not None:
        extra.update(q_segments=seg[:, qi].to(DEVICE), k_segments=seg.to(DEVICE))
    return dict(bam=(bam[:, qi].to(DEVICE), bam.to(DEVICE)), extra=extra)


# ------------------------------------------------------------------------------------------------ tile classes

def _dense_classes(qw, kw, qp, kp, qs, ks, tq, tk):
    ok = masks.allowed(qw, kw, qp, kp, qs, ks)
    b, sq, sk = ok.shape
    nq, nk = -(-sq // tq), -(-sk // tk)
    pad = torch.zeros(b, nq * tq, nk * tk, dtype=torch.bool)
    pad[:, :sq, :sk] = ok
    t = pad.view(b, nq, tq, nk, tk)
    some, every = t.any(4).any(2), t.all(4).all(2)
    return torch.where(every, tiles.FULL, torch.where(some, tiles.PARTIAL, tiles.SKIP)).to(torch.int8)


@pytest.mark.parametrize("spans", [False, True])
@pytest.mark.parametrize("layout", masks.LAYOUTS)
@pytest.mark.parametrize("tq,tk", [(16, 16), (16, 32), (32, 16)])
def test_tile_classes_match_brute_force(layout, tq, tk, spans):
    bam, seg = masks.random_bam(layout, 203, num_encoders=3, batch=2, seed=7, mean_item_tokens=24, spans=spans)
    bam[1, 150:] = 0
    pos = torch.arange(203).expand(2, 203)
    qi = torch.cat([torch.arange(32, 64), torch.arange(160, 203)])  # a CP-like query subset
    seen = set()
    for q_index in (torch.arange(203), qi):
        args = (bam[:, q_index], bam, pos[:, q_index], pos,
                None if seg is None else seg[:, q_index], seg)
        got = tiles.tile_classes(*args, tq, tk)
        assert torch.equal(got, _dense_classes(*args, tq, tk))
        seen |= set(got.unique().tolist())
    assert seen == {tiles.SKIP, tiles.FULL, tiles.PARTIAL}


def test_tile_lists_walk_partial_then_full_tiles_in_order():
    classes = torch.tensor([[[0, 2, 1, 0], [0, 0, 0, 0], [1, 1, 2, 2], [1, 2, 0, 1]]], dtype=torch.int8)
    count, partial, idx = tiles.tile_lists(classes)
    assert count.tolist() == [[2, 0, 4, 3]] and partial.tolist() == [[1, 0, 2, 1]]
    assert idx[0, 0, :2].tolist() == [1, 2]
    assert idx[0, 2].tolist() == [2, 3, 0, 1]
    assert idx[0, 3, :3].tolist() == [1, 0, 3]


def test_tiles_with_more_groups_than_the_summary_stay_sound():
    """A tile holding more (word, segment) groups than ``GROUPS_PER_TILE`` (many tiny packed samples) is classified
    from its bounds: never FULL or SKIP where the brute force says otherwise, and still skipped where the
    segment ranges cannot meet."""
    s = 128
    seg = (torch.arange(s) // 3).expand(1, s)  # 3-token samples: 10+ groups per 32-token tile
    bam = masks.words_from_modalities(torch.zeros(1, s, dtype=torch.long), 0)
    pos = torch.arange(s).expand(1, s)
    args = (bam, bam, pos, pos, seg, seg)
    got = tiles.tile_classes(*args, 32, 32)
    dense = _dense_classes(*args, 32, 32)
    assert ((got == tiles.PARTIAL) | (got == dense)).all()
    far = torch.ones(4, 4, dtype=torch.bool).triu(2) | torch.ones(4, 4, dtype=torch.bool).tril(-2)
    assert (got[0][far] == tiles.SKIP).all()  # tiles two apart share no segment


# ------------------------------------------------------------------------------------------------ split-KV plan

def test_forward_items_cover_every_list_once():
    counts = torch.tensor([[0, 3, 10], [7, 1, 4]])
    items, merges, n_slots = split.forward_items(counts, chunk=3, num_key_tiles=10)
    covered = {}
    for b, qt, start, end, slot in items.tolist():
        if slot != -2:  # -2: an empty piece past the tile's list (the grid is sized by the longest list)
            covered.setdefault((b, qt), []).append((start, end, slot))
        else:
            assert start == end
    for b in range(2):
        for qt in range(3):
            ranges = sorted(covered[(b, qt)])
            assert ranges[0][0] == 0 and ranges[-1][1] == counts[b, qt]
            assert all(r0[1] == r1[0] for r0, r1 in zip(ranges, ranges[1:]))
            assert all(e - s <= 3 for s, e, _ in ranges)
            assert (len(ranges) > 1) == all(sl >= 0 for *_, sl in ranges)
            assert len(ranges) == merges[b * 3 + qt, 3]
    assert n_slots == 6 * 4  # every tile has room for the 4 pieces of a 10-tile list
    lengths = (items[:, 3] - items[:, 2]).tolist()
    assert lengths == sorted(lengths, reverse=True)  # heaviest first
    for b, qt, first, pieces in merges.tolist():
        slots = sorted(sl for *_, sl in covered[(b, qt)])
        assert pieces == 1 or slots == list(range(first, first + pieces))


def test_auto_chunk_splits_only_heavy_tiles():
    assert split.auto_chunk(4, 64, num_heads=1, num_sms=4, min_tiles=2) == 16  # ceil(256 / 16)
    assert split.auto_chunk(4, 64, num_heads=64, num_sms=4, min_tiles=2) == 0  # enough parallel work already
    assert split.auto_chunk(3, 3, num_heads=1, num_sms=4, min_tiles=8) == 0


# ------------------------------------------------------------------------------------------------ fwd + bwd

@pytest.mark.parametrize("layout,kv_split,spans", [
    ("ep", 0, False), ("ee", 1, False), ("mp", 2, True),
    *(pytest.param(*case, marks=pytest.mark.slow)
      for case in [("mp", None, False), ("mp", 2, False), ("ee", None, True)])])
def test_matches_reference_on_layouts(layout, kv_split, spans):
    b, s = 2, 61
    bam, seg = masks.random_bam(layout, s, num_encoders=2, batch=b, seed=3, mean_item_tokens=9, spans=spans)
    bam[0, -5:] = 0  # padding at the end of one row
    q, k, v, dout = _inputs(b, 4, 2, s, s, 32, torch.float32, seed=1)
    _compare(q, k, v, dout, _words(bam, seg), kv_split=kv_split)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_matches_reference(dtype):
    bam, seg = masks.random_bam("mp", 47, num_encoders=2, batch=1, seed=11, mean_item_tokens=7)
    q, k, v, dout = _inputs(1, 2, 1, 47, 47, 64, dtype, seed=2)
    _compare(q, k, v, dout, _words(bam, seg), kv_split=1)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="real sizes need a GPU (the interpreter takes minutes per kernel call)")
@pytest.mark.parametrize("layout", ["ee", "mp"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_real_sizes_match_reference_natively(layout, head_dim):
    """S = 4096 in bf16 with GQA: the default tile sizes, tile skipping and the split-KV path of the compiled
    kernels (not reached at the interpreter's sizes) against the reference, and dq by atomic adds."""
    from dataclasses import replace

    bam, seg = masks.random_bam(layout, 4096, num_encoders=2, batch=1, seed=17)
    q, k, v, dout = _inputs(1, 8, 2, 4096, 4096, head_dim, torch.bfloat16, seed=5)
    for kv_split in (None, 0, 4):  # automatic, never split, split every 4 key tiles
        _compare(q, k, v, dout, _words(bam, seg), kv_split=kv_split)
    _compare(q, k, v, dout, _words(bam, seg), config=replace(kernels.default_config(q), dq_atomic=True))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_launch_table_tile_shapes_match_reference(head_dim):
    """The GPU table's bf16 tile shapes (forward, dk/dv and dq tiles of different sizes, measured on an H200 for
    head dim 128) on packed rows with a split, in fp32 against the reference: run by the interpreter on CPU."""
    from lightning_mm.attention.kernels.launch_config import config_for

    cfg = config_for(torch.bfloat16, head_dim)
    bam, seg = masks.random_bam("mp", 150, num_encoders=2, batch=1, seed=13, mean_item_tokens=20, spans=True)
    q, k, v, dout = _inputs(1, 2, 1, 150, 150, head_dim, torch.float32, seed=6)
    _compare(q, k, v, dout, _words(bam, seg), kv_split=1, config=cfg)


@pytest.mark.parametrize("layout,window", [("ee", None),
                                           *(pytest.param("mp", w, marks=pytest.mark.slow) for w in (None, 9))])
def test_atomic_dq_matches_reference(layout, window):
    """dq added by the dk/dv pass with atomic adds (``KernelConfig.dq_atomic``) on padded rows, GQA and several
    tiles per row (partial and full), with and without a window: every gradient equals the reference's."""
    from dataclasses import replace

    from lightning_mm.attention.kernels.launch_config import INTERPRETER_CONFIG

    bam, seg = masks.random_bam(layout, 61, num_encoders=2, batch=2, seed=3, mean_item_tokens=9)
    bam[0, -5:] = 0
    q, k, v, dout = _inputs(2, 4, 2, 61, 61, 32, torch.float32, seed=1)
    words = _words(bam, seg)
    ref = _run("reference", q, k, v, dout, words, window=window)
    got = _run("triton", q, k, v, dout, words, window=window, config=replace(INTERPRETER_CONFIG, dq_atomic=True))
    for name, r, t in zip(("out", "dq", "dk", "dv"), ref, got):
        torch.testing.assert_close(t, r, atol=2e-5, rtol=2e-5, msg=name)


def test_head_dim_not_a_power_of_two_and_no_gqa():
    bam, _ = masks.random_bam("ee", 40, num_encoders=1, batch=1, seed=5, mean_item_tokens=6)
    q, k, v, dout = _inputs(1, 2, 2, 40, 40, 48, torch.float32, seed=3)
    _compare(q, k, v, dout, _words(bam))


def test_context_parallel_query_subset_with_positions():
    """Sq != Sk: the queries are two blocks of the sequence (zigzag-like), keys the whole sequence."""
    s = 64
    bam, seg = masks.random_bam("mp", s, num_encoders=2, batch=1, seed=13, mean_item_tokens=8)
    q_index = torch.cat([torch.arange(8, 24), torch.arange(45, 57)])
    q, k, v, dout = _inputs(1, 4, 1, len(q_index), s, 32, torch.float32, seed=4)
    for kv_split in (0, 1):
        _compare(q, k, v, dout, _words(bam, seg, q_index), kv_split=kv_split)


def test_fully_masked_rows_give_zeros_and_zero_gradients():
    s = 35
    bam = masks.words_from_modalities(torch.tensor([[0] * 10 + [1] * 8 + [0] * 10 + [-1] * 7]), 1)
    bam[0, 3] = masks.CAUSAL  # non-zero word without modality bits: no key is allowed
    dead = [3] + list(range(28, 35))
    q, k, v, dout = _inputs(1, 2, 1, s, s, 32, torch.float32, seed=5)
    _, (out, dq, dk, dv) = _compare(q, k, v, dout, _words(bam), kv_split=1)
    assert out[:, :, dead].abs().max() == 0 and dq[:, :, dead].abs().max() == 0
    assert dk[:, :, dead[1:]].abs().max() == 0 and dv[:, :, dead[1:]].abs().max() == 0


def test_everything_masked_is_zero_not_nan():
    bam = torch.zeros(1, 20, dtype=torch.int64)
    q, k, v, dout = _inputs(1, 1, 1, 20, 20, 16, torch.float32, seed=6)
    _, got = _compare(q, k, v, dout, _words(bam))
    assert all(t.abs().max() == 0 for t in got)


def test_dispatcher_uses_the_kernels():
    bam, seg = masks.random_bam("ee", 30, num_encoders=1, batch=1, seed=9, mean_item_tokens=5)
    q, k, v, _ = _inputs(1, 2, 1, 30, 30, 32, torch.float32, seed=7)
    ref = bitfield_attention(q, k, v, bam.to(DEVICE), bam.to(DEVICE), backend="reference")
    got = bitfield_attention(q, k, v, bam.to(DEVICE), bam.to(DEVICE), backend="triton")
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_layers_sharing_a_cache_classify_tiles_and_read_the_words_once(monkeypatch):
    """The layers of a microbatch pass the same mask tensors and one cache: the tile maps are built by the first
    layer only, the words are read on the host by it only, and the results and gradients are unchanged. A new
    mask tensor (another microbatch) is classified again."""
    built = []

    class CountingMaps(kernels.attention.TileMaps):
        def __init__(self, *args):
            built.append(1)
            super().__init__(*args)

    monkeypatch.setattr(kernels.attention, "TileMaps", CountingMaps)
    bam, seg = masks.random_bam("mp", 45, num_encoders=2, batch=2, seed=21, mean_item_tokens=7)
    words = _words(bam, seg)
    q, k, v, dout = _inputs(2, 4, 2, 45, 45, 32, torch.float32, seed=8)
    plain = _run("triton", q, k, v, dout, words)
    assert len(built) == 1
    cache, reads = {}, []
    for layer in range(3):
        with HostReads() as mode:
            cached = _run("triton", q, k, v, dout, words, cache=cache)
        reads.append(mode.count)
        for a, b in zip(plain, cached):
            torch.testing.assert_close(b, a, atol=0, rtol=0)
    assert len(built) == 2, "the layers after the first reuse the cached tile maps"
    assert reads[1] == reads[2] < reads[0], f"host reads per layer {reads}: the later layers read no words"
    other = dict(bam=tuple(t.clone() for t in words["bam"]), extra=words["extra"])
    _run("triton", q, k, v, dout, other, cache=cache)
    assert len(built) == 3, "new mask tensors are classified again"
    # positions left out (made inside each call) still hit the cache: it compares what the caller gave
    unpositioned, cache = dict(bam=words["bam"], extra=dict(q_segments=words["extra"]["q_segments"],
                                                            k_segments=words["extra"]["k_segments"])), {}
    for _ in range(2):
        _run("triton", q, k, v, dout, unpositioned, cache=cache)
    assert len(built) == 4 and len(cache["tile_maps"]) == 1


def test_autocast_gives_the_kernels_one_dtype():
    """Rotary embeddings leave q and k in fp32 beside a bf16 v under bf16 autocast (found on an H200): the
    dispatcher casts the three to the autocast dtype, as SDPA does."""
    bam, seg = masks.random_bam("ee", 33, num_encoders=1, batch=1, seed=4, mean_item_tokens=6)
    q, k, v, _ = _inputs(1, 2, 1, 33, 33, 32, torch.float32, seed=9)
    w = _words(bam, seg)
    expected = bitfield_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), *w["bam"], backend="triton", **w["extra"])
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got = bitfield_attention(q, k, v.bfloat16(), *w["bam"], backend="triton", **w["extra"])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------ errors

def test_bad_inputs_raise_clear_errors():
    bam = torch.full((1, 8), 1, dtype=torch.int64).to(DEVICE)
    q = torch.randn(1, 2, 8, 32, device=DEVICE)
    with pytest.raises(TypeError, match="dtypes"):
        kernels.bitfield_attention(q.double(), q.double(), q.double(), bam, bam)
    with pytest.raises(ValueError, match="head dim"):
        big = torch.randn(1, 1, 8, 512, device=DEVICE)
        kernels.bitfield_attention(big, big, big, bam, bam)
    with pytest.raises(ValueError, match="q_bam"):
        kernels.bitfield_attention(q, q, q, bam[:, :5], bam)
    with pytest.raises(ValueError, match="kv_split"):
        kernels.bitfield_attention(q, q, q, bam, bam, kv_split=-1)
    negative = bam.clone()
    negative[0, 0] = -5  # bit 63 set
    with pytest.raises(ValueError, match="bit 63"):
        kernels.bitfield_attention(q, q, q, negative, bam)


@pytest.mark.skipif(ON_GPU, reason="the CPU-without-interpreter error only exists on CPU")
def test_cpu_without_interpreter_says_how_to_fix(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(1, 1, 8, 16)
    bam = torch.ones(1, 8, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.bitfield_attention(x, x, x, bam, bam)


# ------------------------------------------------------------------------------------------------ GPU build, benchmark

def _clean_env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    return env


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter is lenient; the real compiler (down to a cubin) must accept the kernels too."""
    pytest.importorskip("triton.backends.nvidia")
    r = subprocess.run([sys.executable, "-m", "lightning_mm.attention.kernels.compile_check", "--dtypes", "bf16",
                        "--head-dims", "128", "--arch", "90"], capture_output=True, text=True, env=_clean_env(),
                       cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count(" ok") == 6, r.stdout


@pytest.mark.skipif(ON_GPU, reason="checks the no-GPU path of the benchmark")
def test_benchmark_without_gpu_reports_and_exits_zero():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--quick"], capture_output=True,
                       text=True, env=_clean_env(), cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "no GPU" in r.stdout


def test_benchmark_baselines_get_the_same_mask():
    """FlexAttention's mask_mod and SDPA's dense mask in benchmarks/attention.py are the bitfield rule exactly
    (through FlexAttention's own ``create_mask``), and the TF/s count is their number of allowed pairs."""
    import importlib.util

    from torch.nn.attention.flex_attention import create_mask

    spec = importlib.util.spec_from_file_location("attention_benchmark", ROOT / "benchmarks" / "attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for layout in masks.LAYOUTS:
        bam, seg = masks.random_bam(layout, 150, num_encoders=2, batch=2, seed=4, mean_item_tokens=15)
        bam[1, -7:] = 0
        pos = torch.arange(150).expand(2, 150)
        rule = masks.allowed(bam, bam, pos, pos, seg, seg)
        assert torch.equal(create_mask(bench.flex_mask_mod(bam, seg), 2, None, 150, 150, device="cpu")[:, 0], rule)
        assert torch.equal(bench.dense_mask(bam, seg, chunk=64)[:, 0], rule)
        assert bench.count_allowed_pairs(bam, seg, chunk=64) == int(rule.sum())


# ------------------------------------------------------------------------------------------------ host syncs

@pytest.mark.slow
def test_attention_path_of_a_training_step_reads_nothing_on_the_host(monkeypatch):
    """One forward+backward of a 2-layer Qwen2 (GQA, head dim 16) whose attention runs the kernels: no operation on
    the attention path (validation, tile classification, work items, launches' arguments, backward) would make
    the host wait for a GPU (``DeviceToHost``: value reads, value-sized outputs, host copies). The step's only
    two reads are the model's, once per step: building the words checks the modality indices, and
    ``attention_context`` validates the words, which the layers then take as checked. Loss and gradients equal
    the same model on the reference backend. On CPU the interpreter's own argument copies are not counted; on a GPU
    the step runs natively and every read counts."""
    from lightning_mm.attention import dispatch
    from lightning_mm.model import tiny_language_model
    import lightning_mm as lmm
    from tests.helpers.host_reads import DeviceToHost

    torch.manual_seed(0)
    lm = tiny_language_model("qwen2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             num_hidden_layers=2)
    model = lmm.MultimodalModel({}, lm).to(DEVICE)
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def step():
        model.zero_grad()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    monkeypatch.setattr(dispatch, "_triton_available", lambda q: False)
    ref_loss, ref_grads = step()
    mode, launch = DeviceToHost(), kernels.attention.launch

    def paused_launch(*args, **meta):
        with mode.paused():
            launch(*args, **meta)

    if not ON_GPU:
        monkeypatch.setattr(kernels.attention, "launch", paused_launch)
    monkeypatch.setattr(dispatch, "_triton_available", lambda q: True)
    with mode:
        loss, grads = step()
    on_path = [r for r, w in zip(mode.reads, mode.where)
               if any("attention/kernels/" in f or "attention/dispatch.py" in f or "attention/hf.py" in f for f in w)]
    assert on_path == [], f"host reads on the attention path: {on_path}"
    assert len(mode.reads) == 2, list(zip(mode.reads, [w[-2:] for w in mode.where]))
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-4, rtol=1e-3, msg=name)


def test_launch_table_is_keyed_by_dtype_and_head_dim(tmp_path, monkeypatch):
    """The GPU launch settings come from the table row of the dtype and the smallest head-dim bound that fits,
    record their origin, and a JSON table (a tuning sweep's output) replaces rows by name."""
    from lightning_mm.attention.kernels import launch_config as lc

    assert lc.config_for(torch.bfloat16, 64).fwd_warps == 4 and lc.config_for(torch.bfloat16, 96).fwd_warps == 8
    assert lc.config_for(torch.float16, 256).fwd_m == 64 and lc.config_for(torch.float32, 48).fwd_m == 64
    assert "not tuned" in lc.config_for(torch.bfloat16, 64).source
    assert "sweep on one H200" in lc.config_for(torch.bfloat16, 128).source
    assert lc.config_for(torch.bfloat16, 128, cuda=False) is lc.INTERPRETER_CONFIG
    tuned = dict(dtype="bf16", head_dim=128, fwd_m=64, fwd_n=64, dkdv_m=64, dkdv_n=64, dq_m=64, dq_n=64,
                 fwd_warps=4, bwd_warps=8, stages=2, min_split_tiles=8, dq_atomic=True, source="sweep on some GPU")
    path = tmp_path / "table.json"
    path.write_text(__import__("json").dumps([tuned]))
    monkeypatch.setenv("LIGHTNING_MM_KERNEL_TABLE", str(path))
    cfg = lc.config_for(torch.bfloat16, 128)
    assert (cfg.fwd_m, cfg.bwd_warps, cfg.dq_atomic, cfg.source) == (64, 8, True, "sweep on some GPU")
    assert lc.config_for(torch.bfloat16, 64).fwd_warps == 4  # rows the file lacks keep the built-in table's
    assert lc.load_table(str(path)) == {(torch.bfloat16, 128): cfg}
    assert lc.table_rows({(torch.bfloat16, 128): cfg}) == [tuned]
    with pytest.raises(ValueError, match="head dim 300.*add a row"):
        lc.config_for(torch.bfloat16, 300)


def test_full_tiles_take_the_unmasked_path(monkeypatch):
    """The kernels apply no mask on tiles classified FULL (the loop over them has no rule evaluation): with every
    tile of a causal mask forced to FULL, output and gradients are those of unmasked attention (the reference with
    every pair allowed), in the forward, dk/dv and dq passes alike. Forced PARTIAL everywhere, they are causal.
    (S is a multiple of the tiles: a ragged last tile is never FULL, as the classification guarantees.)"""
    s = 32
    causal = masks.words_from_modalities(torch.zeros(1, s, dtype=torch.long), 0)
    everything = torch.full((1, s), masks.text_word(0) & ~masks.CAUSAL, dtype=torch.int64)
    q, k, v, dout = _inputs(1, 2, 1, s, s, 16, torch.float32, seed=12)
    real = tiles.tile_classes
    for forced, words in ((tiles.FULL, everything), (tiles.PARTIAL, causal)):
        monkeypatch.setattr(tiles, "tile_classes", lambda *a, f=forced, **kw: torch.full_like(real(*a, **kw), f))
        got = _run("triton", q, k, v, dout, _words(causal))
        monkeypatch.setattr(tiles, "tile_classes", real)
        ref = _run("reference", q, k, v, dout, _words(words))
        for name, r, t in zip(("out", "dq", "dk", "dv"), ref, got):
            torch.testing.assert_close(t, r, atol=2e-5, rtol=2e-5, msg=name)
