"""Attention benchmark: our Triton bitfield kernels vs FlexAttention vs SDPA (dense mask) vs SDPA causal flash.

What it measures, the goals and the commands: docs/kernels.md, "Benchmark". Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests import this file by path
import harness  # noqa: E402

IMPLS = ("ours", "flex", "sdpa_dense", "sdpa_causal")
FWD_BWD_FACTOR = 3.5  # forward + backward = 2 + 5 matmuls of the forward's 2
GOAL_VS_FLEX, GOAL_VS_CAUSAL, GOAL_FROM_SEQ = 1.2, 0.70, 16384


def _allowed(bam, seg, chunk):
    """(query slice, its rows of the allowed [B, S, S] mask) in query chunks: never an [S, S] tensor at once."""
    from lightning_mm.attention import mask as masks

    b, s = bam.shape
    pos = torch.arange(s, device=bam.device).expand(b, s)
    for a in range(0, s, chunk):
        sl = slice(a, a + chunk)
        yield sl, masks.allowed(bam[:, sl], bam, pos[:, sl], pos, None if seg is None else seg[:, sl], seg)


def count_allowed_pairs(bam, seg, chunk=2048) -> int:
    return sum(int(ok.sum()) for _, ok in _allowed(bam, seg, chunk))


def dense_mask(bam, seg, chunk=2048):
    """Bool [B, 1, S, S] for SDPA."""
    out = torch.empty(bam.shape[0], 1, bam.shape[1], bam.shape[1], dtype=torch.bool, device=bam.device)
    for sl, ok in _allowed(bam, seg, chunk):
        out[:, 0, sl] = ok
    return out


def flex_mask_mod(bam, seg):
    """The bitfield rule as a FlexAttention mask_mod (same rule as ``masks.allowed``)."""
    from lightning_mm.attention import mask as masks

    def mask_mod(b, h, q_idx, kv_idx):
        qw, kw = bam[b, q_idx], bam[b, kv_idx]
        q_mod, k_mod = qw & masks.MODALITY_BITS, kw & masks.MODALITY_BITS
        causal = (qw & masks.CAUSAL) != 0
        ok = torch.where(causal, (kv_idx <= q_idx) & ((q_mod & k_mod) != 0), q_mod == k_mod)
        ok = ok & (qw != 0) & (kw != 0)
        if seg is not None:
            ok = ok & (seg[b, q_idx] == seg[b, kv_idx])
        return ok

    return mask_mod


def failure(e: Exception) -> str:
    return "OOM" if isinstance(e, torch.cuda.OutOfMemoryError) else f"error: {type(e).__name__}: {e}"[:300]


def build(name, bam, seg, q, k):
    """``f(q, k, v) -> out`` of implementation ``name``, its mask built (our tile maps too, as FlexAttention's block
    mask is, and as a microbatch's layers share them through their attention cache)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from lightning_mm.attention.kernels import bitfield_attention

    b, s = bam.shape
    if name == "ours":
        pos, cache = torch.arange(s, device=bam.device).expand(b, s), {}

        def ours(q, k, v):
            return bitfield_attention(q, k, v, bam, bam, q_segments=seg, k_segments=seg, q_positions=pos,
                                      k_positions=pos, cache=cache)
        with torch.no_grad():
            ours(q, k, k)
        return ours
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        block_mask = create_block_mask(flex_mask_mod(bam, seg), b, None, s, s, device=bam.device)
        flex = torch.compile(flex_attention, dynamic=False)
        return lambda q, k, v: flex(q, k, v, block_mask=block_mask, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    mask = dense_mask(bam, seg) if name == "sdpa_dense" else None

    def sdpa_dense_or_causal(q, k, v):  # causal: no mask, on the flash kernel
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if mask is None else contextlib.nullcontext():
            return sdpa(q, k, v, attn_mask=mask, is_causal=mask is None)
    return sdpa_dense_or_causal


def inputs(batch, heads, kv_heads, s, head_dim, seed, device) -> list:
    """Seeded random bf16 q, k, v and output gradient."""
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn((batch, h, s, head_dim), generator=g, device=device, dtype=torch.bfloat16)
            for h in (heads, kv_heads, kv_heads, heads)]


def measure(fn, q, k, v, dout, reps_ms):
    """(fwd ms, fwd+bwd ms, peak MiB of one fwd+bwd above the inputs) with triton.testing.do_bench."""
    from triton.testing import do_bench

    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))

    def step():
        fn(q, k, v).backward(dout)
    fwd_ms = do_bench(lambda: fn(q, k, v), warmup=25, rep=reps_ms)
    both_ms = do_bench(step, warmup=25, rep=reps_ms, grad_to_none=[q, k, v])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return fwd_ms, both_ms, (torch.cuda.max_memory_allocated() - base) / 2**20


def run_case(s, layout, head_dim, args, device):
    from lightning_mm.attention import mask as masks
    from lightning_mm.attention.kernels import FULL, PARTIAL, SKIP, default_config, tile_classes

    bam, seg = masks.random_bam(layout, s, num_encoders=args.encoders, batch=args.batch, seed=args.seed)
    bam, seg = bam.to(device), None if seg is None else seg.to(device)
    pairs, causal_pairs = count_allowed_pairs(bam, seg), args.batch * s * (s + 1) // 2
    q, k, v, dout = inputs(args.batch, args.heads, args.kv_heads, s, head_dim, args.seed, device)
    cfg = default_config(q)
    pos = torch.arange(s, device=device).expand(args.batch, s)
    classes = tile_classes(bam, bam, pos, pos, seg, seg, cfg.fwd_m, cfg.fwd_n)
    tiles = {name: int((classes == c).sum()) / classes.numel()
             for name, c in (("skip", SKIP), ("full", FULL), ("partial", PARTIAL))}
    del classes
    case = dict(seq_len=s, layout=layout, head_dim=head_dim, allowed_pairs=pairs, density=pairs / (args.batch * s * s),
                tiles=tiles, results={}, kernel_config=dict(vars(cfg)))  # the launch table's entry, with its origin
    flops_fwd, ref_out = 4 * args.heads * head_dim, None
    for name in args.impls:
        row = case["results"][name] = {}
        try:
            t0 = time.perf_counter()
            fn = build(name, bam, seg, q, k)
            torch.cuda.synchronize()
            row["setup_ms"] = (time.perf_counter() - t0) * 1e3
            with torch.no_grad():
                out = fn(q, k, v)
            if name in ("ours", "flex") and ref_out is None:
                ref_out = out
            elif name in ("ours", "flex"):
                row["max_abs_diff_vs_" + ("ours" if name == "flex" else "flex")] = \
                    float((out.float() - ref_out.float()).abs().max())
            del out
            fwd_ms, both_ms, peak = measure(fn, q, k, v, dout, args.rep_ms)
            used_pairs = causal_pairs if name == "sdpa_causal" else pairs
            row.update(status="ok", fwd_ms=fwd_ms, fwd_bwd_ms=both_ms, peak_mib=peak,
                       fwd_tflops=flops_fwd * used_pairs / fwd_ms / 1e9,
                       fwd_bwd_tflops=FWD_BWD_FACTOR * flops_fwd * used_pairs / both_ms / 1e9)
        except Exception as e:  # recorded (a failed setup in setup_ms too), the other implementations still run
            row["status"] = failure(e)
            if "setup_ms" not in row:
                row["setup_ms"] = row["status"]
            elif not isinstance(e, torch.cuda.OutOfMemoryError):
                row["traceback"] = traceback.format_exc()[-2000:]
        fn = None
        torch.cuda.empty_cache()
    return case


def summarise(case):
    """Speed-up of ours over FlexAttention and our share of causal flash's effective TFLOP/s."""
    ok = {k: v for k, v in case["results"].items() if v.get("status") == "ok"}
    ours, flex, causal, out = ok.get("ours"), ok.get("flex"), ok.get("sdpa_causal"), {}
    for p in ("fwd_bwd", "fwd") if ours else ():
        if flex:
            out[f"{p}_speedup_vs_flex"] = flex[f"{p}_ms"] / ours[f"{p}_ms"]
        if causal:
            out[f"{p}_tflops_vs_causal_flash"] = ours[f"{p}_tflops"] / causal[f"{p}_tflops"]
    return out


def goals(cases) -> dict:
    """The benchmark's goals over every case that measured both sides: met or not, with the worst ratio."""
    def check(key, bound, where=lambda c: True):
        ratios = {f"S={c['seq_len']} d={c.get('head_dim')} {c['layout']}": c["summary"][key] for c in cases
                  if key in c.get("summary", {}) and where(c)}
        worst = min(ratios.values(), default=None)
        return dict(met=worst is not None and worst >= bound, bound=bound, worst=worst, cases=ratios)

    return {"fwd_bwd_vs_flex_on_ee_mp_from_16k": check(
                "fwd_bwd_speedup_vs_flex", GOAL_VS_FLEX,
                lambda c: c["layout"] in ("ee", "mp") and c["seq_len"] >= GOAL_FROM_SEQ),
            "fwd_bwd_tflops_vs_causal_flash": check("fwd_bwd_tflops_vs_causal_flash", GOAL_VS_CAUSAL)}


def main(argv=None) -> int:
    args = harness.cli(
        __doc__, argv, quick=(False, "S=16k and head dim 128 only, shorter timing"),
        seq_lens=dict(type=int, nargs="+", help="default 4096 8192 16384 32768 65536"),
        layouts=dict(nargs="+", default=["ep", "ee", "mp"], choices=["ep", "ee", "mp"]),
        impls=dict(nargs="+", default=list(IMPLS), choices=list(IMPLS)), batch=1, heads=32, kv_heads=8,
        head_dims=dict(type=int, nargs="+", help="default 64 128"), encoders=2, seed=0,
        rep_ms=dict(type=int, help="timing budget per measurement (do_bench rep)"),
        out=dict(type=Path, help="JSON path (default results/attention_<device>.json)"))
    args.seq_lens = args.seq_lens or ([16384] if args.quick else [4096, 8192, 16384, 32768, 65536])
    args.head_dims = args.head_dims or ([128] if args.quick else [64, 128])
    args.rep_ms = args.rep_ms or (50 if args.quick else 200)
    if not torch.cuda.is_available():
        print("no GPU present: the attention benchmark needs CUDA; nothing was measured "
              "(the kernels are tested under TRITON_INTERPRET=1 in tests/test_kernels.py)")
        return 0
    import triton

    start, device = harness.record(), torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    out = args.out or harness.RESULTS / f"attention_{harness.slug(name)}.json"
    todo, cases = list(itertools.product(args.seq_lens, args.head_dims, args.layouts)), []
    report = dict(benchmark="attention", device=name, torch=torch.__version__, triton=triton.__version__,
                  python=start["python"], dtype="bfloat16", batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
                  head_dims=args.head_dims, encoders=args.encoders, seed=args.seed,
                  flops="allowed pairs x 4 x D x heads (fwd), x3.5 (fwd+bwd); causal flash counts causal pairs",
                  complete=False, cases=cases)
    for s, head_dim, layout in todo:
        try:
            case = run_case(s, layout, head_dim, args, device)
        except Exception as e:
            status = "OOM while building inputs" if isinstance(e, torch.cuda.OutOfMemoryError) else failure(e)
            case = dict(seq_len=s, layout=layout, head_dim=head_dim, results={}, status=status)
        case["summary"] = summarise(case)
        cases.append(case)
        report.update(complete=len(cases) == len(todo), goals=goals(cases))
        harness.write(out, report, start)  # after every case: a run stopped by a time limit keeps what it measured
    harness.print_rows([dict(S=c["seq_len"], d=c.get("head_dim"), layout=c["layout"], impl=k, **r, **c["summary"])
                        for c in cases for k, r in c["results"].items()],
                       ["S", "d", "layout", "impl", "status", "fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops",
                        "peak_mib", "fwd_bwd_speedup_vs_flex", "fwd_bwd_tflops_vs_causal_flash"])
    for goal, g in report["goals"].items():
        worst = "n/a" if g["worst"] is None else f"{g['worst']:.2f}"
        print(f"goal {goal} >= {g['bound']}: {'met' if g['met'] else 'NOT met'} (worst {worst})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
