"""CP load balance of the token distributions, planning time, and the three CP modes' work and traffic.

Parts (docs/context_parallel.md, "Benchmark"): 1. LPT/random/zigzag/contiguous imbalance on EP/EE/MP masks;
2. planning time of one 1M-token row at cp 8 (variants: segment-id widths, 256-token items, cold cache, arrays just
written; ``--only windowed``: Gemma 3's windowed pattern); 3. each CP mode's per-rank work over the ideal; 4. bytes
per rank and layer of a 70B-shaped layer; 5. with CUDA, per-rank attention time of that layer, lpt vs zigzag.
"""

import os
import statistics
import time

import numpy as np
import torch

import harness
from lightning_mm.attention import mask as masks
from lightning_mm.parallel import context as cp

LENGTHS = (16384, 32768, 65536, 131072)
CP_SIZES = (2, 4, 8, 16)
BLOCK = 128
GOAL_IMBALANCE, GOAL_PLAN_MS = 1.02, 1.0
MODE_LENGTHS = (65536, 262144, 1048576)
LAYER_70B = dict(heads=64, kv_heads=8, head_dim=128)
HYBRID_K = {2: None, 4: 2, 8: 4, 16: 4}  # the Ulysses degree of hybrid at each cp size (it needs 1 < K < cp)
WINDOW_TOKENS, GEMMA3_LAYERS = 131072, 62
PLANNING_CASES = [(layout, "", None) for layout in masks.LAYOUTS] + [
    ("mp", "int32 segment ids", None),  # wider ids than the collator's (int16, masks.segment_dtype)
    ("mp", "int64 segment ids", None),
    ("ee", "256-token items", 256),  # ~4k runs: images interleaved with text
    ("ep", "cold cache", None),  # the words read from memory, not from the L3 cache (a batch from elsewhere)
    ("mp", "cold cache", None),
    ("ep", "just written", None),  # the cache emptied, then the arrays copied: what the collator plans on
    ("mp", "just written", None),
]
CP_SOURCES = dict(balance="computed", modes_work="computed", modes_bytes="computed", chart="computed", seeds="setting",
                  block_size="setting", layer_70b="setting")  # planning_* and gpu: measured


def balance_table(seeds: int) -> list[dict]:
    rows = []
    for layout in masks.LAYOUTS:
        for seq in LENGTHS:
            problems = [masks.random_bam(layout, seq, 2, 1, seed) for seed in range(seeds)]
            works = [masks.block_workload(bam, BLOCK, seg).sum(0) for bam, seg in problems]
            for size in CP_SIZES:
                for method in cp.METHODS:
                    loads = [cp.plan_workload(cp.distribute(bam, size, method, BLOCK, seg, seed=s), w).double()
                             for s, ((bam, seg), w) in enumerate(zip(problems, works))]
                    vals = [float(x.max() / x.mean()) for x in loads]
                    rows.append(dict(layout=layout, tokens=seq, cp=size, method=method,
                                     imbalance=statistics.mean(vals), imbalance_max=max(vals)))
    return rows


def _time_ms(fn, repeats: int, before=None) -> tuple[float, float, float]:
    """Median and minimum wall time of ``fn`` in ms and the median of this thread's CPU time (which leaves out the
    time other processes hold the core); ``before`` runs untimed ahead of every repeat."""
    fn()
    ts, cs, _ = harness.repeat(fn, repeats, before, time.thread_time)
    return statistics.median(ts) * 1e3, min(ts) * 1e3, statistics.median(cs) * 1e3


def _runs(bam, seg) -> int:
    return int(masks._runs(*masks._as_batch(bam, seg)[:2], BLOCK)[0].size)


def planning_times(repeats: int, evict_bytes: int, tokens: int = 1 << 20, size: int = 8) -> list[dict]:
    rows = []
    evict = np.ones(evict_bytes // 8, dtype=np.int64)
    for layout, variant, item in PLANNING_CASES:
        bam, seg = masks.random_bam(layout, tokens, 2, 1, 0, mean_item_tokens=item)
        if seg is not None and variant.startswith("int"):
            seg = seg.to(getattr(torch, variant.split()[0]))
        work, load, arrays = masks.block_workload(bam, BLOCK, seg)[0], os.getloadavg()[0], [bam, seg]

        def before():
            evict.sum()
            if variant == "just written":
                arrays[:] = [bam.clone(), None if seg is None else seg.clone()]

        before = before if variant in ("cold cache", "just written") else None
        total = _time_ms(lambda: cp.distribute(arrays[0], size, "lpt", BLOCK, arrays[1]), repeats, before)
        wl = _time_ms(lambda: masks.block_workload(arrays[0], BLOCK, arrays[1]), repeats, before)
        lpt = _time_ms(lambda: cp.lpt_assign(work, size), repeats)
        read = _time_ms(lambda: [a.numpy().max() for a in arrays if a is not None], repeats, before)
        rows.append(dict(layout=layout, variant=variant, tokens=tokens, cp=size, runs=_runs(bam, seg),
                         plan_ms_median=total[0], plan_ms_min=total[1], plan_cpu_ms_median=total[2],
                         array_bytes=sum(a.numel() * a.element_size() for a in arrays if a is not None),
                         read_ms_median=read[0], read_ms_min=read[1],
                         workload_ms_median=wl[0], workload_ms_min=wl[1], lpt_ms_median=lpt[0], lpt_ms_min=lpt[1],
                         load_average=load, met=total[0] <= GOAL_PLAN_MS, met_cpu=total[2] <= GOAL_PLAN_MS))
    return rows


def _band_workload(bam, seg, window) -> torch.Tensor:
    """The windowed work the former way: every block pair listed, cut by the band, summed per distinct window."""
    windows = [window] if window is None or isinstance(window, int) else list(window)
    return sum(masks.block_pairs(bam, BLOCK, seg, w).sum(-1) * windows.count(w) for w in set(windows))


def planning_windowed(repeats: int, size: int = 8) -> list[dict]:
    """Time of the block workload and of LPT's plan per window setting (Gemma 3: the window on 5 of every 6
    layers), and of the former band computation, on 4 images (576..4096 tokens) in text, packed samples (MP) and
    512 images of about 128 tokens in text."""
    gemma3 = lambda w: [None if (i + 1) % 6 == 0 else w for i in range(GEMMA3_LAYERS)]  # noqa: E731
    settings = [("none", None), ("1024", 1024), ("4096", 4096), ("gemma3 1024", gemma3(1024)),
                ("gemma3 4096", gemma3(4096))]
    items = [(1, 2880), (1, 1728), (2, 4096), (1, 576)]
    mods = masks.layout_ee(items, WINDOW_TOKENS - sum(n for _, n in items), torch.Generator().manual_seed(0))
    problems = [("4 images in text", masks.words_from_modalities(mods[None], 2), None),
                ("packed samples", *masks.random_bam("mp", WINDOW_TOKENS, 2, 1, 0)),
                ("512 small images", *masks.random_bam("ee", WINDOW_TOKENS, 2, 1, 0, mean_item_tokens=256))]
    rows = []
    for name, bam, seg in problems:
        for label, window in settings:
            assert torch.equal(masks.block_workload(bam, BLOCK, seg, window), _band_workload(bam, seg, window))
            load = os.getloadavg()[0]
            wl = _time_ms(lambda: masks.block_workload(bam, BLOCK, seg, window), repeats)
            plan = _time_ms(lambda: cp.distribute(bam, size, "lpt", BLOCK, seg, window=window), repeats)
            band = None if window is None else _time_ms(lambda: _band_workload(bam, seg, window), max(3, repeats // 20))
            rows.append(dict(row=name, tokens=WINDOW_TOKENS, runs=_runs(bam, seg), window=label, cp=size,
                             workload_ms_median=wl[0], workload_ms_min=wl[1], plan_ms_median=plan[0],
                             plan_ms_min=plan[1], band_ms_median=band and band[0], load_average=load))
    return rows


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
                k, ideal, hybrid = HYBRID_K[size], total / size, None
                if k:
                    plan = cp.distribute(bam, size, "lpt", BLOCK, seg, ulysses=k)
                    groups = [float(sum(work[p].sum() for p in plan[g * k:(g + 1) * k])) for g in range(size // k)]
                    hybrid = max(groups) / k / ideal
                rows.append(dict(layout=layout, tokens=seq, cp=size, hybrid_ulysses=k, allgather_lpt=allgather / ideal,
                                 ulysses=1.0, hybrid=hybrid, total_block_pairs=total))
    return rows


def mode_bytes(lengths=MODE_LENGTHS) -> list[dict]:
    """Bytes per rank per layer (forward) of each mode, 70B-shaped layer with and without GQA."""
    heads, dim = LAYER_70B["heads"], LAYER_70B["head_dim"]
    rows = []
    for kv in (LAYER_70B["kv_heads"], heads):
        for seq in lengths:
            for size in CP_SIZES:
                k = HYBRID_K[size]
                mib = {m: cp.cp_communication_bytes(m, seq, size, heads, kv, dim, u)["forward"] / 2 ** 20
                       for m, u in (("allgather", None), ("ulysses", None), ("hybrid", k)) if m != "hybrid" or k}
                rows.append(dict(tokens=seq, cp=size, heads=heads, kv_heads=kv, head_dim=dim, hybrid_ulysses=k,
                                 allgather_mib=mib["allgather"], ulysses_mib=mib["ulysses"],
                                 hybrid_mib=mib.get("hybrid")))
    return rows


def gpu_rank_times(tokens: int, repeats: int = 5) -> list[dict] | str:
    """Per-rank attention (fwd) time of a 70B layer, every rank's queries against all keys, one at a time."""
    if not torch.cuda.is_available():
        return "no CUDA device: per-rank 70B attention timing skipped"
    from lightning_mm.attention import bitfield_attention

    size, dev, rows = 8, torch.device("cuda"), []
    for layout in masks.LAYOUTS:
        bam, seg = masks.random_bam(layout, tokens, 2, 1, 0)
        k = torch.randn(1, LAYER_70B["kv_heads"], tokens, LAYER_70B["head_dim"], device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        bam_d, seg_d = bam.to(dev), None if seg is None else seg.to(dev)
        pos = torch.arange(tokens, device=dev)[None]
        for method in ("lpt", "zigzag"):
            times = []
            for blocks in cp.distribute(bam, size, method, BLOCK, seg):
                idx = cp.token_index(blocks, BLOCK, tokens).to(dev)
                q = torch.randn(1, LAYER_70B["heads"], idx.numel(), LAYER_70B["head_dim"], device=dev,
                                dtype=torch.bfloat16)
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


def plot(balance, path) -> str | None:
    plt = harness.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
    for ax, layout in zip(axes, masks.LAYOUTS):
        for method in cp.METHODS:
            pts = [(r["cp"], r["imbalance"]) for r in balance
                   if r["layout"] == layout and r["tokens"] == 65536 and r["method"] == method]
            ax.plot(*zip(*pts), marker="o", label=method)
        ax.axhline(GOAL_IMBALANCE, color="grey", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(title=f"{layout.upper()}, 64k tokens", xlabel="cp ranks")
    axes[0].set_ylabel("max / mean rank work")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def main(argv=None) -> None:
    args = harness.cli(__doc__, argv, seeds=3, repeats=200, gpu_tokens=65536, only=dict(
        choices=("planning", "windowed"),
        help="time the planning only, or the windowed planning only (keeps the other results)"))
    start = harness.record()
    torch.set_num_threads(1)
    path = harness.RESULTS / "cp_balance.json"
    out = harness.read(path) if args.only else {}
    machine = dict(numpy=np.__version__, threads=1, repeats=args.repeats)
    if args.only != "planning":
        rows = planning_windowed(args.repeats)
        harness.print_rows(rows, ["row", "runs", "window", "workload_ms_median", "plan_ms_median", "band_ms_median"],
                           f"windowed planning, one {WINDOW_TOKENS}-token row, block {BLOCK}, cp 8 (ms)")
        out["planning_windowed"] = dict(rows=rows, block_size=BLOCK, machine=dict(harness.finish(start), **machine))
        if args.only == "windowed":  # the other results and the tables they render stay as they are
            harness.write(path, out, sources=CP_SOURCES)
            return
    evict_bytes = 4 * (harness.l3_bytes() or harness.L3_FALLBACK)  # read before each cold-cache repeat
    out["planning_1m"] = planning_times(args.repeats, evict_bytes)
    if not args.only:
        out["balance"] = balance_table(args.seeds)
        out["modes_work"], out["modes_bytes"] = mode_work(), mode_bytes()
        out["gpu"] = gpu_rank_times(args.gpu_tokens)
        out["chart"] = plot(out["balance"], harness.RESULTS / "cp_balance.png")
        out["seeds"] = args.seeds
    out.update(block_size=BLOCK, goals=dict(lpt_imbalance_64k_cp8=GOAL_IMBALANCE, plan_1m_ms=GOAL_PLAN_MS),
               machine=dict(harness.finish(start), **machine, evict_bytes=evict_bytes), layer_70b=LAYER_70B)
    harness.write(path, out, sources=CP_SOURCES)


if __name__ == "__main__":
    main()
