"""Encoder context parallelism's plan: which CP rank encodes which item (image, clip) of a microbatch.

LPT on per-item work (the seeds' Algorithm 1 at item granularity): items sorted by work, heaviest first, each to
the least-loaded rank, ties to the lower index. A rank may get no item (fewer items than ranks); it still takes
part in the gather. Pure: the runtime only executes the plan.
"""

from __future__ import annotations

import heapq


def shard_items(work: list[float], ranks: int) -> list[list[int]]:
    """Item indices per rank (each list ascending), together every item once."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    heap = [(0.0, r) for r in range(ranks)]
    out: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        load, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + work[i], r))
    return [sorted(items) for items in out]


def gather_order(shards: list[list[int]], tokens: list[int]) -> list[int]:
    """Row indices that put features gathered rank by rank (each rank's items in its order) back in item order:
    ``gathered[order]`` lists item 0's tokens, then item 1's, ..."""
    start, at = {}, 0
    for items in shards:
        for i in items:
            start[i] = at
            at += tokens[i]
    return [start[i] + t for i in range(len(tokens)) for t in range(tokens[i])]
