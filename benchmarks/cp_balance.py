"""CP load balance of the token distributions, and planning time.

For EP/EE/MP masks (random placement, seeded) at 16k..128k tokens and cp 2..16: imbalance = max over ranks of
the summed block work (``masks.block_workload``, block 128) / the mean, for lpt, random, zigzag, contiguous
(mean over seeds). Then the wall time of ``distribute(..., "lpt")`` for one 1M-token row. With CUDA: the
per-rank attention time of one 70B-shaped layer (64 heads, 8 KV heads, head dim 128), rank by rank on the one
device, lpt vs zigzag (the seed's Table 4 setting). Writes benchmarks/results/cp_balance.json (+ .png chart).

    python benchmarks/cp_balance.py [--seeds 3] [--repeats 30] [--gpu-tokens 65536]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import time

import torch

from lightning_mm import masks
from lightning_mm.parallel import context as cp

RESULTS = pathlib.Path(__file__).parent / "results"
LENGTHS = (16384, 32768, 65536, 131072)
CP_SIZES = (2, 4, 8, 16)
BLOCK = 128
GOAL_IMBALANCE, GOAL_PLAN_MS = 1.02, 5.0


def imbalance(plan, work) -> float:
    loads = cp.plan_workload(plan, work).double()
    return float(loads.max() / loads.mean())


def balance_table(seeds: int) -> list[dict]:
    rows = []
    for layout in masks.LAYOUTS:
        for seq in LENGTHS:
            problems = [masks.random_bam(layout, seq, 2, 1, seed) for seed in range(seeds)]
            works = [masks.block_workload(bam, BLOCK, seg).sum(0) for bam, seg in problems]
            for size in CP_SIZES:
                for method in cp.METHODS:
                    vals = [imbalance(cp.distribute(bam, size, method, BLOCK, seg, seed=s), w)
                            for s, ((bam, seg), w) in enumerate(zip(problems, works))]
                    rows.append(dict(layout=layout, tokens=seq, cp=size, method=method,
                                     imbalance=statistics.mean(vals), imbalance_max=max(vals)))
    return rows


def _time_ms(fn, repeats: int) -> tuple[float, float]:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts), min(ts)


def planning_times(repeats: int, tokens: int = 1 << 20, size: int = 8) -> list[dict]:
    rows = []
    for layout in masks.LAYOUTS:
        bam, seg = masks.random_bam(layout, tokens, 2, 1, 0)
        work = masks.block_workload(bam, BLOCK, seg)[0]
        total = _time_ms(lambda: cp.distribute(bam, size, "lpt", BLOCK, seg), repeats)
        wl = _time_ms(lambda: masks.block_workload(bam, BLOCK, seg), repeats)
        lpt = _time_ms(lambda: cp.lpt_assign(work, size), repeats)
        rows.append(dict(layout=layout, tokens=tokens, cp=size, plan_ms_median=total[0], plan_ms_min=total[1],
                         workload_ms_median=wl[0], lpt_ms_median=lpt[0]))
    return rows


def gpu_rank_times(tokens: int, repeats: int = 5) -> list[dict] | str:
    """Per-rank attention (fwd) time of a 70B layer, every rank's queries against all keys, one at a time."""
    if not torch.cuda.is_available():
        return "no CUDA device: per-rank 70B attention timing skipped"
    from lightning_mm.attention import bitfield_attention

    heads, kv_heads, dim, size = 64, 8, 128, 8
    rows = []
    for layout in masks.LAYOUTS:
        bam, seg = masks.random_bam(layout, tokens, 2, 1, 0)
        dev = torch.device("cuda")
        k = torch.randn(1, kv_heads, tokens, dim, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        bam_d, seg_d = bam.to(dev), None if seg is None else seg.to(dev)
        pos = torch.arange(tokens, device=dev)[None]
        for method in ("lpt", "zigzag"):
            plan = cp.distribute(bam, size, method, BLOCK, seg)
            times = []
            for blocks in plan:
                idx = cp.token_index(blocks, BLOCK, tokens).to(dev)
                q = torch.randn(1, heads, idx.numel(), dim, device=dev, dtype=torch.bfloat16)
                run = lambda: bitfield_attention(q, k, v, bam_d[:, idx], bam_d, q_positions=idx[None],  # noqa: E731
                                                 k_positions=pos, q_segments=None if seg_d is None else seg_d[:, idx],
                                                 k_segments=seg_d)
                run()
                torch.cuda.synchronize()
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                ev[0].record()
                for _ in range(repeats):
                    run()
                ev[1].record()
                torch.cuda.synchronize()
                times.append(ev[0].elapsed_time(ev[1]) / repeats)
            rows.append(dict(layout=layout, tokens=tokens, cp=size, method=method, rank_ms=times,
                             max_ms=max(times), mean_ms=statistics.mean(times)))
    return rows


def print_tables(balance, planning, gpu) -> None:
    print(f"\nimbalance = max/mean block work per rank (block {BLOCK}, mean over seeds)")
    print(f"{'layout':6} {'tokens':>7} {'cp':>3} " + " ".join(f"{m:>10}" for m in cp.METHODS))
    index = {(r["layout"], r["tokens"], r["cp"], r["method"]): r["imbalance"] for r in balance}
    for layout in masks.LAYOUTS:
        for seq in LENGTHS:
            for size in CP_SIZES:
                vals = " ".join(f"{index[(layout, seq, size, m)]:10.4f}" for m in cp.METHODS)
                print(f"{layout:6} {seq:7d} {size:3d} {vals}")
    print(f"\ngoal: lpt <= {GOAL_IMBALANCE} at 64k tokens on 8 ranks (EE, MP); zigzag beside it")
    for layout in ("ee", "mp", "ep"):
        lpt, zz = index[(layout, 65536, 8, "lpt")], index[(layout, 65536, 8, "zigzag")]
        ok = "met" if lpt <= GOAL_IMBALANCE else "MISSED"
        print(f"  {layout}: lpt {lpt:.4f} ({ok}), zigzag {zz:.4f}")
    print(f"\nplanning one 1M-token row, block {BLOCK}, cp 8 (goal < {GOAL_PLAN_MS} ms)")
    print(f"{'layout':6} {'plan median ms':>15} {'plan min ms':>12} {'workload ms':>12} {'lpt ms':>8}")
    for r in planning:
        print(f"{r['layout']:6} {r['plan_ms_median']:15.2f} {r['plan_ms_min']:12.2f} {r['workload_ms_median']:12.2f} "
              f"{r['lpt_ms_median']:8.2f}  {'met' if r['plan_ms_median'] < GOAL_PLAN_MS else 'MISSED'}")
    if isinstance(gpu, str):
        print("\n" + gpu)
    else:
        print("\nper-rank attention fwd of a 70B layer (ms), rank by rank on one device")
        for r in gpu:
            print(f"  {r['layout']:3} {r['method']:7} max {r['max_ms']:8.2f} mean {r['mean_ms']:8.2f}  "
                  + " ".join(f"{t:.1f}" for t in r["rank_ms"]))


def plot(balance, path: pathlib.Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
    for ax, layout in zip(axes, masks.LAYOUTS):
        for method in cp.METHODS:
            pts = [(r["cp"], r["imbalance"]) for r in balance
                   if r["layout"] == layout and r["tokens"] == 65536 and r["method"] == method]
            ax.plot(*zip(*pts), marker="o", label=method)
        ax.axhline(GOAL_IMBALANCE, color="grey", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{layout.upper()}, 64k tokens")
        ax.set_xlabel("cp ranks")
    axes[0].set_ylabel("max / mean rank work")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--gpu-tokens", type=int, default=65536)
    args = parser.parse_args()
    torch.set_num_threads(1)
    balance = balance_table(args.seeds)
    planning = planning_times(args.repeats)
    gpu = gpu_rank_times(args.gpu_tokens)
    print_tables(balance, planning, gpu)
    RESULTS.mkdir(parents=True, exist_ok=True)
    chart = plot(balance, RESULTS / "cp_balance.png")
    out = dict(block_size=BLOCK, seeds=args.seeds, balance=balance, planning_1m=planning, gpu=gpu, chart=chart,
               goals=dict(lpt_imbalance_64k_cp8=GOAL_IMBALANCE, plan_1m_ms=GOAL_PLAN_MS),
               machine=dict(python=platform.python_version(), torch=torch.__version__, threads=1,
                            cpu=platform.processor() or platform.machine()))
    (RESULTS / "cp_balance.json").write_text(json.dumps(out, indent=1))
    print(f"\nwrote {RESULTS / 'cp_balance.json'}" + (f" and {chart}" if chart else ""))


if __name__ == "__main__":
    main()
