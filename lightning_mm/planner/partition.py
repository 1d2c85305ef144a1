"""Contiguous stage partitioning minimising the slowest stage (003 Eq. 3.5), exact by dynamic programming."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

from lightning_mm.plan.stages import uniform_partition


def _check(costs: Sequence[float], num_stages: int) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if num_stages > len(costs):
        raise ValueError(
            f"cannot split {len(costs)} layers into {num_stages} stages (every stage needs a layer); "
            f"use pp <= {len(costs)} for this module"
        )
    if any(c < 0 for c in costs):
        raise ValueError(f"layer costs must be >= 0, got {list(costs)}")


def partition(costs: Sequence[float], num_stages: int) -> list[int]:
    """Layers per stage, contiguous and non-empty, minimising the maximum stage cost.

    D(i,1) = P_i; D(i,s) = min_{s-1<=j<i} max(D(j,s-1), P_i - P_j), P_i = sum of the first i costs. Among
    optimal splits each boundary is the earliest one, so ties put fewer layers in early stages (which
    hold more in-flight activations under 1F1B). O(N^2 S).
    """
    _check(costs, num_stages)
    n, prefix = len(costs), [0.0, *accumulate(float(c) for c in costs)]
    best = [[float("inf")] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    for i in range(1, n + 1):
        best[1][i] = prefix[i]
    for s in range(2, num_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    sizes, i = [], n
    for s in range(num_stages, 1, -1):
        j = cut[s][i]
        sizes.append(i - j)
        i = j
    sizes.append(i)
    return sizes[::-1]


def stage_sums(values: Sequence[float], sizes: Sequence[int]) -> list[float]:
    """Sum `values` over consecutive groups of `sizes` layers (e.g. per-stage forward time)."""
    if sum(sizes) != len(values):
        raise ValueError(f"stage sizes {list(sizes)} cover {sum(sizes)} layers but there are {len(values)}")
    out, start = [], 0
    for size in sizes:
        out.append(float(sum(values[start : start + size])))
        start += size
    return out


PARTITION_MODES = ("frozen-aware", "forward-only", "uniform")


def partition_module(costs, num_stages: int, mode: str = "frozen-aware") -> list[int]:
    """Layers per stage for one module from its `LayerCost`s: "frozen-aware" balances F + B (Eq. 3.1-3.3),
    "forward-only" balances 3F (the seeds' frozen-unaware baseline), "uniform" balances layer counts."""
    if mode == "frozen-aware":
        return partition([c.total for c in costs], num_stages)
    if mode == "forward-only":
        return partition([3.0 * c.forward for c in costs], num_stages)
    if mode == "uniform":
        return uniform_partition(len(costs), num_stages)
    raise ValueError(f"unknown partition mode {mode!r}; use one of {PARTITION_MODES}")
