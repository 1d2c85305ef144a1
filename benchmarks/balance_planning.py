"""Batch balancing: planning time and load balance of plan_batch per method.

A LLaVA-like synthetic global batch (about half text-only samples, the others 1-8 images of 224-896 px; log-normal
text lengths). For B=512 samples, 4 replicas, 32 microbatches (Entrain's Table 4.1 setting): the median and min
wall time of ``plan_batch`` over --repeats runs, and per method (mean over seeds) max/mean and std of the
microbatch encoder and LLM loads, and the number of deferrals. Writes benchmarks/results/balance_planning.json
(with the machine and the command) and rewrites the tables README.md and docs/ quote from it (benchmarks/tables.py).

    python benchmarks/balance_planning.py [--seeds 5] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

from lightning_mm.plan.balance import METHODS, plan_batch
from lightning_mm.planner.heterogeneity import llava_like_works

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _machine  # noqa: E402
import tables  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
B, R, K, STAGES = 512, 4, 32, 4
GOAL_PLAN_MS = 50.0


def planning_ms(enc: torch.Tensor, llm: torch.Tensor, method: str, repeats: int, replicas: int = R,
                microbatches: int = K, stages: int = STAGES) -> list[float]:
    """Wall milliseconds of ``repeats`` calls of ``plan_batch`` on one global batch."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        plan_batch(enc, llm, replicas, microbatches, method, num_stages=stages)
        times.append((time.perf_counter() - t) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    start = _machine.record()
    batches = [llava_like_works(B, s) for s in range(args.seeds)]
    rows = []
    for method in METHODS:
        stats = []
        for enc, llm in batches:
            plan = plan_batch(enc, llm, R, K, method, num_stages=STAGES)
            e, l = plan.encoder_loads(enc), plan.llm_loads(llm)
            stats.append(dict(enc_max_over_mean=float(e.max() / e.mean()), enc_std=float(e.std()),
                              llm_max_over_mean=float(l.max() / l.mean()), llm_std=float(l.std()),
                              deferrals=len(plan.deferred)))
        times = planning_ms(*batches[0], method, args.repeats)
        rows.append(dict(method=method, plan_ms_median=statistics.median(times), plan_ms_min=min(times),
                         **{k: statistics.mean(s[k] for s in stats) for k in stats[0]}))
    print(f"B={B} R={R} K={K} p={STAGES}, {args.seeds} seeds, {args.repeats} timed runs (goal < {GOAL_PLAN_MS} ms)")
    print(f"{'method':10} {'plan ms':>8} {'enc max/mean':>12} {'enc std':>9} {'llm max/mean':>12} {'llm std':>9} "
          f"{'deferrals':>9}")
    for r in rows:
        print(f"{r['method']:10} {r['plan_ms_median']:8.2f} {r['enc_max_over_mean']:12.3f} {r['enc_std']:9.0f} "
              f"{r['llm_max_over_mean']:12.3f} {r['llm_std']:9.0f} {r['deferrals']:9.1f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "balance_planning.json"
    out.write_text(json.dumps(dict(batch=B, replicas=R, microbatches=K, stages=STAGES, seeds=args.seeds,
                                   repeats=args.repeats, machine=_machine.finish(start), rows=rows), indent=1))
    print(f"wrote {out}")
    tables.main(["--quiet"])


if __name__ == "__main__":
    main()
