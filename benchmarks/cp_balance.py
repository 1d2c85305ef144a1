"""CP load balance of the token distributions, planning time, and the three CP modes' work and traffic.

1. For EP/EE/MP masks (random placement, seeded) at 16k..128k tokens and cp 2..16: imbalance = max over ranks of
   the summed block work (``masks.block_workload``, block 128) / the mean, for lpt, random, zigzag, contiguous
   (mean over seeds).
2. Planning time: the wall time of ``distribute(..., "lpt")`` for one 1M-token row at cp 8, block 128, per layout
   (goal: at most 1 ms), with its two parts (block workload, LPT); single thread, median and minimum of repeats,
   and the load average while it ran (the machine is shared). Segment ids are int16 as the collator makes them;
   MP is timed again with int32 and int64 ones, EE with 256-token items (about 4k runs) shows the cost per run,
   and EP and MP once more from a cold cache (four times the machine's L3 read before every repeat, untimed:
   ``evict_bytes``) and just written (the cache emptied, then the arrays copied, as a collator plans them).
3. Per-rank attention work of the CP modes at 64k..1M tokens, cp 2..16: allgather with the LPT plan (a rank's
   queries against all keys, all heads), ulysses (every rank: the whole sequence, heads / cp of the heads) and
   hybrid (Ulysses in groups of 2, or 4 from cp 8; LPT over the groups): the slowest rank's work over the ideal
   (total / cp), in block pairs x heads.
4. Bytes one rank receives per layer (forward; backward moves as much) for a 70B-shaped layer (64 heads, 8 KV
   heads, head dim 128, bf16) and for the same layer without GQA (64 KV heads), each mode, 64k..1M tokens.
5. With CUDA: the per-rank attention time of one 70B-shaped layer, rank by rank on the one device, lpt vs zigzag.

Writes benchmarks/results/cp_balance.json (+ .png chart; with the machine and the command) and rewrites the tables
README.md and docs/ quote from it (benchmarks/tables.py).

    python benchmarks/cp_balance.py [--seeds 3] [--repeats 200] [--gpu-tokens 65536] [--only planning|windowed]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import numpy as np
import torch

from lightning_mm.attention import mask as masks
from lightning_mm.parallel import context as cp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _machine  # noqa: E402
import tables  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
LENGTHS = (16384, 32768, 65536, 131072)
CP_SIZES = (2, 4, 8, 16)
BLOCK = 128
GOAL_IMBALANCE, GOAL_PLAN_MS = 1.02, 1.0
MODE_LENGTHS = (65536, 262144, 1048576)
LAYER_70B = dict(heads=64, kv_heads=8, head_dim=128)


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


def _time_ms(fn, repeats: int, before=None) -> tuple[float, float]:
    """Median and minimum wall time of ``fn`` in ms; ``before`` runs untimed ahead of every repeat."""
    fn()
    ts = []
    for _ in range(repeats):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts), min(ts)


PLANNING_CASES = [(layout, "", None) for layout in masks.LAYOUTS] + [
    ("mp", "int32 segment ids", None),  # wider ids than the collator's (int16, masks.segment_dtype)
    ("mp", "int64 segment ids", None),
    ("ee", "256-token items", 256),  # ~4k runs: images interleaved with text
    ("ep", "cold cache", None),  # the words read from memory, not from the L3 cache (a batch from elsewhere)
    ("mp", "cold cache", None),
    ("ep", "just written", None),  # the cache emptied, then the arrays copied: what the collator plans on
    ("mp", "just written", None),
]


def evict_bytes() -> int:
    """Bytes read before each cold-cache repeat: four times the machine's L3 (32 MB assumed when it does not say)."""
    return 4 * (_machine.l3_bytes() or _machine.L3_FALLBACK)


def planning_times(repeats: int, tokens: int = 1 << 20, size: int = 8) -> list[dict]:
    rows = []
    evict = np.ones(evict_bytes() // 8, dtype=np.int64)
    for layout, variant, item in PLANNING_CASES:
        bam, seg = masks.random_bam(layout, tokens, 2, 1, 0, mean_item_tokens=item)
        if seg is not None and variant.startswith("int"):
            seg = seg.to(getattr(torch, variant.split()[0]))
        work = masks.block_workload(bam, BLOCK, seg)[0]
        load = os.getloadavg()[0]
        arrays = [bam, seg]

        def before():
            evict.sum()
            if variant == "just written":
                arrays[:] = [bam.clone(), None if seg is None else seg.clone()]

        before = before if variant in ("cold cache", "just written") else None
        total = _time_ms(lambda: cp.distribute(arrays[0], size, "lpt", BLOCK, arrays[1]), repeats, before)
        wl = _time_ms(lambda: masks.block_workload(arrays[0], BLOCK, arrays[1]), repeats, before)
        lpt = _time_ms(lambda: cp.lpt_assign(work, size), repeats)
        rows.append(dict(layout=layout, variant=variant, tokens=tokens, cp=size, runs=int(masks._runs(
                             *masks._as_batch(bam, seg)[:2], BLOCK)[0].size), plan_ms_median=total[0], plan_ms_min=total[1],
                         workload_ms_median=wl[0], workload_ms_min=wl[1], lpt_ms_median=lpt[0], lpt_ms_min=lpt[1],
                         load_average=load, met=total[0] <= GOAL_PLAN_MS))
    return rows


WINDOW_TOKENS = 131072
GEMMA3_LAYERS = 62


def _windowed_rows() -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """The rows the windowed planning is timed on: 4 images (576..4096 tokens) in text, packed samples (MP), and
    512 images of about 128 tokens in text."""
    g = torch.Generator().manual_seed(0)
    items = [(1, 2880), (1, 1728), (2, 4096), (1, 576)]
    mods = masks.layout_ee(items, WINDOW_TOKENS - sum(n for _, n in items), g)
    rows = [("4 images in text", masks.words_from_modalities(mods[None], 2), None)]
    rows.append(("packed samples", *masks.random_bam("mp", WINDOW_TOKENS, 2, 1, 0)))
    rows.append(("512 small images", *masks.random_bam("ee", WINDOW_TOKENS, 2, 1, 0, mean_item_tokens=256)))
    return rows


def _windows(window: int) -> list:
    """Gemma 3's layer pattern: ``window`` on 5 of every 6 layers, full attention on the 6th."""
    return [None if (i + 1) % 6 == 0 else window for i in range(GEMMA3_LAYERS)]


def _band_workload(bam, seg, window) -> torch.Tensor:
    """The windowed work the former way: every block pair listed, cut by the band, summed per distinct window."""
    windows = [window] if window is None or isinstance(window, int) else list(window)
    return sum(masks.block_pairs(bam, BLOCK, seg, w).sum(-1) * windows.count(w) for w in set(windows))


def planning_windowed(repeats: int, size: int = 8) -> list[dict]:
    """Time of the block workload and of LPT's plan per window setting, and the former band computation."""
    settings = [("none", None), ("1024", 1024), ("4096", 4096), ("gemma3 1024", _windows(1024)),
                ("gemma3 4096", _windows(4096))]
    rows = []
    for name, bam, seg in _windowed_rows():
        runs = int(masks._runs(*masks._as_batch(bam, seg)[:2], BLOCK)[0].size)
        for label, window in settings:
            work = masks.block_workload(bam, BLOCK, seg, window)
            assert torch.equal(work, _band_workload(bam, seg, window))
            load = os.getloadavg()[0]
            wl = _time_ms(lambda: masks.block_workload(bam, BLOCK, seg, window), repeats)
            plan = _time_ms(lambda: cp.distribute(bam, size, "lpt", BLOCK, seg, window=window), repeats)
            band = None if window is None else _time_ms(lambda: _band_workload(bam, seg, window),
                                                        max(3, repeats // 20))
            rows.append(dict(row=name, tokens=WINDOW_TOKENS, runs=runs, window=label, cp=size,
                             workload_ms_median=wl[0], workload_ms_min=wl[1], plan_ms_median=plan[0],
                             plan_ms_min=plan[1], band_ms_median=band and band[0], load_average=load))
    return rows


def print_windowed(rows) -> None:
    print(f"\nwindowed planning, one {WINDOW_TOKENS}-token row, block {BLOCK}, cp 8 (ms, median; 1 thread; "
          f"gemma3 = {GEMMA3_LAYERS} layers, the window on 5 of 6)")
    settings = list(dict.fromkeys(r["window"] for r in rows))
    print(f"{'row':18} {'runs':>5} {'':9}" + "".join(f"{s:>13}" for s in settings))
    for name in dict.fromkeys(r["row"] for r in rows):
        mine = {r["window"]: r for r in rows if r["row"] == name}
        for key, title in (("workload_ms_median", "workload"), ("plan_ms_median", "plan"),
                           ("band_ms_median", "former")):
            print(f"{name:18} {mine[settings[0]]['runs']:5d} {title:9}"
                  + "".join("{:>13}".format("-" if mine[s][key] is None else f"{mine[s][key]:.3f}") for s in settings))


def _hybrid_degree(size: int) -> int | None:
    """The hybrid Ulysses degree benchmarked at ``size`` CP ranks (none at 2: hybrid needs 1 < K < cp)."""
    return {2: None, 4: 2}.get(size, 4)


def mode_work(lengths=MODE_LENGTHS) -> list[dict]:
    """Slowest rank's attention work over the ideal (total / cp) for each CP mode (block pairs x heads)."""
    rows = []
    for layout in masks.LAYOUTS:
        for seq in lengths:
            bam, seg = masks.random_bam(layout, seq, 2, 1, 0)
            work = masks.block_workload(bam, BLOCK, seg).sum(0)
            total = float(work.sum())
            for size in CP_SIZES:
                allgather = float(cp.plan_workload(cp.distribute(bam, size, "lpt", BLOCK, seg), work).max())
                k, ideal = _hybrid_degree(size), total / size
                hybrid = None
                if k:
                    plan = cp.distribute(bam, size, "lpt", BLOCK, seg, ulysses=k)
                    groups = [float(sum(work[p].sum() for p in plan[g * k:(g + 1) * k])) for g in range(size // k)]
                    hybrid = max(groups) / k / ideal
                rows.append(dict(layout=layout, tokens=seq, cp=size, hybrid_ulysses=k, allgather_lpt=allgather / ideal,
                                 ulysses=1.0, hybrid=hybrid, total_block_pairs=total))
    return rows


def mode_bytes(lengths=MODE_LENGTHS) -> list[dict]:
    """Bytes per rank per layer (forward) of each mode, 70B-shaped layer with and without GQA."""
    rows = []
    for kv in (LAYER_70B["kv_heads"], LAYER_70B["heads"]):
        for seq in lengths:
            for size in CP_SIZES:
                row = dict(tokens=seq, cp=size, heads=LAYER_70B["heads"], kv_heads=kv, head_dim=LAYER_70B["head_dim"],
                           hybrid_ulysses=_hybrid_degree(size))
                for mode in ("allgather", "ulysses", "hybrid"):
                    if mode == "hybrid" and not _hybrid_degree(size):
                        row["hybrid_mib"] = None
                        continue
                    b = cp.cp_communication_bytes(mode, seq, size, LAYER_70B["heads"], kv, LAYER_70B["head_dim"],
                                                  _hybrid_degree(size) if mode == "hybrid" else None)
                    row[f"{mode}_mib"] = b["forward"] / 2 ** 20
                rows.append(row)
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


def print_modes(work, traffic) -> None:
    if work:
        print("\nslowest rank's attention work / ideal (total / cp): allgather (LPT plan), ulysses, hybrid (K)")
        print(f"{'layout':6} {'tokens':>8} {'cp':>3} {'allgather':>10} {'ulysses':>8} {'hybrid':>8} {'K':>3}")
        for r in work:
            hybrid = "-" if r["hybrid"] is None else f"{r['hybrid']:.4f}"
            print(f"{r['layout']:6} {r['tokens']:8d} {r['cp']:3d} {r['allgather_lpt']:10.4f} {r['ulysses']:8.4f} "
                  f"{hybrid:>8} {r['hybrid_ulysses'] or '-':>3}")
    if traffic:
        print("\nMiB one rank receives per layer, forward (backward the same); 64 heads, head dim 128, bf16")
        print(f"{'kv':>3} {'tokens':>8} {'cp':>3} {'allgather':>10} {'ulysses':>9} {'hybrid':>9} {'K':>3}")
        for r in traffic:
            hybrid = "-" if r["hybrid_mib"] is None else f"{r['hybrid_mib']:.1f}"
            print(f"{r['kv_heads']:3d} {r['tokens']:8d} {r['cp']:3d} {r['allgather_mib']:10.1f} "
                  f"{r['ulysses_mib']:9.1f} "
                  f"{hybrid:>9} {r['hybrid_ulysses'] or '-':>3}")


def print_balance(balance) -> None:
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


def print_planning(planning) -> None:
    print(f"\nplanning one 1M-token row, block {BLOCK}, cp 8 (goal <= {GOAL_PLAN_MS} ms; 1 thread, shared machine)")
    print(f"{'layout':26} {'runs':>5} {'plan median':>12} {'plan min':>9} {'workload':>9} {'lpt':>7} {'load avg':>9}")
    for r in planning:
        name = r["layout"] + (f" ({r['variant']})" if r.get("variant") else "")
        print(f"{name:26} {r.get('runs', 0):5d} {r['plan_ms_median']:12.3f} {r['plan_ms_min']:9.3f} "
              f"{r['workload_ms_median']:9.3f} {r['lpt_ms_median']:7.3f} {r['load_average']:9.2f}  "
              f"{'met' if r['met'] else 'MISSED'}")


def print_gpu(gpu) -> None:
    if isinstance(gpu, str):
        print("\n" + gpu)
        return
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
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--gpu-tokens", type=int, default=65536)
    parser.add_argument("--only", choices=("planning", "windowed"),
                        help="time the planning only, or the windowed planning only (keeps the other results)")
    args = parser.parse_args()
    start = _machine.record()
    torch.set_num_threads(1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "cp_balance.json"
    out = json.loads(path.read_text()) if args.only and path.exists() else {}
    if args.only != "planning":
        rows = planning_windowed(args.repeats)
        print_windowed(rows)
        out["planning_windowed"] = dict(rows=rows, block_size=BLOCK, machine=dict(
            _machine.finish(start), numpy=np.__version__, threads=1, repeats=args.repeats))
        if args.only == "windowed":  # the other results and the tables they render stay as they are
            path.write_text(json.dumps(out, indent=1))
            print(f"\nwrote {path}")
            return
    out["planning_1m"] = planning_times(args.repeats)
    print_planning(out["planning_1m"])
    if not args.only:
        out["balance"] = balance_table(args.seeds)
        out["modes_work"], out["modes_bytes"] = mode_work(), mode_bytes()
        out["gpu"] = gpu_rank_times(args.gpu_tokens)
        print_balance(out["balance"])
        print_modes(out["modes_work"], out["modes_bytes"])
        print_gpu(out["gpu"])
        out["chart"] = plot(out["balance"], RESULTS / "cp_balance.png")
        out["seeds"] = args.seeds
    out.update(block_size=BLOCK, goals=dict(lpt_imbalance_64k_cp8=GOAL_IMBALANCE, plan_1m_ms=GOAL_PLAN_MS),
               machine=dict(_machine.finish(start), numpy=np.__version__, threads=1, repeats=args.repeats,
                            evict_bytes=evict_bytes()), layer_70b=LAYER_70B)
    path.write_text(json.dumps(out, indent=1))
    print(f"\nwrote {path}" + (f" and {out['chart']}" if out.get("chart") else ""))
    tables.main(["--quiet"])


if __name__ == "__main__":
    main()
