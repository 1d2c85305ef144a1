"""Batch balancing: planning time and load balance of plan_batch per method (docs/balancing.md, "Results")."""

from __future__ import annotations

import statistics

import torch

import harness
from lightning_mm.plan.balance import METHODS, plan_batch
from lightning_mm.planner.heterogeneity import llava_like_works

B, R, K, STAGES = 512, 4, 32, 4
GOAL_PLAN_MS = 50.0


def planning_ms(enc: torch.Tensor, llm: torch.Tensor, method: str, repeats: int, replicas: int = R,
                microbatches: int = K, stages: int = STAGES) -> list[float]:
    """Wall milliseconds of ``repeats`` calls of ``plan_batch`` on one global batch."""
    walls, _, _ = harness.repeat(lambda: plan_batch(enc, llm, replicas, microbatches, method, num_stages=stages),
                                 repeats)
    return [w * 1e3 for w in walls]


def main(argv=None) -> None:
    args = harness.cli(__doc__, argv, seeds=5, repeats=20)
    start = harness.record()
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
    harness.write(harness.RESULTS / "balance_planning.json", dict(
        batch=B, replicas=R, microbatches=K, stages=STAGES, seeds=args.seeds, repeats=args.repeats, rows=rows), start)


if __name__ == "__main__":
    main()
