"""Encoder context parallelism's plan: which CP rank encodes which item (image, clip) of a microbatch.

LPT on per-item work (the seeds' Algorithm 1 at item granularity): items sorted by work, heaviest first, each to
the least-loaded rank, ties to the lower index. A rank may get no item (fewer items than ranks); it still takes
part in the gather. Pure: the data loader makes the plan (``data/cp_plans.py``), the runtime only executes it.
"""

from __future__ import annotations

import heapq


def encoder_width(config) -> int:
    """The width ``item_work`` weighs an encoder's tokens with: its config's ``hidden_size`` (or ``embed_dim``)."""
    return getattr(config, "hidden_size", 0) or getattr(config, "embed_dim", 0)


def item_work(tokens: list[int], width: int) -> list[int]:
    """Work of items that run ``tokens[i]`` tokens through encoder layers of width ``width``: ``t (t + 6 d)``
    (attention ~ 4 d t^2, weights ~ 24 d^2 t per layer), the measure ``shard_items`` balances."""
    return [t * (t + 6 * width) for t in tokens]


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
