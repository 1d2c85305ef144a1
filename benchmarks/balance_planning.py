"""Batch balancing: planning time and load balance of plan_batch per method (docs/balancing.md, "Results").

Run ``python benchmarks/balance_planning.py``; ``planning_ms`` also times heterogeneity.py's planning.
"""

from __future__ import annotations

import statistics

import harness
from lightning_mm.plan.balance import METHODS, plan_batch
from lightning_mm.planner.heterogeneity import llava_like_works

B, R, K, STAGES = 512, 4, 32, 4


def planning_ms(enc, llm, method: str, repeats: int, replicas: int = R, microbatches: int = K,
                stages: int = STAGES) -> list[float]:
    """Wall milliseconds of ``repeats`` calls of ``plan_batch`` on one global batch."""
    walls, _, _ = harness.repeat(lambda: plan_batch(enc, llm, replicas, microbatches, method, num_stages=stages),
                                 repeats)
    return [w * 1e3 for w in walls]


def loads(enc, llm, method: str) -> dict:
    plan = plan_batch(enc, llm, R, K, method, num_stages=STAGES)
    e, w = plan.encoder_loads(enc), plan.llm_loads(llm)
    return dict(enc_max_over_mean=float(e.max() / e.mean()), enc_std=float(e.std()),
                llm_max_over_mean=float(w.max() / w.mean()), llm_std=float(w.std()), deferrals=len(plan.deferred))


def main(argv=None) -> None:
    args = harness.cli(__doc__, argv, seeds=5, repeats=20)
    start = harness.record()
    batches = [llava_like_works(B, s) for s in range(args.seeds)]
    rows = []
    for method in METHODS:
        stats = [loads(enc, llm, method) for enc, llm in batches]
        times = planning_ms(*batches[0], method, args.repeats)
        rows.append(dict(method=method, plan_ms_median=statistics.median(times), plan_ms_min=min(times),
                         **{k: statistics.mean(s[k] for s in stats) for k in stats[0]}))
    harness.write(harness.RESULTS / "balance_planning.json", dict(
        batch=B, replicas=R, microbatches=K, stages=STAGES, seeds=args.seeds, repeats=args.repeats, rows=rows), start)


if __name__ == "__main__":
    main()
