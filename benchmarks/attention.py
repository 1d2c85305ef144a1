"""Attention benchmark: our Triton bitfield kernels vs FlexAttention vs SDPA (dense mask) vs SDPA causal flash.

What it measures, the goals and the commands: docs/kernels.md, "Benchmark". Without a GPU it says so and exits 0.
"""

from __future__ import annotations

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


def count_allowed_pairs(bam, seg, chunk=2048) -> int:
    """Allowed (query, key) pairs of a [B, S] mask, in query chunks (never an [S, S] tensor at once)."""
    from lightning_mm.attention import mask as masks

    b, s = bam.shape
    pos = torch.arange(s, device=bam.device).expand(b, s)
    total = 0
    for a in range(0, s, chunk):
        sl = slice(a, a + chunk)
        ok = masks.allowed(bam[:, sl], bam, pos[:, sl], pos, None if seg is None else seg[:, sl], seg)
        total += int(ok.sum())
    return total


def dense_mask(bam, seg, chunk=2048):
    """Bool [B, 1, S, S] for SDPA, filled in query chunks."""
    from lightning_mm.attention import mask as masks

    b, s = bam.shape
    pos = torch.arange(s, device=bam.device).expand(b, s)
    out = torch.empty(b, 1, s, s, dtype=torch.bool, device=bam.device)
    for a in range(0, s, chunk):
        sl = slice(a, a + chunk)
        out[:, 0, sl] = masks.allowed(bam[:, sl], bam, pos[:, sl], pos, None if seg is None else seg[:, sl], seg)
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


def build_impls(names, bam, seg, q, k):
    """Callables ``f(q, k, v) -> out`` for each implementation, plus setup time (ms) of each (mask building)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lightning_mm.attention.kernels import bitfield_attention

    b, s = bam.shape
    hq, hkv = q.shape[1], k.shape[1]
    pos = torch.arange(s, device=bam.device).expand(b, s)
    fns, setup = {}, {}
    groups = hq // hkv

    def expand(x):
        return x.repeat_interleave(groups, dim=1) if groups > 1 else x

    for name in names:
        t0 = time.perf_counter()
        try:
            if name == "ours":  # tile maps built once here, as FlexAttention's block mask is (and as the layers
                cache = {}      # of a microbatch share them through their attention cache)
                fns[name] = lambda q, k, v, c=cache: bitfield_attention(
                    q, k, v, bam, bam, q_segments=seg, k_segments=seg, q_positions=pos, k_positions=pos, cache=c)
                with torch.no_grad():
                    fns[name](q, k, k)
            elif name == "flex":
                from torch.nn.attention.flex_attention import create_block_mask, flex_attention

                block_mask = create_block_mask(flex_mask_mod(bam, seg), b, None, s, s, device=bam.device)
                flex = torch.compile(flex_attention, dynamic=False)
                fns[name] = lambda q, k, v, bm=block_mask: flex(q, k, v, block_mask=bm, enable_gqa=True)
            elif name == "sdpa_dense":
                mask = dense_mask(bam, seg)

                def sdpa_dense(q, k, v, mask=mask):
                    return torch.nn.functional.scaled_dot_product_attention(q, expand(k), expand(v), attn_mask=mask)
                fns[name] = sdpa_dense
            elif name == "sdpa_causal":
                def sdpa_causal(q, k, v):
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(q, expand(k), expand(v),
                                                                                is_causal=True)
                fns[name] = sdpa_causal
            torch.cuda.synchronize()
            setup[name] = (time.perf_counter() - t0) * 1e3
        except torch.cuda.OutOfMemoryError:
            setup[name] = "OOM"
        except Exception as e:  # recorded, the other implementations still run
            setup[name] = f"error: {type(e).__name__}: {e}"[:300]
    return fns, setup


def measure(fn, q, k, v, dout, reps_ms):
    """(fwd ms, fwd+bwd ms, peak MiB of one fwd+bwd above the inputs) with triton.testing.do_bench."""
    from triton.testing import do_bench

    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    fwd_ms = do_bench(lambda: fn(q, k, v), warmup=25, rep=reps_ms)

    def step():
        fn(q, k, v).backward(dout)
    both_ms = do_bench(step, warmup=25, rep=reps_ms, grad_to_none=[q, k, v])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return fwd_ms, both_ms, peak


def run_case(s, layout, head_dim, args, device):
    from lightning_mm.attention import mask as masks
    from lightning_mm.attention.kernels import FULL, PARTIAL, SKIP, default_config, tile_classes

    bam, seg = masks.random_bam(layout, s, num_encoders=args.encoders, batch=args.batch, seed=args.seed)
    bam = bam.to(device)
    seg = None if seg is None else seg.to(device)
    pairs = count_allowed_pairs(bam, seg)
    causal_pairs = args.batch * s * (s + 1) // 2
    g = torch.Generator(device=device).manual_seed(args.seed)
    shape_q, shape_kv = (args.batch, args.heads, s, head_dim), (args.batch, args.kv_heads, s, head_dim)
    q = torch.randn(shape_q, generator=g, device=device, dtype=torch.bfloat16)
    k = torch.randn(shape_kv, generator=g, device=device, dtype=torch.bfloat16)
    v = torch.randn(shape_kv, generator=g, device=device, dtype=torch.bfloat16)
    dout = torch.randn(shape_q, generator=g, device=device, dtype=torch.bfloat16)

    cfg = default_config(q)
    pos = torch.arange(s, device=device).expand(args.batch, s)
    classes = tile_classes(bam, bam, pos, pos, seg, seg, cfg.fwd_m, cfg.fwd_n)
    n = classes.numel()
    case = dict(seq_len=s, layout=layout, head_dim=head_dim, allowed_pairs=pairs, density=pairs / (args.batch * s * s),
                tiles=dict(skip=int((classes == SKIP).sum()) / n, full=int((classes == FULL).sum()) / n,
                           partial=int((classes == PARTIAL).sum()) / n), results={})
    case["kernel_config"] = dict(vars(cfg))  # the launch table's entry, with its recorded origin
    del classes
    fns, setup = build_impls(args.impls, bam, seg, q, k)
    flops_fwd = 4 * args.heads * head_dim
    ref_out = None
    for name in args.impls:
        row = dict(setup_ms=setup.get(name))
        if name not in fns:
            row["status"] = setup.get(name)
            case["results"][name] = row
            continue
        try:
            with torch.no_grad():
                out = fns[name](q, k, v)
            if name in ("ours", "flex"):
                if ref_out is None:
                    ref_out = out
                else:
                    row["max_abs_diff_vs_" + ("ours" if name == "flex" else "flex")] = \
                        float((out.float() - ref_out.float()).abs().max())
            del out
            fwd_ms, both_ms, peak = measure(fns[name], q, k, v, dout, args.rep_ms)
            used_pairs = causal_pairs if name == "sdpa_causal" else pairs
            row.update(status="ok", fwd_ms=fwd_ms, fwd_bwd_ms=both_ms, peak_mib=peak,
                       fwd_tflops=flops_fwd * used_pairs / fwd_ms / 1e9,
                       fwd_bwd_tflops=FWD_BWD_FACTOR * flops_fwd * used_pairs / both_ms / 1e9)
        except torch.cuda.OutOfMemoryError:
            row["status"] = "OOM"
        except Exception as e:
            row["status"] = f"error: {type(e).__name__}: {e}"[:300]
            row["traceback"] = traceback.format_exc()[-2000:]
        case["results"][name] = row
        torch.cuda.empty_cache()
    fns.clear()
    torch.cuda.empty_cache()
    return case


def summarise(case):
    """Speed-up of ours over FlexAttention (fwd+bwd) and our share of causal flash's effective TFLOP/s."""
    r = case["results"]
    ok = {k: v for k, v in r.items() if v.get("status") == "ok"}
    out = {}
    if "ours" in ok and "flex" in ok:
        out["fwd_bwd_speedup_vs_flex"] = ok["flex"]["fwd_bwd_ms"] / ok["ours"]["fwd_bwd_ms"]
        out["fwd_speedup_vs_flex"] = ok["flex"]["fwd_ms"] / ok["ours"]["fwd_ms"]
    if "ours" in ok and "sdpa_causal" in ok:
        out["fwd_bwd_tflops_vs_causal_flash"] = ok["ours"]["fwd_bwd_tflops"] / ok["sdpa_causal"]["fwd_bwd_tflops"]
        out["fwd_tflops_vs_causal_flash"] = ok["ours"]["fwd_tflops"] / ok["sdpa_causal"]["fwd_tflops"]
    return out


def goals(cases) -> dict:
    """The benchmark's goals over every case that measured both sides: met or not, with the worst ratio."""
    def check(ratios, bound):
        worst = min(ratios.values(), default=None)
        return dict(met=worst is not None and worst >= bound, bound=bound, worst=worst, cases=ratios)

    label = lambda c: f"S={c['seq_len']} d={c.get('head_dim')} {c['layout']}"  # noqa: E731
    vs_flex = {label(c): c["summary"]["fwd_bwd_speedup_vs_flex"] for c in cases
               if c["layout"] in ("ee", "mp") and c["seq_len"] >= GOAL_FROM_SEQ
               and "fwd_bwd_speedup_vs_flex" in c.get("summary", {})}
    vs_causal = {label(c): c["summary"]["fwd_bwd_tflops_vs_causal_flash"] for c in cases
                 if "fwd_bwd_tflops_vs_causal_flash" in c.get("summary", {})}
    return {"fwd_bwd_vs_flex_on_ee_mp_from_16k": check(vs_flex, GOAL_VS_FLEX),
            "fwd_bwd_tflops_vs_causal_flash": check(vs_causal, GOAL_VS_CAUSAL)}


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
    cases = []
    for s in args.seq_lens:
        for head_dim in args.head_dims:
            for layout in args.layouts:
                try:
                    case = run_case(s, layout, head_dim, args, device)
                except torch.cuda.OutOfMemoryError:
                    case = dict(seq_len=s, layout=layout, head_dim=head_dim, results={},
                                status="OOM while building inputs")
                except Exception as e:
                    case = dict(seq_len=s, layout=layout, head_dim=head_dim, results={},
                                status=f"error: {type(e).__name__}: {e}"[:300])
                case["summary"] = summarise(case)
                cases.append(case)
                report = dict(  # after every case: a run stopped by a time limit keeps what it measured
                    benchmark="attention", device=name, torch=torch.__version__, triton=triton.__version__,
                    python=start["python"], dtype="bfloat16", batch=args.batch, heads=args.heads,
                    kv_heads=args.kv_heads, head_dims=args.head_dims, encoders=args.encoders, seed=args.seed,
                    flops="allowed pairs x 4 x D x heads (fwd), x3.5 (fwd+bwd); causal flash counts causal pairs",
                    complete=len(cases) == len(args.seq_lens) * len(args.head_dims) * len(args.layouts),
                    cases=cases, goals=goals(cases))
                harness.write(out, report, start)
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
