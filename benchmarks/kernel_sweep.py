"""Launch-table sweep of the Triton bitfield kernels on one GPU: each tile shape / warps / stages setting timed on
the benchmark's masks, the forward and the backward kernels chosen separately (they are independent kernels).

Writes every measured setting and the best row, in ``LIGHTNING_MM_KERNEL_TABLE``'s format (docs/kernels.md,
"Launch settings"). Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from attention import inputs, measure  # noqa: E402

# one factor at a time around the table's entry (first of each part): forward (and its tile lists), dk/dv (whose
# warps the dq pass shares), dq (a second pass, or atomic adds in the dk/dv pass); each part's best is the least
# time summed over the layouts (forward: fwd_ms, the others: bwd_ms)
SETTINGS = ([("fwd", dict(fwd_m=m, fwd_n=n, fwd_warps=w, stages=s))
             for m, n, w, s in [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 4)]]
            + [("dkdv", dict(dkdv_m=m, dkdv_n=n, bwd_warps=w))
               for m, n, w in [(64, 64, 4), (64, 128, 8), (32, 64, 4), (128, 64, 8)]]
            + [("dq", dict(dq_m=m, dq_n=n)) for m, n in [(64, 64), (128, 32), (128, 64)]]
            + [("dq", dict(dq_atomic=True))])
BEST_BY = {"fwd": "fwd_ms", "dkdv": "bwd_ms", "dq": "bwd_ms"}


def best_changes(rows: list[dict], layouts: list[str], fields: set[str]) -> dict:
    best = {}
    for part, key in BEST_BY.items():
        total = {}
        for r in rows:
            if r["part"] == part and r["status"] == "ok":
                total.setdefault(tuple((k, r[k]) for k in r if k in fields), []).append(r[key])
        full = [c for c, t in total.items() if len(t) == len(layouts)]
        if full:
            best.update(min(full, key=lambda c: sum(total[c])))
    return best


def main(argv=None) -> int:
    args = harness.cli(__doc__, argv, seq_len=16384, head_dim=128, layouts=dict(nargs="+", default=["ee", "mp"]),
                       heads=32, kv_heads=8, encoders=2, seed=0, rep_ms=30, out=dict(type=Path, help="JSON path"))
    if not torch.cuda.is_available():
        print("no GPU present: the kernel sweep needs CUDA; nothing was measured")
        return 0
    import triton

    from lightning_mm.attention import mask as masks
    from lightning_mm.attention.kernels import bitfield_attention, default_config

    start, device = harness.record(), torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    out = args.out or harness.RESULTS / "gpu" / f"kernel_sweep_{harness.slug(name)}_d{args.head_dim}.json"
    q, k, v, dout = inputs(1, args.heads, args.kv_heads, args.seq_len, args.head_dim, args.seed, device)
    base, rows = default_config(q), []
    doc = dict(benchmark="kernel_sweep", device=name, torch=torch.__version__, triton=triton.__version__,
               dtype="bfloat16", seq_len=args.seq_len, head_dim=args.head_dim, heads=args.heads, kv_heads=args.kv_heads,
               table_entry=dataclasses.asdict(base), rows=rows, best={})

    def grads(fn):  # dq, dk, dv of one backward
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        fn(*leaves).backward(dout)
        return [t.grad.float() for t in leaves]

    for layout in args.layouts:
        bam, seg = masks.random_bam(layout, args.seq_len, num_encoders=args.encoders, batch=1, seed=args.seed)
        bam, seg = bam.to(device), None if seg is None else seg.to(device)

        def attend(cfg):
            cache = {}
            return lambda q, k, v: bitfield_attention(q, k, v, bam, bam, q_segments=seg, k_segments=seg,
                                                      config=cfg, cache=cache)

        with torch.no_grad():
            reference = attend(base)(q, k, v).float()
        reference_grads = grads(attend(base))
        for part, change in SETTINGS:
            row = dict(layout=layout, part=part, **change)
            try:
                fn = attend(dataclasses.replace(base, **change, source="sweep"))
                with torch.no_grad():
                    row["max_abs_diff_vs_table"] = float((fn(q, k, v).float() - reference).abs().max())
                row["max_abs_grad_diff_vs_table"] = max(float((g - r).abs().max())
                                                        for g, r in zip(grads(fn), reference_grads))
                fwd_ms, both_ms, _ = measure(fn, q, k, v, dout, args.rep_ms)
                row.update(status="ok", fwd_ms=fwd_ms, bwd_ms=both_ms - fwd_ms, fwd_bwd_ms=both_ms)
            except Exception as e:  # a setting that does not fit (shared memory, registers) is recorded
                row["status"] = f"error: {type(e).__name__}: {e}"[:200]
            rows.append(row)
            torch.cuda.empty_cache()
            harness.write(out, doc, start)  # after every setting: a run stopped by its time limit keeps them
    best = best_changes(rows, args.layouts, {f.name for f in dataclasses.fields(base)})
    doc["best"] = dict(dtype="bf16", head_dim=args.head_dim, **{**dataclasses.asdict(base), **best,
                       "source": f"sweep on {name}, S={args.seq_len}, layouts {'/'.join(args.layouts)}"})
    harness.write(out, doc, start)
    harness.print_rows(rows, ["layout", "part", "fwd_m", "fwd_n", "fwd_warps", "stages", "dkdv_m", "dkdv_n",
                              "bwd_warps", "dq_m", "dq_n", "dq_atomic", "status", "fwd_ms", "bwd_ms",
                              "max_abs_diff_vs_table"])
    print("best:", doc["best"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
